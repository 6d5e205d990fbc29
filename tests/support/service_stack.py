"""Helpers for the service/client tests: real server subprocesses and the PEFT reference.

Servers are started once per module (or shared across modules through `shared`), on
ephemeral loopback ports, each with its own store cache and embedded Redis.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch

from loraplex.clients.processes import ServerProcess

METRICS_LINE = re.compile(r"metrics on http://(\S+?):(\d+)/metrics")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) ([-+0-9.eEnaIf]+)$")
STARTUP_S = 240.0

_shared: dict[str, ServerProcess] = {}


def start_inference(
    model: Path, *extra: str, store: ServerProcess | None = None, cache: Path | None = None
) -> ServerProcess:
    args = [
        "--model-path",
        str(model),
        "--port",
        "0",
        "--device",
        "cpu",
        "--metrics-port",
        "0",
        "--max-total-tokens",
        "8192",
        "--grace-period",
        "5",
    ]
    if store is not None:
        args += ["--adapter-store", store.address or ""]
    if cache is not None:
        args += ["--adapter-cache-dir", str(cache)]
    proc = ServerProcess("inference", "loraplex.services.inference", [*args, *extra], echo=False)
    try:
        proc.wait_serving(STARTUP_S)
    except Exception:
        proc.stop()
        raise
    return proc


def start_store(cache_dir: Path, base_model: Path | None = None) -> ServerProcess:
    args = ["--port", "0", "--cache-dir", str(cache_dir)]
    if base_model is not None:
        args += ["--base-model", str(base_model)]
    proc = ServerProcess("store", "loraplex.adapter_store", args, echo=False)
    try:
        proc.wait_serving(STARTUP_S)
    except Exception:
        proc.stop()
        raise
    return proc


def shared(config, key: str, make: Callable[[], ServerProcess]) -> ServerProcess:
    """One server per test session under `key`, stopped when the session ends."""
    proc = _shared.get(key)
    if proc is None or proc.proc.poll() is not None:
        proc = make()
        _shared[key] = proc
        config.add_cleanup(proc.stop)
    return proc


def scrape(proc: ServerProcess) -> dict[str, float]:
    """The server's Prometheus samples, `name{labels}` -> value."""
    match = METRICS_LINE.search(proc.output())
    assert match, "no metrics line in the server log"
    with urllib.request.urlopen(f"http://{match.group(1)}:{match.group(2)}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


class PeftReference:
    """Greedy per-sequence outputs of transformers + PEFT: the numerical reference."""

    def __init__(self, base: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        self._peft = None
        self._names: dict[str, str] = {}
        self._cache: dict[tuple, list[int]] = {}

    def _model_for(self, adapter: Path | None):
        from peft import PeftModel

        if adapter is None:
            return None
        key = str(adapter)
        if key not in self._names:
            name = f"a{len(self._names)}"
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self.base, adapter, adapter_name=name).eval()
            else:
                self._peft.load_adapter(adapter, adapter_name=name)
            self._names[key] = name
        self._peft.set_adapter(self._names[key])
        return self._peft

    def greedy(self, prompt: str, adapter: Path | None, max_new_tokens: int) -> list[int]:
        key = (prompt, str(adapter), max_new_tokens)
        if key not in self._cache:
            # One thread: beside a server process on 2 shared cores, two threads run 5-10x slower.
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                self._cache[key] = self._greedy(prompt, adapter, max_new_tokens)
            finally:
                torch.set_num_threads(threads)
        return self._cache[key]

    @torch.inference_mode()
    def _greedy(self, prompt: str, adapter: Path | None, max_new_tokens: int) -> list[int]:
        ids = torch.tensor([self.tokenizer(prompt).input_ids])
        peft = self._model_for(adapter)
        if peft is None and self._peft is not None:
            with self._peft.disable_adapter():
                out = self._peft.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
        else:
            model = peft if peft is not None else self.base
            out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, ids.shape[1] :].tolist()


STORE_STACK_SHAPE = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def store_stack(config, tmp_path_factory, model: Path) -> tuple[ServerProcess, ServerProcess]:
    """The session's adapter store (embedded Redis) and an inference server that pulls from it."""
    store = shared(config, "store", lambda: start_store(tmp_path_factory.mktemp("store"), model))
    inference = shared(
        config,
        "smollm2-store",
        lambda: start_inference(
            model,
            "--max-lora-rank",
            str(STORE_STACK_SHAPE["r"]),
            "--lora-target-modules",
            *STORE_STACK_SHAPE["target_modules"],
            store=store,
            cache=tmp_path_factory.mktemp("inference-adapters"),
        ),
    )
    return store, inference
