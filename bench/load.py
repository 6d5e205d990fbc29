"""Load test: N concurrent streaming clients over a mix of adapters for a fixed time.

    .venv/bin/python -m loraplex.bench.load --clients 8 --duration 60            # starts its own stack
    .venv/bin/python -m loraplex.bench.load --target HOST:PORT --store HOST:PORT  # a running stack

Without --target it starts what `loraplex up` starts (adapter store with embedded Redis +
inference service on the embedded SmolLM2, free ports, a temporary cache), writes
--adapters random rank-8 PEFT adapters for the base model, registers them in the store and
warms each once. Then every client loops: GenerateStream on the next entry of the mix
(base model, adapter 0, adapter 1, ...) until the time is up. Reports requests completed,
errors (by status code; must be 0), p50/p99 time to first token and inter-token latency,
tokens/s, and the inference server's RSS after warm-up and at the end (psutil; with --target,
pass --server-pid to get it). Prints a table and writes load.json to --out DIR
(bench/results.py). Exit status 1 when any request failed or RSS grew more than
--rss-growth-limit-mb.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from loraplex.bench.results import add_out_argument, write_json
from loraplex.bench.serving_setup import write_adapters as write_random_adapters
from loraplex.clients import Client
from loraplex.clients.errors import LoraplexError
from loraplex.clients.processes import ServerProcess

PROMPTS = (
    "List 3 countries and their capitals.",
    "Write a haiku about the sea.",
    "Explain what a LoRA adapter is in one sentence.",
    "Give me two tips for writing clean code.",
)


class Tally:
    """Every client's samples; appended under one lock (cheap beside a gRPC round trip)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.completed = 0
        self.tokens = 0
        self.errors: dict[str, int] = {}

    def add(self, ttft: float | None, itl: list[float], tokens: int, error: str | None) -> None:
        with self.lock:
            if error is not None:
                self.errors[error] = self.errors.get(error, 0) + 1
                return
            self.completed += 1
            self.tokens += tokens
            if ttft is not None:
                self.ttft.append(ttft)
            self.itl.extend(itl)


def one_request(client: Client, prompt: str, adapter: str, max_new_tokens: int, tally: Tally) -> None:
    start = last = time.perf_counter()
    ttft, itl, tokens = None, [], 0
    try:
        for msg in client.generate_stream(
            prompt, adapter or None, max_new_tokens=max_new_tokens, ignore_eos=True, timeout=300
        ):
            n = len(msg.token_ids)
            if n:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:  # a message may carry several tokens: spread the gap over them
                    itl.extend([(now - last) / n] * n)
                last, tokens = now, tokens + n
        tally.add(ttft, itl, tokens, None)
    except LoraplexError as exc:
        tally.add(None, [], 0, exc.code.name)


def client_loop(index: int, target: str, mix: list[str], opts, stop_at: float, tally: Tally) -> None:
    with Client(target, token=opts.token, tls_ca=opts.tls_ca) as client:
        i = index
        while time.monotonic() < stop_at:
            one_request(client, PROMPTS[i % len(PROMPTS)], mix[i % len(mix)], opts.max_new_tokens, tally)
            i += 1


def write_adapters(model_path: Path, root: Path, count: int, rank: int) -> list[Path]:
    cfg = json.loads((model_path / "config.json").read_text())
    shape = {
        k: cfg[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
        )
    }
    return write_random_adapters(root, model_path, count, shape=shape, rank=rank, device="cpu")


def start_stack(opts, cache: Path) -> tuple[ServerProcess, ServerProcess, Path]:
    from loraplex.services.inference.default_model import ensure_model

    model = Path(opts.model_path) if opts.model_path else ensure_model()
    store = ServerProcess(
        "store",
        "loraplex.adapter_store",
        ["--port", "0", "--cache-dir", str(cache / "store"), "--base-model", str(model)],
        echo=opts.echo,
    )
    store.wait_serving(300)
    inference = ServerProcess(
        "inference",
        "loraplex.services.inference",
        [
            "--model-path",
            str(model),
            "--port",
            "0",
            "--adapter-store",
            store.address,
            "--adapter-cache-dir",
            str(cache / "inference"),
            "--max-lora-rank",
            str(opts.rank),
            *opts.inference_args,
        ],
        echo=opts.echo,
    )
    try:
        inference.wait_serving(300)
    except Exception:
        store.stop()
        raise
    return store, inference, model


