"""Faults the whole stack survives: real Redis, adapter store and inference server as processes.

One stack for the module: redis-server (stopped and restarted by a test) ← adapter store
(mutual TLS, --redis-url) ← a cutting TCP proxy ← inference server on the tiny Llama, which
talks TLS to the store through the proxy (--adapter-store-tls-ca, its own --tls-cert/--tls-key as
the client certificate) and has a KV cache of only 256 tokens. Faults: pulls cut by the proxy
(once, always), the store SIGKILLed mid-pull and restarted, a client gone mid-stream, KV
exhaustion, a store delete under running requests, Redis stopped and restarted, SIGTERM under
load. The SIGTERM test ends the inference server, so it runs last.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplex.clients import Client
from loraplex.clients.processes import ServerProcess
from loraplex.services.inference.store_pull import content_dir_name
from loraplex.v1 import adapter_store_pb2 as spb
from loraplex.v1 import adapter_store_pb2_grpc as spb_grpc
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.reliability_proxy import CuttingProxy
from tests.support.service_stack import STARTUP_S, scrape
from tests.support.store_helpers import RedisServer, start_store_process

KV_TOKENS = 256
BIG_RANK = 256  # ~2 MB of fp32 weights on the tiny model: a pull spans many HTTP/2 frames


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> Path:
    """A CA and one certificate for 127.0.0.1 (no EKU, so usable as server and as client)."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=loraplex-test-ca",
        cwd=d,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "node.key",
        "-out",
        "node.csr",
        "-subj",
        "/CN=loraplex-node",
        cwd=d,
    )
    (d / "node.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "node.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "node.pem",
        "-days",
        "2",
        "-extfile",
        "node.ext",
        cwd=d,
    )
    return d


def start_tls_store(
    pki: Path, cache: Path, redis: RedisServer, base_model: Path, port: int = 0
) -> ServerProcess:
    return start_store_process(
        cache,
        "--redis-url",
        redis.url,
        "--base-model",
        str(base_model),
        "--port",
        str(port),
        "--tls-cert",
        str(pki / "node.pem"),
        "--tls-key",
        str(pki / "node.key"),
        "--tls-ca",
        str(pki / "ca.pem"),
        credentials=node_credentials(pki),
    )


def node_credentials(pki: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "node.key").read_bytes(),
        certificate_chain=(pki / "node.pem").read_bytes(),
    )


