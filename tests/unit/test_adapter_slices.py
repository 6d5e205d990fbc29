"""`--max-loras-per-batch` as demand-weighted time slices (engine/adapter_slices.py): the scheduler
and the real LoRA manager together, on a pool sized apart from the cap.

Pinned here: no step computes more than K distinct adapters, and K whenever K have requests (the
batch stays full); hot adapters (at least 1/K of the requests) compute every step; a cold
adapter's request is admitted within the stated bound while hot adapters keep the batch full; a
chosen adapter's whole queue is admitted at once; base requests never wait; adapters left out of
a step stay resident (no re-upload); and greedy outputs equal PEFT's when requests sit out steps.
"""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.services.inference.engine.adapter_slices import DemandSlices, adapter_work
from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.config import SchedulerConfig
from loraplex.services.inference.engine.request import Request, RequestStatus
from loraplex.services.inference.engine.scheduler import Scheduler
from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.lora.manager import LoRAManager
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes
from tests.support.lora_reference import make_adapters, peft_greedy, server_args, sync_engine
from tests.unit.test_engine_scheduler import advance

HOT = ["h0", "h1"]
COLD = [f"c{i}" for i in range(6)]
CAP = 4


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, adapter_factory):
    return {
        n: adapter_factory(tiny_llama_path, f"turns-{n}", r=4, target_modules=["q_proj"], seed=i)
        for i, n in enumerate([*HOT, *COLD])
    }


def make(tiny_llama_path, adapters, *, cap=CAP, slots=16, max_running=512):
    pool = AdapterPool(
        ModelShapes.from_model_dir(tiny_llama_path),
        slots=slots,
        max_rank=4,
        target_modules=ALL_MODULES,
        dtype=torch.float32,
        device="cpu",
    )
    manager = LoRAManager(pool, max_loras_per_batch=cap)
    for name, path in adapters.items():
        manager.load_adapter(name, path)
    config = SchedulerConfig(
        page_size=4,
        max_num_batched_tokens=1024,
        chunked_prefill_size=1024,
        max_running_requests=max_running,
        context_length=1024,
    )
    return Scheduler(config, BlockManager(4096, 4), manager), manager


def req(rid: str, adapter: str | None, new_tokens: int = 4) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=new_tokens), adapter)


def step_adapters(batch) -> set[str]:
    return {r.adapter for r, _ in batch.entries if r.adapter is not None}


@pytest.mark.parametrize("max_wait", [3, 32])
def test_cold_request_admitted_within_the_bound_while_hot_adapters_keep_the_batch_full(
    tiny_llama_path, adapters, max_wait
):
    scheduler, manager = make(tiny_llama_path, adapters)
    policy = scheduler.adapter_slices
    assert isinstance(policy, DemandSlices)
    policy.max_wait = max_wait
    late = COLD[-1]
    arrival, admitted_at, bound, hot_steps = 30, None, None, 0
    for step in range(90):
        for i in range(4):  # h0: four new requests a step, the most demand by far
            scheduler.add(req(f"h0-{step}-{i}", "h0", 6))
        scheduler.add(req(f"h1-{step}", "h1", 6))
        if step % 2 == 0:
            for name in COLD[:-1]:  # five cold adapters that always have work too
                scheduler.add(req(f"{name}-{step}", name, 12))
        if step == arrival:
            cold = req("late", late, 6)
            scheduler.add(cold)
            work = adapter_work(scheduler.running, scheduler.waiting)
            bound = policy.wait_bound_steps(len(work))
        work = adapter_work(scheduler.running, scheduler.waiting)
        batch = scheduler.schedule()
        ran = step_adapters(batch)
        assert len(ran) == min(CAP, len(work)), f"step {step}: {len(ran)} adapters of {len(work)} with work"
        hot = DemandSlices.hot(work, CAP)
        assert set(hot) <= ran, f"step {step}: a hot adapter sat out"
        hot_steps += "h0" in hot
        if admitted_at is None and step >= arrival and cold.status is RequestStatus.RUNNING:
            admitted_at = step
        advance(scheduler, batch)
    assert hot_steps >= 45, "h0 was meant to hold 1/K of the requests: the check above proved little"
    assert bound is not None and admitted_at is not None
    assert admitted_at - arrival <= bound, (admitted_at - arrival, bound)
    # Left out of steps, never out of the pool: each adapter was uploaded once.
    assert manager.num_uploads == len(HOT) + len(COLD)
    assert sum(i.evictions for i in manager.list_adapters()) == 0


def test_every_adapter_waits_within_the_bound_under_random_load():
    rng = random.Random(7)
    for cap in (1, 2, 3, 8):
        policy = DemandSlices(cap, max_wait=4)
        running: list[Request] = []
        started: dict[str, tuple[int, int]] = {}  # adapter -> (step it started waiting, its bound)
        for step in range(400):
            for _ in range(rng.randint(0, 3)):  # Zipf-ish: a0 most popular
                running.append(req(f"r{step}-{rng.random()}", f"a{min(int(rng.paretovariate(1)) - 1, 11)}"))
            work = adapter_work(running, [])
            for name in work:
                started.setdefault(name, (step, policy.wait_bound_steps(len(work))))
            chosen = policy.select(running, [])
            assert len(chosen) == min(cap, len(work))
            assert set(DemandSlices.hot(work, cap)) <= chosen
            for name in chosen:
                since, bound = started.pop(name)
                assert step - since <= bound, (cap, name, step - since, bound)
            # each chosen adapter finishes one request per step
            for name in chosen:
                running.remove(next(r for r in running if r.adapter == name))
            for name in set(started) - set(adapter_work(running, [])):
                started.pop(name)


