"""The inference side survives an adapter store restart: pulls and WatchAdapters reconnect."""

from __future__ import annotations

import time

import pytest

from loraplex.clients import Client, NotFound, Unavailable
from loraplex.clients.processes import ServerProcess
from tests.support.service_stack import STARTUP_S, start_inference


def store_on(cache, port: int) -> ServerProcess:
    proc = ServerProcess(
        "store", "loraplex.adapter_store", ["--port", str(port), "--cache-dir", str(cache)], echo=False
    )
    proc.wait_serving(STARTUP_S)
    return proc


def test_store_restart(tmp_path, tiny_llama_path, adapter_factory):
    first = adapter_factory(tiny_llama_path, "re-1", seed=51)
    second = adapter_factory(tiny_llama_path, "re-2", seed=52)
    store = store_on(tmp_path / "store", 0)
    port = store.port
    inference = start_inference(tiny_llama_path, store=store, cache=tmp_path / "pulled")
    try:
        with Client(inference.address, store=store.address, timeout=30) as c:
            c.register_adapter("re-1", str(first))
            assert c.generate("hi", "re-1", max_new_tokens=2)[0].adapter == "re-1"
            assert store.stop() == 0
            with pytest.raises(Unavailable) as err:  # a cold adapter needs the store
                c.generate("hi", "never-seen", max_new_tokens=2)
            assert err.value.retry_after_s
            assert c.generate("hi", "re-1", max_new_tokens=2)[0].adapter == "re-1"  # resident: still served
            store = store_on(tmp_path / "store", port)  # same port, same persisted index
            time.sleep(1.2)  # this test client's own channel backs off for up to a second
            c.register_adapter("re-2", str(second))
            assert c.generate("hi", "re-2", max_new_tokens=2)[0].adapter == "re-2"
            # the watch stream reconnected: a delete still reaches the inference side
            assert c.delete_adapter("re-1")
            deadline = time.monotonic() + 20
            while "re-1" in {a.name for a in c.list_adapters()}:
                assert time.monotonic() < deadline, "delete after the restart never arrived"
                time.sleep(0.3)
            with pytest.raises(NotFound):
                c.generate("hi", "re-1", max_new_tokens=2)
    finally:
        inference.stop()
        store.stop()
