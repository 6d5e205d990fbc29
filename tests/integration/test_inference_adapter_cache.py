"""The inference side's adapter cache (issue 32, items 1 and 2): a byte bound with LRU eviction of
directories no loaded adapter uses, RESOURCE_EXHAUSTED (never INTERNAL) when an adapter cannot fit
or the disk refuses the write, and hits checked against the store's digests.

A real store subprocess, real gRPC, the real StoreClient; tiny real PEFT adapters.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from loraplex.services.inference.adapter_cache import WEIGHTS_FILE
from loraplex.services.inference.errors import CapacityExceeded
from loraplex.services.inference.store_client import StoreClient
from loraplex.v1 import adapter_store_pb2 as pb
from tests.support.store_helpers import start_store, store_stub, write_random_adapter

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-store")
    sources = {}
    for i in range(8):
        sources[f"c{i}"] = write_random_adapter(root / "src" / f"c{i}", hidden=64, layers=2, r=4, seed=i)
    with start_store(root / "store") as proc, store_stub(proc.address) as stub:
        records = {
            n: stub.RegisterAdapter(pb.RegisterAdapterRequest(name=n, source=str(p)))
            for n, p in sources.items()
        }
        yield proc.address, records


def adapter_bytes(records, name) -> int:
    return records[name].size_bytes


def fetch_all(address, cache_dir, bound, names, in_use=frozenset()):
    async def run():
        client = StoreClient(address, cache_dir, cache_max_bytes=bound)
        client.cache.in_use = lambda: set(in_use)
        out = []
        try:
            for n in names:
                try:
                    out.append(await client.fetch(n))
                except CapacityExceeded as exc:
                    out.append(exc)
        finally:
            await client.close()
        return out, client

    return asyncio.run(run())


def content_dirs(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir() if not p.name.startswith("."))


def test_cache_stays_under_its_bound_evicting_least_recently_used(store, tmp_path):
    address, records = store
    size = adapter_bytes(records, "c0")
    bound = int(2.5 * (size + 1024))  # two adapters (weights + config) fit, three do not
    out, client = fetch_all(address, tmp_path / "c", bound, ["c0", "c1", "c0", "c2", "c3"])
    assert not [o for o in out if isinstance(o, Exception)]
    assert client.cache.total_bytes() <= bound
    # c0 was used again after c1, so c1 went first; then c0 for c3.
    kept = content_dirs(tmp_path / "c")
    assert len(kept) == 2 and {o.path.name for o in out[-2:]} == set(kept)
    assert client.cache.evictions == 2


def test_adapter_in_use_is_never_evicted_and_no_room_is_resource_exhausted(store, tmp_path):
    address, records = store
    size = adapter_bytes(records, "c0")
    bound = int(1.5 * (size + 1024))
    first, _ = fetch_all(address, tmp_path / "c", bound, ["c0"])
    in_use = {first[0].path.name}
    out, _ = fetch_all(address, tmp_path / "c", bound, ["c1"], in_use=in_use)
    (error,) = out
    assert isinstance(error, CapacityExceeded)
    assert str(tmp_path / "c") in error.message and str(bound) in error.message
    assert "--adapter-cache-max-bytes" in error.message
    assert content_dirs(tmp_path / "c") == sorted(in_use)


def test_adapter_larger_than_the_bound_is_resource_exhausted(store, tmp_path):
    address, records = store
    out, _ = fetch_all(address, tmp_path / "c", adapter_bytes(records, "c0") // 2, ["c0"])
    (error,) = out
    assert isinstance(error, CapacityExceeded) and str(tmp_path / "c") in error.message
    assert content_dirs(tmp_path / "c") == []


PULL_UNDER_FILE_LIMIT = """
import asyncio, json, resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
from loraplex.services.inference.store_client import StoreClient
from loraplex.services.inference.errors import LoraplexError

async def main():
    client = StoreClient(sys.argv[1], sys.argv[2], cache_max_bytes=1 << 30)
    try:
        await client.fetch("c0")
        print(json.dumps({"ok": True}))
    except LoraplexError as e:
        print(json.dumps({"error": type(e).__name__, "message": e.message}))
    finally:
        await client.close()

asyncio.run(main())
"""


def test_a_write_the_disk_refuses_is_resource_exhausted(store, tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse the weights file's write part-way (EFBIG), as a full
    disk refuses one (ENOSPC): the caller gets RESOURCE_EXHAUSTED naming the cache, not INTERNAL."""
    address, records = store
    limit = adapter_bytes(records, "c0") // 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", PULL_UNDER_FILE_LIMIT, address, str(tmp_path / "c"), str(limit)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer.get("error") == "CapacityExceeded", (answer, done.stderr[-2000:])
    assert str(tmp_path / "c") in answer["message"] and "--adapter-cache-max-bytes" in answer["message"]
    assert content_dirs(tmp_path / "c") == []  # the partial pull is gone


