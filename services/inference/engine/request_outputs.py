"""OutputProcessor: the requests' side of a step, from the forward's logits to RequestOutputs.

LLMEngine decides what runs and the model runner computes it; this module holds what only the
requests know: each one's sampling settings, grammar and text stream. It samples a step's tokens
with the inputs built from them (engine/request_sampling.py) and, once the tokens are on the
host, runs the stop checks and detokenization and ends the requests whose token finished them.
The engine times and orders these calls (overlap scheduling processes step N's tokens during
step N+1: engine/overlap.py).
"""

from __future__ import annotations

import logging
import time

import torch

from loraplex.services.inference.engine.logprobs import StepLogprobs
from loraplex.services.inference.engine.output import TextStream
from loraplex.services.inference.engine.overlap import strip_placeholders
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.request_sampling import needs_history, sampling_inputs
from loraplex.services.inference.engine.sampler import SamplingInputs, nonfinite_rows, sample_on_device
from loraplex.services.inference.engine.scheduler import Scheduler
from loraplex.services.inference.engine.types import RequestOutput, TokenLogprob
from loraplex.services.inference.errors import BackendUnavailable, NonFiniteLogits

log = logging.getLogger(__name__)


def _timing(req: Request) -> tuple[float, float, int]:
    """RequestOutput's queue_time, time_to_first_token and cached_prompt_tokens for `req`."""
    queued = req.first_scheduled_time - req.arrival_time if req.first_scheduled_time is not None else 0.0
    first = req.first_token_time - req.arrival_time if req.first_token_time is not None else 0.0
    return queued, first, req.num_cached_prompt_tokens


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one (the last one's state, every token, all the text)."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    logprobs = None if last.logprobs is None else [lp for o in outs for lp in o.logprobs or []]
    return last._replace(
        new_text="".join(o.new_text for o in outs),
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        logprobs=logprobs,
        prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None),
    )


