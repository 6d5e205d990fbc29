"""GrammarCache: a request's Constraint compiled once (xgrammar), off the engine thread, and kept
for the next request with the same constraint, within a byte bound.

- Compiles run on `CompilePool` (engine/compile_pool.py): fair across callers, each compile under
  `compile_timeout_s` of its own running time. A compile past it is refused, and the same grammar
  is then refused at once for `TOO_SLOW_FOR_S` (the time was the grammar's own). A caller that
  waited longer than `queue_timeout_s` for a worker gets CapacityExceeded (retry later); that
  refusal is not kept.
- The cache keeps compiled grammars by the digest of (tokenizer, constraint), least recently used
  dropped first, at most `max_bytes` in all (xgrammar's `memory_size_bytes`: its token masks) and
  `max_entries` of them. A grammar over `max_grammar_bytes` is refused, and kept by nothing.
- Refused at compile, naming the field: parser errors, JSON-schema keywords xgrammar does not
  enforce (engine/schema_keywords.py), and grammars that admit no output at all (`root ::= root`,
  an empty character class, a schema that only refers to itself).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from loraplex.services.inference.engine.compile_pool import CompileJob, CompilePool
from loraplex.services.inference.engine.schema_keywords import check_schema_keywords
from loraplex.services.inference.engine.types import Constraint
from loraplex.services.inference.errors import CapacityExceeded, InvalidRequest

COMPILE_TIMEOUT_S = 10.0
QUEUE_TIMEOUT_S = 30.0  # longest wait for a compile worker before "busy, retry later"
CACHE_ENTRIES = 512
CACHE_MAX_BYTES = 512 * 2**20  # all compiled grammars kept (--grammar-cache-max-bytes)
GRAMMAR_MAX_BYTES = 64 * 2**20  # one compiled grammar (--grammar-max-bytes)
TOO_SLOW_KEPT = 4096  # digests of grammars refused as too slow, remembered to refuse them at once
# ... for this long: a compile slowed by a loaded CPU rather than by its grammar is not refused for good.
TOO_SLOW_FOR_S = 600.0
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


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class GrammarCache:
    """Compiled grammars for one tokenizer, by constraint digest, compiled off the caller's thread.

    `compile_fn(constraint)`: the compiler (default: xgrammar on this tokenizer); tests pass a
    slow one to exercise the pool. `pool_limits`: CompilePool's `workers`, `per_owner`, ...
    `owner` in `submit` / `compile_async`: who asks (the servicer's call), for the pool's fairness."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        tokenizer_name: str = "",
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
        max_entries: int = CACHE_ENTRIES,
        max_bytes: int = CACHE_MAX_BYTES,
        max_grammar_bytes: int = GRAMMAR_MAX_BYTES,
        compile_fn: Callable[[Constraint], object] | None = None,
        compiler=None,
        **pool_limits,
    ):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.tokenizer_name = tokenizer_name
        self.compile_timeout_s = compile_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_grammar_bytes = min(max_grammar_bytes, max_bytes)
        self._compile_fn = compile_fn or self._xgr_compile
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        # xgrammar's compiler on this tokenizer: built on first use (it reads the whole vocabulary:
        # ~0.2 s), or another cache's on the same tokenizer (`compiler`: tests share one).
        self._compiler = compiler
        self._done: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()
        self.bytes_held = 0
        self._too_slow: OrderedDict[tuple[str, str], float] = OrderedDict()  # key -> when refused
        self.pool = CompilePool(compile_timeout_s, self._finished, self._overdue, **pool_limits)

    def key(self, c: Constraint) -> tuple[str, str]:
        return (self.tokenizer_name, constraint_digest(c))

    # -- asking -----------------------------------------------------------------------------

    def submit(self, c: Constraint, owner: str = "") -> CompileJob | object:
        """The compiled grammar if cached, else the compile's job (shared with every other caller
        of the same constraint). Raises the refusals known at once."""
        c.validate()
        key = self.key(c)
        with self._lock:
            refused_at = self._too_slow.get(key)
            if refused_at is not None:
                if time.monotonic() - refused_at < TOO_SLOW_FOR_S:
                    raise self._timeout_error(c)
                del self._too_slow[key]
            hit = self._done.get(key)
            if hit is not None:
                self._done.move_to_end(key)
                return hit[0]
        return self.pool.submit(key, lambda: self._compile_fn(c), owner, c)

    def cached(self, c: Constraint) -> bool:
        with self._lock:
            return self.key(c) in self._done

    def compile(self, c: Constraint, owner: str = ""):
        """Blocking form (the synchronous LLMEngine.generate, tests)."""
        job = self.submit(c, owner)
        if not isinstance(job, CompileJob):
            return job
        try:
            return job.future.result(timeout=self.queue_timeout_s)
        except concurrent.futures.TimeoutError:
            if job.started is None:
                raise self._busy(c) from None
            return job.future.result()  # started: its time limit ends it
        finally:
            if not job.future.done():
                self.pool.leave(job)

    async def compile_async(self, c: Constraint, owner: str = ""):
        """Wait for the compiled grammar without blocking the event loop (or the engine thread).
        A cancelled wait cancels only this caller's interest, never the shared compile."""
        job = self.submit(c, owner)
        if not isinstance(job, CompileJob):
            return job
        waiting = asyncio.wrap_future(job.future)
        try:
            try:
                return await asyncio.wait_for(asyncio.shield(waiting), self.queue_timeout_s)
            except TimeoutError:
                if job.started is None:
                    raise self._busy(c) from None
            return await asyncio.shield(waiting)  # started: its time limit ends it
        finally:
            if not job.future.done():
                self.pool.leave(job)

    def _busy(self, c: Constraint) -> CapacityExceeded:
        return CapacityExceeded(
            f"{c.field} waited {self.queue_timeout_s:g} s for a grammar compiler "
            f"({self.pool.queued_ahead()} compiles queued); retry later",
            field=c.field,
        )

    def _timeout_error(self, c: Constraint) -> InvalidRequest:
        return InvalidRequest(
            f"{c.field} took longer than {self.compile_timeout_s:g} s to compile; simplify it "
            "(fewer alternatives, smaller bounded repetitions)",
            field=c.field,
        )

    # -- the pool's callbacks ---------------------------------------------------------------

    def _finished(self, job: CompileJob, value):
        """A compile ended in time: keep it (within the byte bound) or say why it is refused."""
        if isinstance(value, BaseException):
            return value
        size = int(getattr(value, "memory_size_bytes", 0))
        field = job.context.field
        if size > self.max_grammar_bytes:
            return InvalidRequest(
                f"{field} compiles to {_mb(size)} of token masks; at most {_mb(self.max_grammar_bytes)} "
                "(fewer alternatives, smaller bounded repetitions)",
                field=field,
            )
        with self._lock:
            self._done[job.key] = (value, size)
            self.bytes_held += size
            while self.bytes_held > self.max_bytes or len(self._done) > self.max_entries:
                _, (_, dropped) = self._done.popitem(last=False)  # its requests keep their own reference
                self.bytes_held -= dropped
        return value

    def _overdue(self, job: CompileJob) -> InvalidRequest:
        with self._lock:
            self._too_slow[job.key] = time.monotonic()
            self._too_slow.move_to_end(job.key)
            while len(self._too_slow) > TOO_SLOW_KEPT:
                self._too_slow.popitem(last=False)
        return self._timeout_error(job.context)

    # -- xgrammar ---------------------------------------------------------------------------

    def prepare(self):
        """Build xgrammar's compiler on this tokenizer now (~0.2 s; else the first compile does)."""
        return self._xgr_compiler()

    def _xgr_compiler(self):
        import xgrammar as xgr

        # Its own lock: building the table takes a while, and submit() (on the event loop) must
        # not wait for it.
        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                # No cache of xgrammar's own (unbounded by default): this class keeps a bounded one.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _xgr_compile(self, c: Constraint):
        compiler = self._xgr_compiler()
        try:
            if c.kind == "json_schema":
                try:
                    schema = json.loads(c.value)
                except ValueError as exc:
                    raise InvalidRequest(f"{c.field} is not valid JSON: {exc}", field=c.field) from None
                check_schema_keywords(schema, c.field)
                compiled = compiler.compile_json_schema(
                    c.value, any_whitespace=c.any_whitespace, strict_mode=True
                )
            elif c.kind == "json_object":
                if c.any_whitespace:
                    compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
                else:
                    compiled = compiler.compile_grammar(JSON_OBJECT_GRAMMAR)
            elif c.kind == "regex":
                compiled = compiler.compile_regex(c.value)
            elif c.kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(c.choices))
            else:
                compiled = compiler.compile_grammar(c.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            if isinstance(exc, InvalidRequest):
                raise
            raise InvalidRequest(f"{c.field} is invalid: {_parser_message(exc)}", field=c.field) from None
        if not admits_output(compiled, self.vocab_size):
            raise InvalidRequest(
                f"{c.field} admits no output: no token can start it (a rule that only refers to "
                "itself, an empty character class, a schema that is only a reference to itself)",
                field=c.field,
            )
        return compiled

    def close(self) -> None:
        self.pool.close()


def admits_output(compiled, vocab_size: int) -> bool:
    """Whether any token (a stop token included, where the empty output is allowed) may come first."""
    import xgrammar as xgr

    from loraplex.services.inference.engine.grammar import allocate_bitmask

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = allocate_bitmask(1, vocab_size, pin=False)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())
