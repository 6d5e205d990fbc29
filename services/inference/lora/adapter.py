"""Read a PEFT adapter directory into host tensors, checked against the model's shapes.

`adapter_model.safetensors` keys look like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]). The header is checked (keys, shapes) before any data is read.

An adapter may ship its own chat template (`chat_template.jinja`, or `chat_template` in its
`tokenizer_config.json`, as `save_pretrained` writes them). It is read here, at load time, with the
weights: a regular file only, size-bounded, and covered by the adapter's content digest, so the
template a request renders is the one that was checked and loaded, not whatever the directory
holds when the first chat arrives.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid, AdapterNotFound
from loraplex.services.inference.lora.config import (
    AdapterSpec,
    ModuleLoRA,
    parse_adapter_config,
    resolve_embedding_targets,
    resolve_targets,
)
from loraplex.services.inference.lora.dora import MAGNITUDE_KEY, read_magnitudes
from loraplex.services.inference.lora.embedding_lora import (
    EmbeddingLoRA,
    finish_embedding_lora,
    read_embedding_tensor,
)
from loraplex.services.inference.lora.expert_targets import (
    EXPERT_KEY,
    read_expert_tensor,
    resolve_expert_targets,
    tensor_keys,
)
from loraplex.services.inference.lora.shapes import FUSED_MODULES, FUSED_OF, ModelShapes, module_path
from loraplex.services.inference.lora.tensor_checks import read_checked
from loraplex.services.inference.lora.trainable_tokens import (
    TokenRows,
    check_added_tokens,
    check_token_layers,
    finish_token_rows,
    read_token_rows,
)

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_HEADER_BYTES = 16 * 2**20  # same cap as the adapter store's
MAX_CONFIG_BYTES = 1 * 2**20
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Read besides the config and the weights, for the chat template (the first one present wins).
TEMPLATE_FILES = (TEMPLATE_FILE, TOKENIZER_CONFIG_FILE)
# Large enough for any real tokenizer_config.json (Gemma's, with its added tokens, is about 1 MiB).
MAX_TEMPLATE_FILE_BYTES = 4 * 2**20
_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter version in host memory: per-(layer, module) A `[r, in]` and B `[out, r]`; on
    the experts (lora/expert_targets.py) per-(layer, expert module) A `[E, r, in]` and B `[E, out, r]`."""

    spec: AdapterSpec
    targets: dict[tuple[int, str], ModuleLoRA]
    lora_a: dict[tuple[int, str], torch.Tensor]
    lora_b: dict[tuple[int, str], torch.Tensor]
    digest: str
    chat_template: str | None = None  # the adapter's own, read at load time (None: the model's)
    expert_targets: dict[tuple[int, str], ModuleLoRA] = field(default_factory=dict)
    expert_a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    expert_b: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # DoRA (lora/dora.py): per-(layer, module) magnitude `[out]` float32, as read; and the factor
    # `m / ||W + sBA||` per row, filled once from the base weights (`dora.fill_factors`) before upload.
    dora_magnitude: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    dora_factor: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # LoRA on "model.embed_tokens" / "lm_head" (lora/embedding_lora.py)
    embedding: dict[str, EmbeddingLoRA] = field(default_factory=dict)
    # trainable tokens (lora/trainable_tokens.py): per "model.embed_tokens" / "lm_head", its own rows
    token_rows: dict[str, TokenRows] = field(default_factory=dict)

    @property
    def has_vocab_parts(self) -> bool:
        """Whether the adapter changes the embedding or lm_head (served on one device only)."""
        return bool(self.embedding) or bool(self.token_rows)

    @property
    def all_targets(self) -> dict[tuple[int, str], ModuleLoRA]:
        """The linear targets and the expert targets together (what the server's limits check)."""
        return {**self.targets, **self.expert_targets}

    @property
    def max_rank(self) -> int:
        ranks = [t.rank for t in self.all_targets.values()] + [
            int(e.a.shape[0]) for e in self.embedding.values()
        ]
        return max(ranks)

    @property
    def nbytes(self) -> int:
        tensors = (
            self.lora_a,
            self.lora_b,
            self.expert_a,
            self.expert_b,
            self.dora_magnitude,
            self.dora_factor,
        )
        vocab_parts = [t for e in self.embedding.values() for t in (e.a, e.b)]
        vocab_parts += [r.values for r in self.token_rows.values()]
        return sum(t.numel() * t.element_size() for d in tensors for t in d.values()) + sum(
            t.numel() * t.element_size() for t in vocab_parts
        )


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


