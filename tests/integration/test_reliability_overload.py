"""Overload: a full queue answers RESOURCE_EXHAUSTED with a retry delay; clients that honour
it all finish, and the server stays healthy.

One inference server on the tiny Llama with a 2-request running batch and a 3-request queue.
"""

from __future__ import annotations

import threading
import time

import pytest

from loraplex.clients import Client
from loraplex.clients.errors import ResourceExhausted
from loraplex.clients.processes import ServerProcess
from tests.support.service_stack import STARTUP_S


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    proc = ServerProcess(
        "inference",
        "loraplex.services.inference",
        [
            "--model-path",
            str(tiny_llama_path),
            "--port",
            "0",
            "--device",
            "cpu",
            "--max-total-tokens",
            "2048",
            "--max-running-requests",
            "2",
            "--max-queued-requests",
            "3",
        ],
        echo=False,
    )
    try:
        proc.wait_serving(STARTUP_S)
        yield proc
    finally:
        assert proc.stop() == 0


def test_full_queue_is_resource_exhausted_and_retries_finish(server):
    n, new = 16, 40
    refusals: list[ResourceExhausted] = []
    done: list[int] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        with Client(server.address, timeout=120) as c:
            for _ in range(200):
                try:
                    [out] = c.generate(f"Client {i} asks", max_new_tokens=new, ignore_eos=True)
                except ResourceExhausted as exc:
                    with lock:
                        refusals.append(exc)
                    time.sleep(min(exc.retry_after_s or 1.0, 0.3))  # sooner than asked: more pressure
                    continue
                with lock:
                    done.append(out.completion_tokens)
                return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert sorted(done) == [new] * n, f"{len(done)} of {n} finished"
    assert refusals, "the queue never filled: the test did not test overload"
    assert all(r.retry_after_s and "queued" in r.message for r in refusals), refusals[:3]
    with Client(server.address, timeout=30) as c:
        assert c.health() == "SERVING"
        assert c.generate("still fine?", max_new_tokens=2, ignore_eos=True)[0].completion_tokens == 2
