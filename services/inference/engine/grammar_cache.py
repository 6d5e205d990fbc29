"""GrammarCache: a request's Constraint compiled once (xgrammar, engine/grammar_compile.py), off
the engine thread, against the tokenizer that request uses, and kept for the next request with the
same constraint and tokenizer, within a byte bound.

- Compiles run on `CompilePool` (engine/compile_pool.py): fair across callers, each compile under
  `compile_timeout_s` of its own running time. A compile past it is refused, and the same grammar
  is then refused at once for `TOO_SLOW_FOR_S` (the time was the grammar's own). A caller that
  waited longer than `queue_timeout_s` for a worker gets CapacityExceeded (retry later); that
  refusal is not kept.
- A request's tokenizer is the base model's, or its adapter's own (engine/adapter_tokenizers.py:
  added tokens make other token strings, so a mask built from the base's would allow the wrong
  ids). The base's xgrammar compiler is the cache's; an adapter tokenizer's is built on its first
  constrained request and lives on its entry, so it is bounded as the entries are and goes with the
  last adapter using it (`forget_tokenizer` then drops that tokenizer's compiled grammars too).
- The cache keeps compiled grammars by (tokenizer identity: the base model's name or the adapter
  tokenizer's files digest, the constraint's digest), least recently used dropped first, at most
  `max_bytes` in all (xgrammar's `memory_size_bytes`: its token masks) and `max_entries` of them,
  whatever their tokenizer. A grammar over `max_grammar_bytes` is refused, and kept by nothing.
- Refused at compile, naming the field (engine/grammar_compile.py): parser errors, JSON-schema
  keywords xgrammar does not enforce, and grammars that admit no output at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from loraplex.services.inference.engine.compile_pool import CompileJob, CompilePool
from loraplex.services.inference.engine.grammar_compile import build_compiler, compile_constraint
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

if TYPE_CHECKING:
    from loraplex.services.inference.engine.adapter_tokenizers import AdapterTokenizer


class _Asked(NamedTuple):
    """What a compile job carries for the pool's callbacks."""

    constraint: Constraint
    own: AdapterTokenizer | None  # the adapter's own tokenizer; None: the base's


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
    """Compiled grammars by (tokenizer, constraint digest), compiled off the caller's thread.

    `tokenizer`: the base model's (named `tokenizer_name`); `own` in `submit` / `compile` /
    `compile_async`: the request's adapter tokenizer entry, None for the base's.
    `compile_fn(constraint, own)`: the compiler (default: xgrammar on that tokenizer); tests pass a
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
        compile_fn: Callable[[Constraint, AdapterTokenizer | None], object] | None = None,
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
        # xgrammar's compiler on the base tokenizer: built on first use (it reads the whole
        # vocabulary: ~0.2 s), or another cache's on the same tokenizer (`compiler`: tests share one).
        self._compiler = compiler
        self._done: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()
        self.bytes_held = 0
        self._too_slow: OrderedDict[tuple[str, str], float] = OrderedDict()  # key -> when refused
        self.pool = CompilePool(compile_timeout_s, self._finished, self._overdue, **pool_limits)

    def key(self, c: Constraint, own: AdapterTokenizer | None = None) -> tuple[str, str]:
        """A base request's key is (the model's name, digest), as before adapters had tokenizers; an
        adapter tokenizer's is its files digest ("sha256:..."), which no model name equals."""
        return (self.tokenizer_name if own is None else own.key, constraint_digest(c))

    # -- asking -----------------------------------------------------------------------------

    def submit(
        self, c: Constraint, owner: str = "", own: AdapterTokenizer | None = None
    ) -> CompileJob | object:
        """The compiled grammar if cached, else the compile's job (shared with every other caller
        of the same constraint and tokenizer). Raises the refusals known at once."""
        c.validate()
        key = self.key(c, own)
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
        return self.pool.submit(key, lambda: self._compile_fn(c, own), owner, _Asked(c, own))

    def cached(self, c: Constraint, own: AdapterTokenizer | None = None) -> bool:
        with self._lock:
            return self.key(c, own) in self._done

    def compile(self, c: Constraint, owner: str = "", own: AdapterTokenizer | None = None):
        """Blocking form (the synchronous LLMEngine.generate, tests)."""
        job = self.submit(c, owner, own)
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

    async def compile_async(self, c: Constraint, owner: str = "", own: AdapterTokenizer | None = None):
        """Wait for the compiled grammar without blocking the event loop (or the engine thread).
        A cancelled wait cancels only this caller's interest, never the shared compile."""
        job = self.submit(c, owner, own)
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
        field = job.context.constraint.field
        if size > self.max_grammar_bytes:
            return InvalidRequest(
                f"{field} compiles to {_mb(size)} of token masks; at most {_mb(self.max_grammar_bytes)} "
                "(fewer alternatives, smaller bounded repetitions)",
                field=field,
            )
        with self._lock:
            own = job.context.own
            if own is not None and own.dropped:
                return value  # its tokenizer went meanwhile (forget_tokenizer): this request only
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
        return self._timeout_error(job.context.constraint)

    def forget_tokenizer(self, key: str) -> None:
        """No adapter uses the tokenizer with files digest `key` any more: its compiled grammars go
        (running requests keep their own). AdapterTokenizers marks its entry dropped first, so a
        compile of it that ends after this is not kept either."""
        with self._lock:
            for k in [k for k in self._done if k[0] == key]:
                _, size = self._done.pop(k)
                self.bytes_held -= size
            for k in [k for k in self._too_slow if k[0] == key]:
                del self._too_slow[k]

    # -- xgrammar ---------------------------------------------------------------------------

    def prepare(self):
        """Build xgrammar's compiler on the base tokenizer now (~0.2 s; else the first compile does)."""
        return self._base_compiler()

    def _base_compiler(self):
        # Its own lock: building the table takes a while, and submit() (on the event loop) must
        # not wait for it.
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = build_compiler(self._tokenizer, self.vocab_size, self._stop_token_ids)
            return self._compiler

    def compiler_for(self, own: AdapterTokenizer | None):
        """xgrammar's compiler on the tokenizer of `own`'s requests (None: the base's). An adapter
        tokenizer's is built on first use from its caller-side copy, under that copy's lock (the
        engine thread's copy is decoding meanwhile); masks stay the model's logits wide."""
        if own is None:
            return self._base_compiler()
        with own.grammar_lock:
            if own.grammar_compiler is None:
                with own.lock:
                    own.grammar_compiler = build_compiler(own.caller, self.vocab_size, self._stop_token_ids)
            return own.grammar_compiler

    def _xgr_compile(self, c: Constraint, own: AdapterTokenizer | None = None):
        return compile_constraint(self.compiler_for(own), c, self.vocab_size)

    def close(self) -> None:
        self.pool.close()
