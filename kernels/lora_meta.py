"""Per-step LoRA batch metadata: tokens grouped by adapter slot, in fixed-address device tensors.

`build_segments` runs once per forward (not per layer) and only issues device ops, so it
can sit inside a captured CUDA graph: no `.item()`, no data-dependent shapes, no host sync.

Grouping: a stable sort of the batch's tokens by slot gives `sorted_tokens` (tokens with
slot -1 last, never touched by a kernel). The slot-sorted list is cut into *token blocks*
of `block_m` tokens that never straddle two slots; block `b` holds the token indices
`block_tokens[b, :block_m]` (-1 padding), all of slot `block_slot[b]` (-1: unused block,
the kernel program exits at once). A kernel program reads its slot and its tokens with
one independent load each, so the metadata costs one memory round trip, not a chain. The
kernels launch a fixed grid of `num_blocks_bound(T, ...)` blocks on axis 0, which is an upper
bound on the real number, so the grid never depends on the batch's contents. Blocks are packed:
the real ones come first. With a host-known bound k on the distinct slots of a step,
`num_blocks_bound(T, k, block_m)` blocks suffice (each slot adds at most one partial block),
which cuts the programs that would only find an unused block and exit: the step plan's
`distinct_bound` (`kernels/lora_plan.py`). One map is kept per block size in `BLOCK_MS` (small
blocks for decode, large for prefill).

On CUDA, decode-sized steps build the maps with one Triton launch (`_segments_kernel`, four
programs, one per block size); the torch version (`build_segments_ref`, ~60 small kernels, about
0.1 ms of a decode step's graph) serves larger steps, the CPU, and as the reference. The Triton
version writes only what a kernel can read for this step (blocks below
`num_blocks_bound(T, num_slots, m)`, their first `m` entries); the torch one rewrites the buffers.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from loraplex.kernels.placement import triton_runs_on

# Token-block sizes the kernels may use; a block map is built for each.
BLOCK_MS: tuple[int, ...] = (16, 32, 64, 128)
MAX_BLOCK_M = max(BLOCK_MS)


class LoRASegments(NamedTuple):
    """Preallocated per-step metadata (all int32, on one device; addresses never change).

    token_slots:   [max_tokens]           copy of the step's slots (-1 = no adapter)
    sorted_tokens: [max_tokens]           token indices ordered by slot, -1 tokens last
    slot_start:    [num_slots]            first position of each slot in `sorted_tokens`
    slot_count:    [num_slots]            number of tokens of each slot
    block_slot:    [len(BLOCK_MS), max_blocks]  slot of each token block, -1 = unused
    block_tokens:  [len(BLOCK_MS), max_blocks, MAX_BLOCK_M]  the block's tokens, -1 padding
    """

    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    slot_start: torch.Tensor
    slot_count: torch.Tensor
    block_slot: torch.Tensor
    block_tokens: torch.Tensor

    @property
    def max_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_start.shape[0]

    def blocks_for(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_slot `[max_blocks]`, block_tokens `[max_blocks, MAX_BLOCK_M]`) built for `block_m`."""
        # Views are cached per buffer: slicing tensors costs microseconds of host time per launch.
        key = id(self.block_tokens)
        hit = _BLOCK_VIEWS.get(key)
        if hit is None or hit[0]() is not self.block_tokens:
            views = {bm: (self.block_slot[i], self.block_tokens[i]) for i, bm in enumerate(BLOCK_MS)}
            hit = (weakref.ref(self.block_tokens), views)
            if len(_BLOCK_VIEWS) >= 64:  # the views keep their buffers alive: bound the cache
                _BLOCK_VIEWS.clear()
            _BLOCK_VIEWS[key] = hit
        return hit[1][block_m]


