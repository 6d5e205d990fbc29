"""Log probabilities of a step's chosen tokens and their most likely alternatives.

Computed on the device right after sampling, only for the rows that asked, from the model's
raw logits (log_softmax before penalties, temperature and filtering: what the model thinks,
as OpenAI and vLLM report it). The host reads them when it reads the step's token ids, so a
step with log probabilities adds no sync of its own, and a step without them adds nothing.
Prompt tokens' log probabilities come from the extra logits rows of prefill chunks that asked
(`SeqChunk.all_logits`), read at once (only such steps pay that sync).
"""

from __future__ import annotations

import torch

from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.types import TokenLogprob


class StepLogprobs:
    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], tops: list[int]):
        """`rows`: indices into the step's sampled rows that want log probabilities; `tops`: how many
        alternatives each wants."""
        self.rows, self.tops = rows, tops
        device = logits.device
        index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        lp = logits.index_select(0, index).float().log_softmax(dim=-1)
        chosen = lp.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
        k = max(tops)
        if k:
            top = lp.topk(k, dim=-1)
            values, ids = top.values, top.indices
        else:
            values = torch.empty(len(rows), 0, device=device)
            ids = torch.empty(len(rows), 0, dtype=torch.int64, device=device)
        self._tensors = [chosen, values, ids]
        if device.type == "cuda":  # copied behind the sampling on the same stream, read after its event
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self._tensors]
            for h, t in zip(host, self._tensors, strict=True):
                h.copy_(t, non_blocking=True)
            self._tensors = host

    def per_row(self, tokens: list[int]) -> dict[int, TokenLogprob]:
        """Row -> the chosen token's log probability and alternatives (after the step's tokens are
        on the host: `tokens` are the step's sampled ids)."""
        chosen, values, ids = (t.tolist() for t in self._tensors)
        return {
            row: TokenLogprob(tokens[row], chosen[i], list(zip(ids[i][:k], values[i][:k], strict=True)))
            for i, (row, k) in enumerate(zip(self.rows, self.tops, strict=True))
        }


def rows_logprobs(step: StepLogprobs | None, tokens: list[int]) -> list[TokenLogprob | None] | None:
    """Per sampled row: its token's log probabilities, or None where the request did not ask."""
    if step is None:
        return None
    by_row = step.per_row(tokens)
    return [by_row.get(i) for i in range(len(tokens))]


def record_prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> None:
    """Append to `req.prompt_logprobs` the prompt tokens these rows predict (row i, at position
    start + i, predicts token start + i + 1) that it does not have yet (a recompute after
    preemption predicts them again)."""
    first = max(start, len(req.prompt_logprobs))  # the position predicting the next missing token
    last = min(start + logits.shape[0], req.num_prompt_tokens - 1)
    if first >= last:
        return
    lp = logits[first - start : last - start].float().log_softmax(dim=-1)
    targets = req.prompt_ids[first + 1 : last + 1]
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
    k = req.params.prompt_logprobs
    top_ids, top_values = [[]] * len(targets), [[]] * len(targets)
    if k:
        top = lp.topk(k, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    req.prompt_logprobs.extend(
        TokenLogprob(t, c, list(zip(i, v, strict=True)))
        for t, c, i, v in zip(targets, chosen, top_ids, top_values, strict=True)
    )


def take_prompt_logprobs(entries, chunks, logits: torch.Tensor, num_sampled: int) -> torch.Tensor:
    """The sampled rows of `logits`; the rows after them (chunks with `all_logits`) become their
    requests' prompt log probabilities. Reads them on the host at once: only steps that prefill a
    prompt asking for them pay that sync."""
    if logits.shape[0] == num_sampled:
        return logits
    at = num_sampled
    for (req, n), chunk in zip(entries, chunks, strict=True):
        if chunk.all_logits:
            record_prompt_logprobs(req, chunk.start_pos, logits[at : at + n])
            at += n
    return logits[:num_sampled]
