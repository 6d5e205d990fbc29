"""Each token's raw bytes, for log probabilities: a token that holds part of a UTF-8 character
(byte-level BPE pieces of an emoji, SentencePiece's `<0xF0>` byte fallback) decodes alone to
U+FFFD, which loses what it was; its bytes do not. Concatenated in order, the tokens' bytes are
the text's bytes (what OpenAI's `bytes` promise)."""

from __future__ import annotations

import re
from functools import lru_cache

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


@lru_cache(maxsize=1)
def _byte_level_decoding() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable character table (byte-level BPE vocabularies)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:  # printable bytes stand for themselves, the rest for 256, 257, ...
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_kind(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ if decoder is not None else ""


class TokenBytes:
    """Token id -> its bytes for one tokenizer; memoized (a vocabulary is read at most once)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = _decoder_kind(tokenizer) == "ByteLevel"
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._compute(token_id)
        return got

    def _compute(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id in self.special or not isinstance(piece, str):
            return self.tokenizer.decode([token_id]).encode()
        if self.byte_level:
            table = _byte_level_decoding()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if _SPIECE_SPACE in piece:  # SentencePiece: the word-start marker is a space
            return piece.replace(_SPIECE_SPACE, " ").encode()
        return self.tokenizer.decode([token_id]).encode()