class OutputProcessor:
    """The live requests' host state, and what a step does with it before and after sampling.

    Contract (one engine thread; not thread-safe):
    - `add(req)` when the engine queues a request; it is then in `requests` until its final output.
    - `sample` gives one step's tokens for `reqs`, one row each, in order (after the grammar mask,
      request_sampling.mask_constrained, when a request is constrained).
    - `process` turns one step's host tokens into one RequestOutput per request; a token that ends
      its request (stop token or string, grammar end, length) finishes it in `scheduler` and its
      output is the final one.
    - `final_output` is the final output of a request already finished in `scheduler` (aborted,
      or ended by the scheduler itself). Each request gets exactly one final output: it then
      leaves `requests`, and `errors` keeps why it failed, if it did, for the caller to pop.
    """

    def __init__(self, tokenizer, eos_token_ids: frozenset[int], vocab_size: int, scheduler: Scheduler):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.scheduler = scheduler
        self.requests: dict[str, Request] = {}
        self.errors: dict[str, Exception] = {}  # why a request ended with "abort", when not a client abort
        self._streams: dict[str, TextStream] = {}
        # Counts of live requests that need a costlier step; at 0 the step skips that work.
        self.num_penalized = 0  # sampling reads their history (also: overlap resolves first)
        self.num_logprobs = 0  # they asked for log probabilities
        self.num_constrained = 0  # under a grammar: the step builds a token mask
        self.num_masking = 0  # logit_bias / allowed_token_ids / bad_words: sampling biases or masks rows

    def add(self, req: Request, tokenizer=None) -> None:
        """`tokenizer`: the request's adapter's own, for its text and stop strings (None: the base's)."""
        params = req.params
        self.requests[req.request_id] = req
        self._streams[req.request_id] = TextStream(
            tokenizer or self.tokenizer,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
        )
        if req.grammar is not None:
            self.num_constrained += 1
        if needs_history(params):
            self.num_penalized += 1
        if params.logprobs is not None:
            self.num_logprobs += 1
        if params.masks_tokens:
            self.num_masking += 1

    # -- sampling -------------------------------------------------------------------------

    def sample(
        self, logits: torch.Tensor, reqs: list[Request], masked: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, StepLogprobs | None, torch.Tensor]:
        """Token ids on the logits' device (no host sync for batches without penalties), drawn from
        `masked` (request_sampling.mask_constrained's result) when given, the log probabilities of
        the rows that asked for them (None when none did; they are the model's, before any grammar
        mask), and which rows' raw logits hold a NaN or Inf (bool, on the device: read with the ids)."""
        tokens = sample_on_device(masked if masked is not None else logits, self.sampling_inputs(reqs))
        nonfinite = nonfinite_rows(logits)
        if not self.num_logprobs:
            return tokens, None, nonfinite
        rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not rows:
            return tokens, None, nonfinite
        return tokens, StepLogprobs(logits, tokens, rows, [reqs[i].params.logprobs for i in rows]), nonfinite

    def sampling_inputs(self, reqs: list[Request]) -> SamplingInputs:
        """The sampling settings of `reqs`, one row each (engine/request_sampling.py)."""
        return sampling_inputs(
            reqs, self.eos_token_ids, self.vocab_size, self.num_penalized > 0, self.num_masking > 0
        )

    # -- after sampling ---------------------------------------------------------------------

    def process(
        self,
        reqs: list[Request],
        tokens: list[int],
        positions: list[int] | None = None,
        logprobs: list[TokenLogprob | None] | None = None,
        nonfinite: list[bool] | None = None,
    ) -> list[RequestOutput]:
        """Stop checks, detokenization and finishing for one step's sampled tokens. `positions`:
        where each token goes in its request's token_ids (overlap: over a placeholder); default: appended.
        `nonfinite`: the rows whose logits held a NaN or Inf: those requests end with an error instead."""
        where = positions if positions is not None else [None] * len(reqs)
        lps = logprobs if logprobs is not None else [None] * len(reqs)
        bad = nonfinite if nonfinite is not None else [False] * len(reqs)
        return [
            self._end_nonfinite(r, p) if b else self._append_token(r, t, p, lp)
            for r, t, p, lp, b in zip(reqs, tokens, where, lps, bad, strict=True)
        ]

    def _end_nonfinite(self, req: Request, position: int | None) -> RequestOutput:
        """End `req`, whose logits turned NaN or Inf, with NonFiniteLogits (INTERNAL) and a log line
        naming its adapter; its token (argmax over NaN: id 0) is never appended or returned."""
        index = (len(req.token_ids) if position is None else position) - req.num_prompt_tokens
        who = f"adapter {req.adapter!r}" if req.adapter else "the base model"
        log.error(
            "request %s (%s): non-finite logits (NaN or Inf) at output token %d; ending it with an "
            "error, the rest of its batch goes on",
            req.request_id,
            who,
            index,
        )
        error = NonFiniteLogits(
            f"the model's logits turned non-finite (NaN or Inf) at output token {index} ({who}); "
            "the request was ended",
            adapter=req.adapter,
        )
        self.scheduler.finish(req, "abort", error)
        return self.final_output(req, [])

    def process_run(
        self, req: Request, tokens: list[int], logprobs: list[TokenLogprob | None] | None = None
    ) -> RequestOutput:
        """Several tokens of one request from one step (a verified speculative run), appended one at
        a time with every stop check, as one output. Tokens after one that ends the request are dropped."""
        outs = []
        for j, token in enumerate(tokens):
            outs.append(self._append_token(req, token, None, logprobs[j] if logprobs else None))
            if outs[-1].finished:
                break
        return merge_outputs(outs)

    def _append_token(
        self, req: Request, token: int, position: int | None = None, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        if position is None:
            position = len(req.token_ids)
            req.token_ids.append(token)
        else:
            req.token_ids[position] = token
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        num_output_tokens = position + 1 - req.num_prompt_tokens
        logprobs = [logprob] if logprob is not None else None
        prompt_logprobs = None
        if num_output_tokens == 1 and req.params.prompt_logprobs is not None:
            prompt_logprobs = req.prompt_logprobs
        stream = self._streams[req.request_id]
        params = req.params
        reason = None
        if req.grammar is not None and not req.grammar.accept(num_output_tokens - 1, token):
            # The mask allowed no token (or min_tokens banned the only ones): an error, never OK.
            error = req.grammar.dead_end_error(params, num_output_tokens - 1, self.vocab_size)
            if error is None:  # the mask allows only tokens the grammar accepts: an engine defect
                error = BackendUnavailable(f"the grammar rejected sampled token {token} (an engine defect)")
            self.scheduler.finish(req, "abort", error)
            return self.final_output(req, [token], logprobs, prompt_logprobs)
        if (
            (req.grammar is not None and req.grammar.terminated)  # the grammar ended with its EOS
            or token in params.stop_token_ids
            or (not params.ignore_eos and token in self.eos_token_ids)
        ):
            reason = "stop"  # the stop token's id is returned, its text only when asked (as vLLM)
            if params.include_stop_str_in_output:
                stream.add_token(token)
        elif stream.add_token(token):
            reason = "stop"
        if reason is None and num_output_tokens >= req.max_new_tokens:
            reason = "length"
        if reason is None:
            return RequestOutput(
                req.request_id,
                stream.take(False),
                [token],
                False,
                None,
                req.num_prompt_tokens,
                num_output_tokens,
                logprobs,
                *_timing(req),
                prompt_logprobs=prompt_logprobs,
            )
        self.scheduler.finish(req, reason)
        return self.final_output(req, [token], logprobs, prompt_logprobs)

    def final_output(
        self,
        req: Request,
        new_tokens: list[int],
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        stream = self._streams.pop(req.request_id)
        self.requests.pop(req.request_id, None)
        strip_placeholders(req)  # overlap: the next step's token, sampled before the request ended
        if needs_history(req.params):
            self.num_penalized -= 1
        if req.params.logprobs is not None:
            self.num_logprobs -= 1
            logprobs = logprobs or []
        if req.grammar is not None:
            self.num_constrained -= 1
        if req.params.masks_tokens:
            self.num_masking -= 1
        if req.error is not None:
            self.errors[req.request_id] = req.error
        if req.finish_reason != "abort":
            stream.finish()
        text = stream.take(True) if req.finish_reason != "abort" else ""
        return RequestOutput(
            req.request_id,
            text,
            new_tokens,
            True,
            req.finish_reason,
            req.num_prompt_tokens,
            req.num_output_tokens,
            logprobs,
            *_timing(req),
            prompt_logprobs=prompt_logprobs,
        )