# id(block_tokens) -> (weak ref to it, views per block size). Engines allocate segments once.
_BLOCK_VIEWS: dict[int, tuple[weakref.ref, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}


def num_blocks_bound(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Most token blocks `num_tokens` tokens over `num_slots` slots can need (host-side, static)."""
    return -(-num_tokens // block_m) + min(num_slots, num_tokens)


def alloc_segments(max_tokens: int, num_slots: int, device: torch.device | str) -> LoRASegments:
    """Allocate the metadata buffers once (before CUDA-graph capture)."""
    if max_tokens < 1 or num_slots < 1:
        raise ValueError(f"need max_tokens >= 1 and num_slots >= 1, got {max_tokens}, {num_slots}")
    max_blocks = num_blocks_bound(max_tokens, num_slots, min(BLOCK_MS))

    def i32(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.int32, device=device)

    nb = len(BLOCK_MS)
    return LoRASegments(
        token_slots=torch.full((max_tokens,), -1, dtype=torch.int32, device=device),
        sorted_tokens=i32(max_tokens),
        slot_start=i32(num_slots),
        slot_count=i32(num_slots),
        block_slot=torch.full((nb, max_blocks), -1, dtype=torch.int32, device=device),
        block_tokens=torch.full((nb, max_blocks, MAX_BLOCK_M), -1, dtype=torch.int32, device=device),
    )


# The Triton build holds a [slots+1, T] matrix in one program: above this many entries, torch.
TRITON_MAX_ENTRIES = 32768


def build_segments(token_slots: torch.Tensor, out: LoRASegments) -> LoRASegments:
    """Group the step's tokens by slot into `out` (in place, device ops only); returns `out`.

    `token_slots`: int32 `[T]` on `out`'s device, values in [-1, num_slots). Entries past
    `T` in `out`'s token arrays are left as they were; kernels only look at the first `T`.
    """
    num_tokens = token_slots.shape[0]
    if num_tokens > out.max_tokens:
        raise ValueError(f"{num_tokens} tokens exceed the metadata's max_tokens={out.max_tokens}")
    if triton_runs_on(out.token_slots) and triton_build_fits(num_tokens, out.num_slots):
        return build_segments_triton(token_slots, out)
    return build_segments_ref(token_slots, out)


# Token tile of the Triton build: a power of two, at least this many, so a step's token count picks
# one of a handful of compiled variants (every one of them compiled at start-up: `segments_block_ts`).
MIN_BLOCK_T = 16


def segments_block_t(num_tokens: int) -> int:
    """The `BLOCK_T` the Triton build compiles for a step of `num_tokens` tokens."""
    return max(MIN_BLOCK_T, triton.next_power_of_2(max(num_tokens, 1)))


def triton_build_fits(num_tokens: int, num_slots: int) -> bool:
    """Whether `build_segments_triton` takes a step of this size (else the torch build does)."""
    entries = triton.next_power_of_2(num_slots + 1) * segments_block_t(num_tokens)
    return 0 < num_tokens and entries <= TRITON_MAX_ENTRIES


def segments_block_ts(max_tokens: int, num_slots: int) -> list[int]:
    """Every `BLOCK_T` a step of up to `max_tokens` tokens can compile (what a warm-up must cover)."""
    sizes = {segments_block_t(t) for t in (1, max_tokens)}
    t = MIN_BLOCK_T
    while t < max_tokens:
        sizes.add(t)
        t *= 2
    return sorted(b for b in sizes if triton_build_fits(b if b <= max_tokens else max_tokens, num_slots))


@triton.jit
def _fill_blocks(
    counts,
    key,
    rank,
    offs_t,
    t_mask,
    T,
    block_slot_ptr,
    block_tokens_ptr,
    stride_block_tokens_block,
    S: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_B: tl.constexpr,
    M: tl.constexpr,
):
    offs_s = tl.arange(0, BLOCK_S)
    nblk = tl.where(offs_s < S, (counts + M - 1) // M, 0)
    cum = tl.cumsum(nblk, axis=0)
    n_bound = (T + M - 1) // M + tl.minimum(T, S)  # num_blocks_bound: all a kernel's grid can read
    for b0 in range(0, n_bound, BLOCK_B):
        bb = b0 + tl.arange(0, BLOCK_B)
        b_mask = bb < n_bound
        # Block b belongs to the first slot whose cumulative block count exceeds b.
        slot_of = tl.sum((cum[:, None] <= bb[None, :]).to(tl.int32), axis=0)
        tl.store(block_slot_ptr + bb, tl.where(slot_of < S, slot_of, -1), mask=b_mask)
        pad = tl.full((BLOCK_B, M), -1, tl.int32)
        tl.store(
            block_tokens_ptr + bb[:, None] * stride_block_tokens_block + tl.arange(0, M)[None, :],
            pad,
            mask=b_mask[:, None],
        )
    tl.debug_barrier()  # the padding is down before any token goes over it
    eq = offs_s[:, None] == key[None, :]
    first = tl.sum(tl.where(eq, (cum - nblk)[:, None], 0), axis=0)
    tl.store(
        block_tokens_ptr + (first + rank // M) * stride_block_tokens_block + rank % M,
        offs_t,
        mask=t_mask & (key < S),
    )


# T is a runtime size: its value class (1, a multiple of 16, other) must not pick a compiled variant.
@triton.jit(do_not_specialize=["T"])
def _segments_kernel(
    slots_ptr,
    tok_slots_ptr,
    sorted_ptr,
    start_ptr,
    count_ptr,
    block_slot_ptr,
    block_tokens_ptr,
    T,
    stride_block_slot_size,  # block_slot: from one block size's map to the next
    stride_block_tokens_size,  # block_tokens: from one block size's map to the next
    stride_block_tokens_block,  # block_tokens: from one token block to the next
    S: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_B: tl.constexpr,
    M0: tl.constexpr,
    M1: tl.constexpr,
    M2: tl.constexpr,
    M3: tl.constexpr,
):
    pid = tl.program_id(0)  # which block size this program maps (program 0 also writes the sort)
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    slots = tl.load(slots_ptr + offs_t, mask=t_mask, other=-1)
    # Key S: no adapter (sorts last); lanes past T get a key no slot row matches.
    key = tl.where(t_mask, tl.where(slots >= 0, slots, S), BLOCK_S)
    offs_s = tl.arange(0, BLOCK_S)
    eq = (offs_s[:, None] == key[None, :]).to(tl.int32)
    counts = tl.sum(eq, axis=1)
    # A token's rank among its slot's tokens, in token order: what a stable sort keeps.
    rank = tl.sum(tl.where(eq > 0, tl.cumsum(eq, axis=1), 0), axis=0) - 1
    if pid == 0:
        starts = tl.cumsum(counts, axis=0) - counts
        pos = tl.sum(eq * starts[:, None], axis=0) + rank
        tl.store(tok_slots_ptr + offs_t, slots, mask=t_mask)
        tl.store(sorted_ptr + pos, offs_t, mask=t_mask)
        tl.store(start_ptr + offs_s, starts, mask=offs_s < S)
        tl.store(count_ptr + offs_s, counts, mask=offs_s < S)
        _fill_blocks(
            counts,
            key,
            rank,
            offs_t,
            t_mask,
            T,
            block_slot_ptr,
            block_tokens_ptr,
            stride_block_tokens_block,
            S,
            BLOCK_S,
            BLOCK_B,
            M0,
        )
    elif pid == 1:
        _fill_blocks(
            counts,
            key,
            rank,
            offs_t,
            t_mask,
            T,
            block_slot_ptr + stride_block_slot_size,
            block_tokens_ptr + stride_block_tokens_size,
            stride_block_tokens_block,
            S,
            BLOCK_S,
            BLOCK_B,
            M1,
        )
    elif pid == 2:
        _fill_blocks(
            counts,
            key,
            rank,
            offs_t,
            t_mask,
            T,
            block_slot_ptr + 2 * stride_block_slot_size,
            block_tokens_ptr + 2 * stride_block_tokens_size,
            stride_block_tokens_block,
            S,
            BLOCK_S,
            BLOCK_B,
            M2,
        )
    else:
        _fill_blocks(
            counts,
            key,
            rank,
            offs_t,
            t_mask,
            T,
            block_slot_ptr + 3 * stride_block_slot_size,
            block_tokens_ptr + 3 * stride_block_tokens_size,
            stride_block_tokens_block,
            S,
            BLOCK_S,
            BLOCK_B,
            M3,
        )


def build_segments_triton(token_slots: torch.Tensor, out: LoRASegments) -> LoRASegments:
    """`build_segments` in one launch (see the module docstring for what it leaves unwritten)."""
    assert len(BLOCK_MS) == 4 and list(BLOCK_MS) == sorted(BLOCK_MS)
    num_tokens, num_slots = token_slots.shape[0], out.num_slots
    slots = token_slots.to(device=out.token_slots.device, dtype=torch.int32)
    bslot, btok = out.block_slot, out.block_tokens
    _segments_kernel[(len(BLOCK_MS),)](
        slots,
        out.token_slots,
        out.sorted_tokens,
        out.slot_start,
        out.slot_count,
        bslot,
        btok,
        num_tokens,
        bslot.stride(0),
        btok.stride(0),
        btok.stride(1),
        S=num_slots,
        BLOCK_S=triton.next_power_of_2(num_slots + 1),
        BLOCK_T=segments_block_t(num_tokens),
        BLOCK_B=32,
        M0=BLOCK_MS[0],
        M1=BLOCK_MS[1],
        M2=BLOCK_MS[2],
        M3=BLOCK_MS[3],
        num_warps=8,
    )
    return out


def build_segments_ref(token_slots: torch.Tensor, out: LoRASegments) -> LoRASegments:
    """`build_segments` in torch ops (any size, any device): rewrites every entry of the buffers."""
    num_tokens = token_slots.shape[0]
    num_slots = out.num_slots
    device = out.token_slots.device
    slots = token_slots.to(device=device, dtype=torch.int32)
    out.token_slots[:num_tokens].copy_(slots)
    # Tokens without an adapter sort after every real slot and so fall out of all segments.
    key = torch.where(slots >= 0, slots, num_slots).to(torch.int64)
    order = torch.sort(key, stable=True).indices
    out.sorted_tokens[:num_tokens].copy_(order)

    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_slots]
    starts = torch.cumsum(counts, 0) - counts
    out.slot_count.copy_(counts)
    out.slot_start.copy_(starts)

    # All block sizes at once ([len(BLOCK_MS), ...] broadcasts) to keep the op count per step low.
    max_blocks = out.block_slot.shape[1]
    # torch.full, not torch.tensor: no host-to-device copy, which CUDA-graph capture refuses.
    block_m = torch.stack([torch.full((1,), m, dtype=torch.int64, device=device) for m in BLOCK_MS])
    nblk = (counts[None, :] + block_m - 1) // block_m  # [nb, slots]
    cum = torch.cumsum(nblk, 1)
    block_ids = torch.arange(max_blocks, dtype=torch.int64, device=device).expand(len(BLOCK_MS), -1)
    # Block b belongs to the first slot whose cumulative block count exceeds b.
    slot_of = torch.searchsorted(cum, block_ids.contiguous(), right=True)
    valid = slot_of < num_slots
    s = slot_of.clamp(max=num_slots - 1)
    first_block = torch.gather(cum - nblk, 1, s)
    first = starts[s] + (block_ids - first_block) * block_m
    last = torch.minimum(first + block_m, starts[s] + counts[s])
    out.block_slot.copy_(torch.where(valid, s, -1))
    pos = first[..., None] + torch.arange(MAX_BLOCK_M, dtype=torch.int64, device=device)
    in_block = valid[..., None] & (pos < last[..., None])
    tokens = order[pos.clamp(0, max(num_tokens - 1, 0))] if num_tokens else pos
    out.block_tokens.copy_(torch.where(in_block, tokens, -1))
    return out
