"""Multi-LoRA end to end: our engine's greedy tokens equal PEFT's, per sequence, token for token.

Adapters are real PEFT files of different ranks and target modules; PEFT (`PeftModel` +
`generate(do_sample=False)`, one sequence at a time) is the reference. The mixed-batch tests
run one continuous batch holding the base model and more distinct adapters than
`--max-loras-per-batch`; the flow tests go through `build_engine` (the server's path).
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest
import torch

from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.errors import AdapterIncompatible, AdapterNotFound
from loraplex.services.inference.lora.settings import DEFAULT_MAX_LORA_RANK
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes
from tests.support.lora_reference import (
    BATCH,
    NEW_TOKENS,
    PROMPTS,
    async_engine,
    lora_settings,
    make_adapters,
    peft_greedy,
    server_args,
    sync_engine,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide, as test_engine_correctness: see conftest.one_torch_thread (the engine and the
    PEFT reference each run one torch thread instead of two fighting over the cores)."""


def check_mixed_batch(
    base: Path, adapters: dict[str, Path], batch: list[str | None], slots: int, pool: int | None, **kw
) -> None:
    """More adapters than `slots` distinct per step (--max-loras-per-batch), on a pool of `pool`
    slots (--max-gpu-loras; None: sized from memory)."""
    assert len({a for a in batch if a}) > slots
    engine = sync_engine(server_args(base, adapters, max_loras_per_batch=slots, max_gpu_loras=pool, **kw))
    step = engine.scheduler.schedule
    distinct: list[int] = []

    def counted():
        batch = step()
        distinct.append(len({r.adapter for r, _ in batch.entries if r.adapter}))
        return batch

    engine.scheduler.schedule = counted
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[: len(batch)]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS), list(batch))
    expected = peft_greedy(base, adapters, list(zip(prompts, batch, strict=True)))
    for out, exp, name in zip(outs, expected, batch, strict=True):
        assert out.token_ids == exp, f"adapter {name}: engine {out.token_ids} != PEFT {exp}"
    assert all(len(e) == NEW_TOKENS for e in expected), "every sequence runs the full 24+ tokens"
    # the adapters really change the output (else the comparison proves little)
    assert len({tuple(e) for e in expected[:5]}) == 5
    assert max(distinct) == slots
    if pool is not None:
        assert engine.stats().lora_slots_total == pool


def test_mixed_batch_matches_peft_tiny(tiny_llama_path, adapter_factory):
    """Both limits scarce: 2 distinct adapters per step, 2 resident."""
    adapters = make_adapters(adapter_factory, tiny_llama_path, "e2e-tiny")
    check_mixed_batch(tiny_llama_path, adapters, BATCH, 2, 2)


def test_ranks_4_to_64_in_one_step_take_their_own_pages(tiny_llama_path, adapter_factory):
    """Issue 57 (rank pages): ranks 4, 8, 16 and 64 compute in one step of a rank-64 pool, token for
    token as PEFT, and the pool's bytes in use are the adapters' own pages (1 + 1 + 2 + 8 pages of 8
    rank rows), not four rank-64 slots (32 pages)."""
    adapters = make_adapters(adapter_factory, tiny_llama_path, "e2e-tiny")
    engine = sync_engine(server_args(tiny_llama_path, adapters, max_loras_per_batch=None, max_gpu_loras=4))
    pool = engine.adapter_slots.pool
    step = engine.scheduler.schedule
    seen: list[tuple[int, int]] = []  # (distinct adapters, pages in use) per step

    def counted():
        batch = step()
        seen.append((len({r.adapter for r, _ in batch.entries if r.adapter}), pool.pages_in_use))
        return batch

    engine.scheduler.schedule = counted
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[: len(BATCH)]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS), list(BATCH))
    expected = peft_greedy(tiny_llama_path, adapters, list(zip(prompts, BATCH, strict=True)))
    for out, exp, name in zip(outs, expected, BATCH, strict=True):
        assert out.token_ids == exp, f"adapter {name}: engine {out.token_ids} != PEFT {exp}"
    assert pool.max_rank == 64 and pool.page_rows == 8
    all_four = [pages for distinct, pages in seen if distinct == 4]
    assert all_four and set(all_four) == {1 + 1 + 2 + 8}
    assert pool.pages_in_use * pool.page_nbytes == 12 * pool.page_nbytes < 32 * pool.page_nbytes


