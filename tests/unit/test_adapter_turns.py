"""`--max-loras-per-batch` as turns (engine/adapter_turns.py): the scheduler and the real LoRA
manager together, on a pool sized apart from the cap.

Pinned here: no step computes more than K distinct adapters; the hot adapters compute every step
while they have requests, and the batch holds K adapters whenever K have requests; a cold
adapter's request is admitted within the stated bound while hot adapters keep the batch full;
base requests never wait; adapters left out of a step stay resident (no re-upload); and greedy
outputs equal PEFT's when requests sit out steps.
"""

from __future__ import annotations

import pytest
import torch

from services.inference.engine.adapter_turns import AdapterTurns, DemandSlices
from services.inference.engine.block_manager import BlockManager
from services.inference.engine.config import SchedulerConfig
from services.inference.engine.request import Request, RequestStatus
from services.inference.engine.scheduler import Scheduler
from services.inference.engine.types import SamplingParams
from services.inference.lora.manager import LoRAManager
from services.inference.lora.pool import AdapterPool
from services.inference.lora.shapes import ALL_MODULES, ModelShapes
from tests.support.lora_reference import make_adapters, peft_greedy, server_args, sync_engine
from tests.unit.test_engine_scheduler import advance

HOT = ["h0", "h1"]
COLD = [f"c{i}" for i in range(6)]
CAP = 4  # 2 hot places + 2 turn places


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, adapter_factory):
    return {
        n: adapter_factory(tiny_llama_path, f"turns-{n}", r=4, target_modules=["q_proj"], seed=i)
        for i, n in enumerate([*HOT, *COLD])
    }


def make(tiny_llama_path, adapters, *, cap=CAP, slots=16):
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
        max_num_batched_tokens=512,
        chunked_prefill_size=512,
        max_running_requests=256,
        context_length=1024,
    )
    return Scheduler(config, BlockManager(2048, 4), manager), manager


def req(rid: str, adapter: str | None, new_tokens: int = 4) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=new_tokens), adapter)


def step_adapters(batch) -> set[str]:
    return {r.adapter for r, _ in batch.entries if r.adapter is not None}


def test_cold_request_admitted_within_the_bound_while_hot_adapters_keep_the_batch_full(
    tiny_llama_path, adapters
):
    scheduler, manager = make(tiny_llama_path, adapters)
    turns = scheduler.adapter_turns
    assert isinstance(turns, AdapterTurns) and (turns.hot_places, turns.turn_places) == (2, 2)
    late = COLD[-1]
    arrival, admitted_at, bound = 10, None, None
    for step in range(80):
        for name in HOT:  # a new request every step: the hot adapters always have work
            scheduler.add(req(f"{name}-{step}", name, 6))
        if step % 3 == 0:
            for name in COLD[:-1]:  # five cold adapters that always have work too
                scheduler.add(req(f"{name}-{step}", name, 12))
        if step == arrival:
            cold = req("late", late, 6)
            scheduler.add(cold)
        batch = scheduler.schedule()
        ran = step_adapters(batch)
        assert len(ran) <= CAP, f"step {step}: {len(ran)} distinct adapters"
        assert set(HOT) <= ran, f"step {step}: a hot adapter sat out"
        if step >= 2:
            assert len(ran) == CAP, f"step {step}: places left empty while adapters had requests"
        if step == arrival:
            # the late adapter's place in the turn queue: everyone queued or holding a turn is ahead
            bound = turns.wait_bound_steps(len(turns.queue) + len(turns.turns))
        if admitted_at is None and step >= arrival and cold.status is RequestStatus.RUNNING:
            admitted_at = step
        advance(scheduler, batch)
    assert bound is not None and admitted_at is not None
    assert admitted_at - arrival <= bound, (admitted_at - arrival, bound)
    assert admitted_at - arrival > 0, "every turn place was taken: the late adapter had to wait"
    # Left out of steps, never out of the pool: each adapter was uploaded once.
    assert manager.num_uploads == len(HOT) + len(COLD)
    assert sum(i.evictions for i in manager.list_adapters()) == 0


def test_a_turn_admits_the_adapters_whole_queue_and_base_never_waits(tiny_llama_path, adapters):
    scheduler, _ = make(tiny_llama_path, adapters, cap=2)  # 1 hot place, 1 turn place
    for step in range(30):
        scheduler.add(req(f"h0-{step}", "h0", 8))
        if step == 0:
            for name in COLD:
                for i in range(3):
                    scheduler.add(req(f"{name}-{i}", name, 8))
        base = req(f"base-{step}", None)
        scheduler.add(base)
        batch = scheduler.schedule()
        assert base in [r for r, _ in batch.entries], f"step {step}: a base request waited"
        for name in step_adapters(batch) - {"h0"}:
            # the turn holder's three queued requests were admitted together
            assert sum(r.adapter == name for r in scheduler.running) == 3 or not any(
                r.adapter == name for r in scheduler.waiting
            )
        advance(scheduler, batch)
    assert not any(r.adapter in COLD for r in scheduler.waiting), "every cold adapter got a turn"


def test_policies_never_exceed_the_cap_and_serve_everyone():
    for policy in (AdapterTurns(3), AdapterTurns(1), DemandSlices(3)):
        served: set[str] = set()
        waiting = [req(f"r{i}", f"a{i % 7}") for i in range(40)] + [req("b", None)]
        for _ in range(40):
            chosen = policy.select([], waiting)
            assert len(chosen) <= policy.cap
            served |= chosen
        assert served == {f"a{i}" for i in range(7)}, type(policy).__name__


@pytest.mark.parametrize("cap", [1, 2])
def test_greedy_outputs_match_peft_when_requests_sit_out_steps(
    tiny_llama_path, adapter_factory, cap, one_torch_thread
):
    adapters = make_adapters(adapter_factory, tiny_llama_path, "e2e-tiny")
    engine = sync_engine(server_args(tiny_llama_path, adapters, max_loras_per_batch=cap, max_gpu_loras=None))
    engine.scheduler.adapter_turns.quantum = 1  # a new holder every step: the most pausing
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
