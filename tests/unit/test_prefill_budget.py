"""The decode prefill budget: while decodes run, a step takes at most `decode_prefill_budget` prefill
tokens (so their steps stay short); with no decode running, the full chunk."""

from __future__ import annotations

from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.config import SchedulerConfig
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.scheduler import Scheduler
from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.lora.adapter_slots import NoAdapters


def run_steps(decode_budget: int, steps: int) -> list[list[int]]:
    config = SchedulerConfig(4, 64, 16, 8, context_length=4096, decode_prefill_budget=decode_budget)
    scheduler = Scheduler(config, BlockManager(200, 4), NoAdapters())
    scheduler.add(Request("short", [1] * 3, SamplingParams(max_new_tokens=50)))
    scheduler.add(Request("long", [1] * 60, SamplingParams(max_new_tokens=5)))
    chunks = []
    for _ in range(steps):
        batch = scheduler.schedule()
        chunks.append([n for _, n in batch.entries])
        for req, n in batch.entries:
            sample = req.num_computed_tokens + n == len(req.token_ids)
            req.num_computed_tokens += n
            if sample:
                req.token_ids.append(7)
    return chunks


def test_chunks_shrink_while_decodes_run():
    # Both prompts share the 16-token chunk budget of the first step (no decode is running yet).
    assert run_steps(0, 4) == [[3, 13], [1, 16], [1, 16], [1, 15]]
    # Then, beside the running decode, 5 prefill tokens a step.
    assert run_steps(5, 4) == [[3, 13], [1, 5], [1, 5], [1, 5]]
    config = SchedulerConfig(4, 64, 16, 8, context_length=4096, decode_prefill_budget=40)
    assert config.prefill_budget_for(True) == 16 and config.prefill_budget_for(False) == 16