@pytest.mark.slow
def test_mixed_batch_matches_peft_smollm2(smollm2_path, adapter_factory):
    check_mixed_batch(
        smollm2_path,
        make_adapters(adapter_factory, smollm2_path, "e2e-smol"),
        [None, "r4", "r8rs", "r16", "r64"],
        3,
        None,
        chunked_prefill_size=64,
        max_num_batched_tokens=256,
    )


# ----- flows through build_engine (AsyncEngine on its own thread) -----


async def run(engine, rid: str, ids: list[int], adapter: str | None, n: int = NEW_TOKENS) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(rid, ids, adapter, SamplingParams(max_new_tokens=n)):
        tokens += out.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def tiny_adapters(tiny_llama_path, adapter_factory) -> dict[str, Path]:
    return make_adapters(adapter_factory, tiny_llama_path, "e2e-tiny")


@pytest.fixture(scope="module")
def tiny_ids(tiny_llama_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    return [tok(p).input_ids for p in PROMPTS]


def test_one_adapter_and_base_then_two_adapters(tiny_llama_path, tiny_adapters, tiny_ids, caplog):
    one = {"r4": tiny_adapters["r4"]}
    with caplog.at_level(logging.INFO, logger="loraplex.services.inference.lora.setup"):
        engine = async_engine(server_args(tiny_llama_path, one))
    try:
        info = engine.model_info()
        # inferred from --lora-paths: r4's rank and modules
        assert (info.max_lora_rank, info.lora_target_modules, info.lora_backend) == (
            4,
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"],
            "torch",
        )
        printed = int(re.search(r"LoRA adapter pool: (\d+) bytes", caplog.text).group(1))
        # the pool is sized from memory (64 slots on CPU); --max-loras-per-batch 2 only caps a step
        assert (engine.stats().lora_slots_total, info.max_loras_per_batch) == (64, 2)
        assert printed == documented_pool_bytes(
            tiny_llama_path, slots=64, rank=4, modules=info.lora_target_modules
        )

        async def flow():
            return await asyncio.gather(
                run(engine, "base", tiny_ids[0], None), run(engine, "a", tiny_ids[1], "r4")
            )

        got = asyncio.run(flow())
        assert got == peft_greedy(tiny_llama_path, one, [(tiny_ids[0], None), (tiny_ids[1], "r4")])
    finally:
        asyncio.run(engine.shutdown())
    # two adapters, both from --lora-paths: rank and modules inferred as the max / union
    two = {"r4": tiny_adapters["r4"], "r8rs": tiny_adapters["r8rs"]}
    engine = async_engine(server_args(tiny_llama_path, two))
    try:
        assert engine.model_info().max_lora_rank == 8

        async def flow2():
            return await asyncio.gather(
                run(engine, "x", tiny_ids[2], "r4"),
                run(engine, "y", tiny_ids[3], "r8rs"),
                run(engine, "z", tiny_ids[4], "r8rs"),
            )

        got = asyncio.run(flow2())
        assert got == peft_greedy(
            tiny_llama_path, two, [(tiny_ids[2], "r4"), (tiny_ids[3], "r8rs"), (tiny_ids[4], "r8rs")]
        )
    finally:
        asyncio.run(engine.shutdown())


def test_load_unload_load_while_running(tiny_llama_path, tiny_adapters, tiny_ids):
    long_n = 300
    engine = async_engine(
        server_args(
            tiny_llama_path, {"r4": tiny_adapters["r4"]}, max_lora_rank=64, lora_target_modules=("all",)
        )
    )
    try:

        async def flow():
            stream = engine.generate(
                "long", tiny_ids[3], "r4", SamplingParams(max_new_tokens=long_n, ignore_eos=True)
            )
            first = await stream.__anext__()  # it is running now
            running = asyncio.ensure_future(_drain(stream, list(first.new_token_ids)))
            await engine.load_adapter("r16", str(tiny_adapters["r16"]))
            await engine.unload_adapter("r4")
            assert not running.done(), "the r4 request should still be generating"
            with pytest.raises(AdapterNotFound):
                await run(engine, "late", tiny_ids[0], "r4")
            await engine.load_adapter("r64", str(tiny_adapters["r64"]))
            others = await asyncio.gather(
                run(engine, "b", tiny_ids[1], "r16"), run(engine, "c", tiny_ids[2], "r64")
            )
            return await running, others

        long_tokens, others = asyncio.run(flow())
        assert len(long_tokens) == long_n
        ref_long = peft_greedy(tiny_llama_path, tiny_adapters, [(tiny_ids[3], "r4")], new_tokens=long_n)[0]
        assert long_tokens[: len(ref_long)] == ref_long  # PEFT stops at EOS; we ignore it
        assert others == peft_greedy(
            tiny_llama_path, tiny_adapters, [(tiny_ids[1], "r16"), (tiny_ids[2], "r64")]
        )
        names = {a.name: a for a in engine.list_adapters()}
        assert set(names) == {"r16", "r64"}
        assert engine.stats().lora_slots_used <= 2 and "r4" not in names
    finally:
        asyncio.run(engine.shutdown())


async def _drain(stream, tokens: list[int]) -> list[int]:
    async for out in stream:
        tokens += out.new_token_ids
    return tokens


def test_rank4_and_rank64_side_by_side_and_refused_without_flags(tiny_llama_path, tiny_adapters, tiny_ids):
    pair = {"r4": tiny_adapters["r4"], "r64": tiny_adapters["r64"]}
    engine = async_engine(server_args(tiny_llama_path, pair, max_lora_rank=64, lora_target_modules=("all",)))
    try:

        async def flow():
            return await asyncio.gather(
                run(engine, "p", tiny_ids[4], "r4"),
                run(engine, "q", tiny_ids[5], "r64"),
                run(engine, "r", tiny_ids[6], None),
            )

        got = asyncio.run(flow())
        assert got == peft_greedy(
            tiny_llama_path, pair, [(tiny_ids[4], "r4"), (tiny_ids[5], "r64"), (tiny_ids[6], None)]
        )
    finally:
        asyncio.run(engine.shutdown())
    engine = async_engine(server_args(tiny_llama_path, {"r4": tiny_adapters["r4"]}))
    try:
        with pytest.raises(AdapterIncompatible) as e:
            asyncio.run(engine.load_adapter("r64", str(tiny_adapters["r64"])))
        assert "--max-lora-rank 4" in e.value.message
        assert not engine.has_adapter("r64")
    finally:
        asyncio.run(engine.shutdown())


def documented_pool_bytes(base: Path, slots: int, rank: int, modules: list[str], dtype_bytes: int = 4) -> int:
    """docs/architecture.md: pages * sum_g L*P*(n*d + sum(w))*dtype_bytes + sum_g L*slots*n*8 + the page
    table's slots*ceil(R/P)*4, over allocated groups; a pool sized on CPU has every slot's pages."""
    s = ModelShapes.from_model_dir(base)
    h, i, q, kv = s.hidden_size, s.intermediate_size, s.q_size, s.kv_size
    groups = {
        "qkv": (("q_proj", "k_proj", "v_proj"), h, q + 2 * kv),
        "o": (("o_proj",), q, h),
        "gate_up": (("gate_proj", "up_proj"), h, 2 * i),
        "down": (("down_proj",), i, h),
    }
    P = min(8, rank)
    per_slot = -(-rank // P)
    pages = slots * per_slot
    return slots * per_slot * 4 + sum(
        pages * s.num_layers * P * (len(mods) * d + w) * dtype_bytes + s.num_layers * slots * len(mods) * 8
        for mods, d, w in groups.values()
        if set(mods) & set(modules)
    )


def test_defaults_and_inference(tiny_llama_path, tiny_adapters):
    shapes = ModelShapes.from_model_dir(tiny_llama_path)
    cpu = torch.device("cpu")
    d = lora_settings(server_args(tiny_llama_path), shapes, cpu)
    assert (d.max_lora_rank, d.target_modules, d.backend, d.max_loras_per_batch) == (
        DEFAULT_MAX_LORA_RANK,
        ALL_MODULES,
        "torch",
        2,
    )
    inferred = lora_settings(
        server_args(tiny_llama_path, {k: tiny_adapters[k] for k in ("r8rs", "r16")}), shapes, cpu
    )
    assert inferred.max_lora_rank == 16
    assert inferred.target_modules == ("q_proj", "v_proj", "up_proj", "down_proj")
    explicit = lora_settings(
        server_args(tiny_llama_path, max_lora_rank=8, lora_target_modules=("q_proj", "down_proj")),
        shapes,
        cpu,
    )
    assert (explicit.max_lora_rank, explicit.target_modules) == (8, ("q_proj", "down_proj"))
    with pytest.raises(ValueError, match="wq"):
        lora_settings(server_args(tiny_llama_path, lora_target_modules=("wq",)), shapes, cpu)
