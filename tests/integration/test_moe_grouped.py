"""kernels/moe_grouped.py (Triton grouped expert GEMM) against its torch reference and models/moe.py's
torch paths, in Triton's CPU interpreter (child processes: the interpreter is chosen at import).

Also kernels/expert_lora_pairs.py (expert LoRA per routed pair) against its reference.
Randomized, tiny (8 experts, top-2), uneven routing: a hot expert spanning several tiles, experts with
no token, a single-token step; float32 and float16, SiLU and tanh-GELU, float32 and model-dtype weights.
"""

from __future__ import annotations

import pytest

from tests.support.child import child_env, last_json, run_child

# One child for both checks (the interpreter's start-up and imports are most of the time).
CHILD = """
import json, torch
from loraplex.kernels.moe_grouped_check import CPU_CASES, run_case
from loraplex.services.inference.models import moe
kernel = [run_case(*case, seed=i, device=torch.device("cpu")) for i, case in enumerate(CPU_CASES)]
from loraplex.services.inference.models.config import MoEConfig
torch.manual_seed(0)
out = []
for arch, norm, float_weights in (("mixtral", True, True), ("qwen3_moe", False, False)):
    block = moe.SparseMoE(32, MoEConfig(8, 2, 24, norm, (True,)), "silu", float_weights)
    for p in (block.gate, block.gate_up, block.down):
        p.data.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    for tokens in (1, 5, 70):
        x = torch.randn(tokens, 32)
        weights, experts = block.route(x)
        sorted_ = block._sorted(x, weights, experts)
        grouped = block._grouped(x, weights, experts)
        moe.MOE_GROUPED_ON_CPU = True
        routed = block(x)
        moe.MOE_GROUPED_ON_CPU = False
        err = ((grouped - sorted_).norm() / sorted_.norm()).item()
        out.append(dict(arch=arch, tokens=tokens, err=err, forward_err=(routed - sorted_).abs().max().item()))
# LoRA on the experts through the grouped kernel's deltas, both expert LoRA modes, per-expert reference
from loraplex.services.inference.lora.expert_lora import ExpertLoRA
from loraplex.services.inference.lora.expert_lora_graph import GraphExpertLoRA
from tests.unit.test_expert_lora import HIDDEN, SHAPES, _moe, _pool, _reference
pool, weights = _pool()
block = _moe()
slots = torch.tensor([-1, 0, 1, 0, 2, 3, 1, -1, 3, 0, 1, 1, 2, 0], dtype=torch.int32)
x = torch.randn(slots.numel(), HIDDEN, generator=torch.Generator().manual_seed(9))
expert_lora = {}
moe.MOE_GROUPED_ON_CPU = True
from loraplex.kernels.placement import run_triton_on_cpu
modes = (
    ("grouped", ExpertLoRA(pool)), ("graphs", GraphExpertLoRA(pool)), ("graphs_pairs", GraphExpertLoRA(pool))
)
for name, lora in modes:
    run_triton_on_cpu(name == "graphs_pairs")  # the Triton path: the per-pair kernel's deltas
    lora.prepare(slots)
    errs = []
    for layer in range(SHAPES.num_layers):
        ref = _reference(block, x, slots, weights, layer)
        errs.append(((block(x, expert_lora=lora.at(layer)) - ref).abs().max() / ref.abs().max()).item())
    expert_lora[name] = max(errs)
run_triton_on_cpu(False)
moe.MOE_GROUPED_ON_CPU = False
# kernels/expert_lora_pairs.py against its reference: random shapes, mixed ranks (zeros past a
# rank), base tokens, and a slot with scale 0 whose factors are garbage (NaN)
from loraplex.kernels.expert_lora_pairs import expert_pair_lora, expert_pair_lora_ref
gen = torch.Generator().manual_seed(3)
pairs = []
for i, (t, k, s, e, r, d_in, d_out, per_pair, dtype) in enumerate((
    (5, 2, 3, 4, 16, 40, 70, False, torch.float32),
    (7, 3, 3, 8, 8, 33, 129, True, torch.float32),
    (9, 2, 4, 4, 24, 64, 96, False, torch.bfloat16),
    (1, 1, 1, 2, 16, 16, 16, True, torch.float16),
)):
    a = torch.randn(s * e, r, d_in, generator=gen).to(dtype)
    b = torch.randn(s * e, d_out, r, generator=gen).to(dtype)
    a[:e, r // 2 :] = 0  # slot 0 at half the rank
    b[:e, :, r // 2 :] = 0
    scale = torch.rand(s, generator=gen) + 0.5
    if s > 2:
        scale[2] = 0
        a[2 * e : 3 * e] = float("nan")
    experts = torch.randint(0, e, (t, k), generator=gen)
    token_slots = torch.randint(-1, s, (t + 2,), generator=gen, dtype=torch.int32)
    x_in = torch.randn(t * k if per_pair else t, d_in, generator=gen).to(dtype)
    got = expert_pair_lora(x_in, a, b, scale, experts, token_slots, k, per_pair)
    ref = expert_pair_lora_ref(x_in, a, b, scale, experts, token_slots, k, per_pair)
    pair_slot = token_slots[torch.arange(t * k) // k].long()
    dead = (pair_slot < 0) | (scale[pair_slot.clamp(min=0)] == 0)
    pairs.append(dict(
        dtype=str(dtype), shape_ok=list(got.shape) == [t * k, d_out], finite=bool(got.isfinite().all()),
        dead_zero=bool((got[dead] == 0).all()), some_dead=bool(dead.any()),
        rel_err=((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item(),
    ))
print(json.dumps(dict(kernel=kernel, sparse_moe=out, expert_lora=expert_lora, pairs=pairs)))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    return last_json(run_child(["-c", CHILD], env=child_env(interpret=True), timeout=120).stdout)


def test_grouped_kernel_matches_torch_reference(results):
    rows = results["kernel"]
    assert len(rows) == 4
    for r in rows:
        assert r["tiles_ok"] and r["shape_ok"], r
        assert r["rel_err"] < (1e-5 if r["dtype"] == "float32" else 2e-3), r


def test_sparse_moe_grouped_path_matches_sorted_path(results):
    rows = results["sparse_moe"]
    assert len(rows) == 6
    for r in rows:
        assert r["err"] < 1e-5 and r["forward_err"] < 1e-5, r


def test_expert_lora_deltas_in_the_grouped_kernel_match_the_per_expert_reference(results):
    """Both expert LoRA modes hand their deltas to the grouped kernel (lora/expert_moe.py PairDeltas)."""
    assert set(results["expert_lora"]) == {"grouped", "graphs", "graphs_pairs"}
    for name, err in results["expert_lora"].items():
        assert err < 1e-5, (name, err)  # relative to the output's largest entry (float32)


def test_expert_pair_lora_kernel_matches_its_reference(results):
    """kernels/expert_lora_pairs.py: every pair's delta, zeros for base tokens and scale-0 slots
    (whose garbage factors it must not read)."""
    rows = results["pairs"]
    assert len(rows) == 4 and any(r["some_dead"] for r in rows)
    for r in rows:
        assert r["shape_ok"] and r["finite"] and r["dead_zero"], r
        assert r["rel_err"] < (1e-5 if r["dtype"] == "torch.float32" else 1e-2), r


def test_moe_steps_capture_at_any_size_only_with_the_grouped_kernel():
    """What the engine reads to size its CUDA graphs for an MoE model (engine/startup.py)."""
    import torch

    from loraplex.services.inference.models import moe

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert moe.graph_safe_max_tokens(cuda) is None  # the grouped kernel: the experts' path on CUDA
    assert moe.graph_safe_max_tokens(cpu) == moe.DENSE_MAX_TOKENS  # the CPU runs torch
    try:
        moe.MOE_TORCH_ON_CUDA = True  # bench/moe.py's control row
        assert moe.graph_safe_max_tokens(cuda) == moe.DENSE_MAX_TOKENS
    finally:
        moe.MOE_TORCH_ON_CUDA = False
