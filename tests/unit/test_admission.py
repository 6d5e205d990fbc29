"""Admission with many adapters on few slots: the scheduler and the real LoRA manager together.

The scheduler keeps the batch full of resident adapters' and base requests while other adapters
wait for a slot; a waiting adapter gets one within the manager's stated bound; base requests are
never held back; and greedy outputs (engine on the tiny model) equal PEFT's whether slots rotate
at every step or never drain.
"""

from __future__ import annotations

import pytest
import torch

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
from tests.unit.test_lora_manager import StepClock

COLD = [f"c{i}" for i in range(6)]


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, adapter_factory):
    names = ["h0", "h1", *COLD]
    return {
        n: adapter_factory(tiny_llama_path, f"adm-{n}", r=4, target_modules=["q_proj"], seed=i)
        for i, n in enumerate(names)
    }


def make(tiny_llama_path, adapters, *, slots=2, slot_wait_s=1.0, max_running=64):
    clock = StepClock()
    pool = AdapterPool(
        ModelShapes.from_model_dir(tiny_llama_path),
        slots=slots,
        max_rank=4,
        target_modules=ALL_MODULES,
        dtype=torch.float32,
        device="cpu",
    )
    manager = LoRAManager(pool, slot_wait_s=slot_wait_s, clock=clock)
    for name, path in adapters.items():
        manager.load_adapter(name, path)
    config = SchedulerConfig(
        page_size=4,
        max_num_batched_tokens=256,
        chunked_prefill_size=256,
        max_running_requests=max_running,
        context_length=1024,
    )
    return Scheduler(config, BlockManager(512, 4), manager), manager, clock


def req(rid: str, adapter: str | None, new_tokens: int = 4) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=new_tokens), adapter)


def test_resident_adapters_and_base_keep_being_admitted_behind_waiting_ones(tiny_llama_path, adapters):
    scheduler, manager, clock = make(tiny_llama_path, adapters)
    for r in (req("h0-first", "h0", 50), req("h1-first", "h1", 50)):
        scheduler.add(r)
    advance(scheduler, scheduler.schedule())  # h0 and h1 take both slots and keep running
    # the queue's head: six cold adapters with no slot, then hot adapters' and base requests
    for name in COLD:
        scheduler.add(req(f"{name}-0", name))
    later = [req(f"h{i % 2}-{i}", f"h{i % 2}") for i in range(10)] + [
        req(f"base-{i}", None) for i in range(4)
    ]
    for r in later:
        scheduler.add(r)
    batch = scheduler.schedule()
    admitted = {r.request_id for r, n in batch.entries if n > 1}
    assert admitted == {r.request_id for r in later}
    assert len(scheduler.running) == 2 + len(later) > manager.slots_total()
    assert [r.adapter for r in scheduler.waiting] == COLD  # in their order, still first in line
    assert set(manager.slot_queue()) == set(COLD)


def test_base_requests_are_never_held_back_by_slots(tiny_llama_path, adapters):
    scheduler, manager, clock = make(tiny_llama_path, adapters, slot_wait_s=0.0)
    for name in ("h0", "h1"):
        scheduler.add(req(f"{name}-long", name, 40))
    advance(scheduler, scheduler.schedule())
    for step in range(20):
        clock.now = step * 0.1
        for name in COLD:  # every slot is busy or draining for these the whole time
            scheduler.add(req(f"{name}-{step}", name))
        base = req(f"base-{step}", None)
        scheduler.add(base)
        batch = scheduler.schedule()
        assert base in [r for r, _ in batch.entries], f"step {step}: a base request waited"
        advance(scheduler, batch)


def test_waiting_adapter_gets_a_slot_within_the_bound(tiny_llama_path, adapters):
    """Two hot adapters get a new request every step; a cold one arriving at step 5 is admitted
    within slot_wait_s (3 steps) + one step + the drained slot's longest running request."""
    step_s, wait_s, new_tokens = 0.1, 0.3, 6
    scheduler, manager, clock = make(tiny_llama_path, adapters, slot_wait_s=wait_s)
    admitted_at = None
    started = {"h0": 0, "h1": 0}
    for step in range(60):
        clock.now = step * step_s
        for name in ("h0", "h1"):
            scheduler.add(req(f"{name}-{step}", name, new_tokens))
        if step == 5:
            cold = req("cold", "c0", new_tokens)
            scheduler.add(cold)
        batch = scheduler.schedule()
        for r, n in batch.entries:
            if n > 1 and r.adapter in started:
                started[r.adapter] += 1
        if step >= 5 and admitted_at is None and cold.status is RequestStatus.RUNNING:
            admitted_at = step
        advance(scheduler, batch)
    # each request runs 1 prefill step + new_tokens - 1 decode steps
    assert admitted_at is not None and admitted_at - 5 <= round(wait_s / step_s) + 1 + new_tokens, admitted_at
    assert min(started.values()) >= 40, started  # the hot adapters kept admitting meanwhile
    assert admitted_at - 5 > round(wait_s / step_s), "the hot slots were busy: the cold one had to wait"


