"""The adapter pool: per module group, A/B buffers for `slots` adapters, allocated once.

Layout (docs/architecture.md, "LoRA pool layout"), for group `g` with `n` stacked modules of
output widths `w_i` and input width `d`, `R = max_lora_rank`:
- `lora_a[g]`: `[L, slots, n*R, d]`; stack `i` uses rows `[i*R, i*R + r)`
- `lora_b[g]`: `[L, slots, sum(w), R]`; stack `i` uses rows `[off_i, off_i + w_i)`, cols `[0, r)`
- `rank[g]`: `[L, slots, n]` int32 (0 = not targeted), `scaling[g]`: `[L, slots, n]` float32
- `dora[g]` (allocated with the first DoRA adapter, lora/dora.py): `[L, slots + 1, sum(w)]` float32,
  the per-row factor `m / ||W + sBA||` of a DoRA slot; row `slots` is all ones (non-DoRA tokens)
- `vocab` (lora/vocab_tables.py): embedding / lm_head LoRA and trainable-token rows of up to
  `VOCAB_SLOTS` adapters, stacked, each part allocated with its first adapter; `kinds_slots` names
  the slots holding DoRA or vocabulary parts (a step holding one replays the graphs' kinds variant)
Groups with no module in `--lora-target-modules` are not allocated. Padding beyond a slot's
rank is uninitialised or stale: readers must honour `rank`.

On CUDA an upload is a copy from pinned host memory on a side stream, ordered after the work
already queued on the compute stream (which may still read the slot's previous adapter); its
event tells when the slot may be used. On CPU the copy is synchronous.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import nullcontext

import torch

from loraplex.services.inference.lora.adapter import AdapterWeights
from loraplex.services.inference.lora.backend import GROUPS
from loraplex.services.inference.lora.expert_lora import ExpertLoRAPool, expert_modules, expert_pool_nbytes
from loraplex.services.inference.lora.shapes import ModelShapes
from loraplex.services.inference.lora.vocab_tables import VOCAB_SLOTS, VocabTables

log = logging.getLogger(__name__)

_TABLE_BYTES = 4 + 4  # int32 rank + float32 scaling per (layer, slot, stacked module)


def allocated_groups(target_modules: Iterable[str]) -> list[str]:
    wanted = set(target_modules)
    return [g for g, mods in GROUPS.items() if wanted & set(mods)]


def pool_nbytes(
    shapes: ModelShapes, slots: int, max_rank: int, target_modules: Iterable[str], dtype: torch.dtype
) -> int:
    """The documented formula: `sum_g L*slots*(R*(n*d + sum(w))*dtype_bytes + n*8)`."""
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for g in allocated_groups(target_modules):
        n, d, w = len(GROUPS[g]), shapes.group_in(g), sum(shapes.group_widths(g))
        total += shapes.num_layers * slots * (max_rank * (n * d + w) * elem + n * _TABLE_BYTES)
    # LoRA on the experts (experts.gate_up_proj / experts.down_proj targeted): lora/expert_lora.py
    return total + expert_pool_nbytes(shapes, slots, max_rank, target_modules, dtype)


class AdapterPool:
    """Device buffers holding up to `slots` adapters; slot bookkeeping lives in the manager."""

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
    ):
        self.shapes, self.slots, self.max_rank = shapes, slots, max_rank
        self.target_modules = tuple(target_modules)
        self.dtype, self.device = dtype, torch.device(device)
        self.groups = allocated_groups(self.target_modules)
        L, R = shapes.num_layers, max_rank
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
            # Uninitialised on purpose: nothing reads past a slot's rank, and on CPU the pages of
            # slots never loaded are then never touched (the default rank-64 pool costs nothing idle).
            self.lora_a[g] = torch.empty(L, slots, n * R, d, dtype=dtype, device=self.device)
            self.lora_b[g] = torch.empty(L, slots, sum(widths), R, dtype=dtype, device=self.device)
            self.rank[g] = torch.zeros(L, slots, n, dtype=torch.int32, device=self.device)
            self.scaling[g] = torch.zeros(L, slots, n, dtype=torch.float32, device=self.device)
            self.host_rank[g] = torch.zeros(L, slots, n, dtype=torch.int32)
            self.host_scaling[g] = torch.zeros(L, slots, n, dtype=torch.float32)
            self.offsets[g] = tuple(sum(widths[:i]) for i in range(n + 1))
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
        # DoRA: which slots hold a DoRA adapter (host, for the step's choice; device, for the index)
        self.host_dora = torch.zeros(slots, dtype=torch.bool)
        self.dora_flag = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.dora: dict[str, torch.Tensor] = {}
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
        return sum(
            t.numel() * t.element_size()
            for d in (self.lora_a, self.lora_b, self.rank, self.scaling)
            for t in d.values()
        ) + (0 if self.experts is None else self.experts.nbytes)

    def upload(self, slot: int, weights: AdapterWeights) -> None:
        """Copy an adapter into `slot` (asynchronously on CUDA; see `ready`)."""
        tables: list[torch.Tensor] = []
        keep: list = [weights]
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        ctx = torch.cuda.stream(self._stream) if self._cuda else nullcontext()
        with ctx:
            for g in self.groups:
                rank = torch.zeros(self.shapes.num_layers, len(GROUPS[g]), dtype=torch.int32)
                scaling = torch.zeros(self.shapes.num_layers, len(GROUPS[g]), dtype=torch.float32)
                for (layer, module), t in weights.targets.items():
                    if module not in GROUPS[g]:
                        continue
                    i = GROUPS[g].index(module)
                    r, lo = t.rank, self.offsets[g][i]
                    self.lora_a[g][layer, slot, i * self.max_rank : i * self.max_rank + r].copy_(
                        weights.lora_a[(layer, module)], non_blocking=True
                    )
                    self.lora_b[g][layer, slot, lo : self.offsets[g][i + 1], :r].copy_(
                        weights.lora_b[(layer, module)], non_blocking=True
                    )
                    rank[layer, i], scaling[layer, i] = r, t.scaling
                self.host_rank[g][:, slot] = rank
                self.host_scaling[g][:, slot] = scaling
                if self._cuda:
                    rank, scaling = rank.pin_memory(), scaling.pin_memory()
                    tables += [rank, scaling]
                self.rank[g][:, slot].copy_(rank, non_blocking=True)
                self.scaling[g][:, slot].copy_(scaling, non_blocking=True)
            if self.experts is not None:
                self.experts.upload(slot, weights)
            self._upload_dora(slot, weights, tables)
            self.vocab.upload(slot, weights, tables)
        kinds = bool(self.host_dora[slot]) or self.vocab.host_slot_vocab[slot] >= 0
        self.kinds_slots = self.kinds_slots | {slot} if kinds else self.kinds_slots - {slot}
        if self._cuda:
            # The host tensors must outlive the asynchronous copies.
            self._pending[slot] = (self._stream.record_event(), keep + tables)

    @property
    def kinds_tables(self) -> tuple[bool, int]:
        """What a kinds-variant graph captured: changes when DoRA or vocabulary tables are allocated."""
        return bool(self.dora), self.vocab.generation

    @property
    def dora_nbytes(self) -> int:
        """Bytes of the DoRA factor tables (none until the first DoRA adapter is uploaded)."""
        return sum(t.numel() * t.element_size() for t in self.dora.values())

    def _upload_dora(self, slot: int, weights: AdapterWeights, tables: list) -> None:
        """The slot's DoRA factors (ones for a module it does not target) and its flag."""
        is_dora = bool(weights.dora_factor)
        if is_dora and not self.dora:
            log.info("DoRA adapter in the pool: allocating its per-row factor tables")
            for g in self.groups:
                width = self.offsets[g][-1]
                t = torch.empty(self.shapes.num_layers, self.slots + 1, width, device=self.device)
                self.dora[g] = t.fill_(1.0)
        if is_dora:
            for g in self.groups:
                factor = torch.ones(self.shapes.num_layers, self.offsets[g][-1])
                for (layer, module), f in weights.dora_factor.items():
                    if module in GROUPS[g]:
                        i = GROUPS[g].index(module)
                        factor[layer, self.offsets[g][i] : self.offsets[g][i + 1]] = f
                if self._cuda:
                    factor = factor.pin_memory()
                    tables.append(factor)
                self.dora[g][:, slot].copy_(factor, non_blocking=True)
        self.host_dora[slot] = is_dora
        flag = torch.tensor([is_dora])
        if self._cuda:
            flag = flag.pin_memory()
            tables.append(flag)
        self.dora_flag[slot : slot + 1].copy_(flag, non_blocking=True)

    def ready(self, slot: int) -> bool:
        """True when the slot's last upload has landed (never blocks)."""
        pending = self._pending.get(slot)
        if pending is None:
            return True
        if pending[0].query():
            del self._pending[slot]
            return True
        return False
