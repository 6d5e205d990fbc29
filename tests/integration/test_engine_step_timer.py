"""LLMEngine.step_timer: every phase of every step is reported, in order, with what it returned, and
setting it changes no output (with and without overlap scheduling)."""

from __future__ import annotations

import time

import pytest
import torch

from loraplex.services.inference.engine.scheduled_batch import ScheduledBatch
from loraplex.services.inference.engine.step_loop import STEP_PHASES
from loraplex.services.inference.engine.types import SamplingParams
from tests.integration.test_engine_overlap import make_engine


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [2, 4, 6], [7, 7, 7, 7, 7]]


def drive(engine, timer=None) -> tuple[list[list], list[list[tuple]]]:
    """Each step's outputs and each step's (phase, started, result) reports."""
    engine.step_timer = timer
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    outputs, reports = [], []
    while engine.has_unfinished():
        before = time.perf_counter()
        outputs.append(engine.step())
        reports.append([r for r in (timer.calls if timer else []) if r[1] >= before])
    return outputs, reports


class Recorder:
    def __init__(self):
        self.calls: list[tuple[str, float, object]] = []

    def __call__(self, phase: str, started: float, result: object) -> None:
        assert time.perf_counter() >= started
        self.calls.append((phase, started, result))


@pytest.mark.parametrize("overlap", [False, True])
def test_phases_reported_in_order_and_outputs_unchanged(tiny_llama_path, overlap):
    plain, _ = drive(make_engine(tiny_llama_path, overlap))
    timer = Recorder()
    timed, reports = drive(make_engine(tiny_llama_path, overlap), timer)

    def summary(steps):
        return [[(o.request_id, o.new_token_ids, o.finish_reason) for o in step] for step in steps]

    assert summary(timed) == summary(plain)
    assert {phase for phase, _, _ in timer.calls} == set(STEP_PHASES)
    for step_outputs, step_reports in zip(timed, reports, strict=True):
        phases = [p for p, _, _ in step_reports]
        assert phases.count("schedule") == 1
        starts = [s for _, s, _ in step_reports]
        assert starts == sorted(starts)
        results = {p: r for p, _, r in step_reports}
        batch = results["schedule"]
        assert isinstance(batch, ScheduledBatch)
        if batch.entries:
            assert isinstance(results["forward"], torch.Tensor)
        if "sample" in results:  # one token per row of the logits
            assert results["sample"][0].shape[0] == results["forward"].shape[0] >= 1
        if not overlap and "output" in results:  # without overlap a step's outputs are its output phase's
            emitted = [o for o in step_outputs if o.new_token_ids]
            assert [o.request_id for o in results["output"]] == [o.request_id for o in emitted]
        if overlap and {"sample", "output"} <= set(phases):
            # The previous step's tokens are processed while this step's forward runs on the device.
            assert phases.index("sample") < phases.index("output")
