"""Host copies packed per module group, so an upload moves each group in two host-to-device copies.

Read per (layer, module), a rank-16 q/k/v/o adapter of an 8B model is 256 small tensors: uploaded
one by one that is 256 copies queued from Python (about 2 ms of the scheduler's thread per upload).
Packed, each group `g` of `n` stacked modules (lora/backend.py `GROUPS`) is
- `a`: `[L, n, r_g, d]`, module `i`'s A in rows `[:rank]` of `a[layer, i]`
- `b`: `[L, W, r_g]`, module `i`'s B in columns `[:rank]` of `b[layer, off_i:off_i + w_i]`
(`r_g`: the adapter's largest rank in the group; rows and columns past a module's rank, and modules a
layer does not target, are zeros) — the pool's staging layout (lora/pool.py), so an upload copies it
whole. The per-(layer, module) tensors become views into the packs: no second host copy.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.backend import GROUPS
from loraplex.services.inference.lora.shapes import ModelShapes


class PackedGroup(NamedTuple):
    a: torch.Tensor  # [L, n, r_g, d]
    b: torch.Tensor  # [L, W, r_g]
    # the pool's per-slot tables for this adapter, made once here, not per upload (a Python loop over
    # every (layer, module) that cost more of the engine thread than the copies themselves)
    rank: torch.Tensor  # [L, n] int32, 0: not targeted
    scaling: torch.Tensor  # [L, n] float32


def pack_groups(weights: AdapterWeights, shapes: ModelShapes, *, pin_memory: bool = False) -> AdapterWeights:
    """`weights` with `packed` filled for every group it targets and its A/B as views into the packs
    (pinned when `pin_memory`: an upload from them is then an asynchronous copy)."""
    packed: dict[str, PackedGroup] = {}
    lora_a, lora_b = dict(weights.lora_a), dict(weights.lora_b)
    for g, modules in GROUPS.items():
        mine = [(key, t) for key, t in weights.targets.items() if key[1] in modules]
        if not mine:
            continue
        r = max(t.rank for _, t in mine)
        widths = shapes.group_widths(g)
        offsets = [sum(widths[:i]) for i in range(len(widths) + 1)]
        dtype = weights.lora_a[mine[0][0]].dtype
        a = torch.zeros(
            shapes.num_layers, len(modules), r, shapes.group_in(g), dtype=dtype, pin_memory=pin_memory
        )
        b = torch.zeros(shapes.num_layers, offsets[-1], r, dtype=dtype, pin_memory=pin_memory)
        rank, scaling = group_tables(mine, modules, shapes.num_layers, pin_memory)
        for (layer, module), t in mine:
            i = modules.index(module)
            lo, hi = offsets[i], offsets[i + 1]
            a[layer, i, : t.rank] = weights.lora_a[(layer, module)]
            b[layer, lo:hi, : t.rank] = weights.lora_b[(layer, module)]
            lora_a[(layer, module)] = a[layer, i, : t.rank]
            lora_b[(layer, module)] = b[layer, lo:hi, : t.rank]
        packed[g] = PackedGroup(a, b, rank, scaling)
    return dataclasses.replace(weights, lora_a=lora_a, lora_b=lora_b, packed=packed)


def group_tables(
    mine: list, modules: tuple[str, ...], num_layers: int, pin_memory: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `[L, n]` int32 and scaling `[L, n]` float32 of one group's `((layer, module), ModuleLoRA)`."""
    rank = [[0] * len(modules) for _ in range(num_layers)]
    scaling = [[0.0] * len(modules) for _ in range(num_layers)]
    for (layer, module), t in mine:
        i = modules.index(module)
        rank[layer][i], scaling[layer][i] = t.rank, t.scaling
    tables = torch.tensor(rank, dtype=torch.int32), torch.tensor(scaling, dtype=torch.float32)
    return (tables[0].pin_memory(), tables[1].pin_memory()) if pin_memory else tables
