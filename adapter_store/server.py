"""Build the store (Redis, blobs, registry) and serve it over grpc.aio until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from loraplex.adapter_store.auth import AdminTokenInterceptor
from loraplex.adapter_store.base_model import load_base_model_shapes
from loraplex.adapter_store.blobs import BlobCache
from loraplex.adapter_store.cli.args import StoreConfig
from loraplex.adapter_store.index import AdapterIndex
from loraplex.adapter_store.redis_embedded import EmbeddedRedis, connect, describe
from loraplex.adapter_store.registry import AdapterRegistry
from loraplex.adapter_store.servicer import AdapterStoreServicer, CallerGoneFilter
from loraplex.adapter_store.source_fetcher import SourceFetcher
from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc
from loraplex.wire import MalformedRequestInterceptor

log = logging.getLogger("adapter_store")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdapterStore"].full_name


async def serve(config: StoreConfig) -> None:
    config.cache_dir.mkdir(parents=True, exist_ok=True)
    blobs = BlobCache(config.cache_dir)
    blobs.clean_staging()
    embedded = EmbeddedRedis(config.cache_dir / "redis") if not config.redis_url else None
    client = embedded.client() if embedded else connect(config.redis_url)
    index = AdapterIndex(client, config.key_prefix, config.lock_timeout_s, config.events_max_len)
    base = None
    if config.base_model:
        base = await asyncio.to_thread(
            load_base_model_shapes, config.base_model, endpoint=config.hf_endpoint, token=config.hf_token
        )
        log.info("checking adapters against base model %s (%d layers)", base.name, base.num_layers)
    registry = AdapterRegistry(config, index, blobs, SourceFetcher(config), base)
    try:
        await index.ping()
        if config.reindex:
            await registry.reindex()
        elif missing := await registry.count_unindexed_sidecars():
            log.warning(
                "%d cached blobs are not in the Redis index; restart with --reindex to restore them", missing
            )
        # Records written before tokenizer files were stored once per set hold them inline.
        await registry.tidy_tokenizer_files()
    except Exception as e:
        if config.reindex:
            raise
        log.warning(
            "Redis (%s) is not reachable at start (%s); calls answer UNAVAILABLE until it is",
            describe(config.redis_url),
            e,
        )

    logging.getLogger("grpc._cython.cygrpc").addFilter(CallerGoneFilter())
    interceptors = [AdminTokenInterceptor(config.admin_token)] if config.admin_token else []
    # Undecodable request bytes: INVALID_ARGUMENT rather than grpc's bare UNKNOWN.
    interceptors.append(MalformedRequestInterceptor(f"/{SERVICE_NAME}/"))
    # A PullAdapter header carries the adapter's tokenizer files (tokenizer_files.py: tokenizer.json up
    # to 16 MiB, the others 4 MiB each, the config 1 MiB); servers accept 64 MiB per message.
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.max_send_message_length", 48 << 20)])
    servicer = AdapterStoreServicer(registry, config.max_watchers)
    pb_grpc.add_AdapterStoreServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    if config.tls_cert:
        credentials = grpc.ssl_server_credentials(
            [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
            root_certificates=config.tls_ca.read_bytes() if config.tls_ca else None,
            require_client_auth=config.tls_ca is not None,
        )
        port = server.add_secure_port(f"{config.host}:{config.port}", credentials)
    else:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "listening on %s:%d (cache %s, %s%s%s)",
        config.host,
        port,
        config.cache_dir,
        describe(config.redis_url),
        ", TLS" + (" with client certificates" if config.tls_ca else "") if config.tls_cert else "",
        ", admin token required" if config.admin_token else "",
    )

    async def set_health(status) -> None:
        for service in ("", SERVICE_NAME):
            await health.set(service, status)

    supervisor = None
    if embedded:
        supervisor = asyncio.create_task(
            embedded.supervise(
                lambda: set_health(health_pb2.HealthCheckResponse.NOT_SERVING),
                lambda: set_health(health_pb2.HealthCheckResponse.SERVING),
            )
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining RPCs for up to %.0fs", config.grace_s)
    if supervisor is not None:
        supervisor.cancel()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer.begin_shutdown()
    await server.stop(config.grace_s)
    await client.aclose()
    if embedded:
        embedded.stop()
    log.info("stopped")
