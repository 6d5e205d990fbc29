"""A request's streamed text: detokenized output, stop-string cutting, and hold-back.

Text that could still turn out to be the start of a stop string is held back (at most the
longest stop string's length minus one characters), so what was streamed never has to be
taken back when a stop string completes.
"""

from __future__ import annotations

from loraplex.services.inference.engine.detokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(
        self, tokenizer, stop: tuple[str, ...], skip_special_tokens: bool = True, include_stop: bool = False
    ):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.include_stop = include_stop  # a matched stop string stays in the text
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # the output text so far, cut before a matched stop string
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string matched

    def add_token(self, token_id: int) -> bool:
        """Feed one generated token; True when a stop string completed."""
        return self._append(self.detokenizer.add(token_id))

    def finish(self) -> None:
        """Flush what the detokenizer held back (e.g. a final incomplete character)."""
        if not self.stopped:
            self._append(self.detokenizer.finish())

    def take(self, finished: bool) -> str:
        """New text to hand out now."""
        end = len(self.text) if finished or self.stopped else max(self.sent, len(self.text) - self.holdback)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _append(self, delta: str) -> bool:
        if not delta or self.stopped:
            return False
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [(i, len(s)) for i, s in ((self.text.find(s, search_from), s) for s in self.stop) if i >= 0]
        if hits:
            at, length = min(hits)
            self.text = self.text[: at + length if self.include_stop else at]
            self.stopped = True
        return self.stopped
