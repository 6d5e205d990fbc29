"""LoRA under tensor parallelism, as S-LoRA shards it.

- Column-parallel modules (q, k, v, gate, up): A whole on every rank, B split by output rows;
  each rank adds its slice of the delta to its slice of the output.
- Row-parallel modules (o, down): A split by input columns, B whole; the shrink outputs
  `A_r x_r` ([T, rank], small) are all-reduced, then every rank expands with the whole B
  and adds the delta to the (already all-reduced) base output.

Rank 0's LoRA manager decides what goes in which slot; `ShardedAdapterPool.upload` sends each
worker its shard of the adapter (the tensors rank 0 validated, so every rank holds the same
version) and uploads rank 0's shard locally. Pool writes are the only state, so loads,
reloads and unloads stay in step on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_shrink import alloc_shrink_out, lora_shrink, shrink_out_view
from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.backend import GROUPS, LoRABackend
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.shapes import ModelShapes
from loraplex.services.inference.lora.torch_backend import TorchLoRABackend
from loraplex.services.inference.parallel.partition import COLUMN_MODULES, ShardPlan

log = logging.getLogger(__name__)

ROW_GROUPS = ("o", "down")


def make_tp_backend(
    pool: AdapterPool, backend: str, max_tokens: int, max_distinct: int | None = None
) -> LoRABackend:
    """`--lora-backend` under TP: `triton` (the kernels, GPU or TRITON_INTERPRET=1) or `torch`.
    `max_distinct`: --max-loras-per-batch (None: the pool's slots), the backend's `step_distinct_cap`
    as lora/setup.py sets it for one GPU, so warm-up compiles no LoRA tier a step cannot reach."""
    tp: LoRABackend = TPTritonLoRABackend(pool, max_tokens) if backend == "triton" else TPLoRABackend(pool)
    tp.step_distinct_cap = max_distinct
    return tp


def shard_adapter(weights: AdapterWeights, plan: ShardPlan, shapes: ModelShapes) -> AdapterWeights:
    """This rank's slices: B rows of column modules, A columns of row modules (`shapes`: the whole
    model's). Every tensor has its own storage: a shard is pickled down a worker's pipe, and pickle
    writes a view's whole storage (the loader's A/B are views into its packs)."""
    if weights.packed:
        return _shard_packs(weights, plan, shapes)
    lora_a, lora_b = {}, {}
    for key, a in weights.lora_a.items():
        module = key[1]
        lo, hi = plan.module_range(module)
        b = weights.lora_b[key]
        if module in COLUMN_MODULES:
            lora_a[key], lora_b[key] = a.clone(), b[lo:hi].clone()
        else:
            lora_a[key], lora_b[key] = a[:, lo:hi].clone(), b.clone()
    return dataclasses.replace(weights, lora_a=lora_a, lora_b=lora_b)


def _shard_packs(weights: AdapterWeights, plan: ShardPlan, shapes: ModelShapes) -> AdapterWeights:
    """The packs (lora/packed_groups.py) sliced the same way: a row group's A packs by input columns,
    a column group's B packs by each stacked module's output rows; the shard carries only the packs
    (an upload reads nothing else of A/B), so a worker's copy is a few tensors, uploaded a few copies."""
    packed = {}
    for g, pack in weights.packed.items():
        modules = GROUPS[g]
        if g in ROW_GROUPS:
            lo, hi = plan.module_range(modules[0])
            packed[g] = pack._replace(a=pack.a[..., lo:hi].contiguous())
            continue
        rows, off = [], 0
        for module, width in zip(modules, shapes.group_widths(g), strict=True):
            lo, hi = plan.module_range(module)
            rows.append(pack.b[:, off + lo : off + hi])
            off += width
        packed[g] = pack._replace(b=torch.cat(rows, dim=1))
    return dataclasses.replace(weights, lora_a={}, lora_b={}, packed=packed)


