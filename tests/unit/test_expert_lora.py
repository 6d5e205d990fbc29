"""LoRA on the experts (lora/expert_lora.py, lora/expert_targets.py): PEFT's saved layout read per
expert, and the routed computation (grouped and loop) against a per-(token, expert) loop reference,
with adapters of different ranks, a slot without expert LoRA and base tokens in one batch."""

from __future__ import annotations

import pytest
import torch

from loraplex.services.inference.lora import expert_lora as expert_lora_module
from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.config import AdapterSpec, ModuleLoRA
from loraplex.services.inference.lora.expert_lora import DOWN, GATE_UP, ExpertLoRA, ExpertLoRAPool
from loraplex.services.inference.lora.expert_targets import per_expert
from loraplex.services.inference.lora.shapes import ModelShapes, expert_dims
from loraplex.services.inference.models import moe as moe_module
from loraplex.services.inference.models.config import MoEConfig
from loraplex.services.inference.models.moe import SparseMoE

E, TOP_K, HIDDEN, INTER = 6, 2, 32, 24
SHAPES = ModelShapes(
    num_layers=2,
    hidden_size=HIDDEN,
    intermediate_size=64,
    q_size=32,
    kv_size=16,
    moe=True,
    num_experts=E,
    expert_intermediate_size=INTER,
    sparse_layers=(True, True),
)