@pytest.mark.parametrize("slot_wait_s", [0.0, 1e9], ids=["rotate-every-step", "never-drain"])
def test_greedy_outputs_match_peft_under_slot_rotation(
    tiny_llama_path, adapter_factory, slot_wait_s, one_torch_thread
):
    adapters = make_adapters(adapter_factory, tiny_llama_path, "e2e-tiny")
    engine = sync_engine(server_args(tiny_llama_path, adapters, max_loras_per_batch=None, max_gpu_loras=2))
    engine.adapter_slots.slot_wait_s = slot_wait_s
    names = [None, "r4", "r8rs", "r16", "r64", "r4", "r16", None, "r64", "r8rs"]
    prompts = [engine.tokenizer(p).input_ids for p in ["The capital of France is", "def f(n):", "1, 2, 3,"]]
    jobs = [(prompts[i % len(prompts)], a) for i, a in enumerate(names)]
    outs = engine.generate([p for p, _ in jobs], SamplingParams(max_new_tokens=12), [a for _, a in jobs])
    expected = peft_greedy(tiny_llama_path, adapters, jobs, new_tokens=12)
    for out, exp, (_, name) in zip(outs, expected, jobs, strict=True):
        assert out.token_ids == exp, f"adapter {name}: engine {out.token_ids} != PEFT {exp}"
    assert engine.adapter_slots.num_uploads >= 4  # four adapters rotated through two slots


# ----- residency: the pool is sized from memory; --max-loras-per-batch never sizes it -----


def test_pool_sized_from_memory_whatever_the_per_batch_cap(tiny_llama_path):
    from loraplex.services.inference.lora.settings import DEFAULT_MAX_GPU_LORAS
    from tests.support.lora_reference import lora_settings

    shapes, cpu = ModelShapes.from_model_dir(tiny_llama_path), torch.device("cpu")
    flags = dict(max_loras_per_batch=None, max_gpu_loras=None)
    default = lora_settings(server_args(tiny_llama_path, **flags), shapes, cpu)
    assert default.pool_slots == DEFAULT_MAX_GPU_LORAS["cpu"] == default.distinct_per_batch
    assert default.max_loras_per_batch is None
    bounded = lora_settings(server_args(tiny_llama_path, **dict(flags, max_gpu_loras=5)), shapes, cpu)
    assert (bounded.pool_slots, bounded.distinct_per_batch) == (5, 5)
    capped = lora_settings(
        server_args(tiny_llama_path, max_loras_per_batch=3, max_gpu_loras=None), shapes, cpu
    )
    assert (capped.pool_slots, capped.max_loras_per_batch) == (DEFAULT_MAX_GPU_LORAS["cpu"], 3)
    assert capped.distinct_per_batch == 3
    over = lora_settings(server_args(tiny_llama_path, max_loras_per_batch=8, max_gpu_loras=5), shapes, cpu)
    assert (over.pool_slots, over.distinct_per_batch) == (5, 5)
    with pytest.raises(ValueError, match="--max-gpu-loras"):
        lora_settings(server_args(tiny_llama_path, **dict(flags, max_gpu_loras=0)), shapes, cpu)


def test_default_flags_put_every_adapter_in_one_batch(
    tiny_llama_path, adapter_factory, one_torch_thread, caplog
):
    """20 adapters, default flags: all resident at once, one continuous batch, outputs equal PEFT's."""
    adapters = {
        f"m{i}": adapter_factory(
            tiny_llama_path, f"adm-many-{i}", r=4, target_modules=["q_proj", "v_proj"], seed=100 + i
        )
        for i in range(20)
    }
    with caplog.at_level("INFO", logger="loraplex.services.inference.lora.setup"):
        engine = sync_engine(
            server_args(tiny_llama_path, adapters, max_loras_per_batch=None, max_gpu_loras=None)
        )
    assert "sized from memory" in caplog.text
    names = [None, *adapters]
    prompt = engine.tokenizer("The capital of France is").input_ids
    outs = engine.generate([prompt] * len(names), SamplingParams(max_new_tokens=6), names)
    assert engine.adapter_slots.num_uploads == len(adapters) and engine.stats().lora_slots_used == len(
        adapters
    )
    expected = peft_greedy(tiny_llama_path, adapters, [(prompt, n) for n in names], new_tokens=6)
    assert [o.token_ids for o in outs] == expected


def test_metrics_show_queues_waits_and_uploads(tiny_llama_path, adapters):
    from loraplex.services.inference.metrics import Metrics

    scheduler, manager, clock = make(tiny_llama_path, adapters, slot_wait_s=0.5)
    for r in (req("h0-a", "h0", 50), req("h1-a", "h1", 50)):
        scheduler.add(r)
    advance(scheduler, scheduler.schedule())
    for i in range(3):
        scheduler.add(req(f"c0-{i}", "c0"))
    clock.now = 0.1
    scheduler.schedule()  # c0 queues for a slot
    clock.now = 2.0
    scheduler.schedule()  # aged: one busy slot drains for it
    metrics = Metrics()
    metrics.observe_engine(scheduler_stats := _stats(scheduler, manager))
    metrics.observe_adapters(manager.list_adapters())
    metrics.observe_residency(manager.list_adapters(), [], {}, scheduler_stats.lora_slots_total)
    value = metrics.registry.get_sample_value
    assert value("loraplex_adapter_queued_requests", {"replica": metrics.replica, "adapter": "c0"}) == 3
    assert value("loraplex_adapter_slot_wait_seconds", {"adapter": "c0"}) == pytest.approx(1.9)
    assert value("loraplex_adapter_uploads_total", {"adapter": "h0"}) == 1
    assert value("loraplex_lora_slots_draining") == 1 == scheduler_stats.lora_slots_draining
    assert value("loraplex_lora_adapters_waiting") == 1


def _stats(scheduler, manager):
    from loraplex.services.inference.engine.types import EngineStats

    return EngineStats(
        len(scheduler.waiting),
        len(scheduler.running),
        0,
        0,
        manager.slots_total(),
        manager.slots_used(),
        manager.slots_draining(),
        len(manager.slot_queue()),
    )
