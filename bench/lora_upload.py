"""One adapter's upload into the GPU pool, for the kernels suite (`bench/kernels.py --parts upload`).

`AdapterPool.upload` from a pinned host copy of a Llama-3.1-8B q/k/v/o adapter (ranks 16 and 64, bf16),
packed per module group as the loader keeps it (lora/packed_groups.py; tensor-parallel shards slice the
packs) and per (layer, module) (the pool's path for adapters without packs: the random adapters of tests
and benches, and the layout before packing): the engine thread's time in the call (it only queues
copies on the pool's side stream) and the time until the slot is ready, whose bytes over it give the
host-to-device rate reached (PCIe 5 x16 carries about 50 GB/s).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.backend_check import random_adapter
from loraplex.services.inference.lora.packed_groups import pack_groups
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.shapes import ATTN_MODULES, ModelShapes

LLAMA_8B = ModelShapes(num_layers=32, hidden_size=4096, intermediate_size=14336, q_size=4096, kv_size=1024)
DT = torch.bfloat16


def per_module_adapter(shapes: ModelShapes, rank: int, pin: bool) -> AdapterWeights:
    """A rank-`rank` adapter on q/k/v/o with its A/B per (layer, module), pinned when `pin`."""
    w = random_adapter(shapes, list(ATTN_MODULES), rank, rank, DT, jitter=False)
    if not pin:
        return w
    pinned = [{k: t.pin_memory() for k, t in d.items()} for d in (w.lora_a, w.lora_b)]
    return dataclasses.replace(w, lora_a=pinned[0], lora_b=pinned[1])


def upload_rows(device: torch.device, tiny: bool, repeats: int = 20) -> list[dict]:
    """Per rank and host layout: median ms in `upload` and until ready, MB moved, GB/s reached."""
    shapes = dataclasses.replace(LLAMA_8B, num_layers=2) if tiny else LLAMA_8B
    cuda = device.type == "cuda"
    pool = AdapterPool(shapes, slots=2, max_rank=64, target_modules=ATTN_MODULES, dtype=DT, device=device)
    rows = []
    for rank in (16, 64):
        plain = per_module_adapter(shapes, rank, pin=cuda)
        for layout, weights in (
            ("per module", plain),
            ("packed", pack_groups(plain, shapes, pin_memory=cuda)),
        ):
            host, ready = [], []
            for i in range(repeats + 2):  # two warm-up uploads: the allocator's first blocks
                t0 = time.perf_counter()
                pool.upload(i % 2, weights)
                t1 = time.perf_counter()
                if cuda:
                    torch.cuda.synchronize(device)
                t2 = time.perf_counter()
                if i >= 2:
                    host.append((t1 - t0) * 1e3)
                    ready.append((t2 - t0) * 1e3)
            mb = plain.nbytes / 1e6  # A and B: the same bytes in either layout
            ms = statistics.median(ready)
            rows.append(
                dict(
                    rank=rank,
                    layout=layout,
                    mb=round(mb, 1),
                    host_ms=round(statistics.median(host), 3),
                    ready_ms=round(ms, 3),
                    gb_per_s=round(mb / ms, 1),
                )
            )
    return rows
