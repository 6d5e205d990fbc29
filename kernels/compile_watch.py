"""Which Triton kernel variants get compiled, and when: nothing may compile while serving.

A Triton kernel is compiled once per *specialisation key*: its constexpr values, its argument
types, and the value class Triton gives each integer argument (1, a multiple of 16, other) and
each pointer (16-byte aligned or not), unless the argument is marked `do_not_specialize`. A key
seen for the first time while serving stalls the engine thread for the compile (hundreds of
milliseconds to seconds), so the kernels take per-step sizes as runtime values or as a few
buckets, and the engine runs every bucket once at start-up (engine/warmup.py).

Two views of the same thing:
- `CompileCounter`: Triton's own post-compile hook (`triton.knobs.runtime.jit_post_compile_hook`
  on triton >= 3.4, `JITFunction.cache_hook` before) counts real compilations, and after
  `mark_serving()` logs each one with the kernel's name and key (`loraplex_triton_compiles_after_start`
  in the metrics). The interpreter compiles nothing, so the hook never fires there.
- `record_launch_keys()`: records the key Triton *would* compile each launch under, computed with
  Triton's own binder (the code `JITFunction.run` calls), so it also works under TRITON_INTERPRET=1:
  the tests warm an engine up and check that a varied batch launches no key the warm-up did not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import triton
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

log = logging.getLogger(__name__)


def step_kernels() -> dict[str, object]:
    """Every Triton kernel an engine step can launch, by name."""
    from loraplex.kernels import (
        attention_decode,
        attention_kv_store,
        attention_prefill,
        fp8_quant,
        fp8_weight_gemm,
        fused_ops,
        lora_expand,
        lora_meta,
        lora_shrink,
        moe_align,
        moe_grouped,
    )

    kernels = {}
    for module in (
        attention_decode,
        attention_kv_store,
        attention_prefill,
        fp8_quant,
        fp8_weight_gemm,
        fused_ops,
        lora_expand,
        lora_meta,
        lora_shrink,
        moe_align,
        moe_grouped,
    ):
        for name, value in vars(module).items():
            if hasattr(value, "add_pre_run_hook") and hasattr(value, "fn"):
                kernels[f"{module.__name__.split('.')[-1]}.{name}"] = value
    return kernels


def _binder(kernel) -> object:
    """Triton's argument binder for `kernel` (a JITFunction, or the interpreter's stand-in for one)."""
    if isinstance(kernel, JITFunction):
        jit = kernel
    else:  # InterpretedFunction keeps the decorator's arguments
        opts = getattr(kernel, "kwargs", {}) or {}
        jit = JITFunction(
            kernel.fn,
            do_not_specialize=opts.get("do_not_specialize"),
            do_not_specialize_on_alignment=opts.get("do_not_specialize_on_alignment"),
        )
    # The CUDA backend specialises integers and pointers as the base backend does (divisibility by 16).
    return create_function_from_signature(jit.signature, jit.params, BaseBackend)


def specialization_key(binder, args: tuple, kwargs: dict) -> str:
    """The part of Triton's cache key (jit.py `compute_cache_key`) that a launch's arguments decide."""
    _, specialization, options = binder(*args, **kwargs)
    return str(specialization) + str(sorted(options.items()))


class LaunchKeys:
    """Distinct (kernel, specialisation key) pairs launched while recording."""

    def __init__(self) -> None:
        self.keys: set[tuple[str, str]] = set()

    def new_since(self, before: set[tuple[str, str]]) -> set[tuple[str, str]]:
        return self.keys - before


@contextmanager
def record_launch_keys() -> Iterator[LaunchKeys]:
    """Record the specialisation key of every step-kernel launch inside the block (host cost: a few
    microseconds a launch; for tests and benchmarks, not serving)."""
    record = LaunchKeys()
    hooks = []
    for name, kernel in step_kernels().items():
        binder = _binder(kernel)

        def hook(*args, _name=name, _binder=binder, **kwargs):
            record.keys.add((_name, specialization_key(_binder, args, kwargs)))

        kernel.add_pre_run_hook(hook)
        hooks.append((kernel, hook))
    try:
        yield record
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


class CompileCounter:
    """Counts Triton compilations in this process; after `mark_serving()` each one is logged."""

    def __init__(self) -> None:
        self.total = 0
        self.after_start = 0
        self.serving = False
        self.installed = False
        self._lock = threading.Lock()
        self._previous = None

    def install(self) -> None:
        """Chain onto Triton's post-compile hook (idempotent)."""
        if self.installed:
            return
        knobs = getattr(triton, "knobs", None)
        runtime = getattr(knobs, "runtime", None)
        if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
            self._previous = runtime.jit_post_compile_hook
            runtime.jit_post_compile_hook = self._hook
        elif runtime is not None and hasattr(runtime, "jit_cache_hook"):  # called before each compile
            self._previous = runtime.jit_cache_hook
            runtime.jit_cache_hook = self._hook
        else:  # triton < 3.4: one class-level hook, called before each compile
            self._previous = JITFunction.cache_hook
            JITFunction.cache_hook = self._hook
        self.installed = True

    def mark_starting(self) -> None:
        """An engine is being built (capture, warm-up): its compilations are start-up, not stalls.
        A process that builds engines one after another (the benchmarks) calls this for each."""
        self.serving = False

    def mark_serving(self) -> None:
        """Start-up is over: from now on every compilation is a stall, counted and logged."""
        self.serving = True

    def _hook(self, *args, **kwargs):
        with self._lock:
            self.total += 1
            if self.serving:
                self.after_start += 1
        if self.serving:
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or getattr(getattr(fn, "jit_function", None), "__name__", "?")
            log.warning(
                "Triton compiled %s while serving (%d since start-up): %s",
                name,
                self.after_start,
                kwargs.get("repr", ""),
            )
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None


compile_counter = CompileCounter()
