"""How large a unary Generate reply can grow, checked before any engine work.

A unary reply is one message, so it must fit --max-message-bytes; GenerateStream sends each
token in its own message and has no such bound. The estimate is a floor: every token run to its
`max_new_tokens` (or the context's end) at one byte of text and the smallest log-probability
entries. A request whose floor is over the limit can only fail at the end, after all its compute,
so it is refused at once; one under it that still outgrows the limit (long tokens) is refused when
the reply is built. Both are INVALID_ARGUMENT: the same call fails the same way again.
"""

from __future__ import annotations

from functools import cache

from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.errors import InvalidRequest
from loraplex.v1 import inference_pb2 as pb

STREAM_HINT = "use GenerateStream (one message per token), or lower n, max_new_tokens or top_logprobs"


@cache
def _logprob_entry_bytes(top: int) -> int:
    """The smallest a position's log-probability entry is on the wire, with `top` alternatives."""
    alt = pb.TopLogprob(token_id=1, logprob=-1.0, token="a")
    entry = pb.TokenLogprob(token_id=1, logprob=-1.0, token="a", top=[alt] * top)
    return len(pb.Completion(logprobs=[entry]).SerializeToString())


def _floor_bytes(prompt_tokens: int, params: SamplingParams, context_length: int) -> int:
    new = params.max_new_tokens
    if context_length:
        new = min(new, max(0, context_length - prompt_tokens))
    size = 16 + 2 * new  # the completion's counts and reasons; per token: its id and a byte of text
    if params.logprobs is not None:
        size += new * _logprob_entry_bytes(params.logprobs)
    if params.prompt_logprobs is not None:
        size += max(0, prompt_tokens - 1) * _logprob_entry_bytes(params.prompt_logprobs)
    return size


def check_reply_floor(items, context_length: int, limit: int) -> None:
    """`items`: (prompt token count, SamplingParams) per completion of the call."""
    floor = sum(_floor_bytes(n, params, context_length) for n, params in items)
    if floor > limit:
        raise InvalidRequest(
            f"the reply would be at least {floor} bytes if every completion ran to max_new_tokens, over "
            f"the {limit}-byte message limit (--max-message-bytes): {STREAM_HINT}",
            field="sampling_params.max_new_tokens",
        )


def check_reply(reply: pb.GenerateResponse, limit: int) -> None:
    size = reply.ByteSize()
    if size > limit:
        raise InvalidRequest(
            f"the reply is {size} bytes, over the {limit}-byte message limit (--max-message-bytes): "
            f"{STREAM_HINT}",
            field="sampling_params.max_new_tokens",
        )
