"""Constrained decoding: mask a request's logits each step by its compiled grammar.

The grammar engine is xgrammar (docs/architecture.md says why: its per-token mask is ~30x
cheaper than llguidance's on this tokenizer, and both compile a schema in milliseconds).
engine/grammar_cache.py compiles a request's Constraint (off the engine thread, cached).

- `GrammarState` is one request's matcher: it accepts each output token exactly once (under overlap
  scheduling a token is accepted when the next step's mask needs it, before its output is processed)
  and fills that request's row of the next token bitmask.
- `mask_logits` applies the bitmasks of the constrained rows on the logits' device; a batch without
  constrained rows never calls it.

JSON is compiled without free whitespace (`any_whitespace=False`: "," and ":" are followed by one
space, nothing else): a small model that may emit spaces keeps emitting them and ends on "length".
A request may ask for free whitespace (`Constraint.any_whitespace`, vLLM's
`disable_any_whitespace: false`).
"""

from __future__ import annotations

import torch

from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.errors import InvalidRequest


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0  # output tokens accepted so far

    def accept(self, index: int, token: int) -> bool:
        """Accept output token number `index` (0-based) unless it already was; False if the grammar
        rejects it (the mask makes that impossible for a sampled token)."""
        if index < self.num_accepted:
            return True
        if self._matcher.is_terminated():
            return False
        ok = self._matcher.accept_token(token)
        if ok:
            self.num_accepted += 1
        return ok

    def dead_end_error(self, params: SamplingParams, produced: int, vocab_size: int) -> InvalidRequest | None:
        """Why this grammar rejected the token sampled after `produced` accepted tokens: the mask
        allowed nothing, or allowed only stop tokens that min_tokens banned (None: neither)."""
        constraint = params.constraint
        if not self._matcher.is_terminated():
            bitmask = allocate_bitmask(1, vocab_size, pin=False)
            self._matcher.fill_next_token_bitmask(bitmask, 0)
            if not bool(bitmask.any()):
                return InvalidRequest(
                    f"{constraint.field} admits no output after {produced} tokens (no token can "
                    "continue it: a rule that only refers to itself, or an empty alternative)",
                    field=constraint.field,
                )
            if self._matcher.is_completed() and produced < params.min_tokens:
                return InvalidRequest(
                    f"sampling_params.min_tokens is {params.min_tokens}, but {constraint.field} "
                    f"ends after {produced} tokens; lower min_tokens or widen the constraint",
                    field="sampling_params.min_tokens",
                )
        return None

    @property
    def terminated(self) -> bool:
        """The grammar ended and a stop token (EOS) was accepted."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)


def allocate_bitmask(rows: int, vocab_size: int, pin: bool) -> torch.Tensor:
    """int32 [rows, ceil(vocab/32)], every bit set (= every token allowed)."""
    words = (vocab_size + 31) // 32
    return torch.full((rows, words), -1, dtype=torch.int32, pin_memory=pin)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def mask_logits(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` [B, V] whose `rows` have -inf where `bitmask` (host, one row per entry of
    `rows`) has a 0 bit. Copies and unpacks on the logits' device with no host sync."""
    device, vocab = logits.device, logits.shape[1]
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, dtype=torch.int64, pin_memory=bitmask.is_pinned()).to(
        device, non_blocking=True
    )
    picked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, picked)