def test_a_rewritten_cache_hit_is_pulled_again(store, tmp_path):
    """Weights rewritten on disk (still valid safetensors, same size) are not served: the hit fails
    its digest check and the adapter is pulled again."""
    address, records = store
    (first,), _ = fetch_all(address, tmp_path / "c", 1 << 30, ["c0"])
    original = (first.path / WEIGHTS_FILE).read_bytes()
    other = write_random_adapter(tmp_path / "other", hidden=64, layers=2, r=4, seed=99)
    forged = (other / WEIGHTS_FILE).read_bytes()
    assert len(forged) == len(original) and forged != original
    target = first.path / WEIGHTS_FILE
    os.chmod(target, 0o644)
    target.write_bytes(forged)
    (again,), client = fetch_all(address, tmp_path / "c", 1 << 30, ["c0"])
    assert client.pulls == 1
    assert (again.path / WEIGHTS_FILE).read_bytes() == original
    assert again.record.digest == records["c0"].digest


def disk_bytes(cache_dir: Path) -> int:
    """Every file under the cache, pulls in progress (`.pull-*`) included: one listing of the root,
    so a directory renamed into place during the scan is counted once at most."""
    total = 0
    for entry in list(os.scandir(cache_dir)):
        try:
            total += sum(f.stat().st_size for f in os.scandir(entry.path) if f.is_file())
        except FileNotFoundError:
            pass  # removed (evicted, or renamed into place) since the listing
    return total


def test_concurrent_pulls_stay_under_the_bound(store, tmp_path):
    """Issue 59 M5: eight pulls at once into a cache that fits two. Each pull reserves its bytes
    (weights and config, known from the header) before writing, evicting for the reservation, so
    the cache never holds more than the bound: not after each pull, not at the end, and not at any
    moment a sampler thread looks (pulls in progress counted)."""
    address, records = store
    size = adapter_bytes(records, "c0")
    bound = int(2.5 * (size + 1024))  # two adapters fit, three do not
    cache_dir = tmp_path / "c"
    cache_dir.mkdir()
    names = [f"c{i}" for i in range(8)]
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(disk_bytes(cache_dir))

    async def run():
        client = StoreClient(address, cache_dir, cache_max_bytes=bound)
        client.cache.in_use = set  # nothing loaded: every finished adapter may be evicted
        after_each: list[int] = []

        async def one(name):
            pulled = await client.fetch(name)
            after_each.append(disk_bytes(cache_dir))
            return pulled

        try:
            results = await asyncio.gather(*(one(n) for n in names), return_exceptions=True)
        finally:
            await client.close()
        return results, after_each, client

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        results, after_each, client = asyncio.run(run())
    finally:
        stop.set()
        sampler.join()
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert client.pulls == len(names)
    assert len(after_each) == len(names) and max(after_each) <= bound, (after_each, bound)
    assert samples and max(samples) <= bound, (max(samples), bound)
    assert disk_bytes(cache_dir) <= bound and len(content_dirs(cache_dir)) <= 2
    assert not [n for n in os.listdir(cache_dir) if n.startswith(".pull-")]  # no pull left behind


def test_a_held_directory_is_not_evicted_while_it_is_loaded(store, tmp_path):
    """Pulls waiting for room are woken when one finishes; they must not evict that one's directory
    while its caller (the engine's load) still reads it. Eight loads at once on a bound of two:
    each holds its directory (`StoreClient.held`) across a read spread over loop turns, and every
    read finds its files whole; the bound holds throughout."""
    address, records = store
    bound = int(2.5 * (adapter_bytes(records, "c0") + 1024))
    cache_dir = tmp_path / "c"
    names = [f"c{i}" for i in range(8)]

    async def run():
        client = StoreClient(address, cache_dir, cache_max_bytes=bound)
        client.cache.in_use = set  # nothing loaded: only the holds protect
        peak = 0

        async def load(name):
            nonlocal peak
            async with client.held(name) as pulled:
                for _ in range(5):  # an engine load reads across several loop turns
                    await asyncio.sleep(0.02)
                    peak = max(peak, disk_bytes(cache_dir))
                weights = (pulled.path / WEIGHTS_FILE).read_bytes()
                return hashlib.sha256(weights).hexdigest() == pulled.record.digest.split(":")[1]

        try:
            return await asyncio.gather(*(load(n) for n in names), return_exceptions=True), peak
        finally:
            await client.close()

    results, peak = asyncio.run(run())
    assert results == [True] * len(names), results
    assert peak <= bound and disk_bytes(cache_dir) <= bound
