"""The Triton LoRA backend: one shrink and one expand launch per group, over the whole mixed batch.

`prepare` builds the slot-sorted segments into preallocated device buffers with device ops
only (CUDA-graph safe) and makes the step's launch plan (`kernels/lora_plan.py`: per group the
K-splits and the shrink and expand block sizes) on the host; `apply` launches each group's shrink
and expand with its entry of the plan. The kernels read the pool's per-slot rank and scaling tables
on the device, so a slot's real rank bounds the work and untargeted modules cost nothing.

Side stream (decode-sized steps on CUDA, on by default): a decode step's LoRA kernels are
small and latency-bound while the base matmul beside them streams weights, so `begin` runs
shrink and expand on a second stream into a float32 delta buffer while the base matmul runs,
and `finish` joins the streams and hands the delta back; the model adds it inside the kernel
that reads the output next (`dtype(float(out) + delta)`, rounded as the in-place expand rounds).
The fork and join are captured into the step's CUDA graph as parallel branches. Prefill
steps run in place on the current stream: there both sides are compute-bound.

Two one-launch forms of shrink + expand (a fused kernel with the rank-r row on chip, and a handoff
through per-token counters) were built and measured slower than these two launches on the H100
(docs/benchmarks.md, "Facts behind defaults"), so they were removed.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from loraplex.kernels.lora_configs import DECODE_MAX_TOKENS
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_meta import alloc_segments, build_segments
from loraplex.kernels.lora_plan import GroupShape, LoRAPlan, plan_step
from loraplex.kernels.lora_shrink import alloc_shrink_out, lora_shrink, shrink_out_view
from loraplex.services.inference.lora.backend import GROUPS, LoRABackend
from loraplex.services.inference.lora.pool import AdapterPool


class TritonLoRABackend(LoRABackend):
    name = "triton"
    cuda_graph_safe = True

    def __init__(
        self,
        pool: AdapterPool,
        max_tokens: int,
        side_stream: bool = False,
    ):
        """`side_stream`: compute decode steps' deltas beside the base matmul (see the module
        docstring). On a CPU device the same delta path runs on the one stream (for tests)."""
        self.pool = pool
        self.max_tokens = max_tokens
        self.segments = alloc_segments(max_tokens, pool.slots, pool.device)
        max_d = max((pool.shapes.group_in(g) for g in pool.groups), default=1)
        max_stack = max((len(GROUPS[g]) for g in pool.groups), default=1)
        # One float32 shrink buffer shared by all groups (they run one after another).
        self._shrink_buf = alloc_shrink_out(max_tokens, max_stack, pool.max_rank, max_d, pool.device)
        self._widths = {g: pool.shapes.group_widths(g) for g in pool.groups}
        self.group_shapes = {
            g: GroupShape(pool.shapes.group_in(g), self._widths[g], pool.max_rank) for g in pool.groups
        }
        self._plan = plan_step(self.group_shapes, 0, pool.slots)
        self._delta: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None
        self._side = False
        self.set_side_stream(side_stream)

    @property
    def side_stream(self) -> bool:
        return self._side

    def set_side_stream(self, on: bool) -> None:
        """Switch the side stream on or off (benchmarks compare both; captured graphs keep the
        mode they were captured with, so recapture after switching). The delta buffer and the
        stream, once made, live as long as the backend: a graph of any kind captured in either mode
        never reads memory that switching freed."""
        if on and self._delta is None:
            rows = min(self.max_tokens, DECODE_MAX_TOKENS)
            cols = max((sum(w) for w in self._widths.values()), default=1)
            # One buffer serves every group: a group's delta is added before the next group begins.
            self._delta = torch.zeros(rows, cols, dtype=torch.float32, device=self.pool.device)
            self._stream = torch.cuda.Stream(self.pool.device) if self.pool.device.type == "cuda" else None
        self._side = on

    @property
    def nbytes(self) -> int:
        """Device bytes of the per-step buffers (metadata, the shrink output, the delta buffer)."""
        delta = 0 if self._delta is None else self._delta.numel() * 4
        buffers = self._shrink_buf.numel() * 4 + delta
        return buffers + sum(t.numel() * t.element_size() for t in self.segments)

    @property
    def plan(self) -> LoRAPlan:
        """The launch plan `prepare` made for the current step."""
        return self._plan

    def prepare(self, token_slots: torch.Tensor, max_distinct: int | None = None) -> None:
        build_segments(token_slots, self.segments)
        if self.kinds_step:
            self.prepare_kinds(token_slots)
        if self.experts is not None:  # reads the slots on the host: graphs are off (engine/startup.py)
            self.experts.prepare(token_slots)
        self._plan = plan_step(self.group_shapes, token_slots.shape[0], self.pool.slots, max_distinct)
        if self._uses_delta():
            # Rows of tokens without an adapter are never written by expand: they must read as 0.
            self._delta[: self._plan.num_tokens].zero_()

    def _uses_delta(self) -> bool:
        return self._side and self._plan.num_tokens <= self._delta.shape[0]

    def _run(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        pool, launch = self.pool, self._plan.groups[group]
        ranks, widths = pool.rank[group][layer], self._widths[group]
        a, b, scaling = pool.lora_a[group][layer], pool.lora_b[group][layer], pool.scaling[group][layer]
        n_cols = len(GROUPS[group]) * pool.max_rank
        y = shrink_out_view(self._shrink_buf, launch.splits, self._plan.num_tokens)[..., :n_cols]
        pages = pool.page_table
        lora_shrink(x, a, ranks, pages, self.segments, y, launch)
        lora_expand(y, b, ranks, scaling, pages, self.segments, out, widths, launch, accumulate=accumulate)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if group in self._widths:
            self._run(layer, group, x, out, accumulate=True)

    def begin(self, layer: int, group: str, x: torch.Tensor) -> object:
        if group not in self._widths or not self._uses_delta():
            return None
        delta = self._delta[: self._plan.num_tokens, : sum(self._widths[group])]
        side = nullcontext() if self._stream is None else torch.cuda.stream(self._stream)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
        with side:
            self._run(layer, group, x, delta, accumulate=False)
        return delta

    def finish(
        self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor, started: object
    ) -> torch.Tensor | None:
        if started is None:
            self.apply(layer, group, x, out)
            return None
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        return started  # the float32 delta: the model adds it inside its next fused kernel
