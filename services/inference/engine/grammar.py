"""Constrained decoding: compile a request's Constraint once, then mask its logits each step.

The grammar engine is xgrammar (docs/architecture.md says why: its per-token mask is ~30x
cheaper than llguidance's on this tokenizer, and both compile a schema in milliseconds).

- `GrammarCache` compiles on its own worker threads, never on the engine thread, and keeps each
  compiled grammar by the digest of (tokenizer, constraint): a repeated schema costs nothing. A
  compile that outlasts `compile_timeout_s` is refused (the worker finishes in the background; the
  same grammar is then refused at once), so no request hangs on a pathological grammar.
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

import concurrent.futures
import hashlib
import json
import re
import threading
from collections import OrderedDict

import torch

from loraplex.services.inference.engine.types import Constraint
from loraplex.services.inference.errors import InvalidRequest

COMPILE_TIMEOUT_S = 10.0
CACHE_ENTRIES = 512  # compiled grammars kept (least recently used dropped first)
# "Any JSON object", written the way json_schema output is (", " and ": ", no other whitespace)
# and with numbers of at most 16 integer and 16 fraction digits: xgrammar's built-in JSON grammar
# lets a small model write digits for ever (seen on SmolLM2: "population": 2000000000...).
JSON_OBJECT_GRAMMAR = r"""root ::= object
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ( member ( ", " member )* )? "}"
member ::= string ": " value
array ::= "[" ( value ( ", " value )* )? "]"
string ::= "\"" char* "\""
char ::= [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )
number ::= "-"? int frac? exp?
int ::= "0" | [1-9] [0-9]{0,15}
frac ::= "." [0-9]{1,16}
exp ::= [eE] [+-]? [0-9]{1,3}
"""
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _parser_message(exc: Exception) -> str:
    """xgrammar's error text without its C++ source location prefix."""
    return _CPP_PREFIX.sub("", str(exc).strip()).strip()


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose language is exactly `choices` (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def constraint_digest(c: Constraint) -> str:
    h = hashlib.sha256(c.kind.encode())
    h.update(b"\0" + c.value.encode())
    if c.any_whitespace:
        h.update(b"\0any_whitespace")
    for choice in c.choices:
        h.update(b"\0" + choice.encode())
    return h.hexdigest()


class GrammarCache:
    """Compiled grammars for one tokenizer, by constraint digest, compiled off the caller's thread."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        tokenizer_name: str = "",
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        workers: int = 2,
        max_entries: int = CACHE_ENTRIES,
    ):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.tokenizer_name = tokenizer_name
        self.compile_timeout_s = compile_timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._compiler = None  # built on first use (reads the whole vocabulary: ~0.2 s)
        self.max_entries = max_entries
        self._futures: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._too_slow: set[tuple[str, str]] = set()

    def key(self, c: Constraint) -> tuple[str, str]:
        return (self.tokenizer_name, constraint_digest(c))

    def submit(self, c: Constraint) -> concurrent.futures.Future:
        """The compiled grammar's future (shared with every other request for the same constraint)."""
        c.validate()
        key = self.key(c)
        with self._lock:
            if key in self._too_slow:
                raise self._timeout_error(c)
            fut = self._futures.get(key)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._futures[key] = self._pool.submit(self._compile, c)
                while len(self._futures) > self.max_entries:
                    self._futures.popitem(last=False)  # its requests keep their own reference
            self._futures.move_to_end(key)
            return fut

    def cached(self, c: Constraint) -> bool:
        fut = self._futures.get(self.key(c))
        return fut is not None and fut.done() and fut.exception() is None

    def compile(self, c: Constraint):
        """Blocking form (the synchronous LLMEngine.generate, tests)."""
        fut = self.submit(c)
        try:
            return fut.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise self.refuse_slow(c) from None

    async def compile_async(self, c: Constraint):
        """Wait for the compiled grammar without blocking the event loop (or the engine thread)."""
        import asyncio

        fut = self.submit(c)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.compile_timeout_s)
        except TimeoutError:
            raise self.refuse_slow(c) from None

    def refuse_slow(self, c: Constraint) -> InvalidRequest:
        with self._lock:
            self._too_slow.add(self.key(c))
        return self._timeout_error(c)

    def _timeout_error(self, c: Constraint) -> InvalidRequest:
        return InvalidRequest(
            f"{c.field} took longer than {self.compile_timeout_s:g} s to compile; simplify it "
            "(fewer alternatives, smaller bounded repetitions)",
            field=c.field,
        )

    def _xgr_compiler(self):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                # No cache of xgrammar's own (unbounded by default): this class keeps a bounded one.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, c: Constraint):
        compiler = self._xgr_compiler()
        try:
            if c.kind == "json_schema":
                try:
                    json.loads(c.value)
                except ValueError as exc:
                    raise InvalidRequest(f"{c.field} is not valid JSON: {exc}", field=c.field) from None
                return compiler.compile_json_schema(
                    c.value, any_whitespace=c.any_whitespace, strict_mode=True
                )
            if c.kind == "json_object":
                if c.any_whitespace:
                    return compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
                return compiler.compile_grammar(JSON_OBJECT_GRAMMAR)
            if c.kind == "regex":
                return compiler.compile_regex(c.value)
            if c.kind == "choice":
                return compiler.compile_grammar(choice_grammar(c.choices))
            return compiler.compile_grammar(c.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            if isinstance(exc, InvalidRequest):
                raise
            raise InvalidRequest(f"{c.field} is invalid: {_parser_message(exc)}", field=c.field) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
