"""`loraplex up`: the whole local stack as one process tree.

Embedded Redis (inside the store), the adapter store, the inference service on the
embedded SmolLM2 and the OpenAI-compatible door over it (`--openai-port`); waits for both to
report SERVING, prints how to call them, and stops everything on Ctrl-C / SIGTERM (or when
the store, the router, the door or a lone inference service dies). Flags after `--` go to
`python -m loraplex.services.inference` unchanged (e.g. `-- --max-lora-rank 64`).

`--replicas N` (N > 1) starts N inference replicas on free ports, all pulling from the one
store, with the nginx router (deploy/nginx/loraplex.conf) in front on `--port`: what the
docker-compose `router` service does, on one machine and without Docker. A replica that dies
is logged and restarted on its port with backoff (clients/replica_keeper.py) while the others
serve.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from loraplex.clients.processes import ServerProcess
from loraplex.clients.replica_keeper import ReplicaKeeper

log = logging.getLogger("loraplex.up")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="inference port (0 = any free port)")
    p.add_argument("--store-port", type=int, default=50052, help="adapter store port (0 = any free port)")
    p.add_argument(
        "--openai-port",
        type=int,
        default=8000,
        help="the OpenAI-compatible HTTP door's port (0 = any free port, -1 = do not start it)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus port of the inference service (replica i of --replicas: this + i)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="inference replicas; more than 1 puts the nginx router on --port in front of them",
    )
    p.add_argument(
        "--cache-dir", type=Path, default=Path("~/.cache/loraplex"), help="store blobs, Redis, adapters"
    )
    p.add_argument(
        "--model-path", default=None, help="base model (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "inference_args", nargs=argparse.REMAINDER, help="-- then extra flags for the inference service"
    )


def banner(
    inference: str,
    store: str,
    openai: str | None = None,
    model: str = "SmolLM2-135M-Instruct",
    replicas: list[str] | None = None,
) -> str:
    door = f"  openai     http://{openai}/v1   (OpenAI-compatible HTTP)\n" if openai else ""
    try_door = (
        (
            f"  curl -s http://{openai}/v1/chat/completions -H 'content-type: application/json' -d "
            f'\'{{"model": "{model}", "messages": [{{"role": "user", '
            f'"content": "List 3 countries and their capitals."}}], "max_tokens": 64}}\'\n'
        )
        if openai
        else ""
    )
    chat_prompt = (
        "<|im_start|>user\\nList 3 countries and their capitals.<|im_end|>\\n<|im_start|>assistant\\n"
    )
    try_grpc = (
        "  .venv/bin/grpcurl -plaintext -d "
        f'\'{{"text": ["{chat_prompt}"], "sampling_params": {{"max_new_tokens": 64}}}}\' '
        f"{inference} loraplex.v1.Inference/Generate\n"
        f"  .venv/bin/loraplex --target {inference} generate --chat --max-new-tokens 64 "
        '"List 3 countries and their capitals."\n'
    )
    routed = "".join(f"\n    replica  {r}" for r in replicas or [])
    via = "   (nginx router, by x-loraplex-adapter)" if replicas else ""
    return f"""
loraplex is up.
  inference  {inference}   (loraplex.v1.Inference){via}{routed}
  store      {store}   (loraplex.v1.AdapterStore)
{door}
Try:
{try_grpc}{try_door}
Ctrl-C stops everything.
"""


def run(ns: argparse.Namespace) -> int:
    from loraplex.services.inference.default_model import ensure_model

    cache = ns.cache_dir.expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    model = ns.model_path or str(ensure_model())
    extra = [a for a in ns.inference_args if a != "--"]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    children: list[ServerProcess] = []  # the store first; each of them dying stops the stack
    keeper: ReplicaKeeper | None = None
    try:
        store = ServerProcess(
            "store",
            "loraplex.adapter_store",
            [
                "--host",
                ns.host,
                "--port",
                str(ns.store_port),
                "--cache-dir",
                str(cache / "store"),
                "--base-model",
                model,
            ],
        )
        children.append(store)
        store.wait_serving(ns.startup_timeout)
        args = [
            "--model-path",
            model,
            "--host",
            ns.host,
            "--adapter-store",
            store.address,
            "--adapter-cache-dir",
            str(cache / "inference"),
        ]
        if ns.replicas <= 1:
            metrics = [] if ns.metrics_port is None else ["--metrics-port", str(ns.metrics_port)]
            inference = ServerProcess(
                "inference", "loraplex.services.inference", args + ["--port", str(ns.port)] + metrics + extra
            )
            children.append(inference)
            inference.wait_serving(ns.startup_timeout)
            target, replica_addresses = inference.address, None
        else:

            def start_replica(i: int, port: int = 0) -> ServerProcess:
                name = f"replica-{i}"
                metrics = [] if ns.metrics_port is None else ["--metrics-port", str(ns.metrics_port + i)]
                own = ["--port", str(port), "--replica-id", name, "--listen-when-ready"]
                return ServerProcess(name, "loraplex.services.inference", args + own + metrics + extra)

            replicas = []
            for i in range(ns.replicas):
                replicas.append(start_replica(i))
                children.append(replicas[-1])
            for replica in replicas:  # they load at the same time
                replica.wait_serving(ns.startup_timeout)
            keeper = ReplicaKeeper(list(replicas), start_replica)
            children = [c for c in children if c not in replicas]
            from loraplex.clients.router import start_router

            router = start_router(cache / "router", [r.address for r in replicas], host=ns.host, port=ns.port)
            children.append(router)
            router.wait_serving(ns.startup_timeout)
            target, replica_addresses = router.address, [r.address for r in replicas]
        door = None
        if ns.openai_port >= 0:
            door = ServerProcess(
                "openai",
                "loraplex.services.openai",
                ["--target", target, "--host", ns.host, "--port", str(ns.openai_port)],
            )
            children.append(door)
            door.wait_bound(ns.startup_timeout)
        print(
            banner(
                target, store.address, door.address if door else None, Path(model).name, replica_addresses
            ),
            flush=True,
        )
        while not stop.wait(0.5):
            if keeper is not None:
                keeper.check()
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                log.error("%s exited with %s; stopping the stack", dead[0].name, dead[0].proc.returncode)
                return 1
        return 0
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    finally:
        # The door and router first, then the replicas, then the store: the reverse of start-up.
        replicas_now = keeper.replicas if keeper is not None else []
        for child in [*reversed(children[1:]), *replicas_now, *children[:1]]:
            code = child.stop()
            log.info("%s stopped (exit %s)", child.name, code)
