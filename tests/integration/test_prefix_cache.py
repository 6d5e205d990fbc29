"""Prefix cache: KV reused only when the same content (base model or adapter digest) computed the
same tokens, and greedy outputs with the cache on equal those with it off, token for token.

The engines are the server's own (`build_llm_engine`) on CPU in float32; the cache-off engine is
the reference (tests/integration/test_engine_correctness.py and tests/integration/test_lora_e2e.py
check it against transformers and PEFT), and one test here checks the cached path against PEFT
directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import shutil
from collections import Counter

import pytest

from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.types import SamplingParams
from tests.support.lora_reference import peft_greedy, server_args, sync_engine

NEW = 8
PAGE = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, adapter_factory, tmp_path_factory):
    a = adapter_factory(tiny_llama_path, "pc-a", r=8, target_modules=TARGETS, seed=21)
    b = adapter_factory(tiny_llama_path, "pc-b", r=8, target_modules=TARGETS, seed=22)
    same_as_a = tmp_path_factory.mktemp("pc-a-copy") / "adapter"
    shutil.copytree(a, same_as_a)  # another directory, the same bytes: the same content digest
    return {"a": a, "b": b, "a2": same_as_a}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


SYSTEM = tokens(0, 37)  # 9 full blocks of 4 and one token over
PROMPTS = [SYSTEM + tokens(i + 1, 5 + i) for i in range(4)]


def engine_for(base, adapters=None, cache=True, **kw):
    options = dict(page_size=PAGE, max_loras_per_batch=3, disable_prefix_cache=not cache)
    options.update(kw)
    return sync_engine(server_args(base, adapters, **options))


def one_by_one(engine, jobs, new=NEW):
    """Each (prompt, adapter) to completion before the next; returns tokens and per-request hits."""
    outs, hits = [], []
    for ids, adapter in jobs:
        before = engine.stats().prefix_cache_hit_tokens.get(adapter or "", 0)
        [done] = engine.generate([ids], SamplingParams(max_new_tokens=new, ignore_eos=True), [adapter])
        outs.append(done.token_ids)
        hits.append(engine.stats().prefix_cache_hit_tokens.get(adapter or "", 0) - before)
    return outs, hits


def staggered(engine, jobs, new=NEW, every=2):
    """Requests join a running batch one every `every` steps (later ones reuse earlier ones' blocks
    while those still run); returns tokens per job."""
    outs = {i: [] for i in range(len(jobs))}
    pending = list(enumerate(jobs))
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, (ids, adapter) = pending.pop(0)
            engine.add_request(f"s{i}", ids, params, adapter)
        for out in engine.step():
            outs[int(out.request_id[1:])].extend(out.new_token_ids)
        step += 1
    return [outs[i] for i in range(len(jobs))]


def test_reuse_within_one_adapter_and_base(tiny_llama_path, adapters):
    jobs = [(PROMPTS[0], "a"), (PROMPTS[1], "a"), (PROMPTS[2], None), (PROMPTS[3], None)]
    on = engine_for(tiny_llama_path, adapters)
    outs, hits = one_by_one(on, jobs)
    # the second request of each kind reuses the 9 full blocks of the system prompt
    assert hits == [0, 36, 0, 36]
    off_outs, off_hits = one_by_one(engine_for(tiny_llama_path, adapters, cache=False), jobs)
    assert outs == off_outs and off_hits == [0, 0, 0, 0]
    stats = on.stats()
    assert stats.prefix_cache_enabled and stats.prefix_cache_blocks > 0
    assert stats.prefix_cache_prompt_tokens["a"] == len(PROMPTS[0]) + len(PROMPTS[1])
    assert stats.kv_blocks_free == stats.kv_blocks_total  # cached blocks with no request are free


def test_no_reuse_across_adapters_or_base(tiny_llama_path, adapters):
    engine = engine_for(tiny_llama_path, adapters)
    jobs = [(PROMPTS[0], None), (PROMPTS[0], "a"), (PROMPTS[0], "b"), (PROMPTS[0], None), (PROMPTS[0], "b")]
    outs, hits = one_by_one(engine, jobs)
    assert hits == [0, 0, 0, 40, 40]  # the whole prompt but its last token (in its 11th block)
    assert len({tuple(o) for o in outs[:3]}) == 3, "base, a and b must differ for the check to mean anything"
    assert outs == one_by_one(engine_for(tiny_llama_path, adapters, cache=False), jobs)[0]


def test_equal_content_under_two_names_shares_kv(tiny_llama_path, adapters):
    engine = engine_for(tiny_llama_path, adapters)
    outs, hits = one_by_one(engine, [(PROMPTS[0], "a"), (PROMPTS[1], "a2")])
    assert hits == [0, 36]
    assert (
        outs
        == one_by_one(
            engine_for(tiny_llama_path, adapters, cache=False), [(PROMPTS[0], "a"), (PROMPTS[1], "a2")]
        )[0]
    )


def test_reload_with_new_content_never_reuses_old_kv(tiny_llama_path, adapters):
    engine = engine_for(tiny_llama_path, {"x": adapters["a"]})
    first, hits = one_by_one(engine, [(PROMPTS[0], "x")])
    engine.adapter_slots.load_adapter("x", adapters["b"])  # same name, other weights
    second, hits2 = one_by_one(engine, [(PROMPTS[1], "x"), (PROMPTS[2], "x")])
    assert hits + hits2 == [0, 0, 36]  # the new version reuses only its own blocks
    engine.adapter_slots.load_adapter("x", adapters["a2"])  # back to the first content (another path)
    third, hits3 = one_by_one(engine, [(PROMPTS[3], "x")])
    assert hits3 == [36]  # the first version's blocks, evicted by nothing, are its content's
    expected = peft_greedy(
        tiny_llama_path,
        {"a": adapters["a"], "b": adapters["b"]},
        [(PROMPTS[0], "a"), (PROMPTS[1], "b"), (PROMPTS[2], "b"), (PROMPTS[3], "a")],
        new_tokens=NEW,
    )
    assert first + second + third == expected


def test_reload_between_staggered_requests(tiny_llama_path, adapters):
    """Requests of one name share a prefix while its adapter is reloaded in the middle: those that
    started on v1 finish on v1, later ones run v2, and no one reads the other version's KV."""
    engine = engine_for(tiny_llama_path, {"x": adapters["a"]})
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    outs = {i: [] for i in range(4)}
    engine.add_request("r0", PROMPTS[0], params, "x")
    engine.add_request("r1", PROMPTS[1], params, "x")
    for _ in range(8):  # r0 and r1 have computed the system prompt and are decoding on v1
        for out in engine.step():
            outs[int(out.request_id[1:])].extend(out.new_token_ids)
    engine.adapter_slots.load_adapter("x", adapters["b"])
    engine.add_request("r2", PROMPTS[2], params, "x")
    engine.add_request("r3", PROMPTS[3], params, "x")
    while engine.has_unfinished():
        for out in engine.step():
            outs[int(out.request_id[1:])].extend(out.new_token_ids)
    expected = peft_greedy(
        tiny_llama_path,
        {"a": adapters["a"], "b": adapters["b"]},
        [(PROMPTS[0], "a"), (PROMPTS[1], "a"), (PROMPTS[2], "b"), (PROMPTS[3], "b")],
        new_tokens=NEW,
    )
    assert [outs[i] for i in range(4)] == expected


