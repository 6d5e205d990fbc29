"""Triton backend vs torch backend over one pool of random adapters (ranks, modules, slots mixed).

Used by the CPU test (a child process under TRITON_INTERPRET=1: Triton picks interpreter vs
compiler when a kernel is decorated) and on the GPU (bf16). Prints one JSON line per case:
`python -m loraplex.services.inference.lora.backend_check --device cuda --dtype bfloat16`.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.backend import GROUPS
from loraplex.services.inference.lora.config import AdapterSpec, ModuleLoRA
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes
from loraplex.services.inference.lora.torch_backend import TorchLoRABackend
from loraplex.services.inference.lora.triton_backend import TritonLoRABackend

MODULE_SETS = [
    list(ALL_MODULES),
    ["q_proj", "v_proj"],
    ["up_proj", "down_proj"],
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"],
]


def random_adapter(
    shapes: ModelShapes, modules: list[str], rank: int, seed: int, dtype: torch.dtype, jitter: bool = True
) -> AdapterWeights:
    """Random A/B on `modules` of every layer, each of a random rank up to `rank` (`jitter`) or `rank`."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    targets, lora_a, lora_b = {}, {}, {}
    for layer in range(shapes.num_layers):
        for m in modules:
            r = rnd.randint(1, rank) if jitter else rank
            d_in, d_out = shapes.module_dims(m)
            targets[(layer, m)] = ModuleLoRA(r, 16.0, 16.0 / r)
            lora_a[(layer, m)] = (torch.randn(r, d_in, generator=gen) / d_in**0.5).to(dtype)
            lora_b[(layer, m)] = (torch.randn(d_out, r, generator=gen) / r**0.5).to(dtype)
    return AdapterWeights(
        AdapterSpec(r=rank, lora_alpha=16.0, target_modules=tuple(modules)),
        targets,
        lora_a,
        lora_b,
        digest=f"sha256:{seed}",
    )


def run(
    shapes: ModelShapes,
    num_tokens: int,
    slots: int,
    max_rank: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> dict:
    pool = AdapterPool(
        shapes, slots=slots, max_rank=max_rank, target_modules=ALL_MODULES, dtype=dtype, device=device
    )
    for s in range(slots):
        pool.upload(
            s,
            random_adapter(
                shapes, MODULE_SETS[s % len(MODULE_SETS)], max_rank if s % 2 else 4, seed + s, dtype
            ),
        )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    rnd = random.Random(seed)
    token_slots = torch.tensor(
        [rnd.randint(-1, slots - 1) for _ in range(num_tokens)], dtype=torch.int32, device=device
    )
    ref, tri = TorchLoRABackend(pool), TritonLoRABackend(pool, max_tokens=num_tokens)
    side = TritonLoRABackend(pool, max_tokens=num_tokens, side_stream=True)
    # As the runner does: the distinct count picks the tier (above MANY_ADAPTERS the per-token expand).
    distinct = len(set(token_slots.tolist()) - {-1})
    ref.prepare(token_slots)
    tri.prepare(token_slots, distinct)
    side.prepare(token_slots, distinct)
    side_equal = True
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for layer in range(shapes.num_layers):
        for group in GROUPS:
            x = torch.randn(num_tokens, shapes.group_in(group), generator=gen).to(device, dtype)
            base = torch.randn(num_tokens, sum(shapes.group_widths(group)), generator=gen).to(device, dtype)
            a, b = base.clone(), base.clone()
            ref.apply(layer, group, x, a)
            tri.apply(layer, group, x, b)
            # begin/finish (the side-stream path: delta buffer, then one add) must round as apply does.
            c = base.clone()
            pending = side.finish(layer, group, x, c, side.begin(layer, group, x))
            if pending is not None:
                c.add_(pending)
            side_equal = side_equal and torch.equal(b, c)
            delta = (a.float() - base.float()).norm().item()
            worst = max(worst, (a.float() - b.float()).norm().item() / max(delta, 1e-12))
    return {
        "num_tokens": num_tokens,
        "slots": slots,
        "max_rank": max_rank,
        "dtype": str(dtype),
        "rel_err": worst,
        "side_stream_equal": side_equal,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--large", action="store_true", help="Llama-8B-like widths (GPU)")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    if a.large:
        shapes = ModelShapes(
            num_layers=2, hidden_size=4096, intermediate_size=14336, q_size=4096, kv_size=1024
        )
        cases = [(1, 8, 16), (37, 8, 64), (700, 4, 64)]
    else:
        shapes = ModelShapes(num_layers=2, hidden_size=64, intermediate_size=96, q_size=64, kv_size=32)
        # (48, 24): more than MANY_ADAPTERS distinct; (24, 300): a pool sized from memory, far
        # larger than any batch's distinct adapters (slot ids up to 299 in one step)
        cases = [(5, 3, 16), (40, 4, 32), (48, 24, 16), (24, 300, 8)]
    for num_tokens, slots, rank in cases:
        print(json.dumps(run(shapes, num_tokens, slots, rank, dtype, a.device)), flush=True)


if __name__ == "__main__":
    main()
