"""Scheduler invariants under random workloads (no model: the engine's bookkeeping is simulated).

Each simulated step does what LLMEngine.step does to requests: computed tokens advance by the
scheduled chunk, and a chunk reaching the end of a sequence appends one new token.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.config import SchedulerConfig
from loraplex.services.inference.engine.request import Request, RequestStatus
from loraplex.services.inference.engine.scheduled_batch import ScheduledBatch
from loraplex.services.inference.engine.scheduler import Scheduler
from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.lora.adapter_slots import NoAdapters


def make_scheduler(num_blocks: int, page: int = 4, budget: int = 32, chunk: int = 8, max_running: int = 4):
    config = SchedulerConfig(page, budget, chunk, max_running, context_length=4096)
    return Scheduler(config, BlockManager(num_blocks, page), NoAdapters())


def advance(scheduler: Scheduler, batch: ScheduledBatch) -> list[Request]:
    done = []
    for req, n in batch.entries:
        sample = req.num_computed_tokens + n == len(req.token_ids)
        req.num_computed_tokens += n
        if sample:
            req.token_ids.append(7)
            if req.num_output_tokens >= req.max_new_tokens:
                scheduler.finish(req, "length")
                done.append(req)
    return done


def check_invariants(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    cfg = scheduler.config
    assert batch.num_tokens <= cfg.max_num_batched_tokens
    assert sum(n for _, n in batch.entries if n > 1) <= cfg.prefill_budget
    assert len(scheduler.running) <= cfg.max_running_requests
    owned = [b for r in scheduler.running for b in r.block_table]
    assert len(owned) == len(set(owned))  # no block in two tables
    assert len(owned) + scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    for req, n in batch.entries:
        assert req.status is RequestStatus.RUNNING
        assert len(req.block_table) * cfg.page_size >= req.num_computed_tokens + n  # KV room for the chunk
    singles = [n == 1 for _, n in batch.entries]
    assert singles == sorted(singles, reverse=True)  # decodes first


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    new_tokens=st.integers(1, 20),
    num_blocks=st.integers(16, 40),
    arrivals=st.lists(st.integers(0, 6), min_size=12, max_size=12),
)
def test_random_workloads_finish_within_limits(prompts, new_tokens, num_blocks, arrivals):
    scheduler = make_scheduler(num_blocks)
    pending = [
        (arrivals[i], Request(f"r{i}", [1] * n, SamplingParams(max_new_tokens=new_tokens)))
        for i, n in enumerate(prompts)
    ]
    finished: list[Request] = []
    for step in range(2000):
        for at, req in [p for p in pending if p[0] <= step]:
            scheduler.add(req)  # requests join between steps
            pending.remove((at, req))
        batch = scheduler.schedule()
        finished += batch.finished
        check_invariants(scheduler, batch)
        finished += advance(scheduler, batch)
        if not pending and not scheduler.has_work():
            break
    assert len(finished) == len(prompts)
    capacity = num_blocks * 4
    for req in finished:
        if req.finish_reason == "length" and req.num_output_tokens < new_tokens:
            assert len(req.token_ids) >= capacity - 4  # cut only when one sequence filled the cache
        else:
            assert req.num_output_tokens == new_tokens
    assert scheduler.blocks.num_free_blocks == num_blocks


def test_latest_admitted_is_preempted_and_recomputed():
    scheduler = make_scheduler(num_blocks=6, page=4, budget=64, chunk=64)
    reqs = [Request(f"r{i}", [1] * 8, SamplingParams(max_new_tokens=20)) for i in range(3)]
    for r in reqs:
        scheduler.add(r)
    batch = scheduler.schedule()  # 3 x 2 blocks: the cache is full
    assert [n for _, n in batch.entries] == [8, 8, 8]
    advance(scheduler, batch)
    batch = scheduler.schedule()  # each decode needs a 3rd block: r2 goes back to waiting
    assert [r.request_id for r, _ in batch.entries] == ["r0", "r1"]
    assert reqs[2].status is RequestStatus.WAITING and reqs[2].num_computed_tokens == 0
    assert reqs[2].block_table == [] and scheduler.num_preemptions == 1
    assert scheduler.waiting[0] is reqs[2]  # first in line when room comes back


def test_request_cap_and_budget_hold_back_new_requests():
    scheduler = make_scheduler(num_blocks=64, budget=10, chunk=6, max_running=2)
    for i in range(3):
        scheduler.add(Request(f"r{i}", [1] * 9, SamplingParams(max_new_tokens=3)))
    batch = scheduler.schedule()
    assert [(r.request_id, n) for r, n in batch.entries] == [("r0", 6)]  # prefill budget 6
    advance(scheduler, batch)
    batch = scheduler.schedule()
    assert [(r.request_id, n) for r, n in batch.entries] == [("r0", 3), ("r1", 3)]
    advance(scheduler, batch)
    batch = scheduler.schedule()  # r0 decodes, r1 continues; r2 waits for the cap of 2
    assert [(r.request_id, n) for r, n in batch.entries] == [("r0", 1), ("r1", 6)]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_kv_cache_sizing():
    import torch

    from loraplex.services.inference.engine.kv_cache import (
        CPU_KV_BYTES_CAP,
        kv_bytes_per_token,
        plan_num_blocks,
    )
    from loraplex.services.inference.models.config import parse_config

    cfg = parse_config(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
         "vocab_size": 100, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "max_position_embeddings": 8192}
    )  # fmt: skip
    per_token = kv_bytes_per_token(cfg, torch.float32)
    assert per_token == 30 * 2 * 3 * 64 * 4
    cpu = torch.device("cpu")
    common = dict(page_size=16, context_length=8192, mem_fraction_static=0.9)
    forced = plan_num_blocks(cfg, torch.float32, cpu, max_running_requests=8, max_total_tokens=1000, **common)
    assert forced == 1000 // 16
    one = plan_num_blocks(cfg, torch.float32, cpu, max_running_requests=1, max_total_tokens=None, **common)
    assert one * 16 == 8192  # one request at full context
    big = plan_num_blocks(cfg, torch.float32, cpu, max_running_requests=256, max_total_tokens=None, **common)
    assert big * 16 * per_token <= CPU_KV_BYTES_CAP and big * 16 >= 8192


def test_finish_keeps_an_error_set_before_it():
    """`req.error = ...; finish(req, "abort")` must not return the request as a success: finish
    used to reset the error to None (a grammar dead end came back OK, issue 59 M1)."""
    from loraplex.services.inference.errors import InvalidRequest

    scheduler = make_scheduler(16)
    first, second = (Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=4)) for rid in ("a", "b"))
    for req in (first, second):
        scheduler.add(req)
    error = InvalidRequest("why")
    first.error = error
    scheduler.finish(first, "abort")
    scheduler.finish(second, "abort", error)
    assert first.error is error and second.error is error
    assert first.finished and second.finished