@pytest.mark.parametrize("overlap,pieces", [(False, False), (True, False), (False, True)])
def test_staggered_mixed_batch_matches_cache_off(tiny_llama_path, adapters, overlap, pieces):
    """Later requests reuse blocks that running ones computed, in batches of base and adapters,
    with chunked prefill (8 tokens a step) and, when `overlap`, overlap scheduling; when `pieces`,
    mixed steps (a chunk starting after the reused blocks) run the piecewise-graph path eagerly."""
    jobs = [(PROMPTS[i % 4], [None, "a", "b", "a2"][i % 4]) for i in range(8)]
    jobs += [(PROMPTS[i] + tokens(50 + i, 9), a) for i, a in enumerate([None, "a", "b"])]
    on = engine_for(tiny_llama_path, adapters)
    on.config = dataclasses.replace(on.config, overlap_schedule=overlap)
    if pieces:
        on.runner.capture_mixed_graphs(64, use_graphs=False)
    outs = staggered(on, jobs)
    assert sum(on.stats().prefix_cache_hit_tokens.values()) > 0
    if pieces:
        assert on.runner.mixed_graphs.steps_run > 0
    assert outs == staggered(engine_for(tiny_llama_path, adapters, cache=False), jobs)


# ----- the cache costs nothing when it cannot help -----


