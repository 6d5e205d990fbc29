"""The adapter pool: per module group, A/B pages of `PAGE_ROWS` rank rows, and per-slot tables.

Layout (docs/architecture.md, "LoRA pool layout"), for group `g` with `n` stacked modules of
output widths `w_i` and input width `d`, `P = min(PAGE_ROWS, R)`, `R = max_lora_rank`:
- `lora_a[g]`: `[L, pages, n*P, d]`; rank row `r` of stack `i` of a slot lives in page
  `page_table[slot, r // P]`, row `i*P + r % P` (contiguous along `d`)
- `lora_b[g]`: `[L, pages, P, sum(w)]`; rank row `r` of stack `i`: page `page_table[slot, r // P]`,
  row `r % P`, columns `[off_i, off_i + w_i)` (B transposed: contiguous along the output width)
- `page_table`: `[slots, ceil(R/P)]` int32 on the device (static: CUDA graphs read it in place);
  entries past a slot's own pages are 0 (a valid page: readers mask rows past the rank)
- `rank[g]`: `[L, slots, n]` int32 (0 = not targeted), `scaling[g]`: `[L, slots, n]` float32
- `dora.factors[g]` (lora/dora_tables.py, with the first DoRA adapter): `[L, slots + 1, sum(w)]` float32,
  the per-row factor `m / ||W + sBA||` of a DoRA slot; row `slots` is all ones (non-DoRA tokens)
- `vocab` (lora/vocab_tables.py): embedding / lm_head LoRA and trainable-token rows of up to
  `VOCAB_SLOTS` adapters, stacked, each part allocated with its first adapter; `kinds_slots` names
  the slots holding DoRA or vocabulary parts (a step holding one replays the graphs' kinds variant)
A page holds `P` rank rows of one adapter in every layer and group, so an adapter takes
`ceil(r_max / P)` pages (`r_max`: its largest rank over the pool's groups), whatever `R` is, and any
free page serves any adapter: pages are one size, so freeing never fragments. Groups with no module
in `--lora-target-modules` are not allocated. Rows past a slot's rank are stale: readers honour `rank`.
LoRA on the experts keeps its own per-slot layout (lora/expert_lora.py), as do the DoRA and vocabulary
tables.

On CUDA an upload is a copy from pinned host memory on a side stream, ordered after the work
already queued on the compute stream (which may still read the pages' previous adapter); its
event tells when the slot may be used. On CPU the copy is synchronous.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import nullcontext

import torch

from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.backend import GROUPS
from loraplex.services.inference.lora.dora_tables import DoraTables
from loraplex.services.inference.lora.expert_lora import ExpertLoRAPool, expert_modules
from loraplex.services.inference.lora.packed_groups import group_tables
from loraplex.services.inference.lora.pool_layout import (
    FreePages,
    allocated_groups,
    default_pages,
    page_nbytes,
    page_rows,
    pages_for_rank,
)
from loraplex.services.inference.lora.shapes import ModelShapes
from loraplex.services.inference.lora.vocab_tables import VOCAB_SLOTS, VocabTables

log = logging.getLogger(__name__)


class PoolFull(RuntimeError):
    """An upload found fewer free pages than its adapter needs (the manager frees pages first)."""


class AdapterPool:
    """Device buffers holding up to `slots` adapters in `num_pages` pages; which adapter a slot
    holds lives in the manager, which pages it holds lives here."""

    def __init__(
        self,
        shapes: ModelShapes,
        *,
        slots: int,
        max_rank: int,
        target_modules: Iterable[str],
        dtype: torch.dtype,
        device: torch.device | str,
        vocab_slots: int = VOCAB_SLOTS,
        num_pages: int | None = None,
        external_pages: bool = False,
    ):
        """`num_pages` None: `default_pages` (every slot can hold a max-rank adapter); fewer pages
        bound the memory, and then uploads need free pages (`free_pages`) as well as a slot.
        `external_pages`: allocate no page buffers; `adopt` brings them (lora/unified.py)."""
        self.shapes, self.slots, self.max_rank = shapes, slots, max_rank
        self.target_modules = tuple(target_modules)
        self.dtype, self.device = dtype, torch.device(device)
        self.groups = allocated_groups(self.target_modules)
        self.page_rows = page_rows(max_rank)
        self.pages_per_slot = pages_for_rank(max_rank, max_rank)
        self.num_pages = default_pages(slots, max_rank) if num_pages is None else num_pages
        if external_pages:
            self.num_pages = 0
        elif self.groups and self.num_pages < self.pages_per_slot:
            raise ValueError(
                f"an adapter pool of {self.num_pages} pages cannot hold one rank-{max_rank} adapter "
                f"({self.pages_per_slot} pages of {self.page_rows} rank rows)"
            )
        L, P = shapes.num_layers, self.page_rows
        self.lora_a: dict[str, torch.Tensor] = {}
        self.lora_b: dict[str, torch.Tensor] = {}
        self.rank: dict[str, torch.Tensor] = {}
        self.scaling: dict[str, torch.Tensor] = {}
        # Host mirrors of the tables let the torch backend slice by rank without device syncs.
        self.host_rank: dict[str, torch.Tensor] = {}
        self.host_scaling: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, tuple[int, ...]] = {}
        for g in self.groups:
            n, d, widths = len(GROUPS[g]), shapes.group_in(g), shapes.group_widths(g)
            # Uninitialised on purpose: nothing reads past a slot's rank, and on CPU pages never
            # written are never touched (free pages are taken lowest first, so an idle pool costs nothing).
            self.lora_a[g] = torch.empty(L, self.num_pages, n * P, d, dtype=dtype, device=self.device)
            self.lora_b[g] = torch.empty(L, self.num_pages, P, sum(widths), dtype=dtype, device=self.device)
            self.rank[g] = torch.zeros(L, slots, n, dtype=torch.int32, device=self.device)
            self.scaling[g] = torch.zeros(L, slots, n, dtype=torch.float32, device=self.device)
            self.host_rank[g] = torch.zeros(L, slots, n, dtype=torch.int32)
            self.host_scaling[g] = torch.zeros(L, slots, n, dtype=torch.float32)
            self.offsets[g] = tuple(sum(widths[:i]) for i in range(n + 1))
        self.page_table = torch.zeros(slots, self.pages_per_slot, dtype=torch.int32, device=self.device)
        self.host_pages: list[list[int]] = [[] for _ in range(slots)]
        self.page_source: FreePages = FreePages(self.num_pages)
        # Pages in the KV cache's memory (lora/unified.py): the most that adapters requests compute
        # with may hold (the pool's own share of the budget); None: the pool's own buffers.
        self.guaranteed_pages: int | None = None
        # The experts' buffers, when --lora-target-modules names them (lora/expert_lora.py).
        self.experts = (
            ExpertLoRAPool(
                shapes,
                slots=slots,
                max_rank=max_rank,
                modules=self.target_modules,
                dtype=dtype,
                device=self.device,
            )
            if expert_modules(self.target_modules)
            else None
        )
        self.dora = DoraTables(shapes, self.groups, self.offsets, slots, self.device)  # lora/dora_tables.py
        # LoRA on the embedding / lm_head and trainable tokens, in a few vocab slots (lora/vocab_tables.py)
        self.vocab = VocabTables(
            slots,
            vocab=shapes.vocab_size,
            hidden=shapes.hidden_size,
            max_rank=max_rank,
            dtype=dtype,
            device=self.device,
            vocab_slots=vocab_slots,
        )
        # Slots holding a DoRA adapter or one with vocabulary parts (host; the step's graph variant)
        self.kinds_slots: frozenset[int] = frozenset()
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._pending: dict[int, tuple[torch.cuda.Event, list]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer allocated on the device (equals `pool_nbytes`)."""
        return (
            sum(
                t.numel() * t.element_size()
                for d in (self.lora_a, self.lora_b, self.rank, self.scaling)
                for t in d.values()
            )
            + (self.page_table.numel() * 4 if self.groups else 0)
            + (0 if self.experts is None else self.experts.nbytes)
        )

    def adopt(self, lora_a: dict[str, torch.Tensor], lora_b: dict[str, torch.Tensor]) -> None:
        """Hold the pages in other memory (lora/unified.py: views of the KV cache's blocks), before any
        adapter is uploaded: same shapes and dtype, any page stride."""
        if self.pages_in_use:
            raise RuntimeError("the pool's pages can move only while no adapter holds any")
        num_pages = next(iter(lora_a.values())).shape[1] if lora_a else self.num_pages
        for mine, theirs in ((self.lora_a, lora_a), (self.lora_b, lora_b)):
            for g, t in mine.items():
                want = (t.shape[0], num_pages, *t.shape[2:])
                if tuple(theirs[g].shape) != want or theirs[g].dtype != t.dtype:
                    raise ValueError(f"group {g}: {tuple(theirs[g].shape)} {theirs[g].dtype} for {want}")
        self.lora_a, self.lora_b = dict(lora_a), dict(lora_b)
        self.num_pages = num_pages

    @property
    def page_nbytes(self) -> int:
        return page_nbytes(self.shapes, self.max_rank, self.target_modules, self.dtype)

    @property
    def free_pages(self) -> int:
        return self.page_source.available()

    @property
    def pages_in_use(self) -> int:
        return sum(len(pages) for pages in self.host_pages)

    def pages_needed(self, weights: AdapterWeights) -> int:
        """Pages `weights` takes: its largest rank over the pool's groups, in pages (0: it targets
        none of them, e.g. an adapter of the experts or the embedding only)."""
        if not self.groups:
            return 0
        return pages_for_rank(max((t.rank for t in weights.targets.values()), default=0), self.max_rank)

    def pages_available(self, returned: int = 0) -> int:
        """Pages an upload could take, were `returned` pages of resident adapters given back first."""
        return self.page_source.available(returned)

    def slot_pages(self, slot: int) -> int:
        return len(self.host_pages[slot])

    def release(self, slot: int) -> None:
        """Give the slot's pages back (its adapter left the pool). Nothing may compute on the slot
        any more; an upload into the pages is ordered after the work already queued that read them."""
        pending = self._pending.get(slot)
        if pending is not None and self.host_pages[slot]:
            # Pages inside the KV cache (lora/unified.py) may be written by the compute stream next:
            # never before the side stream's copy into them has landed.
            torch.cuda.current_stream(self.device).wait_event(pending[0])
        for page in self.host_pages[slot]:
            self.page_source.give(page)
        self.host_pages[slot] = []

    def upload(self, slot: int, weights: AdapterWeights) -> None:
        """Copy an adapter into `slot` (asynchronously on CUDA; see `ready`), its pages taken from the
        free list after the slot's previous pages went back; `PoolFull` when too few are free."""
        need = self.pages_needed(weights)
        available = self.pages_available(self.slot_pages(slot))
        if need > available:
            raise PoolFull(f"adapter needs {need} pages; {available} free for slot {slot}")
        self.release(slot)
        pages = [self.page_source.take() for _ in range(need)]
        self.host_pages[slot] = pages
        row = torch.zeros(self.pages_per_slot, dtype=torch.int32)
        row[:need] = torch.tensor(pages, dtype=torch.int32)
        tables: list[torch.Tensor] = []
        keep: list = [weights]
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            row = row.pin_memory()
            tables.append(row)
        ctx = torch.cuda.stream(self._stream) if self._cuda else nullcontext()
        with ctx:
            self.page_table[slot].copy_(row, non_blocking=True)
            page_ids = torch.tensor(pages, dtype=torch.int64, device=self.device)
            for g in self.groups:
                self._upload_group(g, slot, weights, need, page_ids, tables, keep)
            if self.experts is not None:
                self.experts.upload(slot, weights)
            self.dora.upload(slot, weights, tables)
            self.vocab.upload(slot, weights, tables)
        kinds = bool(self.dora.host_flag[slot]) or self.vocab.host_slot_vocab[slot] >= 0
        self.kinds_slots = self.kinds_slots | {slot} if kinds else self.kinds_slots - {slot}
        if self._cuda:
            # The host tensors (and the device staging) must outlive the asynchronous copies.
            self._pending[slot] = (self._stream.record_event(), keep + tables)

    @property
    def kinds_tables(self) -> tuple[bool, int]:
        """What a kinds-variant graph captured: changes when DoRA or vocabulary tables are allocated."""
        return bool(self.dora.factors), self.vocab.generation

    def _upload_group(
        self,
        g: str,
        slot: int,
        weights: AdapterWeights,
        need: int,
        page_ids: torch.Tensor,
        tables: list,
        keep: list,
    ) -> None:
        """One group's rows and tables: its A and B are copied into a rank-padded device staging (the
        unpaged layout: two copies from a pack, lora/packed_groups.py, else two per (layer, module)),
        then scattered into the adapter's pages with one device copy per tensor."""
        L, P, n = self.shapes.num_layers, self.page_rows, len(GROUPS[g])
        pack = weights.packed.get(g)
        if pack is not None:
            mine, rank, scaling = [], pack.rank, pack.scaling  # pinned on CUDA already
        else:
            mine = [(key, t) for key, t in weights.targets.items() if key[1] in GROUPS[g]]
            rank, scaling = group_tables(mine, GROUPS[g], L, pin_memory=self._cuda)
            tables += [rank, scaling]  # the asynchronous copies read them
        if mine or pack is not None:
            stage_a, stage_b = self._staging(g, weights, mine, need)
            d, width = self.shapes.group_in(g), self.offsets[g][-1]
            # [L, n, pages*P, d] -> [L, pages, n*P, d]; [L, W, pages*P] -> [L, pages, P, W]
            paged_a = stage_a.view(L, n, need, P, d).transpose(1, 2).reshape(L, need, n * P, d)
            paged_b = stage_b.view(L, width, need, P).permute(0, 2, 3, 1)
            self.lora_a[g].index_copy_(1, page_ids, paged_a)
            self.lora_b[g].index_copy_(1, page_ids, paged_b.contiguous())
            # The stagings are made and read on the upload's stream only: freeing them here is safe.
        self.host_rank[g][:, slot] = rank
        self.host_scaling[g][:, slot] = scaling
        self.rank[g][:, slot].copy_(rank, non_blocking=True)
        self.scaling[g][:, slot].copy_(scaling, non_blocking=True)

    def _staging(
        self, g: str, weights: AdapterWeights, mine: list, need: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's A `[L, n, need*P, d]` and B `[L, W, need*P]` on the device, zero past each rank."""
        L, P, n = self.shapes.num_layers, self.page_rows, len(GROUPS[g])
        pack = weights.packed.get(g)
        if pack is not None and pack.a.shape[2] == need * P and pack.a.dtype == self.dtype:
            # the pack is the staging itself (its rank fills whole pages: rank 16 on 8-row pages)
            return pack.a.to(self.device, non_blocking=True), pack.b.to(self.device, non_blocking=True)
        d, width = self.shapes.group_in(g), self.offsets[g][-1]
        stage_a = torch.zeros(L, n, need * P, d, dtype=self.dtype, device=self.device)
        stage_b = torch.zeros(L, width, need * P, dtype=self.dtype, device=self.device)
        if pack is not None:
            r = pack.a.shape[2]
            stage_a[:, :, :r].copy_(pack.a.to(self.device, non_blocking=True))
            stage_b[:, :, :r].copy_(pack.b.to(self.device, non_blocking=True))
            return stage_a, stage_b
        for (layer, module), t in mine:
            i = GROUPS[g].index(module)
            r, lo, hi = t.rank, self.offsets[g][i], self.offsets[g][i + 1]
            stage_a[layer, i, :r].copy_(weights.lora_a[(layer, module)], non_blocking=True)
            stage_b[layer, lo:hi, :r].copy_(weights.lora_b[(layer, module)], non_blocking=True)
        return stage_a, stage_b

    def ready(self, slot: int) -> bool:
        """True when the slot's last upload has landed (never blocks)."""
        pending = self._pending.get(slot)
        if pending is None:
            return True
        if pending[0].query():
            del self._pending[slot]
            return True
        return False
