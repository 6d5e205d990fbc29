"""LoRA on the embedding (`embed_tokens`) and on the output layer (`lm_head`), as PEFT 0.21 trains them.

- `embed_tokens` (PEFT's `lora.Embedding`): `lora_embedding_A` `[r, vocab]`, `lora_embedding_B`
  `[hidden, r]`; a token `t` of the adapter's request gets `s * B @ A[:, t]` added to its looked-up
  embedding (before a Gemma's sqrt(hidden) scale, which PEFT applies to the delta too).
- `lm_head` (a `lora.Linear`): `lora_A` `[r, hidden]`, `lora_B` `[vocab, r]`; the request's logits
  rows get `s * (h @ A^T) @ B^T` added (before a final soft-cap). With tied embeddings the two are
  separate adapters of one shared base weight, as in PEFT.

PEFT saves a copy of the base layer beside them (`...embed_tokens.base_layer.weight`,
`lm_head.base_layer.weight`, `save_embedding_layers`): its shape is checked and it is not used.

Where they live: a slot's tensors are copied to the device when the adapter is uploaded
(`SlotEmbeddingLoRA`, held by the pool per slot, sized by the adapter's own rank, none for adapters
without them). A step holding such a request runs eagerly (as DoRA's, lora/dora.py), and its delta
is one shrink and one expand per distinct such adapter in the step over that adapter's rows.
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


@dataclass(frozen=True)
class SlotEmbeddingLoRA:
    """A slot's embedding / lm_head LoRA on the device, laid out for the step's gathers."""

    embed_a_t: torch.Tensor | None  # [vocab, r]: a token's row of A^T
    embed_b_t: torch.Tensor | None  # [r, hidden]
    embed_scaling: float
    head_a_t: torch.Tensor | None  # [hidden, r]
    head_b_t: torch.Tensor | None  # [r, vocab]
    head_scaling: float
    # trainable tokens (lora/trainable_tokens.py): each vocabulary id's row in `embed_rows` (-1: the
    # base's), and lm_head's listed ids with their rows
    embed_lut: torch.Tensor | None = None  # int64 [vocab]
    embed_rows: torch.Tensor | None = None  # [n, hidden]
    head_ids: torch.Tensor | None = None  # int64 [n]
    head_rows: torch.Tensor | None = None  # [n, hidden]

    @property
    def has_embedding(self) -> bool:
        return self.embed_a_t is not None or self.embed_lut is not None

    @property
    def has_head(self) -> bool:
        return self.head_a_t is not None or self.head_ids is not None

    @classmethod
    def upload(
        cls, lora: dict[str, EmbeddingLoRA], rows: dict, vocab: int, device: torch.device, non_blocking: bool
    ) -> SlotEmbeddingLoRA:
        """`rows`: the adapter's trainable-token rows (`TokenRows` per layer path)."""

        def dev(t: torch.Tensor, transpose: bool = True) -> torch.Tensor:
            return (t.t() if transpose else t).contiguous().to(device, non_blocking=non_blocking)

        e, h = lora.get(EMBED_PATH), lora.get(HEAD_PATH)
        embed_lut = embed_rows = head_ids = head_rows = None
        if EMBED_PATH in rows:
            lut = torch.full((vocab,), -1, dtype=torch.int64)
            lut[rows[EMBED_PATH].ids] = torch.arange(len(rows[EMBED_PATH].ids))
            embed_lut, embed_rows = dev(lut, False), dev(rows[EMBED_PATH].values, False)
        if HEAD_PATH in rows:
            head_ids, head_rows = dev(rows[HEAD_PATH].ids, False), dev(rows[HEAD_PATH].values, False)
        return cls(
            None if e is None else dev(e.a),
            None if e is None else dev(e.b),
            0.0 if e is None else e.scaling,
            None if h is None else dev(h.a),
            None if h is None else dev(h.b),
            0.0 if h is None else h.scaling,
            embed_lut,
            embed_rows,
            head_ids,
            head_rows,
        )


def add_embedding_deltas(
    h: torch.Tensor, input_ids: torch.Tensor, segments: list[tuple[SlotEmbeddingLoRA, torch.Tensor]]
) -> torch.Tensor:
    """`h` `[T, hidden]` (the looked-up embeddings) plus each segment's `s * B @ A[:, token]` on its
    token rows (`segments`: (the slot's LoRA, the rows' indices) per distinct adapter with one)."""
    if not segments:
        return h
    h = h.clone()
    for lora, rows in segments:
        ids = input_ids.index_select(0, rows)
        if lora.embed_lut is not None:  # trainable tokens: the adapter's rows replace the base's
            at = lora.embed_lut.index_select(0, ids)
            own = lora.embed_rows.index_select(0, at.clamp(min=0)).to(h.dtype)
            h.index_copy_(0, rows, torch.where((at >= 0).unsqueeze(1), own, h.index_select(0, rows)))
        if lora.embed_a_t is not None:
            after_a = lora.embed_a_t.index_select(0, ids)  # [n, r]
            delta = (after_a @ lora.embed_b_t) * lora.embed_scaling
            h.index_add_(0, rows, delta.to(h.dtype))
    return h


def add_head_deltas(
    logits: torch.Tensor, hidden: torch.Tensor, segments: list[tuple[SlotEmbeddingLoRA, torch.Tensor]]
) -> torch.Tensor:
    """`logits` `[R, vocab]` plus each segment's `s * (h A^T) B^T` on its rows of `hidden` `[R, hidden]`."""
    for lora, rows in segments:
        h = hidden.index_select(0, rows)
        if lora.head_ids is not None:  # trainable tokens: those ids' logits from the adapter's rows
            own = (h @ lora.head_rows.t()).to(logits.dtype)  # [n_rows, n_ids]
            logits.index_put_((rows.unsqueeze(1), lora.head_ids.unsqueeze(0)), own)
        if lora.head_a_t is not None:
            delta = ((h @ lora.head_a_t) @ lora.head_b_t) * lora.head_scaling
            logits.index_add_(0, rows, delta.to(logits.dtype))
    return logits
