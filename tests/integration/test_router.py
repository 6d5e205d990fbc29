"""Two inference replicas behind the nginx router (deploy/nginx/loraplex.conf), one adapter store.

Checks what the router promises: every response names its replica (trailing metadata
x-loraplex-replica, errors too); a request naming an adapter (x-loraplex-adapter) always
lands on the same replica and both replicas get adapters; base requests alternate; fleet
LoadAdapter/UnloadAdapter act through the store; a killed replica's requests that had sent
nothing yet succeed on the other, which pulls its adapters, and its share returns when it
is back.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time

import grpc
import pytest

from loraplex.clients import Client, NotFound
from loraplex.clients.processes import ServerProcess
from loraplex.clients.requests import make_channel, routing_metadata
from loraplex.clients.router import FAIL_TIMEOUT_S, start_router
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.service_stack import STARTUP_S, STORE_STACK_SHAPE, scrape, shared, start_store

PROMPT = "List 3 countries and their capitals."
ADAPTERS = [f"route-{i}" for i in range(12)]
REPLICA_FLAGS = [
    "--listen-when-ready",
    "--device",
    "cpu",
    "--metrics-port",
    "0",
    "--max-total-tokens",
    "4096",
    "--grace-period",
    "2",
    "--max-lora-rank",
    str(STORE_STACK_SHAPE["r"]),
    "--lora-target-modules",
    *STORE_STACK_SHAPE["target_modules"],
]


def start_replica(model, store, cache, replica: str, port: int = 0) -> ServerProcess:
    return ServerProcess(
        replica,
        "loraplex.services.inference",
        [
            "--model-path",
            str(model),
            "--port",
            str(port),
            "--adapter-store",
            store.address,
            "--adapter-cache-dir",
            str(cache),
            "--replica-id",
            replica,
            *REPLICA_FLAGS,
        ],
        echo=False,
    )


class Stack:
    def __init__(self, request, tmp_path_factory, model) -> None:
        self.model, self.tmp = model, tmp_path_factory
        self.store = shared(
            request.config, "store", lambda: start_store(tmp_path_factory.mktemp("store"), model)
        )
        self.replicas = {
            name: start_replica(model, self.store, tmp_path_factory.mktemp(name), name)
            for name in ("r1", "r2")
        }
        self.router: ServerProcess | None = None
        self.channel = None

    def start(self) -> None:
        for proc in self.replicas.values():  # both load at once
            proc.wait_serving(STARTUP_S)
        self.router = start_router(
            self.tmp.mktemp("router"), [p.address for p in self.replicas.values()], echo=False
        )
        self.router.wait_serving(30)
        self.channel = make_channel(self.router.address)
        self.stub = pb_grpc.InferenceStub(self.channel)

    def generate(self, adapter: str = "", stub=None, max_new_tokens: int = 1, timeout: float = 60):
        """(response, replica that answered) of a Generate through the router (or `stub`)."""
        params = pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        request = pb.GenerateRequest(
            text=[PROMPT], adapter=[adapter] if adapter else [], sampling_params=params
        )
        response, call = (stub or self.stub).Generate.with_call(
            request, timeout=timeout, metadata=routing_metadata(None, [adapter])
        )
        return response, replica_of(call)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        for proc in [self.router, *self.replicas.values()]:
            if proc is not None:
                proc.stop()


def replica_of(call) -> str:
    return dict(call.trailing_metadata() or ()).get("x-loraplex-replica", "")


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory, smollm2_path, adapter_factory):
    s = Stack(request, tmp_path_factory, smollm2_path)
    try:
        sources = [
            adapter_factory(smollm2_path, f"route-src-{i}", seed=40 + i, **STORE_STACK_SHAPE)
            for i in range(2)
        ]
        s.start()
        with Client(s.router.address, store=s.store.address, timeout=60) as c:
            for i, name in enumerate(ADAPTERS):
                c.register_adapter(name, str(sources[i % 2]))
        s.sources = sources
        yield s
    finally:
        if s.router is not None:
            print("router log:\n" + s.router.output()[-3000:])
        s.stop()


def test_every_response_names_its_replica(stack):
    for name, proc in stack.replicas.items():
        with make_channel(proc.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            _, replica = stack.generate(stub=stub)
            assert replica == name
            stream = stub.GenerateStream(
                pb.GenerateRequest(text=[PROMPT], sampling_params=pb.SamplingParams(max_new_tokens=2)),
                timeout=60,
            )
            assert list(stream) and replica_of(stream) == name
            with pytest.raises(grpc.RpcError) as err:  # errors carry it too, beside the rich status
                stack.generate("never-registered", stub=stub)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and replica_of(err.value) == name
            assert "grpc-status-details-bin" in dict(err.value.trailing_metadata())


def test_each_adapter_sticks_to_one_replica(stack):
    served: dict[str, collections.Counter] = {}
    for _ in range(3):
        for name in ADAPTERS:
            response, replica = stack.generate(name)
            assert response.completions[0].adapter == name
            served.setdefault(name, collections.Counter())[replica] += 1
    assert all(len(c) == 1 for c in served.values()), served
    owners = collections.Counter(next(iter(c)) for c in served.values())
    assert set(owners) == {"r1", "r2"}, owners  # 12 names on 2 replicas: both get some
    stack.owner = {name: next(iter(c)) for name, c in served.items()}
    # a replica pulled only the adapters routed to it
    for replica, proc in stack.replicas.items():
        with make_channel(proc.address) as channel:
            local = {
                a.name
                for a in pb_grpc.InferenceStub(channel).ListAdapters(pb.ListAdaptersRequest()).adapters
                if a.location != pb.ADAPTER_LOCATION_STORE
            }
        assert {n for n in ADAPTERS if stack.owner[n] == replica} == local & set(ADAPTERS)


def test_residency_metrics_per_replica(stack):
    """Each replica reports where every adapter lives on it, and the vllm:lora_requests_info shape."""
    name = ADAPTERS[0]
    owner = stack.owner[name]
    other = next(r for r in stack.replicas if r != owner)

    def location(replica: str) -> str:
        samples = scrape(stack.replicas[replica])
        found = [
            loc
            for loc in ("gpu", "host", "store")
            if samples.get(
                f'loraplex_adapter_location{{adapter="{name}",location="{loc}",replica="{replica}"}}'
            )
        ]
        return found[0] if found else ""

    # Not pulled on the other replica: no row of its own there (series stay bounded), but counted
    # among the adapters that live only in the store, which each replica learns from WatchAdapters.
    assert location(other) == "", [k for k in scrape(stack.replicas[other]) if name in k]
    assert scrape(stack.replicas[other])["loraplex_store_adapters"] >= 1
    assert location(owner) in ("gpu", "host")
    samples = scrape(stack.replicas[owner])
    assert samples[f'loraplex_adapter_queued_requests{{adapter="{name}",replica="{owner}"}}'] == 0
    [info] = [k for k in samples if k.startswith("loraplex_lora_requests_info{")]
    slots = int(samples["loraplex_lora_slots_total"])
    assert slots > 0 and f'max_lora="{slots}"' in info
    assert "running_lora_adapters=" in info and "waiting_lora_adapters=" in info


def test_python_client_sends_the_routing_header(stack):
    """A batch naming several adapters is routed by its first; the client API sets the header."""
    name = ADAPTERS[0]
    with Client(stack.router.address, timeout=60) as c:
        for _ in range(3):
            c.generate([PROMPT, PROMPT], ["", name], max_new_tokens=1)
    proc = stack.replicas[stack.owner[name]]
    assert scrape(proc).get(f'loraplex_requests_total{{adapter="{name}",code="OK"}}', 0) >= 6


def test_base_requests_go_round_robin(stack):
    replicas = collections.Counter(stack.generate()[1] for _ in range(8))
    assert set(replicas) == {"r1", "r2"} and min(replicas.values()) >= 3, replicas


def test_fleet_load_and_unload_go_through_the_store(stack):
    with Client(stack.router.address, store=stack.store.address, timeout=60) as c:
        info = c.load_adapter("route-fleet", str(stack.sources[0]))
        assert info.name == "route-fleet"
        assert c.get_adapter("route-fleet").digest  # registered in the store: the fleet has it
        for proc in stack.replicas.values():  # every replica serves it (the other one pulls on demand)
            with make_channel(proc.address) as channel:
                response, _ = stack.generate("route-fleet", stub=pb_grpc.InferenceStub(channel))
                assert response.completions[0].adapter == "route-fleet"
        c.unload_adapter("route-fleet")
        assert "route-fleet" not in {r.name for r in c.list_store_adapters()}
        with pytest.raises(NotFound):
            c.unload_adapter("route-fleet")
    deadline = time.monotonic() + 10
    for proc in stack.replicas.values():  # each replica dropped it (WatchAdapters), none pulls it back
        with make_channel(proc.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            while "route-fleet" in {a.name for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}:
                assert time.monotonic() < deadline, "a replica kept the unloaded adapter"
                time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as err:
                stack.generate("route-fleet", stub=stub)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_failover_and_return(stack):
    victim = "r2"
    moved = [n for n in ADAPTERS if stack.owner[n] == victim]
    proc = stack.replicas[victim]
    port = proc.port
    # Unary generations in flight on the victim have sent nothing yet: killed under them, they are
    # retried on the survivor and succeed.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stack.generate, moved[i % len(moved)], None, 48) for i in range(4)]
        time.sleep(0.3)
        proc.proc.kill()
        proc.proc.wait()
        results = [f.result() for f in futures]
    assert all(r.completions[0].completion_tokens > 0 for r, _ in results)
    assert {replica for _, replica in results} == {"r1"}
    # every adapter, and the base model, is served by the survivor; it pulled the victim's adapters
    for name in ["", *ADAPTERS]:
        assert stack.generate(name)[1] == "r1"
    with make_channel(stack.replicas["r1"].address) as channel:
        local = {
            a.name
            for a in pb_grpc.InferenceStub(channel).ListAdapters(pb.ListAdaptersRequest()).adapters
            if a.location != pb.ADAPTER_LOCATION_STORE
        }
    assert set(moved) <= local
    # back on the same port: after nginx's fail_timeout its adapters return to it
    stack.replicas[victim] = start_replica(
        stack.model, stack.store, stack.tmp.mktemp("r2-again"), victim, port
    )
    stack.replicas[victim].wait_serving(STARTUP_S)
    time.sleep(FAIL_TIMEOUT_S + 0.5)
    deadline = time.monotonic() + 20
    while {stack.generate(n)[1] for n in moved} != {victim}:
        assert time.monotonic() < deadline, "the restarted replica did not get its adapters back"
        time.sleep(0.5)
