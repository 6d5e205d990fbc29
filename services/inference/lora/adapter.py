"""Read a PEFT adapter directory into host tensors, checked against the model's shapes.

`adapter_model.safetensors` keys look like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]). The header is checked (keys, shapes) before any data is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid, AdapterNotFound
from loraplex.services.inference.lora.config import (
    AdapterSpec,
    ModuleLoRA,
    parse_adapter_config,
    resolve_targets,
)
from loraplex.services.inference.lora.shapes import FUSED_MODULES, FUSED_OF, ModelShapes, module_path

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_HEADER_BYTES = 16 * 2**20  # same cap as the adapter store's
MAX_CONFIG_BYTES = 1 * 2**20
_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter version in host memory: per-(layer, module) A `[r, in]` and B `[out, r]`."""

    spec: AdapterSpec
    targets: dict[tuple[int, str], ModuleLoRA]
    lora_a: dict[tuple[int, str], torch.Tensor]
    lora_b: dict[tuple[int, str], torch.Tensor]
    digest: str

    @property
    def max_rank(self) -> int:
        return max(t.rank for t in self.targets.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.lora_a, self.lora_b) for t in d.values())


def _check_header_size(path: Path) -> None:
    """Refuse a safetensors header longer than MAX_HEADER_BYTES (or the file) before it is parsed."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE} is {size} bytes, too short for a safetensors header", field=WEIGHTS_FILE
        )
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        # n is not echoed: in a file that is not safetensors it is the file's first 8 bytes.
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: the header length field exceeds the {MAX_HEADER_BYTES}-byte cap "
            f"or the {size}-byte file (truncated, or not safetensors?)",
            field=WEIGHTS_FILE,
        )


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode() + b"\0")
        with open(directory / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def read_config(directory: str | Path) -> tuple[AdapterSpec, Path]:
    """Parse the directory's adapter_config.json (no weights read)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AdapterNotFound(f"adapter directory {directory} does not exist", field="source")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterInvalid(f"{directory} has no {CONFIG_FILE}", field=CONFIG_FILE)
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterInvalid(
            f"{CONFIG_FILE} is {config_path.stat().st_size} bytes; at most {MAX_CONFIG_BYTES} are read",
            field=CONFIG_FILE,
        )
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterInvalid(f"{CONFIG_FILE} is not valid JSON: {e}", field=CONFIG_FILE) from None
    except UnicodeDecodeError as e:  # its message would echo the file's bytes
        raise AdapterInvalid(
            f"{CONFIG_FILE} is not valid JSON: not UTF-8 at byte {e.start}", field=CONFIG_FILE
        ) from None
    except RecursionError:
        raise AdapterInvalid(f"{CONFIG_FILE}: JSON nested too deeply", field=CONFIG_FILE) from None
    return parse_adapter_config(cfg), directory


def load_adapter_weights(
    directory: str | Path,
    shapes: ModelShapes,
    *,
    dtype: torch.dtype = torch.float32,
    pin_memory: bool = False,
) -> AdapterWeights:
    """Validate config and weights against `shapes`; return host tensors in `dtype`.

    AdapterInvalid: malformed config, missing/unexpected tensors, rank disagreeing with the config.
    AdapterIncompatible: layer indices or widths of another base model.
    """
    spec, directory = read_config(directory)
    targets = resolve_targets(spec, shapes.num_layers, shapes.hf_modules)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        if any((directory / n).exists() for n in PICKLE_FILES):
            raise AdapterInvalid(
                f"{directory} has only pickle weights ({', '.join(PICKLE_FILES)}), which are never "
                "loaded here (unpickling can run code); convert them to safetensors, or register "
                "the adapter with a store started with --allow-pickle",
                field=WEIGHTS_FILE,
            )
        raise AdapterInvalid(f"{directory} has no {WEIGHTS_FILE}", field=WEIGHTS_FILE)
    _check_header_size(weights_path)

    def hf_module(module: str) -> str:  # the HF module a pool module's weights come from
        return FUSED_OF.get(module, module) if shapes.fused_checkpoint else module

    by_path = {module_path(n, hf_module(m)): (n, hf_module(m)) for (n, m) in targets}
    lora_a: dict[tuple[int, str], torch.Tensor] = {}
    lora_b: dict[tuple[int, str], torch.Tensor] = {}
    try:
        f = safe_open(str(weights_path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise AdapterInvalid(
            f"{WEIGHTS_FILE} is not a readable safetensors file: {e}", field=WEIGHTS_FILE
        ) from None
    with f:
        keys = list(f.keys())
        for key in keys:
            m = _KEY.match(key)
            if m is None:
                raise AdapterInvalid(
                    f"{WEIGHTS_FILE}: unexpected tensor {key!r} (only lora_A/lora_B weights "
                    "of the target modules are supported)",
                    field=WEIGHTS_FILE,
                )
            path = m.group("path")
            if path not in by_path:
                layer = re.match(r"model\.layers\.(\d+)\.", path)
                if layer and int(layer.group(1)) >= shapes.num_layers:
                    raise AdapterIncompatible(
                        f"{WEIGHTS_FILE}: {key!r} is for layer {layer.group(1)} but this "
                        f"base model has {shapes.num_layers} layers",
                        field=WEIGHTS_FILE,
                    )
                raise AdapterInvalid(
                    f"{WEIGHTS_FILE}: tensor {key!r} is for a module that adapter_config.json "
                    "target_modules does not target",
                    field=WEIGHTS_FILE,
                )
            layer, module = by_path[path]
            rank = targets[(layer, FUSED_MODULES.get(module, (module,))[0])].rank
            d_in, d_out = shapes.module_dims(module)
            shape = tuple(f.get_slice(key).get_shape())
            expected = (rank, d_in) if m.group("ab") == "A" else (d_out, rank)
            if len(shape) != 2:
                raise AdapterInvalid(
                    f"{WEIGHTS_FILE}: {key!r} has shape {shape}, expected 2-D", field=WEIGHTS_FILE
                )
            rank_axis = 0 if m.group("ab") == "A" else 1
            if shape[rank_axis] != rank:
                raise AdapterInvalid(
                    f"{WEIGHTS_FILE}: {key!r} has rank {shape[rank_axis]} but adapter_config.json "
                    f"(r / rank_pattern) gives {rank}",
                    field="r",
                )
            if shape != expected:
                raise AdapterIncompatible(
                    f"{WEIGHTS_FILE}: {key!r} has shape {shape}, this base model needs "
                    f"{expected}: the adapter was trained for another base model",
                    field=WEIGHTS_FILE,
                )
            t = f.get_tensor(key).to(dtype)
            parts = FUSED_MODULES.get(module, (module,))
            # A fused module's parts share its A; each takes its rows of B.
            pieces = (
                [t] * len(parts)
                if m.group("ab") == "A"
                else t.split([shapes.module_dims(p)[1] for p in parts], dim=0)
            )
            for part, piece in zip(parts, pieces, strict=True):
                piece = piece.contiguous()
                if pin_memory:
                    piece = piece.pin_memory()
                (lora_a if m.group("ab") == "A" else lora_b)[(layer, part)] = piece
    missing = list(
        dict.fromkeys(
            module_path(n, hf_module(mod)) + ".lora_" + ab
            for (n, mod) in targets
            for ab, d in (("A", lora_a), ("B", lora_b))
            if (n, mod) not in d
        )
    )
    if missing:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: missing tensors for targeted modules: {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""),
            field=WEIGHTS_FILE,
        )
    return AdapterWeights(spec=spec, targets=targets, lora_a=lora_a, lora_b=lora_b, digest=_digest(directory))