def recorded_schedules(engine, jobs, new=NEW, every=2):
    """`staggered`, recording each step's schedule as (request id, tokens) pairs."""
    schedule = engine.scheduler.schedule
    steps = []

    def recording():
        batch = schedule()
        steps.append([(e.request.request_id, e.num_tokens) for e in batch.entries])
        return batch

    engine.scheduler.schedule = recording
    return staggered(engine, jobs, new, every), steps


@pytest.mark.parametrize("overlap", [False, True])
def test_no_shared_prefix_schedules_like_cache_off(tiny_llama_path, adapters, overlap):
    """Unique prompts (base and adapters, chunked prefill, overlap on and off): with the cache on
    every step schedules the same requests for the same token counts as with it off."""
    jobs = [(tokens(300 + i, 11 + 5 * i), [None, "a", "b"][i % 3]) for i in range(9)]
    runs = []
    for cache in (False, True):
        engine = engine_for(tiny_llama_path, adapters, cache=cache)
        engine.config = dataclasses.replace(engine.config, overlap_schedule=overlap)
        runs.append(recorded_schedules(engine, jobs, every=1))
        assert sum(engine.stats().prefix_cache_hit_tokens.values()) == 0
    (off_outs, off_steps), (on_outs, on_steps) = runs
    assert any(n > 1 for step in off_steps for _, n in step[1:]), "no step mixed prefill and decodes"
    assert on_steps == off_steps and on_outs == off_outs


def test_no_shared_prefix_schedules_like_cache_off_under_kv_pressure():
    """Scheduler alone, a KV cache small enough to preempt: the same schedule as cache-off up to
    the first reuse, and the only reuse is a preempted request readmitted onto its own blocks."""
    from loraplex.services.inference.engine.config import SchedulerConfig
    from loraplex.services.inference.engine.request import Request
    from loraplex.services.inference.engine.scheduler import Scheduler
    from loraplex.services.inference.lora.adapter_slots import NoAdapters

    def run(cache: bool):
        config = SchedulerConfig(PAGE, 24, 8, 6, context_length=4096)
        scheduler = Scheduler(config, BlockManager(30, PAGE, prefix_cache=cache), NoAdapters())
        steps, reuses = [], []
        reuse = scheduler.prefix_cache.reuse

        def recording_reuse(req, hit):
            if hit:
                reuses.append((len(steps), req.num_preemptions))
            reuse(req, hit)

        scheduler.prefix_cache.reuse = recording_reuse
        reqs = [
            Request(f"r{i}", tokens(400 + i, 9 + 3 * i), SamplingParams(max_new_tokens=12)) for i in range(10)
        ]
        while len(steps) < len(reqs) or scheduler.has_work():
            if len(steps) < len(reqs):
                scheduler.add(reqs[len(steps)])
            batch = scheduler.schedule()
            steps.append([(e.request.request_id, e.num_tokens) for e in batch.entries])
            for req, n in batch.entries:
                sample = req.num_computed_tokens + n == len(req.token_ids)
                req.num_computed_tokens += n
                if sample:
                    req.token_ids.append(7)
                    if req.num_output_tokens >= req.max_new_tokens:
                        scheduler.finish(req, "length")
        return steps, reuses, scheduler.num_preemptions

    off, _, preemptions = run(False)
    on, reuses, _ = run(True)
    assert preemptions > 0, "no KV pressure; the test proves nothing"
    assert all(preempted for _, preempted in reuses)
    first_reuse = reuses[0][0] if reuses else len(on)
    assert first_reuse > len(off) // 4, "too little compared"
    assert on[:first_reuse] == off[:first_reuse]
    if not reuses:
        assert on == off


# ----- eviction and preemption under KV pressure -----


def staggered_checked(engine, jobs, new, every):
    """`staggered`, checking after every step that each block's refcount is exactly the number of
    running requests whose table holds it: a running request's block is never free or evictable."""
    outs = {i: [] for i in range(len(jobs))}
    pending = list(enumerate(jobs))
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    shared_seen = False
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, (ids, adapter) = pending.pop(0)
            engine.add_request(f"s{i}", ids, params, adapter)
        for out in engine.step():
            outs[int(out.request_id[1:])].extend(out.new_token_ids)
        holders = Counter(b for req in engine.scheduler.running for b in req.block_table)
        for block, n in holders.items():
            assert engine.block_manager.refcount(block) == n, f"block {block}"
        shared_seen |= any(n > 1 for n in holders.values())
        step += 1
    return [outs[i] for i in range(len(jobs))], shared_seen