def test_peft_layout_per_expert_matches_peft_delta():
    """PEFT's ParamWrapper delta of expert e equals scaling * B_e @ A_e as per_expert reads them."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=64,
        moe_intermediate_size=INTER,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=E,
        num_experts_per_tok=TOP_K,
    )
    model = get_peft_model(
        Qwen3MoeForCausalLM(cfg),
        LoraConfig(
            r=3,
            lora_alpha=6,
            target_modules=[],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        ),
    )
    experts = model.base_model.model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    # gate_up_proj is the inner wrapper (registered first), down_proj the outer one
    for wrapper, param in ((experts.base_layer, "gate_up_proj"), (experts, "down_proj")):
        assert wrapper.parameter_name == param
        a = per_expert(wrapper.lora_A["default"].weight.detach(), "A", E, 3)
        b = per_expert(wrapper.lora_B["default"].weight.detach(), "B", E, 3)
        d_in, d_out = expert_dims(SHAPES, param)
        assert a.shape == (E, 3, d_in) and b.shape == (E, d_out, 3)
        delta = wrapper.get_delta_weight("default")  # [E, out, in], like the parameter
        torch.testing.assert_close(delta, 2.0 * b @ a, rtol=1e-5, atol=1e-5)


def _adapter(ranks: dict[str, int], seed: int) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    targets, a, b = {}, {}, {}
    for layer in range(SHAPES.num_layers):
        for module, r in ranks.items():
            d_in, d_out = expert_dims(SHAPES, module.removeprefix("experts."))
            targets[(layer, module)] = ModuleLoRA(r, 2.0 * r, 2.0 + seed)
            a[(layer, module)] = torch.randn(E, r, d_in, generator=gen) / d_in**0.5
            b[(layer, module)] = torch.randn(E, d_out, r, generator=gen) / r**0.5
    return AdapterWeights(AdapterSpec(r=1, lora_alpha=1), {}, {}, {}, "d", None, targets, a, b)


# slot -> the adapter's expert ranks (slot 2: an adapter without expert LoRA, e.g. attention only)
ADAPTERS = {0: {GATE_UP: 2, DOWN: 5}, 1: {GATE_UP: 8, DOWN: 8}, 3: {GATE_UP: 3}}


def _pool() -> tuple[ExpertLoRAPool, dict[int, AdapterWeights]]:
    pool = ExpertLoRAPool(
        SHAPES, slots=4, max_rank=8, modules=(GATE_UP, DOWN), dtype=torch.float32, device="cpu"
    )
    weights = {slot: _adapter(ranks, seed=slot + 1) for slot, ranks in ADAPTERS.items()}
    for slot, w in weights.items():
        pool.upload(slot, w)
    return pool, weights


def _moe(seed: int = 5) -> SparseMoE:
    moe = SparseMoE(HIDDEN, MoEConfig(E, TOP_K, INTER, True, (True, True)), "silu", float_weights=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return moe


def _reference(moe: SparseMoE, x, slots, weights: dict[int, AdapterWeights], layer: int) -> torch.Tensor:
    """Token by token: each routed expert's weights plus its adapter's delta, as PEFT merges them."""
    route_w, route_e = moe.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w = weights.get(int(slots[t]))
        for j in range(TOP_K):
            e = int(route_e[t, j])
            gate_up, down = moe.gate_up[e].clone(), moe.down[e].clone()
            for module, base in ((GATE_UP, gate_up), (DOWN, down)):
                if w is not None and (layer, module) in w.expert_targets:
                    scale = w.expert_targets[(layer, module)].scaling
                    base += scale * w.expert_b[(layer, module)][e] @ w.expert_a[(layer, module)][e]
            act = moe._act(x[t] @ gate_up.t())
            out[t] += route_w[t, j] * (act @ down.t())
    return out


@pytest.mark.parametrize("grouped", ["span", True, False])
@pytest.mark.parametrize("path", ["dense", "sorted"])
def test_expert_lora_matches_per_expert_reference(grouped, path, monkeypatch):
    if grouped and not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    monkeypatch.setattr(moe_module, "DENSE_MAX_TOKENS", 64 if path == "dense" else 0)
    pool, weights = _pool()
    lora = ExpertLoRA(pool, grouped=bool(grouped), span=grouped == "span")
    moe = _moe()
    # base, three expert adapters of mixed ranks, one without expert LoRA, interleaved
    slots = torch.tensor([-1, 0, 1, 0, 2, 3, 1, -1, 3, 0, 1, 1, 2, 0], dtype=torch.int32)
    x = torch.randn(slots.numel(), HIDDEN, generator=torch.Generator().manual_seed(9))
    lora.prepare(slots)
    assert [s for s, _ in lora.runs] == [0, 1, 3]  # slot 2 has no expert LoRA: costs nothing
    for layer in range(SHAPES.num_layers):
        got = moe(x, expert_lora=lora.at(layer))
        torch.testing.assert_close(got, _reference(moe, x, slots, weights, layer), rtol=1e-4, atol=1e-4)
    base = moe(x)
    assert not torch.allclose(got[1], base[1], atol=1e-3)  # the adapter changes its tokens
    torch.testing.assert_close(got[[0, 4, 7, 12]], base[[0, 4, 7, 12]], rtol=1e-5, atol=1e-6)


def test_span_too_many_groups_for_cuda_takes_the_grouped_path(monkeypatch):
    """A slot span of SPAN_MAX_GROUPS (slot, expert) groups or more is not sent to grouped_mm as one
    call (CUDA refuses it): the step computes per slot, with the same numbers."""
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    pool, weights = _pool()
    slots = torch.tensor([0, 3, 1, -1, 0, 3], dtype=torch.int32)  # span 0..3: 4 * E groups
    x = torch.randn(slots.numel(), HIDDEN, generator=torch.Generator().manual_seed(4))
    moe = _moe()
    monkeypatch.setattr(expert_lora_module, "SPAN_MAX_GROUPS", 4 * E + 1)
    fits = ExpertLoRA(pool, grouped=True, span=True)
    fits.prepare(slots)
    assert fits.span_active
    monkeypatch.setattr(expert_lora_module, "SPAN_MAX_GROUPS", 4 * E)
    lora = ExpertLoRA(pool, grouped=True, span=True)
    lora.prepare(slots)
    assert not lora.span_active
    for layer in range(SHAPES.num_layers):
        got = moe(x, expert_lora=lora.at(layer))
        torch.testing.assert_close(got, _reference(moe, x, slots, weights, layer), rtol=1e-4, atol=1e-4)


def test_no_expert_lora_in_the_step_takes_the_plain_path():
    pool, _ = _pool()
    lora = ExpertLoRA(pool)
    lora.prepare(torch.tensor([-1, 2, -1], dtype=torch.int32))
    assert lora.at(0) is None and lora.at(1) is None