class Stack:
    def __init__(
        self,
        pki: Path,
        redis: RedisServer,
        store: ServerProcess,
        proxy: CuttingProxy,
        inference: ServerProcess,
        cache: Path,
        store_cache: Path,
        base_model: Path,
    ) -> None:
        self.pki, self.redis, self.store, self.proxy, self.inference, self.cache = (
            pki,
            redis,
            store,
            proxy,
            inference,
            cache,
        )
        self.store_cache, self.base_model = store_cache, base_model
        self.creds = node_credentials(pki)
        self.channel = grpc.secure_channel(inference.address, self.creds)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.store_channel = grpc.secure_channel(store.address, self.creds)
        self.store_stub = spb_grpc.AdapterStoreStub(self.store_channel)

    def generate(
        self, adapter: str = "", n: int = 8, timeout: float = 60, text: str = "Hello there"
    ) -> pb.Completion:
        params = pb.SamplingParams(max_new_tokens=n, ignore_eos=True)
        req = pb.GenerateRequest(text=[text], adapter=[adapter] if adapter else [], sampling_params=params)
        return self.stub.Generate(req, timeout=timeout).completions[0]

    def register(self, name: str, source: Path) -> spb.AdapterRecord:
        return self.store_stub.RegisterAdapter(
            spb.RegisterAdapterRequest(name=name, source=str(source)), timeout=60
        )

    def location(self, name: str) -> int | None:
        for a in self.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters:
            if a.name == name:
                return a.location
        return None

    def serving(self) -> bool:
        check = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return check.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_path):
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    redis = RedisServer()
    redis.start()
    procs: list[ServerProcess] = []
    proxy = stack = None
    try:
        store_cache = tmp_path_factory.mktemp("store")
        store = start_tls_store(pki, store_cache, redis, tiny_llama_path)
        procs.append(store)
        proxy = CuttingProxy(store.address)
        cache = tmp_path_factory.mktemp("inference-adapters")
        inference = ServerProcess(
            "inference",
            "loraplex.services.inference",
            [
                "--model-path",
                str(tiny_llama_path),
                "--port",
                "0",
                "--device",
                "cpu",
                "--metrics-port",
                "0",
                "--max-total-tokens",
                str(KV_TOKENS),
                "--page-size",
                "16",
                "--grace-period",
                "10",
                "--max-lora-rank",
                str(BIG_RANK),
                "--adapter-store",
                proxy.address,
                "--adapter-cache-dir",
                str(cache),
                "--adapter-store-tls-ca",
                str(pki / "ca.pem"),
                "--tls-cert",
                str(pki / "node.pem"),
                "--tls-key",
                str(pki / "node.key"),
                "--log-level",
                "debug",
            ],
            echo=False,
        )
        procs.append(inference)
        inference.wait_serving(STARTUP_S, tls_ca=str(pki / "ca.pem"))
        stack = Stack(pki, redis, store, proxy, inference, cache, store_cache, tiny_llama_path)
        yield stack
    finally:
        for proc in reversed(procs):
            proc.stop()
        if procs and stack.store is not procs[0]:  # restarted by a test
            stack.store.stop()
        if proxy is not None:
            proxy.close()
        redis.close()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_path, adapter_factory):
    def make(name: str, r: int = 4, seed: int = 0) -> Path:
        return adapter_factory(
            tiny_llama_path,
            name,
            r=r,
            lora_alpha=2 * r,
            seed=seed,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )

    return make


def _no_partial_pulls(cache: Path) -> None:
    leftovers = [p.name for p in cache.iterdir() if p.name.startswith(".pull-")]
    assert not leftovers, f"half-pulled copies left in the cache: {leftovers}"


