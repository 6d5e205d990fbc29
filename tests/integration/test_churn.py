"""Adapter churn through one server (issue 32, "done when"): register, serve and delete many
adapters, and check that the inference cache's bytes, the per-adapter metric series and the
per-name state go back to where they started, and that registration does not get slower.

A real store subprocess and a real in-process InferenceServer (tiny Llama on the CPU, real gRPC
on loopback); each adapter is a distinct tiny PEFT file, so each one is pulled and loaded.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import grpc
import pytest

from loraplex.services.inference.server import InferenceServer
from loraplex.services.inference.server_args import ServerArgs
from loraplex.v1 import adapter_store_pb2 as spb
from loraplex.v1 import adapter_store_pb2_grpc as spb_grpc
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.store_helpers import start_store, write_random_adapter

CHURN = int(os.environ.get("LORAPLEX_CHURN", "2000"))  # registered and deleted (3000: ~2 min here)
SERVE_EVERY = int(os.environ.get("LORAPLEX_CHURN_SERVE_EVERY", "8"))  # of which every 8th is served
pytestmark = pytest.mark.timeout(300)


def series(metrics) -> list:
    families = (*metrics._per_adapter(), metrics.requests, metrics.residency)
    return [
        (m._name, key)
        for m in (*families, metrics.adapter_location, metrics.adapter_queued)
        for key in m._metrics
    ]


async def wait_for(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what() if callable(what) else what
        await asyncio.sleep(0.05)


def test_churn_returns_state_to_its_start(tmp_path, tiny_llama_path):
    sources = tmp_path / "src"
    with start_store(tmp_path / "store") as store:
        args = ServerArgs.from_fields(
            model_path=str(tiny_llama_path),
            device="cpu",
            port=0,
            max_total_tokens=2048,
            adapter_store=store.address,
            adapter_cache_dir=str(tmp_path / "cache"),
            metrics_max_adapters=16,
        )

        async def run():
            server = InferenceServer(args)
            await server.start()
            try:
                return await churn(server)
            finally:
                server._stop.set()
                await server.drain()

        async def churn(server):
            await wait_for(lambda: server.state.engine is not None, "engine up", 120)
            resolver, cache, metrics = server.state.resolver, server.store.cache, server.metrics
            await asyncio.sleep(1.5)  # the watch is subscribed and metrics refreshed once

            def state():
                return cache.total_bytes(), metrics.adapter_series(), resolver.per_name_state()

            start = state()
            store_channel = grpc.aio.insecure_channel(store.address)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
            store_stub, stub = spb_grpc.AdapterStoreStub(store_channel), pb_grpc.InferenceStub(channel)
            register_s = []
            peak_series = 0
            for i in range(CHURN):
                name = f"churn-{i:05d}"
                path = write_random_adapter(
                    sources / name, hidden=64, layers=2, r=2, modules=("q_proj", "o_proj"), seed=i
                )
                t = time.perf_counter()
                await store_stub.RegisterAdapter(spb.RegisterAdapterRequest(name=name, source=str(path)))
                register_s.append(time.perf_counter() - t)
                if i % SERVE_EVERY == 0:  # pulled into the cache, loaded, counted in metrics
                    out = await stub.Generate(
                        pb.GenerateRequest(
                            text=["hi"], adapter=[name], sampling_params=pb.SamplingParams(max_new_tokens=1)
                        )
                    )
                    assert out.completions[0].adapter == name
                await store_stub.DeleteAdapter(spb.DeleteAdapterRequest(name=name))
                peak_series = max(peak_series, metrics.adapter_series())
            # Deletes reach the server through WatchAdapters; the next metrics refresh prunes.
            await wait_for(lambda: not server.state.engine.list_adapters(), "every adapter unloaded")
            await wait_for(
                lambda: state() == start,
                lambda: (
                    f"state {start} at start, now {state()}: {resolver.per_name_tables()} {series(metrics)}"
                ),
            )
            end = state()
            await channel.close()
            await store_channel.close()
            return start, end, register_s, peak_series

        t0 = time.perf_counter()
        start, end, register_s, peak_series = asyncio.run(run())
        print(f"churn {CHURN}: {time.perf_counter() - t0:.1f}s, register total {sum(register_s):.1f}s")
    assert end == start
    # Per-adapter series never exceed the bound (16 names, each ~ a dozen series).
    assert peak_series <= 16 * 20
    window = min(100, CHURN // 4)
    early = statistics.median(register_s[window : 2 * window])
    late = statistics.median(register_s[-window:])
    assert late < 2.5 * early, f"registration median {early * 1e3:.1f} ms early, {late * 1e3:.1f} ms late"


def test_list_adapters_pages_through_local_and_store_adapters(tmp_path, tiny_llama_path):
    """ListAdapters answers a page at a time, in name order, merging adapters loaded here with those
    only in the store (one store page per call, never the whole store)."""
    sources = tmp_path / "src"
    with start_store(tmp_path / "store") as store:
        args = ServerArgs.from_fields(
            model_path=str(tiny_llama_path),
            device="cpu",
            port=0,
            max_total_tokens=2048,
            adapter_store=store.address,
            adapter_cache_dir=str(tmp_path / "cache"),
        )

        async def run():
            server = InferenceServer(args)
            await server.start()
            try:
                await wait_for(lambda: server.state.engine is not None, "engine up", 120)
                store_channel = grpc.aio.insecure_channel(store.address)
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
                store_stub, stub = spb_grpc.AdapterStoreStub(store_channel), pb_grpc.InferenceStub(channel)
                names = [f"page-{i:02d}" for i in range(23)]
                for i, name in enumerate(names):
                    path = write_random_adapter(
                        sources / name, hidden=64, layers=2, r=2, modules=("q_proj", "o_proj"), seed=i
                    )
                    await store_stub.RegisterAdapter(spb.RegisterAdapterRequest(name=name, source=str(path)))
                for name in names[::5]:  # a few loaded here, the rest only in the store
                    await stub.Generate(
                        pb.GenerateRequest(
                            text=["hi"], adapter=[name], sampling_params=pb.SamplingParams(max_new_tokens=1)
                        )
                    )
                pages, token = [], ""
                while True:
                    resp = await stub.ListAdapters(pb.ListAdaptersRequest(page_size=7, page_token=token))
                    pages.append([(a.name, a.location) for a in resp.adapters])
                    if not (token := resp.next_page_token):
                        break
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await stub.ListAdapters(pb.ListAdaptersRequest(page_token="../x"))
                await channel.close()
                await store_channel.close()
                return names, pages, bad.value.code()
            finally:
                server._stop.set()
                await server.drain()

        names, pages, bad_code = asyncio.run(run())
    listed = [name for page in pages for name, _ in page]
    assert listed == names and all(len(p) <= 7 for p in pages) and len(pages) == 4
    located = dict(entry for page in pages for entry in page)
    stores = pb.AdapterLocation.Value("ADAPTER_LOCATION_STORE")
    assert {n for n, loc in located.items() if loc != stores} == set(names[::5])
    assert bad_code == grpc.StatusCode.INVALID_ARGUMENT
