"""Tensor parallelism on the CPU (gloo): `--tp-size 2` equals `--tp-size 1` token for token.

Real parts only: the spawned worker process, gloo collectives on loopback, real PEFT
adapters, the engine built through `build_engine` (the server's path).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.errors import BackendUnavailable
from loraplex.services.inference.server_args import ServerArgs
from tests.support.child import child_env, last_json, run_child
from tests.support.factories import make_tiny_model
from tests.support.lora_reference import async_engine

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]


def tp_args(model, tp: int, adapters: dict, **extra) -> ServerArgs:
    options = dict(
        model_path=str(model),
        device="cpu",
        dtype="float32",
        tp_size=tp,
        max_total_tokens=2048,
        context_length=512,
        max_num_batched_tokens=256,
        max_running_requests=8,
        max_loras_per_batch=4,
        max_lora_rank=16,
        lora_target_modules=("all",),
        lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()),
    )
    options.update(extra)
    return ServerArgs.from_fields(**options)


async def _one(engine, rid, prompt, adapter, params) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(rid, prompt, adapter, params):
        tokens.extend(out.new_token_ids)
    return tokens


def run_batch(engine, jobs: list[tuple[str, str | None]], max_new_tokens: int) -> list[list[int]]:
    """Greedy outputs of (prompt, adapter) jobs submitted together (one mixed batch)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(_one(engine, f"r{i}", p, a, params) for i, (p, a) in enumerate(jobs)))

    return asyncio.run(main())


def outputs(
    args: ServerArgs, jobs, max_new_tokens: int, load_later: dict | None = None, family: str = "llama"
) -> list[list[int]]:
    """Build through build_engine, load `load_later` adapters at run time, run one mixed batch."""
    engine = async_engine(args)
    try:
        info = engine.model_info()  # what GetModelInfo reports
        assert info.tp_size == args.engine.tp_size and info.family == family
        for name, path in (load_later or {}).items():
            asyncio.run(engine.load_adapter(name, str(path)))
        return run_batch(engine, jobs, max_new_tokens)
    finally:
        asyncio.run(engine.shutdown())


def mixed_adapters(adapter_factory, base) -> dict:
    return {
        "attn": adapter_factory(base, "attn", r=8, target_modules=["q_proj", "k_proj", "v_proj"], seed=1),
        "mlp_o": adapter_factory(
            base, "mlp_o", r=16, lora_alpha=8, target_modules=["o_proj", "down_proj", "up_proj"], seed=2
        ),
        "all": adapter_factory(base, "all", r=4, target_modules="all-linear", use_rslora=True, seed=3),
    }


def mixed_jobs() -> list[tuple[str, str | None]]:
    adapters = [None, "attn", "mlp_o", "all"]
    return [(p, a) for p, a in zip(PROMPTS, adapters, strict=True)] + [
        (PROMPTS[0], "all"),
        (PROMPTS[2], None),
    ]


def test_tiny_llama_tp2_matches_tp1(tiny_llama_path, adapter_factory):
    """4 heads / 2 KV heads: one KV head per rank. Two slots for three adapters, one loaded at
    run time: slots are evicted and re-uploaded to every rank while the batch runs."""
    adapters = mixed_adapters(adapter_factory, tiny_llama_path)
    later = {"all": adapters.pop("all")}
    jobs = mixed_jobs()
    want = outputs(tp_args(tiny_llama_path, 1, adapters, max_loras_per_batch=2), jobs, 8, later)
    got = outputs(tp_args(tiny_llama_path, 2, adapters, max_loras_per_batch=2), jobs, 8, later)
    assert got == want
    assert len({tuple(t) for t in want}) > 3  # the adapters change the outputs


