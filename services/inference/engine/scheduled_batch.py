"""What the scheduler hands the step: the requests it picked and how many tokens each computes
(`ScheduledBatch`), and per request the plain data the model runner needs (`SeqChunk`).

Its own module so that the runners (model_runner.py, draft_runner.py, warmup.py, the benchmarks)
depend on the plan's shape, not on the scheduler that makes it.
"""

from __future__ import annotations

from typing import NamedTuple

from loraplex.services.inference.engine.request import Request


class SeqChunk(NamedTuple):
    """What the model runner needs of one scheduled request (plain data, no request object)."""

    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of token_ids[0]; tokens before it are already in the KV cache
    block_table: list[int]
    lora_slot: int
    sample: bool  # the chunk reaches the end of the sequence: sample the next token
    all_logits: bool = False  # also return every token's logits (prompt log probabilities)
    # Speculative verification: token_ids ends with the request's draft tokens, and every token's
    # logits are sampled rows (engine/speculative_verify.py).
    verify: bool = False


class ScheduledEntry(NamedTuple):
    request: Request
    num_tokens: int

    @property
    def sample(self) -> bool:
        # `>`: a verify chunk runs past the sequence's end into the draft tokens
        return self.request.num_computed_tokens + self.num_tokens >= len(self.request.token_ids)


class ScheduledBatch(NamedTuple):
    entries: list[ScheduledEntry]  # single-token entries (decodes) first
    finished: list[Request]  # requests that ended while scheduling (errors, cache too small)

    def chunks(self) -> list[SeqChunk]:
        out = []
        for req, n in self.entries:
            start = req.num_computed_tokens
            ids = req.token_ids[start : start + n]
            verify = len(ids) < n  # the rest are draft tokens
            if verify:
                ids = ids + req.draft_ids[: n - len(ids)]
            sample = start + n >= len(req.token_ids)
            all_logits = req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1
            out.append(SeqChunk(ids, start, req.block_table, req.lora_slot, sample, all_logits, verify))
        return out

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)