def test_store_channel_is_mutual_tls(stack):
    """The store refuses anyone without a client certificate, yet the inference server pulls from it."""
    with (
        grpc.secure_channel(
            stack.store.address,
            grpc.ssl_channel_credentials(root_certificates=(stack.pki / "ca.pem").read_bytes()),
        ) as channel,
        pytest.raises(grpc.RpcError) as e,
    ):
        spb_grpc.AdapterStoreStub(channel).ListAdapters(spb.ListStoreAdaptersRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "client certificates" in stack.store.output()
    pki = stack.pki
    with Client(
        stack.inference.address,
        store=stack.store.address,
        tls_ca=str(pki / "ca.pem"),
        tls_cert=str(pki / "node.pem"),
        tls_key=str(pki / "node.key"),
        timeout=30,
    ) as client:
        assert client.health() == "SERVING"
        client.list_store_adapters()  # the Python client presents its certificate too


def test_pull_cut_halfway_is_retried_and_digest_checked(stack, adapters):
    record = stack.register("big-cut-once", adapters("big-cut-once", r=BIG_RANK, seed=1))
    assert record.size_bytes > 1_500_000
    stack.proxy.arm(record.size_bytes // 2, times=1)
    out = stack.generate("big-cut-once")
    assert out.completion_tokens == 8
    assert stack.proxy.cuts == 1, "the proxy never cut the pull: the test did not test anything"
    assert "retrying" in stack.inference.output()
    [info] = [
        a
        for a in stack.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
        if a.name == "big-cut-once"
    ]
    assert info.digest == record.digest and info.location == pb.ADAPTER_LOCATION_GPU
    local = stack.cache / content_dir_name(record.digest, record.config_digest) / "adapter_model.safetensors"
    import hashlib

    assert "sha256:" + hashlib.sha256(local.read_bytes()).hexdigest() == record.digest
    _no_partial_pulls(stack.cache)


def test_pull_that_keeps_breaking_is_unavailable_and_leaves_no_half_adapter(stack, adapters):
    record = stack.register("big-cut-always", adapters("big-cut-always", r=BIG_RANK, seed=2))
    stack.proxy.arm(record.size_bytes // 3, times=10)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stack.generate("big-cut-always")
    finally:
        stack.proxy.disarm()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "big-cut-always" in e.value.details()
    assert stack.location("big-cut-always") == pb.ADAPTER_LOCATION_STORE  # known to the store only
    assert not (stack.cache / content_dir_name(record.digest, record.config_digest)).exists()
    _no_partial_pulls(stack.cache)
    assert stack.generate("big-cut-always").completion_tokens == 8  # the network is back: it pulls
    assert stack.serving()


def test_store_killed_mid_pull_leaves_no_half_adapter_and_recovers(stack, adapters):
    record = stack.register("big-crash", adapters("big-crash", r=BIG_RANK, seed=6))
    outcome: dict = {}

    def request() -> None:
        try:
            outcome["tokens"] = stack.generate("big-crash", timeout=120).completion_tokens
        except grpc.RpcError as err:
            outcome["code"], outcome["details"] = err.code(), err.details()

    stack.proxy.throttle_s = 0.02  # ~3 MB/s: the pull takes about a second
    start = stack.proxy.downstream_bytes
    worker = threading.Thread(target=request)
    worker.start()
    try:
        _wait(
            lambda: stack.proxy.downstream_bytes - start > record.size_bytes // 3, 60, "the pull to get going"
        )
        stack.store.proc.kill()  # SIGKILL: no drain, the stream just dies
        stack.store.proc.wait(10)
        # The kernel still sends what the killed process had written (on loopback its send buffer
        # grows to megabytes, most of this pull); cutting the proxy's connections loses it, as a
        # lost host would, so the stream ends part-way whatever the buffers held.
        stack.proxy.cut_all()
        worker.join(120)
    finally:
        stack.proxy.throttle_s = 0.0
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
    assert not (stack.cache / content_dir_name(record.digest, record.config_digest)).exists()
    _no_partial_pulls(stack.cache)
    assert stack.location("big-crash") is None  # neither loaded nor (store down) listed
    assert stack.generate("").completion_tokens == 8  # the base model is unaffected
    port = stack.store.port
    stack.store = start_tls_store(stack.pki, stack.store_cache, stack.redis, stack.base_model, port)

    def pulled() -> bool:
        try:
            return stack.generate("big-crash").completion_tokens == 8
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
            return False

    _wait(pulled, 30, "the pull to succeed once the store is back")
    _no_partial_pulls(stack.cache)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_client_disconnect_mid_stream_frees_kv(stack):
    before = scrape(stack.inference).get('loraplex_aborted_requests_total{reason="cancelled"}', 0.0)
    params = pb.SamplingParams(max_new_tokens=200, ignore_eos=True)
    stream = stack.stub.GenerateStream(
        pb.GenerateRequest(text=["Tell me a long story"] * 2, sampling_params=params), timeout=60
    )
    got = [next(stream) for _ in range(4)]
    assert got and all(not m.finish_reason for m in got)
    stream.cancel()

    def freed() -> bool:
        m = scrape(stack.inference)
        return (
            m.get('loraplex_aborted_requests_total{reason="cancelled"}', 0.0) >= before + 2
            and m["loraplex_requests_running"] == 0
            and m["loraplex_kv_blocks_free"] == m["loraplex_kv_blocks_total"]
        )

    _wait(freed, 15, "the cancelled stream's KV blocks to be freed")
    assert stack.generate(n=4).completion_tokens == 4


def test_kv_exhaustion_under_load_preempts_and_everyone_finishes(stack):
    """16 requests x ~60 tokens need ~4x the 256-token KV cache at once."""
    n, new = 16, 48
    results: list[pb.Completion | grpc.RpcError] = []

    def one(i: int) -> None:
        try:
            results.append(stack.generate(n=new, text=f"Request number {i} says hello", timeout=120))
        except grpc.RpcError as err:
            results.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    errors = [r for r in results if isinstance(r, grpc.RpcError)]
    assert not errors, [(e.code(), e.details()) for e in errors]
    assert len(results) == n and all(r.completion_tokens == new for r in results)
    assert "preempted" in stack.inference.output(), "KV never ran out: the test did not test preemption"
    assert stack.serving()


def test_adapter_deleted_in_store_while_requests_use_it(stack, adapters):
    stack.register("doomed", adapters("doomed", seed=3))
    params = pb.SamplingParams(max_new_tokens=40, ignore_eos=True)
    stream = stack.stub.GenerateStream(
        pb.GenerateRequest(text=["One", "Two", "Three"], adapter=["doomed"], sampling_params=params),
        timeout=120,
    )
    first = next(stream)
    assert first.text or first.token_ids
    deleted = stack.store_stub.DeleteAdapter(spb.DeleteAdapterRequest(name="doomed"), timeout=30)
    assert deleted.deleted
    finished = [first] + list(stream)  # the running requests finish on the version they started with
    ends = [m for m in finished if m.finish_reason]
    assert sorted(m.index for m in ends) == [0, 1, 2]
    assert all(m.finish_reason == "length" and m.completion_tokens == 40 for m in ends)

    def refused() -> bool:
        try:
            stack.generate("doomed", n=2)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND, (err.code(), err.details())
            return True
        return False

    _wait(refused, 15, "new requests for the deleted adapter to get NOT_FOUND")
    assert stack.location("doomed") is None


def test_redis_down_and_back_while_the_stack_runs(stack, adapters):
    stack.register("warm", adapters("warm", seed=4))
    stack.register("cold", adapters("cold", seed=5))
    assert stack.generate("warm").completion_tokens == 8  # now resident
    stack.redis.stop()
    try:
        for _ in range(3):
            assert stack.generate("warm").completion_tokens == 8
            assert stack.generate("").completion_tokens == 8
        with pytest.raises(grpc.RpcError) as e:
            stack.generate("cold")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (e.value.code(), e.value.details())
        assert stack.serving()
    finally:
        stack.redis.start()

    def cold_works() -> bool:
        try:
            return stack.generate("cold").completion_tokens == 8
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
            return False

    _wait(cold_works, 30, "the cold adapter to load once Redis is back")
    assert stack.generate("warm").completion_tokens == 8


def test_sigterm_during_load_finishes_in_flight_and_exits_0(stack):
    """Runs last: it ends the module's inference server."""
    n = 8
    outcomes: dict[int, object] = {}
    streaming = threading.Barrier(n + 1, timeout=60)

    def one(i: int) -> None:
        params = pb.SamplingParams(max_new_tokens=60, ignore_eos=True)
        tokens, passed = 0, False
        try:
            for msg in stack.stub.GenerateStream(
                pb.GenerateRequest(text=[f"Client {i}"], sampling_params=params), timeout=120
            ):
                tokens += len(msg.token_ids)
                if not passed:
                    passed = True
                    streaming.wait()
                if msg.finish_reason:
                    outcomes[i] = (msg.finish_reason, tokens)
        except grpc.RpcError as err:
            outcomes[i] = err.code()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    streaming.wait()  # every client has its first tokens: all are in flight
    stack.inference.proc.send_signal(signal.SIGTERM)
    _wait(lambda: "draining" in stack.inference.output(), 10, "the server to start draining")
    with pytest.raises(grpc.RpcError) as late:
        stack.generate(n=2, timeout=10)
    assert late.value.code() == grpc.StatusCode.UNAVAILABLE
    for t in threads:
        t.join(120)
    assert stack.inference.proc.wait(60) == 0, stack.inference.output()[-3000:]
    clean = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
    assert all(o == ("length", 60) or o in clean for o in outcomes.values()), outcomes
    finished = sum(1 for o in outcomes.values() if o == ("length", 60))
    assert finished == n, f"within a 10 s grace all {n} in-flight requests should finish: {outcomes}"
    assert re.search(r"draining: \d+ RPCs running", stack.inference.output())
