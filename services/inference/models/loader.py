"""Find a checkpoint (local directory or Hub id) and load its safetensors into our model.

Only safetensors are read: pickle `.bin` weights can run code when unpickled, so they are
refused with a message saying how to convert them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.services.inference.models.config import ModelConfig, UnsupportedModelError, load_config
from loraplex.services.inference.models.llama import LlamaForCausalLM
from loraplex.services.inference.models.quantization.fp8_linear import load_fp8, quantize_linears
from loraplex.services.inference.models.quantization.scheme import read_quantization_config, resolve_scheme

log = logging.getLogger(__name__)

# What we fetch from the Hub: weights in safetensors, configs, tokenizer files. Never pickles.
HUB_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "*.jinja",
]


def resolve_model_dir(model_path: str) -> Path:
    """A local directory as is; otherwise a Hub id (`org/name` or `org/name@revision`) via the HF cache.

    huggingface_hub honours HF_HUB_OFFLINE (cache only) and HF_HOME/HF_HUB_CACHE itself.
    """
    local = Path(model_path).expanduser()
    if local.is_dir():
        return local
    if local.exists() or model_path.startswith((".", "/", "~")) or model_path.count("/") != 1:
        raise UnsupportedModelError(f"--model-path {model_path!r} is neither a model directory nor a Hub id")
    from huggingface_hub import snapshot_download

    repo_id, _, revision = model_path.partition("@")
    try:
        path = snapshot_download(repo_id, revision=revision or None, allow_patterns=HUB_PATTERNS)
    except Exception as exc:  # network, auth, offline cache miss: all end the start-up
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set and the model is not in the cache)" if offline else ""
        raise UnsupportedModelError(
            f"could not fetch {model_path!r} from the Hugging Face Hub{hint}: {exc}"
        ) from exc
    return Path(path)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise UnsupportedModelError(f"{model_dir}: shards named in the index are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")) or any(model_dir.glob("*.pth")):
        raise UnsupportedModelError(
            f"{model_dir} has only pickle weights (.bin/.pt), which loraplex refuses to load because "
            "unpickling can run code; convert them to safetensors (e.g. transformers "
            "`save_pretrained(dir, safe_serialization=True)`)"
        )
    raise UnsupportedModelError(f"{model_dir} has no *.safetensors weights")


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: Path, device: torch.device, dtype: torch.dtype, quantization: str | None = None
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model on `device` in `dtype` (uninitialised) and copy the checkpoint into it.
    `quantization` ("fp8" or None) and the checkpoint's quantization_config pick FP8 base linears."""
    config = load_config(model_dir)
    scheme = resolve_scheme(quantization, read_quantization_config(model_dir))
    files = safetensors_files(model_dir)
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(config)
        if scheme is not None:
            quantize_linears(model, scheme)
    try:
        if scheme is None:
            model.load_weights(iter_weights(files))
        else:
            load_fp8(model, iter_weights(files))
    except ValueError as exc:
        raise UnsupportedModelError(f"{model_dir}: {exc}") from exc
    model.eval()
    log.info(
        "loaded %s (%d layers) from %s on %s as %s",
        config.architecture,
        config.num_layers,
        model_dir,
        device,
        dtype,
    )
    return model, config


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(requested: str, config_dtype: str | None, device: torch.device) -> torch.dtype:
    """`auto` is the checkpoint's dtype on GPU (bfloat16 if unstated) and float32 on CPU."""
    if requested != "auto":
        return DTYPES[requested]
    if device.type == "cpu":
        return torch.float32
    return DTYPES.get(str(config_dtype).replace("torch.", ""), torch.bfloat16)