@pytest.fixture(scope="module")
def one_kv_head_path(tmp_path_factory, smollm2_path):
    """4 heads sharing 1 KV head (replicated on both ranks), tied embeddings, an odd vocabulary
    (49155 rows: rank 1's shard has one zero padding row, cut from the gathered logits)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-1kv"),
        num_kv_heads=1,
        tie_word_embeddings=True,
        vocab_size=49155,
        tokenizer_from=smollm2_path,
        seed=5,
    )


@pytest.mark.parametrize("model", ["one_kv_head_path", "tiny_qwen2_path"])
def test_kv_replication_and_qkv_bias_tp2_match_tp1(model, request, adapter_factory):
    """Small step budgets: prompts are prefilled in chunks beside decodes, and some steps
    sample no row at all (no logits gathered)."""
    base = request.getfixturevalue(model)
    adapters = mixed_adapters(adapter_factory, base)
    jobs = mixed_jobs()
    budget = dict(chunked_prefill_size=3, max_num_batched_tokens=6)
    family = "qwen2" if "qwen2" in model else "llama"
    want = outputs(tp_args(base, 1, adapters, **budget), jobs, 6, family=family)
    got = outputs(tp_args(base, 2, adapters, **budget), jobs, 6, family=family)
    assert got == want
    assert len({tuple(t) for t in want}) > 3


def test_smollm2_tp2_matches_tp1(smollm2_path, adapter_factory):
    """9 heads / 3 KV heads over 2 ranks: KV groups split 2 + 1 (6 and 3 query heads)."""
    adapters = {
        "attn": adapter_factory(
            smollm2_path, "attn", r=8, target_modules=["q_proj", "v_proj", "o_proj"], seed=1
        ),
        "mlp": adapter_factory(smollm2_path, "mlp", r=4, target_modules=["gate_proj", "down_proj"], seed=2),
    }
    jobs = [(PROMPTS[0], None), (PROMPTS[1], "attn"), (PROMPTS[2], "mlp"), (PROMPTS[3], "attn")]
    want = outputs(tp_args(smollm2_path, 1, adapters, max_lora_rank=8), jobs, 5)
    got = outputs(tp_args(smollm2_path, 2, adapters, max_lora_rank=8), jobs, 5)
    assert got == want
    assert len({tuple(t) for t in want}) == len(jobs)


@pytest.mark.parametrize("when", ["mid_stream", "idle"])
def test_dead_worker_makes_engine_unhealthy_without_hanging(tiny_llama_path, when, caplog):
    """Killed while a request streams (the collective fails) or while idle (only the monitor
    can tell): unhealthy within seconds, a log line naming the rank, UNAVAILABLE after."""
    engine = async_engine(tp_args(tiny_llama_path, 2, {}))
    try:
        assert engine.healthy()
        worker = engine.workers.procs[0]
        params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)

        async def kill_mid_stream():
            stream = engine.generate("long", PROMPTS[0], None, params)
            first = await anext(stream)
            assert first.new_token_ids
            os.kill(worker.pid, signal.SIGKILL)
            with pytest.raises(BackendUnavailable, match="rank 1 .* died"):
                async for _ in stream:
                    pass

        start = time.monotonic()
        if when == "mid_stream":
            asyncio.run(asyncio.wait_for(kill_mid_stream(), timeout=30))
        else:
            os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while engine.healthy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.healthy()
        reason = f"rank 1 (pid {worker.pid}) died"
        assert reason in engine.unhealthy_reason()
        assert time.monotonic() - start < 15
        assert any(
            reason in r.getMessage() and "NOT_SERVING" in r.getMessage()
            for r in caplog.records
            if r.levelname == "ERROR"
        )

        async def new_request():
            async for _ in engine.generate("after", PROMPTS[1], None, params):
                pass

        with pytest.raises(BackendUnavailable, match="rank 1"):
            asyncio.run(asyncio.wait_for(new_request(), timeout=5))
    finally:
        start = time.monotonic()
        asyncio.run(engine.shutdown())
        assert time.monotonic() - start < 15


def test_unrunnable_tp_sizes_are_refused_before_any_worker_starts(tiny_llama_path):
    with pytest.raises(ValueError, match="--tp-size must be >= 1"):
        async_engine(tp_args(tiny_llama_path, 0, {}))
    with pytest.raises(ValueError, match=r"--tp-size 3: the model has 4 attention heads in 2 KV groups"):
        async_engine(tp_args(tiny_llama_path, 3, {}))


def test_triton_lora_kernels_under_tp2_match_torch_tp1(tiny_llama_path, adapter_factory):
    """The Triton LoRA path with the row-parallel shrink all-reduce, on Triton's CPU interpreter."""
    adapters = mixed_adapters(adapter_factory, tiny_llama_path)
    proc = run_child(
        [
            "-m",
            "tests.support.tp_triton_check",
            str(tiny_llama_path),
            *(f"{n}={p}" for n, p in adapters.items()),
        ],
        env=child_env(interpret=True),
        timeout=240,
    )
    result = last_json(proc.stdout)
    assert result["tp2_triton"] == result["tp1_torch"]
    assert result["tp1_triton"] == result["tp1_torch"]
    assert len({tuple(t) for t in result["tp1_torch"]}) > 3