def _digest(directory: Path, side_files: dict[str, bytes]) -> str:
    """sha256 of the config and weights (as the adapter store computes it) and of the other files
    read (`side_files`, the bytes actually used), so a changed template is another version."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode() + b"\0")
        with open(directory / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    for name, data in sorted(side_files.items()):
        h.update(b"\0" + name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return "sha256:" + h.hexdigest()


def read_side_file(path: Path, limit: int) -> bytes | None:
    """The bytes of the regular file `path` (None if absent), at most `limit` of them.

    Symlinks are followed (a Hub cache snapshot is all symlinks); where they may lead is checked
    before loading (`local_sources`, --allowed-local-dirs). A FIFO or device is refused, not
    read: it would block or never end, and `stat` says 0 bytes for both."""
    if not os.path.lexists(path):
        return None
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        reason = "a dangling symlink" if isinstance(e, FileNotFoundError) else e.strerror
        raise AdapterInvalid(f"{path.name} cannot be opened: {reason}", field=path.name) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AdapterInvalid(f"{path.name} is not a regular file", field=path.name)
        data = b""
        while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > limit:
        raise AdapterInvalid(f"{path.name} is over {limit} bytes, the most read", field=path.name)
    return data


def read_chat_template(directory: str | Path) -> tuple[str | None, dict[str, bytes]]:
    """The chat template the directory ships (None: none) and the files read to find it."""
    directory = Path(directory)
    for name in TEMPLATE_FILES:
        data = read_side_file(directory / name, MAX_TEMPLATE_FILE_BYTES)
        if data is None:
            continue
        try:
            text = data.decode("utf-8")
            template = text if name == TEMPLATE_FILE else json.loads(text).get("chat_template")
        except UnicodeDecodeError as e:  # its message would echo the file's bytes
            raise AdapterInvalid(f"{name} is not UTF-8 at byte {e.start}", field=name) from None
        except (ValueError, AttributeError, RecursionError):
            raise AdapterInvalid(f"{name} is not a JSON object", field=name) from None
        if name == TOKENIZER_CONFIG_FILE and not isinstance(template, str):
            template = None  # a tokenizer_config.json without a template (or with a list of named ones)
        return template or None, {name: data}
    return None, {}


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
    embedding_targets = check_embedding_targets(spec, shapes)
    embedding_read: dict[str, dict[str, torch.Tensor]] = {}
    token_layers = check_token_layers(spec.trainable_tokens, shapes.vocab_size, shapes.tie_word_embeddings)
    token_read: dict[str, TokenRows] = {}
    expert_targets = resolve_expert_targets(spec, shapes)
    expert_keys = tensor_keys(expert_targets)
    expert_a: dict[tuple[int, str], torch.Tensor] = {}
    expert_b: dict[tuple[int, str], torch.Tensor] = {}
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
    magnitude: dict[tuple[int, str], torch.Tensor] = {}
    try:
        f = safe_open(str(weights_path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise AdapterInvalid(
            f"{WEIGHTS_FILE} is not a readable safetensors file: {e}", field=WEIGHTS_FILE
        ) from None
    with f:
        keys = list(f.keys())
        for key in keys:
            if EXPERT_KEY.match(key):
                t = read_expert_tensor(f, key, expert_keys, expert_targets, shapes)
                layer, module, ab = expert_keys[key]
                t = t.to(dtype).contiguous()
                (expert_a if ab == "A" else expert_b)[(layer, module)] = t.pin_memory() if pin_memory else t
                continue
            if read_token_rows(f, key, token_layers, shapes.hidden_size, dtype, token_read):
                continue
            if read_embedding_tensor(
                f, key, embedding_targets, shapes.vocab_size, shapes.hidden_size, dtype, embedding_read
            ):
                continue
            mag = MAGNITUDE_KEY.match(key)
            if mag is not None and mag.group("path") in by_path:
                read_magnitudes(f, key, by_path[mag.group("path")], shapes, spec.use_dora, magnitude)
                continue
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
            t = read_checked(f, key).to(dtype)  # dtype, finite, magnitude (lora/tensor_checks.py)
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
    missing = (
        list(
            dict.fromkeys(
                module_path(n, hf_module(mod)) + ".lora_" + ab
                for (n, mod) in targets
                for ab, d in (("A", lora_a), ("B", lora_b))
                if (n, mod) not in d
            )
        )
        + [
            module_path(n, hf_module(mod)) + ".lora_magnitude_vector"
            for (n, mod) in (targets if spec.use_dora else ())
            if (n, mod) not in magnitude
        ]
        + [
            key
            for key, (n, mod, ab) in expert_keys.items()
            if (n, mod) not in (expert_a if ab == "A" else expert_b)
        ]
    )
    if missing:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: missing tensors for targeted modules: {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""),
            field=WEIGHTS_FILE,
        )
    embedding = finish_embedding_lora(embedding_targets, embedding_read)
    token_rows = finish_token_rows(token_layers, token_read, shapes.tie_word_embeddings)
    both = sorted(set(token_rows) & set(embedding))
    if both:
        raise AdapterInvalid(
            f"adapter_config.json: trainable_token_indices: {both[0]} has both trainable token rows and "
            "LoRA; serve one of them",
            field="trainable_token_indices",
        )
    if token_rows or embedding:  # its tokenizer must not need rows the base does not have
        check_added_tokens(directory, shapes.vocab_size, read_side_file)
    chat_template, side_files = read_chat_template(directory)
    return AdapterWeights(
        spec=spec,
        targets=targets,
        lora_a=lora_a,
        lora_b=lora_b,
        digest=_digest(directory, side_files),
        chat_template=chat_template,
        expert_targets=expert_targets,
        expert_a=expert_a,
        expert_b=expert_b,
        dora_magnitude=magnitude,
        embedding=embedding,
        token_rows=token_rows,
    )


def check_embedding_targets(spec: AdapterSpec, shapes: ModelShapes) -> dict[str, ModuleLoRA]:
    """The embedding / lm_head targets, refused where this engine cannot serve them."""
    targets = resolve_embedding_targets(spec, shapes.num_layers)
    if targets and spec.use_dora:
        raise AdapterInvalid(
            "adapter_config.json: use_dora: DoRA on embed_tokens / lm_head is not supported "
            "(DoRA on the linear projections is)",
            field="use_dora",
        )
    if targets and not shapes.vocab_size:
        raise AdapterIncompatible(
            "adapter_config.json: target_modules: the base model's vocabulary size is unknown here, "
            "so LoRA on embed_tokens / lm_head cannot be checked",
            field="target_modules",
        )
    return targets
