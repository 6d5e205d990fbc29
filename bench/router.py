"""Several replicas behind the nginx router: affinity, failover and the cost of the hop.

Starts an adapter store, two inference replicas on the embedded SmolLM2 (or --model-path) and
nginx (clients/router.py), registers --adapters PEFT adapters, then runs three phases with
closed-loop streaming clients (Zipf adapter choice, --base-share of base-model requests):

  affinity  every request's replica (trailing metadata x-loraplex-replica): the share of each
            adapter's requests served by its main replica, and each replica's share of traffic
  overhead  time to first token of base requests, direct to a replica vs through nginx,
            interleaved in one run (one request at a time)
  failover  replica r2 is SIGKILLed a third of the way in and restarted; errors split into
            calls that had streamed tokens (lost with the replica) and calls that had not
            (must be 0: nginx answers UNAVAILABLE and the client's retry policy moves them);
            the share of r2's adapters it serves again after it is back

Prints a table and writes router.json to --out DIR (bench/results.py).

    PYTHONPATH=protos python3 -m loraplex.bench.router                                          # CPU
    PYTHONPATH=protos python3 -m loraplex.bench.router --device cuda --model-path /models/llama  # GPU
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from loraplex.bench.results import add_out_argument, write_json
from loraplex.clients import Client
from loraplex.clients.processes import ServerProcess
from loraplex.clients.requests import make_channel, routing_metadata
from loraplex.clients.router import FAIL_TIMEOUT_S, start_router
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc

PROMPT = "<|im_start|>user\nList 3 countries and their capitals.<|im_end|>\n<|im_start|>assistant\n"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_adapters(model: str, out: Path, n: int, rank: int) -> list[Path]:
    """`n` PEFT adapters with random B (so they change the output) on the base model's shape."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    peft = get_peft_model(base, config)
    for i in range(n):
        torch.manual_seed(1000 + i)
        for name, param in peft.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.02)
        path = out / f"adapter-{i}"
        peft.save_pretrained(path)
        paths.append(path)
    return paths


class Fleet:
    def __init__(self, ns: argparse.Namespace, work: Path) -> None:
        self.ns, self.work = ns, work
        self.store = ServerProcess(
            "store",
            "loraplex.adapter_store",
            ["--port", "0", "--cache-dir", str(work / "store"), "--base-model", ns.model_path],
            echo=False,
        )
        self.store.wait_serving(300)
        self.replicas = {name: self._replica(name, 0) for name in ("r1", "r2")}
        for proc in self.replicas.values():
            proc.wait_serving(600)
        self.router = start_router(work / "router", [p.address for p in self.replicas.values()], echo=False)
        self.router.wait_serving(60)

    def _replica(self, name: str, port: int) -> ServerProcess:
        ns = self.ns
        return ServerProcess(
            name,
            "loraplex.services.inference",
            [
                "--model-path",
                ns.model_path,
                "--port",
                str(port),
                "--device",
                ns.device,
                "--adapter-store",
                self.store.address,
                "--adapter-cache-dir",
                str(self.work / f"cache-{name}"),
                "--replica-id",
                name,
                "--listen-when-ready",
                "--max-lora-rank",
                str(ns.rank),
                "--lora-target-modules",
                *TARGETS,
                "--max-loras-per-batch",
                str(ns.slots),
                *ns.server_args,
            ],
            echo=False,
        )

    def restart(self, name: str, port: int) -> None:
        self.replicas[name] = self._replica(name, port)
        self.replicas[name].wait_serving(600)

    def stop(self) -> None:
        for proc in [self.router, *self.replicas.values(), self.store]:
            proc.stop()


def stream_once(stub, adapter: str, max_new_tokens: int) -> dict:
    """One GenerateStream: replica, time to first token, whether tokens arrived, error code."""
    request = pb.GenerateRequest(
        text=[PROMPT],
        adapter=[adapter] if adapter else [],
        sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )
    start = time.perf_counter()
    first = None
    call = stub.GenerateStream(request, timeout=120, metadata=routing_metadata(None, [adapter]))
    try:
        for msg in call:
            if first is None and (msg.token_ids or msg.text):
                first = time.perf_counter() - start
        code = "OK"
    except grpc.RpcError as err:
        code = err.code().name
    replica = dict(call.trailing_metadata() or ()).get("x-loraplex-replica", "")
    return dict(
        adapter=adapter,
        replica=replica,
        ttft=first,
        streamed=first is not None,
        code=code,
        t=time.monotonic(),
    )