@pytest.mark.parametrize("arch", ["phi3", "gemma2"])
def test_new_families_tp2_match_tp1(arch, tmp_path_factory, smollm2_path, adapter_factory):
    """Phi-3's fused checkpoint tensors are sliced per rank part by part (and its fused-module
    adapters shard as their parts); Gemma 2's sandwich norms, soft-capping and sliding window
    run on each rank's heads."""
    base = make_tiny_model(tmp_path_factory.mktemp(f"tp-{arch}"), arch=arch, tokenizer_from=smollm2_path)
    fused = arch == "phi3"
    adapters = {
        "attn": adapter_factory(
            base,
            f"tp-{arch}-attn",
            r=8,
            target_modules=["qkv_proj"] if fused else ["q_proj", "v_proj"],
            seed=1,
        ),
        "mlp": adapter_factory(
            base,
            f"tp-{arch}-mlp",
            r=4,
            target_modules=["gate_up_proj" if fused else "up_proj", "down_proj"],
            seed=2,
        ),
    }
    jobs = [(PROMPTS[0], None), (PROMPTS[1], "attn"), (PROMPTS[2], "mlp"), (PROMPTS[3], "attn")]
    want = outputs(tp_args(base, 1, adapters), jobs, 16, family=arch)
    got = outputs(tp_args(base, 2, adapters), jobs, 16, family=arch)
    assert got == want
    assert len({tuple(t) for t in want}) > 2


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_tp2_matches_tp1(arch, tmp_path_factory, smollm2_path, adapter_factory):
    """Every expert split by its intermediate width (an odd 45 columns: 23 + 22), the router whole
    on each rank, the partial expert outputs all-reduced; Qwen3-MoE's dense layer 1 is split as a
    dense MLP beside its sparse layers. An attention adapter in the batch."""
    width = {"moe_intermediate_size": 45} if arch == "qwen3_moe" else {"intermediate_size": 45}
    base = make_tiny_model(
        tmp_path_factory.mktemp(f"tp-{arch}"), arch=arch, tokenizer_from=smollm2_path, **width
    )
    adapters = {
        "attn": adapter_factory(base, f"tp-{arch}-attn", r=8, target_modules=["q_proj", "o_proj"], seed=3)
    }
    jobs = [(PROMPTS[0], None), (PROMPTS[1], "attn"), (PROMPTS[2], None), (PROMPTS[3], "attn")]
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    want = outputs(tp_args(base, 1, adapters, lora_target_modules=attention), jobs, 12, family=arch)
    got = outputs(tp_args(base, 2, adapters, lora_target_modules=attention), jobs, 12, family=arch)
    assert got == want
    assert len({tuple(t) for t in want}) > 2
    if arch == "qwen3_moe":  # LoRA on the experts is not sharded: refused before any worker starts
        with pytest.raises(ValueError, match="LoRA on the experts.*not sharded"):
            async_engine(tp_args(base, 2, {}, lora_target_modules=(*attention, "experts.down_proj")))