def test_a_chosen_adapters_whole_queue_is_admitted_and_base_never_waits(tiny_llama_path, adapters):
    scheduler, _ = make(tiny_llama_path, adapters, cap=2)
    for step in range(40):
        scheduler.add(req(f"h0-{step}", "h0", 8))
        if step == 0:
            for name in COLD:
                for i in range(3):
                    scheduler.add(req(f"{name}-{i}", name, 8))
        base = req(f"base-{step}", None)
        scheduler.add(base)
        batch = scheduler.schedule()
        assert base in [r for r, _ in batch.entries], f"step {step}: a base request waited"
        for name in step_adapters(batch):
            left = [r.request_id for r in scheduler.waiting if r.adapter == name]
            assert not left, f"step {step}: {name} computed but left {left} queued"
        advance(scheduler, batch)
    assert not any(r.adapter in COLD for r in scheduler.waiting), "every cold adapter got a place"


def test_requests_sitting_a_step_out_leave_their_place_in_the_batch(tiny_llama_path, adapters):
    """--max-running-requests bounds the requests computing in a step: paused ones hold KV only."""
    scheduler, _ = make(tiny_llama_path, adapters, cap=1, max_running=4)
    for i in range(3):
        scheduler.add(req(f"h0-{i}", "h0", 50))
    advance(scheduler, scheduler.schedule())
    for i in range(3):
        scheduler.add(req(f"c0-{i}", "c0", 50))
    batch = scheduler.schedule()  # c0 starts at the lowest pass: h0's three sit this step out
    assert step_adapters(batch) == {"c0"}
    assert sorted(r.request_id for r, n in batch.entries if n > 1) == ["c0-0", "c0-1", "c0-2"]
    assert len(scheduler.running) == 6 > scheduler.config.max_running_requests


@pytest.mark.parametrize("cap", [1, 2])
def test_greedy_outputs_match_peft_when_requests_sit_out_steps(
    tiny_llama_path, adapter_factory, cap, one_torch_thread
):
    adapters = make_adapters(adapter_factory, tiny_llama_path, "e2e-tiny")
    engine = sync_engine(server_args(tiny_llama_path, adapters, max_loras_per_batch=cap, max_gpu_loras=None))
    engine.scheduler.adapter_slices.max_wait = 2  # aging overrides demand often: the most pausing
    names = [None, "r4", "r8rs", "r16", "r64", "r4", "r16", None, "r64", "r8rs"]
    prompts = [engine.tokenizer(p).input_ids for p in ["The capital of France is", "def f(n):", "1, 2, 3,"]]
    jobs = [(prompts[i % len(prompts)], a) for i, a in enumerate(names)]
    seen: list[int] = []
    step = engine.scheduler.schedule

    def counted():
        batch = step()
        seen.append(len(step_adapters(batch)))
        return batch

    engine.scheduler.schedule = counted
    outs = engine.generate([p for p, _ in jobs], SamplingParams(max_new_tokens=12), [a for _, a in jobs])
    expected = peft_greedy(tiny_llama_path, adapters, jobs, new_tokens=12)
    for out, exp, (_, name) in zip(outs, expected, jobs, strict=True):
        assert out.token_ids == exp, f"adapter {name}: engine {out.token_ids} != PEFT {exp}"
    assert max(seen) == cap
    assert engine.adapter_slots.num_uploads == len(adapters)  # resident throughout


def test_fairness_metrics_queue_time_by_popularity_decile_and_swaps():
    from loraplex.services.inference.lora.adapter_slots import AdapterInfo
    from loraplex.services.inference.metrics import Metrics

    metrics = Metrics()
    for i in range(20):  # adapter k gets 20 - k requests: a0 the most popular
        for k in range(20 - i):
            metrics.observe_queue_time(f"a{k}", 0.002)
    value = metrics.registry.get_sample_value

    def decile_sum(d):
        return value("loraplex_adapter_queue_seconds_sum", {"popularity_decile": d}) or 0.0

    before = {d: decile_sum(d) for d in ("0", "9")}
    metrics.observe_queue_time("a0", 3.0)  # the most requested adapter: decile 0
    metrics.observe_queue_time("a19", 7.0)  # the least requested of 20: decile 9
    metrics.observe_queue_time("", 0.001)  # base
    assert decile_sum("0") - before["0"] == pytest.approx(3.0)
    assert decile_sum("9") - before["9"] == pytest.approx(7.0)
    assert value("loraplex_adapter_queue_seconds_count", {"popularity_decile": "base"}) == 1

    def info(name, evictions, uploads):
        return AdapterInfo(name, 4, 8.0, ["q_proj"], "gpu", evictions=evictions, uploads=uploads)

    metrics.observe_adapters([info("a", 2, 3), info("b", 0, 1)])
    metrics.observe_adapters([info("a", 5, 6), info("b", 1, 2)])
    metrics.observe_adapters([info("b", 1, 2)])  # "a" unloaded: its swaps stay counted
    assert value("loraplex_lora_swaps_total") == 6 and value("loraplex_lora_uploads_total") == 8
