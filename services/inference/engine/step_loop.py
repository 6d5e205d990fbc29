"""The step half of LLMEngine: one `step()` = schedule, forward, sample, update, emit outputs.

Three shapes of step: the plain one; with overlap scheduling (EngineConfig.overlap_schedule; on by
default on CUDA) a step launches its forward and sampling first and then processes the previous
step's tokens (stop checks, detokenization, outputs) while the device works, so outputs come one
step later (engine/overlap.py); a step with speculative verify chunks takes each drafting request's
accepted run (engine/speculative_verify.py), after a draft made on the host (engine/speculative.py).

`LLMEngine.step_timer` (None by default: then a step makes no extra clock reads) is told when each
phase of a step ends, so a benchmark can split a step's time without patching the engine.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from loraplex.services.inference.engine.logprobs import StepLogprobs, rows_logprobs, take_prompt_logprobs
from loraplex.services.inference.engine.model_runner import ModelRunner
from loraplex.services.inference.engine.overlap import InFlightStep, kv_fits_without_preemption
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.request_sampling import mask_constrained
from loraplex.services.inference.engine.sampler import read_sampled
from loraplex.services.inference.engine.speculative_verify import verify_step
from loraplex.services.inference.engine.types import RequestOutput

STEP_PHASES = ("schedule", "forward", "sample", "output")


class StepTimer(Protocol):
    """Called at the end of each phase of a step with its name (one of STEP_PHASES, or "mask"), the
    `time.perf_counter()` at its start and what it returned: schedule -> the ScheduledBatch, forward ->
    the logits, sample -> (device token ids, log probabilities), output -> the RequestOutputs of the
    sampled tokens; mask -> the masked logits (inside sample, on steps with constrained requests
    only). The device may still be working when forward and sample end (synchronize in the timer to
    attribute device time to them); with overlap scheduling a step's output phase processes the
    previous step's tokens."""

    def __call__(self, phase: str, started: float, result: object) -> None: ...


def _admitted(entries) -> None:
    """Stamp the requests scheduled for the first time (the end of their queue time)."""
    now = time.monotonic()
    for req, _ in entries:
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now


class StepLoop:
    """LLMEngine's steps. Reads the engine's parts (`scheduler`, `runner`, `output_processor`,
    `speculator`, `block_manager`, `config`, `requests`) on every step, so a test or a benchmark
    may swap one between steps; `_in_flight` is the overlapped step launched and not yet processed.
    Not thread-safe: AsyncEngine drives it from a single engine thread."""

    step_timer: StepTimer | None = None  # see StepTimer
    _in_flight: InFlightStep | None

    @property
    def _overlap(self) -> bool:
        # A runner wrapper (tensor parallelism's step broadcast) sends the chunks to worker ranks,
        # which cannot fill placeholders from this rank's sampled ids: overlap only with the plain runner.
        return self.config.overlap_enabled and isinstance(self.runner, ModelRunner)

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if self.speculator is not None and self.speculator.speculates(self.scheduler.running):
            # A draft needs every running request's tokens on the host: the in-flight step first.
            if self._in_flight is not None:
                pending, self._in_flight = self._in_flight, None
                outputs.extend(self._resolve(pending))
            self.speculator.draft(self.scheduler.running)
        elif self._overlap:
            return self._step_overlapped()
        batch = self._phase("schedule", self.scheduler.schedule)
        outputs.extend(self.output_processor.final_output(req, []) for req in batch.finished)
        if not batch.entries:
            return outputs
        _admitted(batch.entries)
        chunks = batch.chunks()
        logits = self._phase("forward", self.runner.forward, chunks)
        if any(c.verify for c in chunks):
            rows = sum(len(c.token_ids) if c.verify else 1 for c in chunks if c.sample)
            logits = take_prompt_logprobs(batch.entries, chunks, logits, rows)
            outputs.extend(verify_step(self, batch.entries, chunks, logits))
            return outputs
        sampled = [e.request for e in batch.entries if e.sample]
        logits = take_prompt_logprobs(batch.entries, chunks, logits, len(sampled))
        tokens, logprobs, nonfinite = [], None, None
        if sampled:
            device_tokens, step_logprobs, device_nonfinite = self._phase(
                "sample", self._sample, logits, sampled
            )
            tokens, nonfinite = read_sampled(device_tokens, device_nonfinite)
            logprobs = rows_logprobs(step_logprobs, tokens)
        for req, n in batch.entries:
            req.num_computed_tokens += n
        outputs.extend(
            self._phase("output", self.output_processor.process, sampled, tokens, None, logprobs, nonfinite)
        )
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        """Launch this step, then process the previous one's outputs (engine/overlap.py)."""
        outputs: list[RequestOutput] = []
        pending, self._in_flight = self._in_flight, None
        if pending is not None and (
            self.output_processor.num_penalized
            or not kv_fits_without_preemption(self.scheduler.running, self.block_manager)
        ):
            outputs.extend(self._resolve(pending))
            pending = None
        batch = self._phase("schedule", self.scheduler.schedule)
        outputs.extend(self.output_processor.final_output(req, []) for req in batch.finished)
        if batch.entries:
            _admitted(batch.entries)
            chunks = batch.chunks()
            logits = self._phase(
                "forward", self.runner.forward, chunks, pending.device_tokens if pending else None
            )
            sampled = [e.request for e in batch.entries if e.sample]
            logits = take_prompt_logprobs(batch.entries, chunks, logits, len(sampled))
            for req, n in batch.entries:
                req.num_computed_tokens += n
            if sampled:
                self._in_flight = InFlightStep(
                    sampled, *self._phase("sample", self._sample, logits, sampled, pending)
                )
        if pending is not None:
            outputs.extend(self._resolve(pending))
        return outputs

    def _resolve(self, step: InFlightStep) -> list[RequestOutput]:
        """An in-flight step's outputs; rows of requests that ended since (finished, aborted) are dropped."""
        tokens = step.host_tokens()
        nonfinite = step.host_nonfinite()
        logprobs = rows_logprobs(step.logprobs, tokens)
        requests = self.requests
        live = [i for i, req in enumerate(step.requests) if requests.get(req.request_id) is req]
        return self._phase(
            "output",
            self.output_processor.process,
            [step.requests[i] for i in live],
            [tokens[i] for i in live],
            [step.positions[i] for i in live],
            [logprobs[i] for i in live] if logprobs else None,
            [nonfinite[i] for i in live],
        )

    def _phase(self, phase: str, fn, *args):
        """`fn(*args)`, reported to the step timer when there is one."""
        if self.step_timer is None:
            return fn(*args)
        started = time.perf_counter()
        result = fn(*args)
        self.step_timer(phase, started, result)
        return result

    def _sample(
        self, logits: torch.Tensor, reqs: list[Request], pending: InFlightStep | None = None
    ) -> tuple[torch.Tensor, StepLogprobs | None, torch.Tensor]:
        """`output_processor.sample`, after the grammar mask (its own step-timer phase) when a request is
        constrained; `pending`: the overlapped step whose tokens that mask may need first."""
        masked = None
        if self.output_processor.num_constrained:
            masked = self._phase("mask", mask_constrained, logits, reqs, pending, self.requests)
        return self.output_processor.sample(logits, reqs, masked)
