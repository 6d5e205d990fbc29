"""The inference gRPC server: Inference + Health + reflection, engine start-up, SIGTERM drain.

Lifecycle: bind and answer Health (NOT_SERVING) at once → build and warm the engine in
the background → SERVING (with --listen-when-ready, the port is bound only at that point).
On SIGTERM/SIGINT: NOT_SERVING, new work is refused with UNAVAILABLE, running RPCs get up
to --grace-period to finish, then the server stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraplex.kernels.compile_watch import compile_counter
from loraplex.services.inference import auth, store_watch
from loraplex.services.inference.adapter_resolver import AdapterResolver
from loraplex.services.inference.default_model import default_cache_dir
from loraplex.services.inference.engine.api import Engine
from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.errors import BackendUnavailable
from loraplex.services.inference.metrics import Metrics
from loraplex.services.inference.models.config import UnsupportedModelError
from loraplex.services.inference.replica import ReplicaInterceptor, replica_id
from loraplex.services.inference.server_args import ServerArgs
from loraplex.services.inference.servicer import InferenceServicer, ServerState
from loraplex.services.inference.store_client import StoreClient
from loraplex.services.inference.store_rpc import channel_credentials
from loraplex.v1 import inference_pb2, inference_pb2_grpc
from loraplex.wire import MalformedRequestInterceptor

log = logging.getLogger("loraplex.services.inference")

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
METRICS_REFRESH_S = 1.0


def grpc_options(args: ServerArgs) -> list[tuple[str, int]]:
    """Message limits and keepalive that let a long unary Generate live.

    The server pings idle connections every 30 s and lets clients ping every 10 s even
    with no data in flight; clients should set `grpc.keepalive_time_ms` >= 10000
    (docs/walkthrough.md). grpc's own size limit sits above --max-message-bytes so an
    oversized request gets our INVALID_ARGUMENT rather than grpc's RESOURCE_EXHAUSTED.
    """
    limit = args.max_message_bytes + (1 << 20)
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


EngineFactory = Callable[[ServerArgs], Engine]
"""Builds (and starts) the engine for the flags; blocking, so the server runs it on a thread."""


def build_engine(args: ServerArgs) -> Engine:
    """The serving engine for `args` (one device, or tensor parallel for --tp-size > 1)."""
    # Imported here, not at the top: torch and the model code take seconds to import, and the
    # port should answer Health (NOT_SERVING) while they load.
    from loraplex.services.inference.engine.build import build_engine as build

    return build(args.engine, args.lora)


class InferenceServer:
    def __init__(self, args: ServerArgs, engine_factory: EngineFactory = build_engine) -> None:
        self.args = args
        self.engine_factory = engine_factory
        self.state = ServerState()
        self.metrics = Metrics(replica_id(args.replica_id), args.metrics_max_adapters)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            options=grpc_options(args),
            interceptors=[
                ReplicaInterceptor(replica_id(args.replica_id)),
                *auth.interceptors(args),
                MalformedRequestInterceptor(f"/{SERVICE_NAME}/"),
            ],
        )
        self.store: StoreClient | None = None
        self.port = 0
        self._listening = False
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> int:
        inference_pb2_grpc.add_InferenceServicer_to_server(
            InferenceServicer(self.args, self.state, self.metrics), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        await self._set_health(False)
        if not self.args.listen_when_ready:
            await self._listen()
        else:
            auth.server_credentials(self.args)  # bad TLS flags fail now, not after the model loads
        if self.args.metrics_port is not None:
            mport = self.metrics.serve(self.args.host, self.args.metrics_port)
            log.info("metrics on http://%s:%d/metrics", self.args.host, mport)
        if self.args.adapter_store and self.args.adapter_store != "none":
            cache = Path(self.args.adapter_cache_dir or default_cache_dir() / "inference")
            credentials = channel_credentials(
                self.args.adapter_store_tls_ca, self.args.tls_cert, self.args.tls_key
            )
            self.store = StoreClient(
                self.args.adapter_store,
                cache,
                on_pull=self._on_pull,
                token=self.args.admin_token,
                credentials=credentials,
                cache_max_bytes=self.args.adapter_cache_max_bytes,
            )
        self._tasks.append(asyncio.create_task(self._bring_up()))
        return self.port

    async def _listen(self) -> None:
        address = f"{self.args.host}:{self.args.port}"
        credentials = auth.server_credentials(self.args)
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)
        if self.port == 0:
            raise SystemExit(f"could not bind {address}")
        await self.server.start()
        self._listening = True
        log.info(
            "listening on %s:%d%s%s",
            self.args.host,
            self.port,
            " (TLS)" if credentials else "",
            ", tokens required" if self.args.api_token or self.args.admin_token else "",
        )

    def _on_pull(self, nbytes: int) -> None:
        self.metrics.store_pulls.inc()
        self.metrics.store_pull_bytes.inc(nbytes)

    async def _bring_up(self) -> None:
        try:
            engine = await asyncio.to_thread(self.engine_factory, self.args)
            resolver = AdapterResolver(engine, self.store, self.metrics, self.args.allowed_local_dirs)
            await self._preload(engine, resolver)
            await self._warm_up(engine)
        except Exception as exc:
            if isinstance(exc, UnsupportedModelError):  # a refusal whose message says it all: one line
                log.error("engine failed to start: %s", exc)
            else:
                log.exception("engine failed to start")
            self.state.not_ready = BackendUnavailable(f"engine failed to start: {exc}")
            self._stop.set()
            self.exit_code = 1
            return
        self.state.engine, self.state.resolver = engine, resolver
        self.metrics.live_names = lambda: {a.name for a in engine.list_adapters()} | set(resolver.in_flight)
        if self.args.listen_when_ready:
            try:
                await self._listen()
            except SystemExit as exc:
                log.error("%s", exc)
                self.exit_code = 1
                self._stop.set()
                return
        if self.store is not None:
            self.store.cache.in_use = resolver.cache_dirs_in_use
            self._tasks.append(asyncio.create_task(store_watch.watch(self.store, resolver.on_store_event)))
        self._tasks.append(asyncio.create_task(self._refresh_metrics()))
        if not self.state.draining:
            await self._set_health(True)
            log.info("model loaded and warmed up: SERVING")

    async def _preload(self, engine: Engine, resolver: AdapterResolver) -> None:
        """--lora-paths the engine did not load itself (it loads them when it can)."""
        for name, source in self.args.lora.path_map.items():
            if not engine.has_adapter(name):
                await resolver.load(name, source, "", pin=False)

    async def _warm_up(self, engine: Engine) -> None:
        params = SamplingParams(max_new_tokens=2)
        async for _ in engine.generate("warmup", "Hello", None, params):
            pass

    async def _refresh_metrics(self) -> None:
        """Every second: engine metrics, and health (a dead engine or TP worker -> NOT_SERVING)."""
        engine, resolver = self.state.engine, self.state.resolver
        assert engine is not None and resolver is not None, "started once the engine is up"
        engine_down = False
        while True:
            try:
                stats = engine.stats()
                self.metrics.observe_engine(stats)
                adapters = engine.list_adapters()
                self.metrics.observe_compiles(compile_counter.after_start)
                # Series of adapters neither loaded nor busy here (deleted, unloaded) go first.
                self.metrics.prune({a.name for a in adapters} | set(resolver.in_flight))
                self.metrics.observe_adapters(adapters)
                store_names = self.store.known_names if self.store is not None else ()
                self.metrics.observe_residency(
                    adapters, store_names, resolver.in_flight, stats.lora_slots_total
                )
            except Exception:  # noqa: BLE001 - metrics never take the server down
                log.debug("metrics refresh failed", exc_info=True)
            if not engine_down and not engine.healthy():
                engine_down = True
                reason = engine.unhealthy_reason()
                log.error("engine unhealthy: %s; health is NOT_SERVING until the server is restarted", reason)
                self.state.not_ready = BackendUnavailable(f"engine unhealthy: {reason}")
                await self._set_health(False)
            await asyncio.sleep(METRICS_REFRESH_S)

    async def drain(self) -> None:
        """Refuse new work, let running RPCs finish up to the grace period, then stop."""
        log.info("draining: %d RPCs running, grace %.1fs", self.state.active_rpcs, self.args.grace_period)
        self.state.draining = True
        await self._set_health(False)
        try:
            await asyncio.wait_for(self.state.idle.wait(), timeout=self.args.grace_period)
        except TimeoutError:
            log.warning("grace period over with %d RPCs running; cancelling them", self.state.active_rpcs)
        if self._listening:
            await self.server.stop(grace=1.0)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if self.store is not None:
            await self.store.close()
        if self.state.engine is not None:
            await self.state.engine.shutdown()
        log.info("stopped")

    async def run_until_signal(self) -> int:
        self.exit_code = 0
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self.start()
        await self._stop.wait()
        await self.drain()
        return self.exit_code


def main(args: ServerArgs) -> int:
    async def run() -> int:
        # grpc.aio objects bind to the running loop: build the server inside it.
        return await InferenceServer(args).run_until_signal()

    return asyncio.run(run())
