"""The torch LoRA backend: gather/segment matmuls over the pool, on CPU or GPU.

Reads the pool through its page table (lora/pool.py): a slot's rank rows are its pages' rows, in
order. `prepare` groups the step's tokens by slot once (a slice when a slot's tokens are contiguous,
which is the usual case since the runner lays each request's tokens out together; else an
index tensor). `apply` then runs, per slot and stacked module, one shrink and one expand
using only the slot's real rank, in PEFT's order: `B(A(x)) * scaling`.

It reads the slot table on the host in `prepare`, so it is not CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.services.inference.lora.backend import GROUPS, LoRABackend
from loraplex.services.inference.lora.pool import AdapterPool


class TorchLoRABackend(LoRABackend):
    name = "torch"
    cuda_graph_safe = False

    def __init__(self, pool: AdapterPool):
        self.pool = pool
        self._segments: list[tuple[int, slice | torch.Tensor]] = []
        # group -> [layer][segment][stack] rank / scaling, read once per step.
        self._ranks: dict[str, list[list[list[int]]]] = {}
        self._scales: dict[str, list[list[list[float]]]] = {}
        self._pages: list[list[int]] = []  # per segment, its slot's pages (the host page table)

    def prepare(self, token_slots: torch.Tensor, max_distinct: int | None = None) -> None:
        slots_host = token_slots.to("cpu", torch.int64)
        segments: list[tuple[int, slice | torch.Tensor]] = []
        for slot in torch.unique(slots_host).tolist():
            if slot < 0:
                continue
            idx = torch.nonzero(slots_host == slot).flatten()
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            sel = slice(lo, hi) if hi - lo == idx.numel() else idx.to(token_slots.device)
            segments.append((slot, sel))
        self._segments = segments
        used = [s for s, _ in segments]
        self._ranks = {g: self.pool.host_rank[g][:, used].tolist() for g in self.pool.groups}
        self._scales = {g: self.pool.host_scaling[g][:, used].tolist() for g in self.pool.groups}
        self._pages = [self.pool.host_pages[s] for s in used]
        if self.experts is not None:
            self.experts.prepare(token_slots)
        if self.kinds_step:
            self.prepare_kinds(token_slots)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if group not in self._ranks or not self._segments:
            return
        pool = self.pool
        lora_a, lora_b = pool.lora_a[group][layer], pool.lora_b[group][layer]
        offsets = pool.offsets[group]
        ranks, scales = self._ranks[group][layer], self._scales[group][layer]
        for k, (_, sel) in enumerate(self._segments):
            xs = x[sel]
            for i in range(len(GROUPS[group])):
                r = ranks[k][i]
                if r == 0:
                    continue
                a, bt = self.rows(lora_a, lora_b, k, i, r, offsets[i], offsets[i + 1])
                delta = F.linear(F.linear(xs, a), bt.t()) * scales[k][i]
                out[sel, offsets[i] : offsets[i + 1]] += delta.to(out.dtype)

    def rows(
        self, lora_a: torch.Tensor, lora_b: torch.Tensor, k: int, i: int, r: int, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment `k`'s adapter, stack `i` of rank `r`, from one layer's pages: A `[r, d]` and B
        transposed `[r, hi - lo]` (the slot's first ceil(r/P) pages, in order, hold rows [0, r))."""
        P = self.pool.page_rows
        pages = self._pages[k][: -(-r // P)]
        a = lora_a[pages, i * P : (i + 1) * P].reshape(-1, lora_a.shape[-1])[:r]
        bt = lora_b[pages, :, lo:hi].reshape(-1, hi - lo)[:r]
        return a, bt
