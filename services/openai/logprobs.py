"""Log probabilities in OpenAI's shapes, built from each token's raw bytes (TokenLogprob.token_bytes).

A token that holds part of a UTF-8 character (an emoji's byte-level pieces, a `<0xF0>` byte
fallback) has no text of its own: its `token` string is its bytes escaped (`\\xf0\\x9f`, prefixed
`bytes:` in the legacy completions shape, as OpenAI writes them), `bytes` are the real bytes, and
`text_offset` counts the characters the bytes before it decode to. So different ids never share a
`top_logprobs` key unless their bytes are equal (then the more likely one is kept: a JSON object
cannot hold both).
"""

from __future__ import annotations

import codecs
from typing import Any


def raw(lp) -> bytes:
    """A TokenLogprob's (or TopLogprob's) bytes; a server without token_bytes gives its text's."""
    return lp.token_bytes or lp.token.encode()


def _escaped(b: bytes) -> str:
    """Printable ASCII as itself, every other byte as `\\xNN`."""
    return "".join(chr(x) if 0x20 <= x < 0x7F and x != 0x5C else f"\\x{x:02x}" for x in b)


def token_text(b: bytes, legacy: bool = False) -> str:
    """The token's text, or its escaped bytes when they are not whole UTF-8 characters."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return ("bytes:" if legacy else "") + _escaped(b)


class TextOffsets:
    """Character offsets of consecutive tokens in the text their bytes decode to."""

    def __init__(self, start: int = 0):
        self.at = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, b: bytes) -> int:
        """The offset of the token with bytes `b` (the characters completed before it)."""
        here = self.at
        self.at += len(self._decoder.decode(b))
        return here


def name(lp, legacy: bool = False, ids: bool = False) -> str:
    """A token's name in an answer: its text, or vLLM's `token_id:N` (return_tokens_as_token_ids)."""
    return f"token_id:{lp.token_id}" if ids else token_text(raw(lp), legacy)


def _top_dict(top, k: int | None, ids: bool = False) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in list(top)[:k] if k is not None else top:
        out.setdefault(name(t, True, ids), t.logprob)  # most likely first: keep it
    return out


def legacy(
    lps,
    offsets: TextOffsets,
    k: int | None = None,
    *,
    first_prompt_token: bytes | None = None,
    ids: bool = False,
) -> dict[str, list]:
    """The completions `logprobs` object's lists for `lps` (at most `k` alternatives each);
    `first_prompt_token` (echo) leads with the prompt's first token, which has no log probability
    (null, as OpenAI gives it)."""
    tokens, values, tops, text_offset = [], [], [], []
    if first_prompt_token is not None:
        tokens.append(token_text(first_prompt_token, legacy=True))
        values.append(None)
        tops.append(None)
        text_offset.append(offsets.add(first_prompt_token))
    for lp in lps:
        b = raw(lp)
        tokens.append(name(lp, True, ids))
        values.append(lp.logprob)
        tops.append(_top_dict(lp.top, k, ids))
        text_offset.append(offsets.add(b))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": text_offset}


def completion_logprobs(lps, offset: int = 0, k: int | None = None, ids: bool = False) -> dict[str, Any]:
    """The legacy completions `logprobs` object for generated tokens starting at character `offset`."""
    return legacy(lps, TextOffsets(offset), k, ids=ids)


def chat_logprobs(lps, k: int | None = None, ids: bool = False) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": name(lp, ids=ids),
                "logprob": lp.logprob,
                "bytes": list(raw(lp)),
                "top_logprobs": [
                    {"token": name(t, ids=ids), "logprob": t.logprob, "bytes": list(raw(t))}
                    for t in list(lp.top)[:k]
                ],
            }
            for lp in lps
        ]
    }


def prompt_logprobs(lps, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map from token id
    to {logprob, rank (1 = most likely; when known), decoded_token}: the prompt's own token and the
    `k` most likely."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in lps:
        entry: dict[str, dict[str, Any]] = {}
        ranks = {t.token_id: r for r, t in enumerate(lp.top, 1)}
        entry[str(lp.token_id)] = {
            "logprob": lp.logprob,
            "rank": ranks.get(lp.token_id),
            "decoded_token": token_text(raw(lp)),
        }
        for r, t in enumerate(list(lp.top)[:k], 1):
            entry.setdefault(
                str(t.token_id), {"logprob": t.logprob, "rank": r, "decoded_token": token_text(raw(t))}
            )
        out.append(entry)
    return out
