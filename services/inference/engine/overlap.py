"""Overlap scheduling: the host processes step N's outputs while the device runs step N+1.

`LLMEngine.step` with overlap on: schedule step N+1 assuming every running request goes on,
launch it, and only then read step N's sampled tokens (stop checks, detokenization, outputs).
Each request sampled at step N gets a placeholder id `-1 - row` appended to its token ids; the
model runner replaces it on the device with row `row` of step N's sampled ids, so no token
crosses to the host before step N+1 is queued. A request found finished at step N simply has
its step N+1 row dropped (its KV blocks are freed at once: later writes to them are queued
after step N+1 on the same stream).

Placeholders never reach anything that reads token values on the host: steps that could
preempt (and so recompute a placeholder), or that sample with a penalty (which reads the
output ids), resolve the in-flight step first.
"""

from __future__ import annotations

import torch

from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.logprobs import StepLogprobs
from loraplex.services.inference.engine.request import Request


class InFlightStep:
    """A launched step's sampled tokens (and log probabilities, when asked), still on the device,
    and where they go; with them, which rows' logits held a NaN or Inf (`nonfinite`, copied to the
    host in the same copy as the ids)."""

    def __init__(
        self,
        requests: list[Request],
        tokens: torch.Tensor,
        logprobs: StepLogprobs | None = None,
        nonfinite: torch.Tensor | None = None,
    ):
        self.requests = requests
        self.logprobs = logprobs
        self.positions = [len(req.token_ids) for req in requests]  # each placeholder's index
        for row, req in enumerate(requests):
            req.token_ids.append(-1 - row)
        self.device_tokens = tokens
        flags = torch.zeros_like(tokens) if nonfinite is None else nonfinite.to(tokens.dtype)
        both = torch.stack((tokens, flags))  # row 0 the ids, row 1 the non-finite flags
        if tokens.is_cuda:
            self._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self._host.copy_(both, non_blocking=True)
            self._ready: torch.cuda.Event | None = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = both, None

    def host_tokens(self) -> list[int]:
        """The sampled ids (waits for the step's sampling, not for anything queued after it)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host[0].tolist()

    def host_nonfinite(self) -> list[bool]:
        """Per row: its logits held a NaN or Inf (waits as `host_tokens`)."""
        if self._ready is not None:
            self._ready.synchronize()
        return [bool(b) for b in self._host[1].tolist()]


def kv_fits_without_preemption(running: list[Request], blocks: BlockManager) -> bool:
    """True when the free blocks cover every running request's uncomputed tokens, so the next
    schedule cannot preempt (or end for lack of KV) a request that holds a placeholder."""
    page = blocks.page_size
    need = 0
    for req in running:
        need += max(0, -(-len(req.token_ids) // page) - len(req.block_table))
    return need <= blocks.num_free_blocks


def fill_placeholders(input_ids: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """Replace, in place and on the device, each id `-1 - i` with `prev_tokens[i]` (no host sync)."""
    rows = (-1 - input_ids).clamp_(min=0)  # real ids map to row 0, then are kept by the where
    input_ids.copy_(torch.where(input_ids < 0, prev_tokens[rows], input_ids))


def strip_placeholders(req: Request) -> None:
    """Drop unresolved placeholders (always at the end) from a request that has ended."""
    ids = req.token_ids
    while len(ids) > len(req.prompt_ids) and ids[-1] < 0:
        ids.pop()
