"""The start-up warm-up never builds a step with more sequences than the runner holds."""

import pytest
import torch

from loraplex.services.inference.engine.warmup import warm_up_steps


@pytest.mark.parametrize("max_num_seqs", [2, 5, 17, 65])
@pytest.mark.parametrize("num_slots", [0, 8, 24])
def test_warm_up_steps_fit_max_num_seqs(max_num_seqs: int, num_slots: int) -> None:
    steps = warm_up_steps(2048, max_num_seqs, num_slots, 8, 4096, 16, torch.device("cpu"))
    assert steps
    assert max(len(chunks) for chunks in steps) <= max_num_seqs
    assert max(sum(len(c.token_ids) for c in chunks) for chunks in steps) <= 2048


def test_compiles_count_as_stalls_only_between_engine_builds() -> None:
    from loraplex.kernels.compile_watch import CompileCounter

    counter = CompileCounter()
    counter._hook(fn=None)  # start-up of the first engine
    counter.mark_serving()
    counter._hook(fn=None)  # a stall while serving
    counter.mark_starting()  # a second engine is built in the same process (the benchmarks)
    counter._hook(fn=None)
    counter.mark_serving()
    assert (counter.total, counter.after_start) == (3, 1)
