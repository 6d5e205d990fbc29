"""LoRA on the experts of a mixture-of-experts base: per-slot buffers and the routed computation.

Buffers (`ExpertLoRAPool`, allocated with the adapter pool, before the KV cache is sized), per
targeted expert module `m` (experts.gate_up_proj, experts.down_proj) of widths in -> out, over the
`n` sparse layers, `R = max_lora_rank`:
- `a[m]`: `[n, slots, E, R, in]`: expert e of a slot of rank r uses `[.., e, :r, :]`
- `b[m]`: `[n, slots, E, out, R]`: it uses `[.., e, :, :r]`
- host tables `rank[m]`, `scaling[m]`: `[n, slots]` (rank 0: the slot's adapter leaves m alone),
  and `dev_scaling[m]`, the scaling on the device (scaling 0 where the rank is 0).
Padding past a slot's rank is stale: nothing reads it.

Computation (`ExpertLoRA`): a token of slot s routed to expert e gets `scaling * B_se(A_se x)` added
to that expert's gate_up output (before the activation) and down output (before the routing
weight), as PEFT's `W_e + scaling * B_e @ A_e` does; tokens without an expert adapter, and the
experts a token was not routed to, cost nothing. `prepare` lists the step's slots that have expert
LoRA (one host read, as the torch backend does); per layer the LoRA tokens' (token, expert) pairs
are sorted by (slot, expert) on the device. Then per slot, with its own rank (no padding):
- grouped (`F.grouped_mm`, where torch has it): one shrink and one expand over all its experts,
  group sizes as device offsets, so no host sync;
- loop: one shrink and expand per (slot, expert) group (the per-group counts are read on the host);
- span (opt-in, `span=True`): one shrink and one expand per layer and module over every expert of the
  slots from the step's lowest to its highest expert slot, at the step's largest rank among them:
  fewer launches, but a smaller rank is padded with the zeros `upload` writes past it. A span of
  `SPAN_MAX_GROUPS` (slot, expert) groups or more takes the grouped path instead: CUDA's grouped GEMM
  refuses that many groups.
All give the same numbers; the loop is the reference. The host read in `prepare` makes steps with
expert LoRA uncapturable: the engine turns CUDA graphs off when the pool holds expert buffers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from loraplex.services.inference.lora.expert_moe import LayerExpertLoRA
from loraplex.services.inference.lora.shapes import (
    EXPERT_MODULES,
    ModelShapes,
    expert_dims,
    sparse_layer_indices,
)

if TYPE_CHECKING:
    from loraplex.services.inference.lora.adapter_weights import AdapterWeights

GATE_UP, DOWN = EXPERT_MODULES
# torch 2.11's CUDA grouped_mm refused 8 slots x 128 experts ("Can't process more than 1024 groups")
SPAN_MAX_GROUPS = 1024


def expert_modules(target_modules: Iterable[str]) -> tuple[str, ...]:
    wanted = set(target_modules)
    return tuple(m for m in EXPERT_MODULES if m in wanted)


def expert_pool_nbytes(
    shapes: ModelShapes, slots: int, max_rank: int, target_modules: Iterable[str], dtype: torch.dtype
) -> int:
    """`sum_m n_sparse * slots * E * R * (in_m + out_m) * dtype_bytes` (host tables: not on the device)."""
    elem = torch.empty((), dtype=dtype).element_size()
    n, e = len(sparse_layer_indices(shapes)), shapes.num_experts
    return sum(
        n * slots * e * max_rank * sum(expert_dims(shapes, m.removeprefix("experts."))) * elem
        for m in expert_modules(target_modules)
    )


class ExpertLoRAPool:
    """The experts' LoRA buffers of every slot (see the module docstring)."""

    def __init__(
        self,
        shapes: ModelShapes,
        *,
        slots: int,
        max_rank: int,
        modules: Iterable[str],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.shapes, self.slots, self.max_rank = shapes, slots, max_rank
        self.modules = expert_modules(modules)
        self.num_experts = shapes.num_experts
        self.layer_row = {n: i for i, n in enumerate(sparse_layer_indices(shapes))}
        n, e, r = len(self.layer_row), self.num_experts, max_rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.host_rank: dict[str, torch.Tensor] = {}
        self.host_scaling: dict[str, torch.Tensor] = {}
        self.dev_scaling: dict[str, torch.Tensor] = {}  # host_scaling's copy (lora/expert_lora_graph.py)
        for m in self.modules:
            d_in, d_out = expert_dims(shapes, m.removeprefix("experts."))
            # Uninitialised, as the adapter pool's: nothing reads past a slot's rank.
            self.a[m] = torch.empty(n, slots, e, r, d_in, dtype=dtype, device=device)
            self.b[m] = torch.empty(n, slots, e, d_out, r, dtype=dtype, device=device)
            self.host_rank[m] = torch.zeros(n, slots, dtype=torch.int32)
            self.host_scaling[m] = torch.zeros(n, slots, dtype=torch.float32)
            self.dev_scaling[m] = torch.zeros(n, slots, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for t in d.values())

    def upload(self, slot: int, weights: AdapterWeights) -> None:
        """Copy the adapter's expert factors into `slot` (on the pool's current stream)."""
        for m in self.modules:
            rank = torch.zeros(len(self.layer_row), dtype=torch.int32)
            scaling = torch.zeros(len(self.layer_row), dtype=torch.float32)
            for (layer, module), t in weights.expert_targets.items():
                if module != m:
                    continue
                i, r = self.layer_row[layer], t.rank
                self.a[m][i, slot, :, :r].copy_(weights.expert_a[(layer, m)], non_blocking=True)
                self.b[m][i, slot, :, :, :r].copy_(weights.expert_b[(layer, m)], non_blocking=True)
                rank[i], scaling[i] = r, t.scaling
                # zeros past the rank: the span computation (ExpertLoRA span=True) reads them
                self.a[m][i, slot, :, r:].zero_()
                self.b[m][i, slot, :, :, r:].zero_()
            for i in torch.nonzero(rank == 0).flatten().tolist():
                self.a[m][i, slot].zero_()
                self.b[m][i, slot].zero_()
            self.host_rank[m][:, slot] = rank
            self.host_scaling[m][:, slot] = scaling
            self.dev_scaling[m][:, slot].copy_(scaling, non_blocking=True)

    def has_experts(self, slot: int) -> bool:
        return any(bool(self.host_rank[m][:, slot].any()) for m in self.modules)


class PairPlan(NamedTuple):
    """One layer's LoRA (token, expert) pairs, sorted by (slot run, expert)."""

    flat: torch.Tensor  # [P] the pair's index in the router's `[T, k]` output, flattened
    experts: torch.Tensor  # [P] its expert
    counts: torch.Tensor  # [runs, E] pairs per (run, expert), on the device
    offsets: torch.Tensor  # [runs, E] int32 cumulative counts within each run (grouped_mm's offs)
    run: torch.Tensor  # [P] the pair's run (index into ExpertLoRA.runs)


class ExpertLoRA:
    """The step's expert LoRA over an `ExpertLoRAPool` (see the module docstring).

    `grouped`: None picks `F.grouped_mm` where torch has it (bfloat16 on CUDA), False the loop.
    `span`: the grouped computation in one launch pair over the step's slot span (see above)."""

    graph_safe = False  # `prepare` reads the step's slots on the host (lora/expert_lora_graph.py does not)

    def __init__(self, pool: ExpertLoRAPool, grouped: bool | None = None, span: bool = False):
        self.pool = pool
        self.grouped = hasattr(F, "grouped_mm") if grouped is None else grouped
        self.span = span
        self.runs: list[tuple[int, int]] = []  # (slot, tokens) of the step's slots with expert LoRA
        self._tokens = self._run_of_token = None
        self._span_rows = None  # (lo, hi, rows) of the step's slot span; None: no span this step
        self._ranks: dict[str, list[list[int]]] = {}
        self._scales: dict[str, list[list[float]]] = {}

    def prepare(self, token_slots: torch.Tensor) -> None:
        host = token_slots.to("cpu", torch.int64)
        runs, groups = [], []
        for slot in torch.unique(host).tolist():
            if slot < 0 or not self.pool.has_experts(slot):
                continue
            tokens = torch.nonzero(host == slot).flatten()
            runs.append((slot, tokens.numel()))
            groups.append(tokens)
        self.runs = runs
        self._span_rows = None
        if not runs:
            return
        device = token_slots.device
        self._tokens = torch.cat(groups).to(device)
        sizes = torch.tensor([n for _, n in runs])
        self._run_of_token = torch.repeat_interleave(torch.arange(len(runs)), sizes).to(device)
        used = [s for s, _ in runs]
        self._ranks = {m: self.pool.host_rank[m][:, used].tolist() for m in self.pool.modules}
        self._scales = {m: self.pool.host_scaling[m][:, used].tolist() for m in self.pool.modules}
        if self.span and (runs[-1][0] + 1 - runs[0][0]) * self.pool.num_experts < SPAN_MAX_GROUPS:
            self._scale_dev = {
                m: self.pool.host_scaling[m][:, used].to(device, self.pool.a[m].dtype)
                for m in self.pool.modules
            }
            rows = torch.tensor(used) - used[0]  # runs are in slot order (torch.unique sorts)
            self._span_rows = (used[0], used[-1] + 1, rows.to(device))

    @property
    def span_active(self) -> bool:
        """Whether this step runs the span computation (`span` and the span fits one grouped_mm)."""
        return self._span_rows is not None

    def at(self, layer: int) -> LayerExpertLoRA | None:
        """The hook SparseMoE.forward takes for `layer` (None: no expert LoRA in this step)."""
        if not self.runs or layer not in self.pool.layer_row:
            return None
        return LayerExpertLoRA(self, self.pool.layer_row[layer])

    def direct_deltas(self, row: int, experts: torch.Tensor) -> None:
        """None: this mode plans the pairs on the host (`pairs`); GraphExpertLoRA may compute the
        grouped kernel's deltas without a plan."""
        return None

    def pairs(self, experts: torch.Tensor) -> PairPlan:
        """Sort the LoRA tokens' (token, expert) pairs of one layer's routing `[T, k]` by (run, expert)."""
        k, e = experts.shape[1], self.pool.num_experts
        choice = torch.arange(k, device=experts.device)
        flat = (self._tokens[:, None] * k + choice).flatten()
        chosen = experts.flatten()[flat]
        key = self._run_of_token.repeat_interleave(k) * e + chosen
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=len(self.runs) * e).view(len(self.runs), e)
        offsets = counts.cumsum(dim=1).to(torch.int32)
        return PairPlan(flat[order], chosen[order], counts, offsets, key[order] // e)

    def delta(self, row: int, module: str, xs: torch.Tensor, plan: PairPlan, top_k: int) -> torch.Tensor:
        """`[P, out]`: each pair's `scaling * B(A x)` for its slot and expert (0 where untargeted)."""
        a, b = self.pool.a.get(module), self.pool.b.get(module)
        out_width = expert_dims(self.pool.shapes, module.removeprefix("experts."))[1]
        out = torch.zeros(xs.shape[0], out_width, dtype=xs.dtype, device=xs.device)
        if a is None:
            return out
        if self._span_rows is not None:
            rank = max(self._ranks[module][row], default=0)
            if rank and self._use_grouped(xs, rank):
                return self._span_delta(row, module, xs, plan, rank, out)
        counts_host = None
        start = 0
        for run, (slot, n_tokens) in enumerate(self.runs):
            rows = slice(start, start + n_tokens * top_k)
            start = rows.stop
            r, scale = self._ranks[module][row][run], self._scales[module][row][run]
            if r == 0:
                continue
            if self._use_grouped(xs, r):
                offs = plan.offsets[run]
                y = F.grouped_mm(xs[rows], a[row, slot, :, :r].transpose(1, 2), offs=offs)
                out[rows] = F.grouped_mm(y, b[row, slot, :, :, :r].transpose(1, 2), offs=offs) * scale
                continue
            if counts_host is None:
                counts_host = plan.counts.tolist()  # one host read per layer and module
            lo = rows.start
            for e, n in enumerate(counts_host[run]):
                if n:
                    sel = slice(lo, lo + n)
                    out[sel] = (
                        F.linear(F.linear(xs[sel], a[row, slot, e, :r]), b[row, slot, e, :, :r]) * scale
                    )
                lo += n
        return out

    def _span_delta(
        self, row: int, module: str, xs: torch.Tensor, plan: PairPlan, rank: int, out: torch.Tensor
    ) -> torch.Tensor:
        """One shrink and one expand over every expert of the slots lo..hi-1 (the step's span), at
        `rank`, the largest of the step's; slots and experts without pairs are empty groups."""
        lo, hi, rows = self._span_rows
        e = self.pool.num_experts
        counts = plan.counts.new_zeros(hi - lo, e).index_copy_(0, rows, plan.counts)
        offs = counts.flatten().cumsum(0).to(torch.int32)
        a = self.pool.a[module][row, lo:hi, :, :rank].reshape((hi - lo) * e, rank, -1)
        b = self.pool.b[module][row, lo:hi, :, :, :rank].reshape((hi - lo) * e, -1, rank)
        y = F.grouped_mm(xs, a.transpose(1, 2), offs=offs) * self._scale_dev[module][row][plan.run][:, None]
        out.copy_(F.grouped_mm(y, b.transpose(1, 2), offs=offs))
        return out

    def _use_grouped(self, xs: torch.Tensor, rank: int) -> bool:
        if not self.grouped:
            return False
        # CUDA's grouped GEMM takes bfloat16 with 16-byte aligned strides: the rank, the pool's row
        # pitch (max rank) and the input width in multiples of 8 elements.
        aligned = rank % 8 == 0 and self.pool.max_rank % 8 == 0 and xs.shape[1] % 8 == 0
        return xs.device.type != "cuda" or (xs.dtype == torch.bfloat16 and aligned)
