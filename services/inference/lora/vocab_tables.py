"""Vocabulary tables: the embedding / lm_head LoRA and trainable-token rows of resident adapters, laid
out so one step applies every adapter's with a fixed set of device ops (no host reads, no
data-dependent shapes, no per-adapter loop): what a decode CUDA graph captures, and what an eager
step runs too (one path).

A few "vocab slots" (`VOCAB_SLOTS`, V) hold the vocabulary parts of the adapters that have any; a
device table maps each pool slot to its vocab slot (-1: none), written when an adapter is uploaded
over a slot. With R the pool's max rank and N = `MAX_TOKEN_ROWS`, each part's tables are allocated
with the first adapter that has that part (servers without such adapters pay nothing):
- embedding LoRA: `A^T` stacked `[vocab, V*R]` and `B^T` `[V*R, hidden]`: a step gathers each
  token's row of A^T, keeps the columns of its own vocab slot (scaled), then ONE matmul with B^T;
- lm_head LoRA: `A^T` `[hidden, V*R]`, `B^T` `[V*R, vocab]`: `h @ A^T` masked per row the same
  way, then ONE matmul with B^T (the vocabulary-sized output: one launch for every adapter);
- trainable tokens: per vocab slot a dense map token id -> its row (-1: the base's), `[V*vocab]`,
  and the rows `[V*N, hidden]` (embedding: a gather and a `where`); for lm_head the slot's ids
  `[V, N]` and rows `[V*N, hidden]`: `h @ rows^T` for every row, then each row's own ids' logits
  written with one scatter. Padding entries repeat the slot's first id and value (and a row with
  none writes a logit back onto itself), so no two writes of a row's scatter disagree.
Columns past an adapter's rank, and the parts an adapter lacks, are zero: a stale adapter's values
never reach another's tokens. A slot's tables are written on the pool's upload stream.

A step's adapters may hold at most V vocab slots between them: the manager places an adapter with
vocabulary parts only where a vocab slot is free or its evicted occupant frees one; otherwise it
waits in the slot queue like an adapter waiting for a pool slot (lora/slot_rotation.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from loraplex.services.inference.errors import AdapterIncompatible
from loraplex.services.inference.lora.embedding_lora import EMBED_PATH, HEAD_PATH

log = logging.getLogger(__name__)

# How many resident adapters may bring embedding / lm_head LoRA or trainable tokens at once. Each costs
# the step one rank-R slice of the stacked matmuls, and each allocated part 2 * vocab * R elements.
VOCAB_SLOTS = 4
# The most trainable-token rows per layer one adapter may bring (chat and tool-call markers: a few).
MAX_TOKEN_ROWS = 256


def check_vocab_fits(weights, max_rank: int, max_token_rows: int = MAX_TOKEN_ROWS) -> None:
    """AdapterIncompatible when the adapter's vocabulary parts exceed the tables' fixed sizes."""
    for path, lora in weights.embedding.items():
        rank = int(lora.a.shape[0])
        if rank > max_rank:
            raise AdapterIncompatible(
                f"adapter_config.json: r: {path} LoRA rank {rank} exceeds this server's --max-lora-rank "
                f"{max_rank}; restart with --max-lora-rank {rank} or more",
                field="r",
            )
    for path, rows in weights.token_rows.items():
        if len(rows.ids) > max_token_rows:
            raise AdapterIncompatible(
                f"adapter_config.json: trainable_token_indices: {path} lists {len(rows.ids)} token ids; "
                f"at most {max_token_rows} per layer are served",
                field="trainable_token_indices",
            )


@dataclass
class _LoRAPart:
    a_t: torch.Tensor  # embedding: [vocab, V*R]; lm_head: [hidden, V*R]
    b_t: torch.Tensor  # embedding: [V*R, hidden]; lm_head: [V*R, vocab]
    scale: torch.Tensor  # float32 [V] (0: the vocab slot's adapter has no such LoRA)


@dataclass
class _EmbedTokens:
    lut: torch.Tensor  # int64 [V*vocab]: vocab slot v's token t -> its row in `rows`, or -1
    rows: torch.Tensor  # [V*N, hidden]


@dataclass
class _HeadTokens:
    ids: torch.Tensor  # int64 [V, N]: the slot's ids, padded with its first
    src: torch.Tensor  # int64 [V, N]: each entry's column of `h @ rows^T` (padding: the first's)
    rows: torch.Tensor  # [V*N, hidden]
    has: torch.Tensor  # bool [V]: the slot's adapter has lm_head rows


class VocabTables:
    """The pool's vocabulary tables (see the module docstring); `AdapterPool.vocab`."""

    def __init__(
        self,
        slots: int,
        *,
        vocab: int,
        hidden: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        vocab_slots: int = VOCAB_SLOTS,
        max_token_rows: int = MAX_TOKEN_ROWS,
    ):
        self.vocab, self.hidden, self.rank = vocab, hidden, max_rank
        self.dtype, self.device = dtype, device
        self.vocab_slots, self.max_token_rows = vocab_slots, max_token_rows
        self.slot_vocab = torch.full((slots,), -1, dtype=torch.int64, device=device)
        self.host_slot_vocab = [-1] * slots  # the host mirror (placement, the step's variant)
        # each column's vocab slot, for the masks
        self.column_vslot = torch.arange(vocab_slots * max_rank, device=device) // max_rank
        self.embed_lora: _LoRAPart | None = None
        self.head_lora: _LoRAPart | None = None
        self.embed_tokens: _EmbedTokens | None = None
        self.head_tokens: _HeadTokens | None = None
        # Bumped when a part is allocated: graphs captured before it lack that part (engine/cuda_graph.py).
        self.generation = 0

    # ----- placement (host) -----

    def free_vocab_slot(self) -> bool:
        return sum(v >= 0 for v in self.host_slot_vocab) < self.vocab_slots

    def holders(self) -> set[int]:
        """Pool slots holding a vocab slot (uploading over one of them frees it)."""
        return {s for s, v in enumerate(self.host_slot_vocab) if v >= 0}

    @property
    def nbytes(self) -> int:
        parts = [self.slot_vocab, self.column_vslot]
        for p in (self.embed_lora, self.head_lora, self.embed_tokens, self.head_tokens):
            if p is not None:
                parts += list(vars(p).values())
        return sum(t.numel() * t.element_size() for t in parts)

    def upload(self, slot: int, weights, keep: list) -> None:
        """Write `weights`' vocabulary parts for pool `slot` (on the current stream), or release its
        vocab slot when it has none. `keep`: host tensors that must outlive asynchronous copies."""
        old = self.host_slot_vocab[slot]
        if not weights.has_vocab_parts:
            if old >= 0:
                self._set_slot(slot, -1, keep)
            return
        if old < 0:
            used = set(self.host_slot_vocab)
            free = [v for v in range(self.vocab_slots) if v not in used]
            if not free:  # the manager places vocab adapters only where one is free (see module doc)
                raise RuntimeError(f"no free vocab slot for pool slot {slot}")
            old = free[0]
        v = old
        self._write_lora(v, weights.embedding.get(EMBED_PATH), "embed", keep)
        self._write_lora(v, weights.embedding.get(HEAD_PATH), "head", keep)
        self._write_embed_tokens(v, weights.token_rows.get(EMBED_PATH), keep)
        self._write_head_tokens(v, weights.token_rows.get(HEAD_PATH), keep)
        self._set_slot(slot, v, keep)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, keep: list) -> None:
        if self.device.type == "cuda":
            src = src.pin_memory()
            keep.append(src)
        dst.copy_(src, non_blocking=True)

    def _set_slot(self, slot: int, v: int, keep: list) -> None:
        self.host_slot_vocab[slot] = v
        self._copy(self.slot_vocab[slot : slot + 1], torch.tensor([v], dtype=torch.int64), keep)

    def _allocate(self, what: str) -> None:
        V, R, N, d = self.vocab_slots, self.rank, self.max_token_rows, self.device
        log.info("adapter with %s in the pool: allocating its vocabulary tables (%d vocab slots)", what, V)
        if what == "embed":
            self.embed_lora = _LoRAPart(
                torch.zeros(self.vocab, V * R, dtype=self.dtype, device=d),
                torch.zeros(V * R, self.hidden, dtype=self.dtype, device=d),
                torch.zeros(V, dtype=torch.float32, device=d),
            )
        elif what == "head":
            self.head_lora = _LoRAPart(
                torch.zeros(self.hidden, V * R, dtype=self.dtype, device=d),
                torch.zeros(V * R, self.vocab, dtype=self.dtype, device=d),
                torch.zeros(V, dtype=torch.float32, device=d),
            )
        elif what == "embed_tokens":
            self.embed_tokens = _EmbedTokens(
                torch.full((V * self.vocab,), -1, dtype=torch.int64, device=d),
                torch.zeros(V * N, self.hidden, dtype=self.dtype, device=d),
            )
        else:
            self.head_tokens = _HeadTokens(
                torch.zeros(V, N, dtype=torch.int64, device=d),
                torch.zeros(V, N, dtype=torch.int64, device=d),
                torch.zeros(V * N, self.hidden, dtype=self.dtype, device=d),
                torch.zeros(V, dtype=torch.bool, device=d),
            )
        if d.type == "cuda":  # filled on the upload stream: no step may read them before that ends
            torch.cuda.synchronize(d)
        self.generation += 1

    def _write_lora(self, v: int, lora, which: str, keep: list) -> None:
        part = self.embed_lora if which == "embed" else self.head_lora
        if part is None and lora is None:
            return
        if part is None:
            self._allocate(which)
            part = self.embed_lora if which == "embed" else self.head_lora
        R = self.rank
        cols = slice(v * R, (v + 1) * R)
        a_t = torch.zeros(part.a_t.shape[0], R, dtype=self.dtype)
        b_t = torch.zeros(R, part.b_t.shape[1], dtype=self.dtype)
        scale = 0.0
        if lora is not None:
            r = int(lora.a.shape[0])
            a_t[:, :r] = lora.a.t().to(self.dtype)
            b_t[:r] = lora.b.t().to(self.dtype)
            scale = lora.scaling
        self._copy(part.a_t[:, cols], a_t, keep)
        self._copy(part.b_t[cols], b_t, keep)
        self._copy(part.scale[v : v + 1], torch.tensor([scale], dtype=torch.float32), keep)

    def _write_embed_tokens(self, v: int, rows, keep: list) -> None:
        if self.embed_tokens is None and rows is None:
            return
        if self.embed_tokens is None:
            self._allocate("embed_tokens")
        N, t = self.max_token_rows, self.embed_tokens
        lut = torch.full((self.vocab,), -1, dtype=torch.int64)
        values = torch.zeros(N, self.hidden, dtype=self.dtype)
        if rows is not None:
            n = len(rows.ids)
            lut[rows.ids] = v * N + torch.arange(n)
            values[:n] = rows.values.to(self.dtype)
        self._copy(t.lut[v * self.vocab : (v + 1) * self.vocab], lut, keep)
        self._copy(t.rows[v * N : (v + 1) * N], values, keep)

    def _write_head_tokens(self, v: int, rows, keep: list) -> None:
        if self.head_tokens is None and rows is None:
            return
        if self.head_tokens is None:
            self._allocate("head_tokens")
        N, t = self.max_token_rows, self.head_tokens
        ids = torch.zeros(N, dtype=torch.int64)
        src = torch.full((N,), v * N, dtype=torch.int64)
        values = torch.zeros(N, self.hidden, dtype=self.dtype)
        if rows is not None:
            n = len(rows.ids)
            ids[:n], ids[n:] = rows.ids, rows.ids[0]
            src[:n] = v * N + torch.arange(n)
            values[:n] = rows.values.to(self.dtype)
        self._copy(t.ids[v], ids, keep)
        self._copy(t.src[v], src, keep)
        self._copy(t.rows[v * N : (v + 1) * N], values, keep)
        self._copy(t.has[v : v + 1], torch.tensor([rows is not None]), keep)

    # ----- the step (device ops only, static shapes) -----

    def token_vslots(self, token_slots: torch.Tensor) -> torch.Tensor:
        """Each token's vocab slot (int64, -1: none) from its pool slot (-1: no adapter)."""
        s = token_slots.to(torch.int64)
        return torch.where(s >= 0, self.slot_vocab.index_select(0, s.clamp(min=0)), -1)

    def _masked(self, x: torch.Tensor, vslots: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`x` `[T, V*R]` with each row's columns of other vocab slots zeroed and its own scaled (a
        `where`, not a product: another slot's columns never leak, not even a non-finite value)."""
        s = scale.index_select(0, vslots.clamp(min=0)).to(x.dtype).unsqueeze(1)
        mine = self.column_vslot.unsqueeze(0) == vslots.unsqueeze(1)
        return torch.where(mine, x * s, 0.0)

    def embed(self, h: torch.Tensor, input_ids: torch.Tensor, vslots: torch.Tensor) -> torch.Tensor:
        """The looked-up embeddings `h` `[T, hidden]` with each token's adapter rows and LoRA delta."""
        t = self.embed_tokens
        if t is not None:  # trainable tokens: the adapter's row replaces the base's
            flat = vslots.clamp(min=0) * self.vocab + input_ids.clamp(min=0)
            at = torch.where(vslots >= 0, t.lut.index_select(0, flat), -1)
            own = t.rows.index_select(0, at.clamp(min=0)).to(h.dtype)
            h = torch.where((at >= 0).unsqueeze(1), own, h)
        p = self.embed_lora
        if p is not None:
            after_a = self._masked(p.a_t.index_select(0, input_ids.clamp(min=0)), vslots, p.scale)
            h = _add_product(h, after_a, p.b_t)
        return h

    def head(self, logits: torch.Tensor, hidden: torch.Tensor, vslots: torch.Tensor) -> torch.Tensor:
        """`logits` `[rows, vocab]` of `hidden` `[rows, hidden]` with each row's adapter's lm_head parts
        (`logits` may be changed in place: the model passes the lm_head matmul's fresh output)."""
        t = self.head_tokens
        if t is not None:  # trainable tokens: the listed ids' logits from the adapter's rows
            v = vslots.clamp(min=0)
            use = ((vslots >= 0) & t.has.index_select(0, v)).unsqueeze(1)
            own = (hidden @ t.rows.t()).gather(1, t.src.index_select(0, v)).to(logits.dtype)
            cols = torch.where(use, t.ids.index_select(0, v), 0)
            logits.scatter_(1, cols, torch.where(use, own, logits.gather(1, cols)))  # a fresh tensor
        p = self.head_lora
        if p is not None:
            after_a = self._masked(hidden.to(p.a_t.dtype) @ p.a_t, vslots, p.scale)
            logits = _add_product(logits, after_a, p.b_t)
        return logits


def _add_product(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`c + a @ b`: one GEMM with the add in its epilogue where the dtypes agree (the vocabulary-wide
    lm_head delta is then written once, not written, read and added)."""
    if c.dtype == a.dtype:
        return torch.addmm(c, a, b)
    return c + (a @ b).to(c.dtype)
