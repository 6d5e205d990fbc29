"""Mixtral and Qwen3-MoE against transformers + PEFT: greedy tokens equal and log probabilities within
1e-4, for the base model and two attention adapters in one mixed batch, with chunked prefill, the
prefix cache and preemption on (the same harness as test_model_families.py).

The tiny models (tests/support/factories.py FAMILY_CONFIGS) have 8 experts, top-2: Mixtral
renormalises the top-2 routing weights and windows every layer (12 tokens); Qwen3-MoE does not
renormalise (`norm_topk_prob` false) and keeps a dense MLP in layer 1 (`mlp_only_layers`). Both
expert paths of models/moe.py run: dense (every expert, decode-sized steps) and sorted by expert.

LoRA on the experts (lora/expert_lora.py): PEFT `target_parameters` adapters on attention and both
expert parameters, with their own ranks (and a rank_pattern inside one), in a batch with an
attention-only adapter and base requests.
"""

from __future__ import annotations

import pytest

from loraplex.services.inference.models import moe
from tests.integration.test_model_families import PROMPTS, reference, run_engine
from tests.support.factories import make_tiny_model
from tests.support.lora_reference import server_args, sync_engine

# Adapters on attention (what MoE bases accept): one on q/k/v, one on o with rsLoRA.
ADAPTERS = {
    "a4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], seed=21),
    "b8": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["o_proj", "v_proj"], seed=22),
}
BATCH = [None, "a4", "b8", "a4", None, None]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


@pytest.mark.parametrize("experts_path", ["dense", "sorted"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_matches_transformers_and_peft(
    arch, experts_path, tmp_path_factory, smollm2_path, adapter_factory, monkeypatch
):
    # Every step here has <= 64 tokens: dense by default; DENSE_MAX_TOKENS 0 forces the sorted path.
    if experts_path == "sorted":
        monkeypatch.setattr(moe, "DENSE_MAX_TOKENS", 0)
    base = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, tokenizer_from=smollm2_path)
    adapters = {name: adapter_factory(base, f"moe-{arch}-{name}", **kw) for name, kw in ADAPTERS.items()}
    engine = sync_engine(
        server_args(
            base, adapters, max_loras_per_batch=2, page_size=4, max_total_tokens=96, context_length=256
        )
    )
    assert engine.runner.model.config.is_moe
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    got = run_engine(engine, prompts, BATCH)
    expected = reference(base, adapters, list(zip(prompts, BATCH, strict=True)))
    for (tokens, logprobs), (ref_tokens, ref_logprobs), name in zip(got, expected, BATCH, strict=True):
        assert tokens == ref_tokens, f"{arch} adapter {name}: engine {tokens} != PEFT {ref_tokens}"
        for step, lp in enumerate(logprobs):
            row = ref_logprobs[step]
            assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4, (arch, name, step)
            for token, value in lp.top:
                assert abs(value - row[token].item()) < 1e-4, (arch, name, step, token)
    assert expected[0][0] != expected[3][0], "adapter a4 changes the first prompt's tokens"
    assert expected[0][0] != expected[2][0] or expected[3][0] != expected[2][0]
    stats = engine.stats()
    assert sum(stats.prefix_cache_hit_tokens.values()) > 0
    assert engine.scheduler.num_preemptions > 0


EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
# PEFT serves several target_parameters adapters only when they target the same parameters.
EXPERT_ADAPTERS = {
    "e4": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=EXPERTS,
        seed=31,
        rank_pattern={"down_proj": 8},
    ),
    "e8": dict(
        r=8, lora_alpha=16, use_rslora=True, target_modules=["o_proj"], target_parameters=EXPERTS, seed=32
    ),
    "a4": ADAPTERS["a4"],
}
EXPERT_BATCH = [None, "e4", "a4", "e8", "e4", None]


@pytest.mark.parametrize(
    ("arch", "experts_path", "mode"),
    [("mixtral", "dense", "grouped"), ("qwen3_moe", "sorted", "span"), ("qwen3_moe", "dense", "graphs")],
)
def test_expert_lora_matches_transformers_and_peft(
    arch, experts_path, mode, tmp_path_factory, smollm2_path, adapter_factory, monkeypatch
):
    if experts_path == "sorted":
        monkeypatch.setattr(moe, "DENSE_MAX_TOKENS", 0)
    base = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, tokenizer_from=smollm2_path)
    adapters = {
        name: adapter_factory(base, f"moe-{arch}-{name}", **kw) for name, kw in EXPERT_ADAPTERS.items()
    }
    engine = sync_engine(
        server_args(
            base,
            adapters,
            max_loras_per_batch=3,
            page_size=4,
            max_total_tokens=160,
            context_length=256,
            expert_lora_mode=mode,
        )
    )
    pool = engine.runner.lora_backend.pool
    assert pool.experts is not None and set(EXPERTS) <= set(pool.target_modules)
    experts = engine.runner.lora_backend.experts
    assert engine.runner.lora_backend.max_step_distinct() == 3  # --max-loras-per-batch (lora/setup.py)
    assert getattr(experts, "span", False) == (mode == "span") and experts.graph_safe == (mode == "graphs")
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    got = run_engine(engine, prompts, EXPERT_BATCH)
    expected = reference(base, adapters, list(zip(prompts, EXPERT_BATCH, strict=True)))
    for (tokens, logprobs), (ref_tokens, ref_logprobs), name in zip(got, expected, EXPERT_BATCH, strict=True):
        assert tokens == ref_tokens, f"{arch} adapter {name}: engine {tokens} != PEFT {ref_tokens}"
        for step, lp in enumerate(logprobs):
            row = ref_logprobs[step]
            assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4, (arch, name, step)
            for token, value in lp.top:
                assert abs(value - row[token].item()) < 1e-4, (arch, name, step, token)
    # the expert adapters change the tokens (on the same prompt as the base row)
    assert expected[0][0] != expected[1][0] or expected[4][0] != expected[5][0]


def test_a_router_holding_nan_is_refused_at_load(tmp_path):
    """Issue 59 (M6): NaN router weights were served (NaN routing, NaN outputs); now one line naming them."""
    import torch
    from safetensors.torch import load_file, save_file

    from loraplex.services.inference.models.config import UnsupportedModelError
    from loraplex.services.inference.models.loader import load_model

    base = make_tiny_model(tmp_path / "mixtral", arch="mixtral", vocab_size=128)
    name = "model.layers.1.block_sparse_moe.gate.weight"
    tensors = load_file(str(base / "model.safetensors"))
    assert name in tensors, sorted(tensors)[:8]
    load_model(base, torch.device("cpu"), torch.float32)  # the unbroken one loads
    tensors[name][3, 5] = float("nan")
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=rf"'{name}' holds NaN or Inf values"):
        load_model(base, torch.device("cpu"), torch.float32)
