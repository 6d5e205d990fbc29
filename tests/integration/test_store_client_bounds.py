"""The inference server's pull from the adapter store is bounded while streaming: a store (or
whatever answers at its address) that sends more weights than its record's size_bytes is cut off
at that size, not written to disk until the digest check at the end."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest

from loraplex.services.inference.errors import BackendUnavailable
from loraplex.services.inference.store_client import StoreClient
from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc

CONFIG = b'{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}'
CHUNK = b"\0" * (1 << 20)
OFFERED = 64  # chunks of 1 MiB the lying store would send


class LyingStore(pb_grpc.AdapterStoreServicer):
    def __init__(self) -> None:
        self.sent: list[int] = []  # chunks yielded, per pull (the client may retry)
        self.record = pb.AdapterRecord(
            name="liar",
            digest="sha256:" + hashlib.sha256(b"x" * 100).hexdigest(),
            config_digest="sha256:" + hashlib.sha256(CONFIG).hexdigest(),
            size_bytes=100,
        )

    async def GetAdapter(self, request, context):
        return self.record

    async def PullAdapter(self, request, context):
        yield pb.AdapterChunk(
            header=pb.AdapterHeader(record=self.record, adapter_config_json=CONFIG.decode())
        )
        self.sent.append(0)
        for _ in range(OFFERED):
            self.sent[-1] += 1
            yield pb.AdapterChunk(data=CHUNK)


def test_pull_stops_at_the_records_size(tmp_path):
    asyncio.run(_pull_stops_at_the_records_size(tmp_path))


async def _pull_stops_at_the_records_size(tmp_path):
    server = grpc.aio.server()
    store = LyingStore()
    pb_grpc.add_AdapterStoreServicer_to_server(store, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = StoreClient(f"127.0.0.1:{port}", tmp_path / "pulls")
    try:
        with pytest.raises(BackendUnavailable) as err:
            await client.fetch("liar")
        assert "past the 100 bytes" in err.value.message
        # each pull was cut off early (what it read ahead is grpc's receive window, not the stream)
        assert store.sent and max(store.sent) < OFFERED / 2, (
            f"an oversized stream was read whole: {store.sent}"
        )
        await asyncio.sleep(0)
        assert list((tmp_path / "pulls").iterdir()) == []  # no partial copy left
        assert client.pulls == 0
    finally:
        await client.close()
        await server.stop(None)