def test_eviction_and_preemption_with_shared_prefixes(tiny_llama_path, adapters):
    """A KV cache of 20 blocks for requests of ~14 blocks that share 9: cached blocks are evicted
    for room, requests sharing a prefix are preempted and readmitted, outputs equal cache-off."""
    jobs = [(PROMPTS[i], None) for i in range(4)] + [(tokens(70 + i, 30), "a") for i in range(3)]
    jobs += [(PROMPTS[i], "a") for i in range(3)] + [(PROMPTS[i], None) for i in range(2)]
    on = engine_for(tiny_llama_path, adapters, max_total_tokens=80)
    outs, shared = staggered_checked(on, jobs, new=16, every=3)
    stats = on.stats()
    assert shared, "no two running requests held one block; the test proves nothing"
    assert on.scheduler.num_preemptions > 0 and stats.prefix_cache_evictions > 0
    assert sum(stats.prefix_cache_hit_tokens.values()) > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    off = engine_for(tiny_llama_path, adapters, max_total_tokens=80, cache=False)
    assert outs == staggered(off, jobs, new=16, every=3)


def test_block_manager_lru_eviction_and_refcounts():
    bm = BlockManager(6, 4, prefix_cache=True)
    a, b = [], []
    bm.allocate(a, 12)  # 3 blocks
    for i, block in enumerate(a):
        bm.register(bytes([i]), block)
    hit = bm.match([bytes([0]), bytes([1]), bytes([9])])
    assert hit == a[:2]
    bm.reuse(b, hit)  # b shares a's first two blocks
    assert [bm.refcount(x) for x in a] == [2, 2, 1]
    bm.free(a)
    assert [bm.refcount(x) for x in b] == [1, 1] and bm.num_free_blocks == 4  # a's tail: evictable
    # three never-cached blocks go first, then the evictable one; b's blocks are never taken
    c = []
    bm.allocate(c, 16)
    assert bm.num_evictions == 1 and set(c).isdisjoint(b)
    assert bm.match([bytes([0]), bytes([1]), bytes([2])]) == b  # the evicted third block is gone
    with pytest.raises(RuntimeError):
        bm.allocate(c, 20)
    bm.free(b)
    d = []
    bm.allocate(d, 4)  # LRU among evictable: b's tail block (freed first) before its head
    assert d == [hit[1]] and bm.match([bytes([0]), bytes([1])]) == [hit[0]]
    bm.reset_prefix_cache(False)
    assert bm.match([bytes([0])]) == [] and bm.num_cached_blocks == 0 and bm.num_free_blocks == 5 - len(c)


@pytest.mark.slow
def test_smollm2_cache_on_equals_off(smollm2_path, adapter_factory):
    adapters = {"s": adapter_factory(smollm2_path, "pc-smol", r=8, target_modules=TARGETS, seed=5)}
    tok_system = tokens(3, 70)
    jobs = [(tok_system + tokens(80 + i, 6), [None, "s"][i % 2]) for i in range(4)]
    kw = dict(chunked_prefill_size=32, max_num_batched_tokens=64, page_size=16)
    on = engine_for(smollm2_path, adapters, **kw)
    outs = staggered(on, jobs, every=6)
    assert on.stats().prefix_cache_hit_tokens == {"": 64, "s": 64}
    assert outs == staggered(engine_for(smollm2_path, adapters, cache=False, **kw), jobs, every=6)


def test_prometheus_series_follow_the_engine(tiny_llama_path, adapters):
    from loraplex.services.inference.metrics import Metrics

    engine = engine_for(tiny_llama_path, adapters, max_total_tokens=64)
    metrics = Metrics()
    jobs = [(PROMPTS[0], "a"), (PROMPTS[1], "a"), (PROMPTS[2], None), (PROMPTS[3], None)]
    one_by_one(engine, jobs[:2])
    metrics.observe_engine(engine.stats())
    one_by_one(engine, jobs[2:])
    metrics.observe_engine(engine.stats())
    value = metrics.registry.get_sample_value
    assert value("loraplex_prefix_cache_enabled") == 1
    assert value("loraplex_prefix_cache_hit_tokens_total", {"adapter": "a"}) == 36
    assert value("loraplex_prefix_cache_hit_tokens_total", {"adapter": "base"}) == 36
    assert value("loraplex_prefix_cache_prompt_tokens_total", {"adapter": "a"}) == len(PROMPTS[0]) + len(
        PROMPTS[1]
    )
    assert value("loraplex_prefix_cache_evictions_total") == engine.stats().prefix_cache_evictions > 0
    assert value("loraplex_prefix_cache_blocks") == engine.stats().prefix_cache_blocks > 0
    off = Metrics()
    off.observe_engine(engine_for(tiny_llama_path, None, cache=False).stats())
    assert off.registry.get_sample_value("loraplex_prefix_cache_enabled") == 0