def zipf_choice(rng: random.Random, names: list[str], s: float = 1.0) -> str:
    weights = [1 / (i + 1) ** s for i in range(len(names))]
    return rng.choices(names, weights)[0]


def run_clients(
    address: str, names: list[str], ns: argparse.Namespace, seconds: float, during=None
) -> list[dict]:
    results: list[dict] = []
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(i)
        with make_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            while time.monotonic() < stop:
                adapter = "" if rng.random() < ns.base_share else zipf_choice(rng, names)
                out = stream_once(stub, adapter, ns.max_new_tokens)
                with lock:
                    results.append(out)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(ns.clients)]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join()
    return results


def affinity(results: list[dict]) -> dict:
    by_adapter: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        if r["adapter"] and r["code"] == "OK":
            by_adapter[r["adapter"]][r["replica"]] += 1
    shares = {a: max(c.values()) / sum(c.values()) for a, c in by_adapter.items()}
    per_replica = collections.Counter(r["replica"] for r in results if r["code"] == "OK")
    total = sum(per_replica.values()) or 1
    return dict(
        requests=len(results),
        errors=sum(r["code"] != "OK" for r in results),
        min_adapter_share=min(shares.values()) if shares else None,
        adapters_seen=len(shares),
        replica_share={k: v / total for k, v in sorted(per_replica.items())},
        owner={a: c.most_common(1)[0][0] for a, c in by_adapter.items()},
    )


def overhead(fleet: Fleet, n: int, max_new_tokens: int) -> dict:
    channels = {name: make_channel(p.address) for name, p in fleet.replicas.items()}
    channels["router"] = make_channel(fleet.router.address)
    stubs = {k: pb_grpc.InferenceStub(c) for k, c in channels.items()}
    direct, routed = [], []
    for i in range(n):  # interleaved: both see the same load, caches and clock
        d = stream_once(stubs["r1" if i % 2 else "r2"], "", max_new_tokens)
        r = stream_once(stubs["router"], "", max_new_tokens)
        if i >= 4 and d["ttft"] and r["ttft"]:  # the first few warm connections and caches
            direct.append(d["ttft"])
            routed.append(r["ttft"])
    # The hop alone, without generation's noise: a unary call the server answers at once.
    unary_direct, unary_routed = [], []
    for i in range(5 * n):
        for stub, out in ((stubs["r1" if i % 2 else "r2"], unary_direct), (stubs["router"], unary_routed)):
            start = time.perf_counter()
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            out.append(time.perf_counter() - start)
    for c in channels.values():
        c.close()
    p50d, p50r = statistics.median(direct), statistics.median(routed)
    u50d, u50r = statistics.median(unary_direct[20:]), statistics.median(unary_routed[20:])
    return dict(
        samples=len(direct),
        direct_ttft_p50_ms=1e3 * p50d,
        router_ttft_p50_ms=1e3 * p50r,
        hop_ms=1e3 * (p50r - p50d),
        unary_samples=len(unary_direct) - 20,
        direct_unary_p50_ms=1e3 * u50d,
        router_unary_p50_ms=1e3 * u50r,
        unary_hop_ms=1e3 * (u50r - u50d),
    )