class ShardedAdapterPool:
    """What the LoRA manager sees as its pool on rank 0: whole-model shapes for validation,
    uploads fanned out to every rank. `local` is rank 0's own pool (read by its backend)."""

    def __init__(
        self,
        shapes: ModelShapes,
        plans: list[ShardPlan],
        local: AdapterPool,
        send_upload: Callable[[int, int, AdapterWeights | None], None],
    ):
        self.shapes = shapes
        self.plans = plans
        self.local = local
        self._send_upload = send_upload  # (rank, slot, shard or None: release) to a worker, in step order
        self.slots, self.max_rank, self.target_modules = local.slots, local.max_rank, local.target_modules
        self.dtype, self.device, self.groups = local.dtype, local.device, local.groups
        # Rank 0's vocab slots, for the manager's bookkeeping: adapters with vocabulary parts are
        # refused under tensor parallelism (lora/embedding_lora.py), so these stay empty.
        self.vocab = local.vocab

    @property
    def nbytes(self) -> int:
        """Rank 0's pool bytes (every rank's is about this size)."""
        return self.local.nbytes

    # Pages: every rank's pool has the same page count and sees the same uploads and releases in the
    # same order, so every rank's free list (lowest page first) stays rank 0's.
    guaranteed_pages = None  # --lora-memory unified is refused under tensor parallelism

    @property
    def num_pages(self) -> int:
        return self.local.num_pages

    @property
    def pages_per_slot(self) -> int:
        return self.local.pages_per_slot

    @property
    def free_pages(self) -> int:
        return self.local.free_pages

    def pages_needed(self, weights: AdapterWeights) -> int:
        return self.local.pages_needed(weights)

    def pages_available(self, returned: int = 0) -> int:
        return self.local.pages_available(returned)

    def slot_pages(self, slot: int) -> int:
        return self.local.slot_pages(slot)

    def release(self, slot: int) -> None:
        for plan in self.plans[1:]:
            self._send_upload(plan.rank, slot, None)  # None: free the slot's pages
        self.local.release(slot)

    def upload(self, slot: int, weights: AdapterWeights) -> None:
        for plan in self.plans[1:]:
            self._send_upload(plan.rank, slot, shard_adapter(weights, plan, self.shapes))
        self.local.upload(slot, shard_adapter(weights, self.plans[0], self.shapes))

    def ready(self, slot: int) -> bool:
        # Workers apply uploads before the next step message (the pipe is ordered) and wait for them.
        return self.local.ready(slot)


class TPLoRABackend(TorchLoRABackend):
    """The torch LoRA path over one rank's pool shard, with the row-parallel shrink all-reduce.

    Column groups are the torch backend's own path (A whole, B this rank's output rows). Reads
    the step's slots on the host, so not CUDA-graph safe. Every rank sees the same slots and
    the same rank tables, so all ranks make the same collectives.
    """

    def __init__(self, pool: AdapterPool):
        super().__init__(pool)
        self._num_tokens = 0

    def prepare(self, token_slots: torch.Tensor, max_distinct: int | None = None) -> None:
        super().prepare(token_slots, max_distinct)
        self._num_tokens = token_slots.numel()

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if group in ROW_GROUPS and group in self._ranks and self._segments:
            self._apply_row(layer, group, x, out)
        else:
            super().apply(layer, group, x, out)

    def _apply_row(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        ranks, scales = self._ranks[group][layer], self._scales[group][layer]
        if not any(rk[0] for rk in ranks):
            return  # no adapter of the batch targets this module here (the same on every rank)
        lora_a, lora_b = self.pool.lora_a[group][layer], self.pool.lora_b[group][layer]
        # One [T, R] buffer for every segment's shrink: one all-reduce per layer, not per adapter.
        shrunk = torch.zeros(self._num_tokens, self.pool.max_rank, dtype=x.dtype, device=x.device)
        width = lora_b.shape[-1]
        for k, (_, sel) in enumerate(self._segments):
            r = ranks[k][0]
            if r:
                shrunk[sel, :r] = F.linear(x[sel], self.rows(lora_a, lora_b, k, 0, r, 0, width)[0])
        dist.all_reduce(shrunk)
        for k, (_, sel) in enumerate(self._segments):
            r = ranks[k][0]
            if r:
                delta = F.linear(shrunk[sel, :r], self.rows(lora_a, lora_b, k, 0, r, 0, width)[1].t())
                out[sel] += (delta * scales[k][0]).to(out.dtype)


class TPTritonLoRABackend(LoRABackend):
    """The Triton kernels under TP: column groups exactly as `TritonLoRABackend`; row groups
    shrink into their own `[splits, T, R]` float32 buffer, all-reduce it (the K-split partials
    add up either way), then expand, with the inner backend's launch plan. No host reads, so
    CUDA-graph safe."""

    name = "triton"

    cuda_graph_safe = True

    def __init__(self, pool: AdapterPool, max_tokens: int):
        from loraplex.services.inference.lora.triton_backend import TritonLoRABackend

        self.pool = pool
        self.inner = TritonLoRABackend(pool, max_tokens)
        row_in = [pool.shapes.group_in(g) for g in ROW_GROUPS if g in pool.groups]
        # One stacked module per row group: the buffer's columns are exactly R, so views stay contiguous.
        self._row_buf = alloc_shrink_out(max_tokens, 1, pool.max_rank, max(row_in, default=1), pool.device)

    def prepare(self, token_slots: torch.Tensor, max_distinct: int | None = None) -> None:
        self.inner.prepare(token_slots, max_distinct)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if group not in ROW_GROUPS:
            self.inner.apply(layer, group, x, out)
            return
        if group not in self.pool.groups:
            return
        pool, plan = self.pool, self.inner.plan
        launch = plan.groups[group]
        y = shrink_out_view(self._row_buf, launch.splits, plan.num_tokens)
        ranks = pool.rank[group][layer]
        lora_shrink(x, pool.lora_a[group][layer], ranks, pool.page_table, self.inner.segments, y, launch)
        dist.all_reduce(y)
        lora_expand(
            y,
            pool.lora_b[group][layer],
            ranks,
            pool.scaling[group][layer],
            pool.page_table,
            self.inner.segments,
            out,
            pool.shapes.group_widths(group),
            launch,
        )