def test_disable_prefix_cache_flag():
    from loraplex.services.inference.server_flags import parse_args

    assert not parse_args(["--model-path", "m", "--device", "cpu"]).engine.disable_prefix_cache
    args = parse_args(["--model-path", "m", "--device", "cpu", "--disable-prefix-cache"])
    assert args.engine.disable_prefix_cache


def test_base_model_digest_names_the_checkpoint_and_dtype(tiny_llama_path, tiny_qwen2_path):
    from loraplex.services.inference.engine.prefix_cache import base_model_digest

    d = base_model_digest(tiny_llama_path, "torch.float32")
    assert d.startswith("base:") and d == base_model_digest(tiny_llama_path, "torch.float32")
    assert d != base_model_digest(tiny_llama_path, "torch.bfloat16")
    assert d != base_model_digest(tiny_qwen2_path, "torch.float32")


def test_tensor_parallel_reuses_cached_prefixes(tiny_llama_path, adapters):
    """`--tp-size 2` (gloo, a spawned worker): the cache decisions are rank 0's and travel in the
    block tables; outputs equal one device without the cache."""
    from tests.integration.test_tp import run_batch, tp_args
    from tests.support.lora_reference import async_engine

    def run(tp: int, cache: bool):
        engine = async_engine(
            tp_args(tiny_llama_path, tp, {"a": adapters["a"]}, page_size=PAGE, disable_prefix_cache=not cache)
        )
        try:
            outs = run_batch(engine, [(PROMPTS[0], None), (PROMPTS[1], "a")], NEW)
            outs += run_batch(engine, [(PROMPTS[2], None), (PROMPTS[3], "a")], NEW)
            return outs, engine.stats().prefix_cache_hit_tokens
        finally:
            asyncio.run(engine.shutdown())

    got, hits = run(2, True)
    assert hits == {"": 36, "a": 36}
    assert got == run(1, False)[0]


def _prompt_logprobs_run(engine, ids, adapter, k=2):
    """One request asking prompt log probabilities, to completion: (prompt log probs, final output)."""
    engine.add_request("plp", ids, SamplingParams(max_new_tokens=2, prompt_logprobs=k), adapter)
    got, final = None, None
    while final is None:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got = out.prompt_logprobs
            if out.finished:
                final = out
    return got, final


@pytest.mark.parametrize("adapter", [None, "a"])
def test_prompt_logprobs_complete_with_the_cache(tiny_llama_path, adapters, adapter):
    """With the cache warm on the very prompt (and on a longer one), a request asking prompt log
    probabilities still gets one per prompt token after the first, equal to the cache-off values;
    a request not asking reuses the cache and reports it in cached_prompt_tokens."""
    ids = PROMPTS[0]
    off = engine_for(tiny_llama_path, {"a": adapters["a"]}, cache=False)
    want, final_off = _prompt_logprobs_run(off, ids, adapter)
    assert final_off.cached_prompt_tokens == 0
    on = engine_for(tiny_llama_path, {"a": adapters["a"]}, cache=True)
    one_by_one(on, [(ids + tokens(99, 6), adapter), (ids, adapter)])  # the prompt's blocks are cached
    assert on.stats().prefix_cache_hit_tokens.get(adapter or "", 0) > 0
    for _ in range(2):  # the second run finds this request's own blocks cached too
        got, final = _prompt_logprobs_run(on, ids, adapter)
        assert [lp.token_id for lp in got] == ids[1:]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-5)
        assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in want]
        assert final.cached_prompt_tokens == 0  # computed, not reused
    on.add_request("plain", ids, SamplingParams(max_new_tokens=1), adapter)
    final = next(o for _ in range(50) for o in on.step() if o.finished)
    assert final.cached_prompt_tokens == (len(ids) - 1) // PAGE * PAGE