def rss_mb(pid: int | None) -> float | None:
    return psutil.Process(pid).memory_info().rss / 2**20 if pid else None


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def run(opts) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="loraplex-load-"))
    procs: list[ServerProcess] = []
    try:
        if opts.target:
            target, store_address, pid = opts.target, opts.store, opts.server_pid
            model = Path(opts.model_path) if opts.model_path else None
        else:
            store, inference, model = start_stack(opts, cache)
            procs = [store, inference]
            target, store_address, pid = inference.address, store.address, inference.proc.pid
        names: list[str] = []
        if opts.adapters and store_address:
            if model is None:
                raise SystemExit("--model-path is needed to write adapters for a running stack")
            with Client(
                target, store=store_address, store_token=opts.store_token, tls_ca=opts.tls_ca
            ) as admin:
                for i, path in enumerate(write_adapters(model, cache / "adapters", opts.adapters, opts.rank)):
                    names.append(f"load-{i}")
                    admin.register_adapter(names[-1], str(path), timeout=300)
        mix = ["", *names]
        warm = Tally()
        with Client(target, token=opts.token, tls_ca=opts.tls_ca) as client:
            for name in mix:  # pulls every adapter once; not measured
                one_request(client, PROMPTS[0], name, 4, warm)
        if warm.errors:
            raise SystemExit(f"warm-up failed: {warm.errors}")
        rss_start = rss_mb(pid)
        tally = Tally()
        stop_at = time.monotonic() + opts.duration
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=client_loop, args=(i, target, mix, opts, stop_at, tally), daemon=True)
            for i in range(opts.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        rss_end = rss_mb(pid)
        return dict(
            date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            machine=f"{platform.node()} {platform.machine()}, {psutil.cpu_count()} CPUs",
            command=" ".join(sys.argv),
            clients=opts.clients,
            duration_s=round(elapsed, 1),
            adapters=len(names),
            max_new_tokens=opts.max_new_tokens,
            completed=tally.completed,
            errors=sum(tally.errors.values()),
            errors_by_code=tally.errors,
            tokens=tally.tokens,
            tokens_per_s=round(tally.tokens / elapsed, 1),
            ttft_p50_ms=round(pct(tally.ttft, 50), 1),
            ttft_p99_ms=round(pct(tally.ttft, 99), 1),
            itl_p50_ms=round(pct(tally.itl, 50), 1),
            itl_p99_ms=round(pct(tally.itl, 99), 1),
            rss_start_mb=None if rss_start is None else round(rss_start, 1),
            rss_end_mb=None if rss_end is None else round(rss_end, 1),
        )
    finally:
        for proc in reversed(procs):
            proc.stop()


def print_table(res: dict) -> None:
    rows = [
        ("requests completed", res["completed"]),
        ("errors", f"{res['errors']} {res['errors_by_code'] or ''}"),
        ("tokens generated", f"{res['tokens']} ({res['tokens_per_s']} tok/s)"),
        ("TTFT p50 / p99", f"{res['ttft_p50_ms']} / {res['ttft_p99_ms']} ms"),
        ("inter-token latency p50 / p99", f"{res['itl_p50_ms']} / {res['itl_p99_ms']} ms"),
        ("server RSS after warm-up / end", f"{res['rss_start_mb']} / {res['rss_end_mb']} MiB"),
    ]
    print(
        f"\n{res['clients']} streaming clients, {res['duration_s']} s, base + {res['adapters']} adapters, "
        f"{res['max_new_tokens']} new tokens each ({res['date']}, {res['machine']})"
    )
    print("| metric | value |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--adapters", type=int, default=3, help="random adapters in the mix (plus the base model)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--target", default=None, help="HOST:PORT of a running inference service")
    p.add_argument("--store", default=None, help="HOST:PORT of its adapter store (to register the adapters)")
    p.add_argument(
        "--server-pid", type=int, default=None, help="inference server pid (for RSS) with --target"
    )
    p.add_argument("--model-path", default=None, help="base model (default: the embedded SmolLM2)")
    p.add_argument("--token", default=None, help="--api-token of the inference service")
    p.add_argument("--store-token", default=None, help="--admin-token of the store")
    p.add_argument("--tls-ca", default=None)
    p.add_argument("--rss-growth-limit-mb", type=float, default=100.0)
    add_out_argument(p)
    p.add_argument("--echo", action="store_true", help="show the servers' logs")
    p.add_argument(
        "inference_args", nargs=argparse.REMAINDER, help="-- then extra flags for the inference service"
    )
    opts = p.parse_args(argv)
    opts.inference_args = [a for a in opts.inference_args if a != "--"]
    res = run(opts)
    print_table(res)
    write_json(opts.out, "load", res)
    grew = (res["rss_end_mb"] or 0) - (res["rss_start_mb"] or 0)
    ok = res["errors"] == 0 and res["completed"] > 0 and grew <= opts.rss_growth_limit_mb
    print(
        f"\n{'PASS' if ok else 'FAIL'}: errors {res['errors']}, RSS growth {grew:.1f} MiB "
        f"(limit {opts.rss_growth_limit_mb:.0f} MiB)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
