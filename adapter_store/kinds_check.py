"""The store's checks of adapter tensors beyond plain LoRA A/B pairs (the inference server reads the
same tensors: services/inference/lora/dora.py).

- DoRA (`use_dora: true`): one `lora_magnitude_vector` `[out]` per targeted module, beside its A/B
  pair; every value finite and positive (a zero or negative magnitude flips or kills a row).
- LoRA on `embed_tokens` (`lora_embedding_A` `[r, vocab]`, `lora_embedding_B` `[hidden, r]`) and on
  `lm_head` (`lora_A.weight` `[r, hidden]`, `lora_B.weight` `[vocab, r]`), and PEFT's copies of those
  base layers (`base_layer.weight` `[vocab, hidden]`, not used): targeted, ranked as the config says,
  and (with --base-model) the base's vocabulary and width.

`split_kind_tensors` takes these tensors out of the header's list before the A/B pairs are checked;
`check_kind_tensors` checks them against the pairs, and `check_kind_values` their values (one small
read each: magnitudes are a vector per module).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from loraplex.adapter_store.base_model import BaseModelShapes
from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.lora_config import LoraConfig
from loraplex.adapter_store.safetensors_header import SafetensorsHeader, TensorInfo

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
MAGNITUDE_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_magnitude_vector(?:\.weight)?$")
_NUMPY = {"F32": "<f4", "F16": "<f2"}


VOCAB_RE = re.compile(
    r"^base_model\.model\.(?P<module>model\.embed_tokens|lm_head)\."
    r"(?P<kind>lora_embedding_A|lora_embedding_B|lora_A\.weight|lora_B\.weight|base_layer\.weight"
    r"|token_adapter\.trainable_tokens_delta)$"
)


def split_kind_tensors(tensors: tuple[TensorInfo, ...]) -> tuple[list[TensorInfo], dict[str, TensorInfo]]:
    """(the other tensors, DoRA magnitudes by module path)."""
    rest: list[TensorInfo] = []
    magnitudes: dict[str, TensorInfo] = {}
    for t in tensors:
        m = MAGNITUDE_RE.match(t.name)
        if m is None:
            rest.append(t)
        else:
            magnitudes[m["module"]] = t
    return rest, magnitudes


def split_vocab_tensors(tensors: list[TensorInfo]) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """(the other tensors, those of embed_tokens / lm_head LoRA and PEFT's base-layer copies)."""
    rest = [t for t in tensors if VOCAB_RE.match(t.name) is None]
    return rest, [t for t in tensors if VOCAB_RE.match(t.name) is not None]


def check_vocab_tensors(tensors: list[TensorInfo], config: LoraConfig, base: BaseModelShapes | None) -> int:
    """Check the embed_tokens / lm_head tensors; returns their largest rank (0: none)."""
    vocab_hidden = None
    if base is not None and "lm_head" in base.linears:
        hidden, vocab = base.linears["lm_head"]
        vocab_hidden = (vocab, hidden)
    found: dict[str, set[str]] = {}
    max_rank = 0
    for t in tensors:
        m = VOCAB_RE.match(t.name)
        module, kind = m["module"], m["kind"].removesuffix(".weight")
        where = f"{WEIGHTS_FILE}:{t.name}"
        if len(t.shape) != 2 or 0 in t.shape:
            raise InvalidArgument(
                f"{where}: shape {list(t.shape)} is not a non-empty matrix", field=f"{where}.shape"
            )
        if kind == "token_adapter.trainable_tokens_delta":
            _check_token_rows(t, module, config, base, vocab_hidden)
            continue
        if kind == "base_layer":
            if vocab_hidden is not None and tuple(t.shape) != vocab_hidden:
                raise InvalidArgument(
                    f"{where}: shape {list(t.shape)} != {list(vocab_hidden)} (vocabulary, hidden) of "
                    f"base model {base.name}",
                    field=f"{where}.shape",
                )
            continue
        if not config.targets(module):
            raise InvalidArgument(
                f"{where}: module {module} is not in target_modules {config.target_modules!r}", field=where
            )
        if (module == "lm_head") == kind.startswith("lora_embedding"):
            raise InvalidArgument(
                f"{where}: {module} takes "
                + ("lora_A / lora_B" if module == "lm_head" else "lora_embedding_A / lora_embedding_B")
                + " tensors",
                field=where,
            )
        is_a = kind.endswith("A")
        rank = config.rank_for(module)
        got = t.shape[0 if is_a else 1]
        if got != rank:
            raise InvalidArgument(
                f"{where}: shape {list(t.shape)} has rank {got}, but adapter_config.json "
                f"gives {module} rank {rank} (r / rank_pattern)",
                field=f"{where}.shape",
            )
        if vocab_hidden is not None:
            vocab, hidden = vocab_hidden
            other = {
                ("model.embed_tokens", True): vocab,
                ("model.embed_tokens", False): hidden,
                ("lm_head", True): hidden,
                ("lm_head", False): vocab,
            }[(module, is_a)]
            if t.shape[1 if is_a else 0] != other:
                raise InvalidArgument(
                    f"{where}: shape {list(t.shape)} does not fit base model {base.name} "
                    f"(vocabulary {vocab}, hidden {hidden})",
                    field=f"{where}.shape",
                )
        found.setdefault(module, set()).add("A" if is_a else "B")
        max_rank = max(max_rank, rank)
    for module in config.trainable_tokens:
        if not any(VOCAB_RE.match(t.name)["module"] == module and "token_adapter" in t.name for t in tensors):
            # with tied embeddings PEFT saves the embedding's rows only, which lm_head shares
            if module == "lm_head" and "model.embed_tokens" in config.trainable_tokens:
                continue
            raise InvalidArgument(
                f"{WEIGHTS_FILE}: trainable_token_indices lists {module} but it has no "
                "token_adapter.trainable_tokens_delta",
                field=f"{WEIGHTS_FILE}:base_model.model.{module}.token_adapter.trainable_tokens_delta",
            )
    for module, sides in sorted(found.items()):
        if sides != {"A", "B"}:
            missing = "B" if "A" in sides else "A"
            raise InvalidArgument(
                f"{WEIGHTS_FILE}: {module} has no matching lora_{missing} tensor",
                field=f"{WEIGHTS_FILE}:base_model.model.{module}",
            )
    return max_rank


def check_kind_tensors(
    magnitudes: dict[str, TensorInfo], pairs: dict[str, dict[str, TensorInfo]], config: LoraConfig
) -> None:
    """Every magnitude belongs to a DoRA config and to a module with an A/B pair, `[out]` of its B;
    every module of a DoRA adapter has one."""
    for module, t in sorted(magnitudes.items()):
        where = f"{WEIGHTS_FILE}:{t.name}"
        if not config.use_dora:
            raise InvalidArgument(
                f"{where}: a DoRA magnitude, but adapter_config.json use_dora is not true",
                field=f"{WEIGHTS_FILE}:{t.name}",
            )
        if module not in pairs or "B" not in pairs[module]:
            raise InvalidArgument(f"{where}: no lora_A/lora_B pair for {module}", field=where)
        out_features = pairs[module]["B"].shape[0]
        if tuple(t.shape) != (out_features,):
            raise InvalidArgument(
                f"{where}: shape {list(t.shape)}, but {module}'s lora_B has {out_features} output rows",
                field=f"{where}.shape",
            )
    if config.use_dora:
        missing = sorted(m for m in pairs if m not in magnitudes)
        if missing:
            raise InvalidArgument(
                f"{WEIGHTS_FILE}: use_dora is true but {missing[0]} has no lora_magnitude_vector"
                + (f" (and {len(missing) - 1} more modules)" if len(missing) > 1 else ""),
                field=f"{WEIGHTS_FILE}:{missing[0]}.lora_magnitude_vector",
            )


def _check_token_rows(
    t: TensorInfo,
    module: str,
    config: LoraConfig,
    base: BaseModelShapes | None,
    vocab_hidden: tuple[int, int] | None,
) -> None:
    """Trainable-token rows: listed in the config, `[n ids, hidden]`, ids within the vocabulary."""
    where = f"{WEIGHTS_FILE}:{t.name}"
    ids = config.trainable_tokens.get(module)
    if ids is None:
        raise InvalidArgument(
            f"{where}: trainable-token rows of {module}, which trainable_token_indices does not list",
            field=where,
        )
    if t.shape[0] != len(ids) or (vocab_hidden is not None and t.shape[1] != vocab_hidden[1]):
        raise InvalidArgument(
            f"{where}: shape {list(t.shape)} does not fit {len(ids)} token ids"
            + ("" if vocab_hidden is None else f" of hidden {vocab_hidden[1]} (base model {base.name})"),
            field=f"{where}.shape",
        )
    if vocab_hidden is not None and max(ids) >= vocab_hidden[0]:
        raise InvalidArgument(
            f"{CONFIG_FILE}: trainable_token_indices: token id {max(ids)} is past the vocabulary of "
            f"{vocab_hidden[0]} of base model {base.name} (an adapter of a resized embedding)",
            field=f"{CONFIG_FILE}:trainable_token_indices",
        )


def check_kind_values(path: Path, header: SafetensorsHeader, magnitudes: dict[str, TensorInfo]) -> None:
    """Every DoRA magnitude finite and positive."""
    with open(path, "rb") as f:
        for t in magnitudes.values():
            f.seek(header.data_start + t.begin)
            values = _as_float32(f.read(t.end - t.begin), t.dtype)
            bad = ~(np.isfinite(values) & (values > 0))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise InvalidArgument(
                    f"{WEIGHTS_FILE}:{t.name}: DoRA magnitudes must be finite and positive "
                    f"(row {i} is {float(values[i])!r})",
                    field=f"{WEIGHTS_FILE}:{t.name}.values",
                )


def _as_float32(data: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # the upper half of a float32
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(data, dtype=_NUMPY[dtype]).astype(np.float32)