def failover(fleet: Fleet, names: list[str], owner: dict, ns: argparse.Namespace) -> dict:
    victim = "r2"
    port = fleet.replicas[victim].port
    marks: dict[str, float] = {}

    def kill_and_restart() -> None:
        time.sleep(ns.failover_seconds / 3)
        marks["killed"] = time.monotonic()
        fleet.replicas[victim].proc.kill()
        fleet.replicas[victim].proc.wait()
        fleet.restart(victim, port)
        marks["serving"] = time.monotonic()

    results = run_clients(fleet.router.address, names, ns, ns.failover_seconds, kill_and_restart)
    back_after = marks.get("serving", float("inf")) + FAIL_TIMEOUT_S + 1
    moved = {a for a, r in owner.items() if r == victim}
    late = [r for r in results if r["adapter"] in moved and r["t"] > back_after and r["code"] == "OK"]
    during = [r for r in results if marks.get("killed", 0) < r["t"] < marks.get("serving", 0)]
    return dict(
        requests=len(results),
        killed_to_serving_s=marks.get("serving", 0) - marks.get("killed", 0),
        errors_after_tokens=sum(r["code"] != "OK" and r["streamed"] for r in results),
        errors_before_tokens=sum(r["code"] != "OK" and not r["streamed"] for r in results),
        served_while_down=sum(r["code"] == "OK" for r in during),
        served_while_down_by_survivor=sum(r["code"] == "OK" and r["replica"] == "r1" for r in during),
        victim_adapters_back_share=(sum(r["replica"] == victim for r in late) / len(late)) if late else None,
        victim_adapter_requests_after_return=len(late),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--slots", type=int, default=4, help="--max-loras-per-batch of each replica")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--base-share", type=float, default=0.2)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--affinity-seconds", type=float, default=30)
    p.add_argument("--overhead-requests", type=int, default=60)
    p.add_argument("--failover-seconds", type=float, default=60)
    add_out_argument(p)
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="-- then extra flags for each replica")
    ns = p.parse_args()
    ns.server_args = [a for a in ns.server_args if a != "--"]
    if ns.model_path is None:
        from loraplex.services.inference.default_model import ensure_model

        ns.model_path = str(ensure_model())
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        work = Path(tmp)
        paths = make_adapters(ns.model_path, work / "adapters", ns.adapters, ns.rank)
        fleet = Fleet(ns, work)
        try:
            names = [f"ad-{i}" for i in range(ns.adapters)]
            with Client(fleet.router.address, store=fleet.store.address, timeout=120) as c:
                for name, path in zip(names, paths, strict=True):
                    c.register_adapter(name, str(path))
            result = dict(config={k: v for k, v in vars(ns).items() if k != "out"})
            result["affinity"] = affinity(run_clients(fleet.router.address, names, ns, ns.affinity_seconds))
            result["overhead"] = overhead(fleet, ns.overhead_requests, 1)
            result["failover"] = failover(fleet, names, result["affinity"]["owner"], ns)
        finally:
            fleet.stop()
    a, o, f = result["affinity"], result["overhead"], result["failover"]
    print(
        f"\n{ns.device}, {ns.adapters} adapters (Zipf), {ns.clients} streaming clients, "
        f"{ns.base_share:.0%} base, {ns.max_new_tokens} tokens each"
    )
    print("| phase | measure | value |\n| --- | --- | --- |")
    print(f"| affinity | requests / errors | {a['requests']} / {a['errors']} |")
    print(
        f"| affinity | lowest share of an adapter's requests on its replica | {a['min_adapter_share']:.3f} "
        f"({a['adapters_seen']} adapters) |"
    )
    shares = ", ".join(f"{k} {v:.2f}" for k, v in a["replica_share"].items())
    print(f"| affinity | traffic per replica | {shares} |")
    print(
        f"| overhead | TTFT p50 direct / through nginx ({o['samples']} each) | "
        f"{o['direct_ttft_p50_ms']:.2f} / {o['router_ttft_p50_ms']:.2f} ms (hop {o['hop_ms']:+.2f} ms) |"
    )
    print(
        f"| overhead | GetModelInfo p50 direct / through nginx ({o['unary_samples']} each) | "
        f"{o['direct_unary_p50_ms']:.2f} / {o['router_unary_p50_ms']:.2f} ms "
        f"(hop {o['unary_hop_ms']:+.2f} ms) |"
    )
    print(
        f"| failover | requests; errors before any token / after tokens | {f['requests']}; "
        f"{f['errors_before_tokens']} / {f['errors_after_tokens']} |"
    )
    print(
        f"| failover | served while r2 was down (by r1) | {f['served_while_down']} "
        f"({f['served_while_down_by_survivor']}); down {f['killed_to_serving_s']:.1f} s |"
    )
    back = f["victim_adapters_back_share"]
    print(
        f"| failover | r2's adapters served by r2 after it returned | "
        f"{'n/a' if back is None else f'{back:.2f}'} ({f['victim_adapter_requests_after_return']} requests) |"
    )
    result["affinity"].pop("owner")
    write_json(ns.out, "router", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
