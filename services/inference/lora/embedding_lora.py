"""LoRA on the embedding (`embed_tokens`) and on the output layer (`lm_head`), as PEFT 0.21 trains them.

- `embed_tokens` (PEFT's `lora.Embedding`): `lora_embedding_A` `[r, vocab]`, `lora_embedding_B`
  `[hidden, r]`; a token `t` of the adapter's request gets `s * B @ A[:, t]` added to its looked-up
  embedding (before a Gemma's sqrt(hidden) scale, which PEFT applies to the delta too).
- `lm_head` (a `lora.Linear`): `lora_A` `[r, hidden]`, `lora_B` `[vocab, r]`; the request's logits
  rows get `s * (h @ A^T) @ B^T` added (before a final soft-cap). With tied embeddings the two are
  separate adapters of one shared base weight, as in PEFT.

PEFT saves a copy of the base layer beside them (`...embed_tokens.base_layer.weight`,
`lm_head.base_layer.weight`, `save_embedding_layers`): its shape is checked and it is not used.

Where they live: the pool's vocabulary tables (lora/vocab_tables.py), a few vocab slots stacked so
one step applies every resident adapter's with one gather and one matmul (embedding) and one
shrink and one expand (lm_head), inside the decode graphs' kinds variant (engine/cuda_graph.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid

if TYPE_CHECKING:
    from loraplex.services.inference.lora.config import ModuleLoRA

WEIGHTS_FILE = "adapter_model.safetensors"
EMBED_PATH, HEAD_PATH = "model.embed_tokens", "lm_head"
EMBEDDING_KEY = re.compile(
    r"^base_model\.model\.(?P<path>model\.embed_tokens|lm_head)\."
    r"(?P<kind>lora_embedding_A|lora_embedding_B|lora_A\.weight|lora_B\.weight|base_layer\.weight)$"
)

TP_REFUSAL = (
    "adapter_config.json: target_modules: LoRA on embed_tokens / lm_head is not served under "
    "tensor parallelism (--tp-size > 1): the vocabulary is sharded across ranks"
)


@dataclass(frozen=True)
class EmbeddingLoRA:
    """One adapter's LoRA on the embedding or lm_head, host tensors as PEFT stores them."""

    a: torch.Tensor  # embed_tokens: [r, vocab]; lm_head: [r, hidden]
    b: torch.Tensor  # embed_tokens: [hidden, r]; lm_head: [vocab, r]
    scaling: float


def read_embedding_tensor(
    f: Any,
    key: str,
    targets: dict[str, ModuleLoRA],
    vocab: int,
    hidden: int,
    dtype: torch.dtype,
    out: dict[str, dict[str, torch.Tensor]],
) -> bool:
    """Read `key` into `out[path][kind]` if it is an embedding / lm_head tensor (True), checking
    it against the config's targets and the base model's vocabulary and width; False otherwise."""
    m = EMBEDDING_KEY.match(key)
    if m is None:
        return False
    path, kind = m["path"], m["kind"].removesuffix(".weight")
    shape = tuple(f.get_slice(key).get_shape())
    if kind == "base_layer":  # PEFT's copy of the base layer: not used, but it must be this model's
        if shape != (vocab, hidden):
            raise AdapterIncompatible(
                f"{WEIGHTS_FILE}: {key!r} has shape {shape}, this base model's is {(vocab, hidden)}: "
                "the adapter was trained for another base model (or another vocabulary)",
                field=WEIGHTS_FILE,
            )
        return True
    if path not in targets:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: tensor {key!r} is for {path}, which adapter_config.json target_modules "
            "does not target",
            field=WEIGHTS_FILE,
        )
    wrong_kind = (path == EMBED_PATH) != kind.startswith("lora_embedding")
    if wrong_kind:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: {key!r}: {path} takes "
            + ("lora_embedding_A / lora_embedding_B" if path == EMBED_PATH else "lora_A / lora_B")
            + " tensors",
            field=WEIGHTS_FILE,
        )
    rank = targets[path].rank
    is_a = kind.endswith("A")
    if path == EMBED_PATH:
        expected = (rank, vocab) if is_a else (hidden, rank)
    else:
        expected = (rank, hidden) if is_a else (vocab, rank)
    if len(shape) != 2 or shape[0 if is_a else 1] != rank:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: {key!r} has shape {shape}, but adapter_config.json (r / rank_pattern) "
            f"gives {path} rank {rank}",
            field="r",
        )
    if shape != expected:
        raise AdapterIncompatible(
            f"{WEIGHTS_FILE}: {key!r} has shape {shape}, this base model needs {expected} "
            f"(vocabulary {vocab}, hidden {hidden}): the adapter was trained for another base model",
            field=WEIGHTS_FILE,
        )
    out.setdefault(path, {})["A" if is_a else "B"] = f.get_tensor(key).to(dtype).contiguous()
    return True


def finish_embedding_lora(
    targets: dict[str, ModuleLoRA], read: dict[str, dict[str, torch.Tensor]]
) -> dict[str, EmbeddingLoRA]:
    """The adapter's embedding / lm_head LoRA; AdapterInvalid if a targeted one lacks A or B."""
    out = {}
    for path, target in targets.items():
        got = read.get(path, {})
        missing = [ab for ab in "AB" if ab not in got]
        if missing:
            names = {"A": "lora_embedding_A", "B": "lora_embedding_B"} if path == EMBED_PATH else None
            what = ", ".join(f"{path}.{names[ab] if names else 'lora_' + ab}" for ab in missing)
            raise AdapterInvalid(
                f"{WEIGHTS_FILE}: missing tensors for targeted modules: {what}", field=WEIGHTS_FILE
            )
        out[path] = EmbeddingLoRA(got["A"], got["B"], target.scaling)
    return out
