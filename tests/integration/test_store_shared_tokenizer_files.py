"""Tokenizer files are stored once per distinct set (issue 56): many fine-tunes of one model ship the
same `tokenizer.json` (SmolLM2's here, with a marker token: 1.8 MB), and a copy per name would put
megabytes per name in Redis and in each record file. Each set is a content-addressed file under
`tokenizer_files/sha256/`, with one reference per name, and Redis holds only its digest; the set
goes with its last reference, under the per-digest lock; records of the older format (files inline)
are served and moved out at start. In process: a real redis-server, the real registry, blob cache
and index; then a real store subprocess over gRPC.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import threading
from pathlib import Path

import pytest
import redis

from loraplex.adapter_store import tokenizer_files
from loraplex.adapter_store.blobs import BlobCache
from loraplex.adapter_store.cli.args import StoreConfig
from loraplex.adapter_store.errors import FailedPrecondition
from loraplex.adapter_store.index import AdapterIndex
from loraplex.adapter_store.redis_embedded import connect
from loraplex.adapter_store.registry import AdapterRegistry
from loraplex.adapter_store.source_fetcher import SourceFetcher
from loraplex.adapter_store.tokenizer_store import TokenizerFileStore
from loraplex.adapter_store.tokenizer_tidy import drop_stale_references, move_inline_files
from loraplex.v1 import adapter_store_pb2 as pb
from tests.support.adapter_tokenizer import write_marker_tokenizer
from tests.support.store_helpers import RedisServer, pull, start_store, store_stub, write_random_adapter

pytestmark = pytest.mark.timeout(180)
N = 12  # names sharing one set: the old layout held N copies of the 1.8 MB tokenizer.json in Redis
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def sources(tmp_path_factory, smollm2_path) -> dict[str, Path]:
    """`marker`: an adapter with SmolLM2's tokenizer and a marker token; `templated`: the same
    weights and tokenizer with another chat template (another set); `plain`: no tokenizer files."""
    root = tmp_path_factory.mktemp("shared-tok")
    plain = write_random_adapter(root / "plain", hidden=16, layers=1, r=2)
    marker = shutil.copytree(plain, root / "marker")
    write_marker_tokenizer(smollm2_path, marker)
    templated = shutil.copytree(marker, root / "templated")
    (templated / "chat_template.jinja").write_text("{{ messages[0].content }} ANSWER:")
    return {"plain": plain, "marker": marker, "templated": templated}


def _files(src: Path) -> dict[str, bytes]:
    return {n: (src / n).read_bytes() for n in tokenizer_files.CARRIED_FILES if (src / n).is_file()}


@pytest.fixture()
def store(tmp_path, redis_server) -> AdapterRegistry:
    """Per test: its own cache dir and key prefix on the shared redis-server."""
    config = StoreConfig(cache_dir=tmp_path / "store", redis_url=redis_server.url)
    index = AdapterIndex(connect(redis_server.url), f"t{next(_prefixes)}:")
    return AdapterRegistry(config, index, BlobCache(config.cache_dir), SourceFetcher(config))


def _redis_bytes(redis_server: RedisServer, prefix: str) -> dict[str, int]:
    """Each key of the prefix and the memory Redis holds for it."""
    r = redis.Redis(unix_socket_path=str(redis_server.socket))
    return {k.decode(): r.memory_usage(k, samples=0) for k in r.scan_iter(match=prefix + "*")}


def _sets_on_disk(registry: AdapterRegistry) -> dict[str, set[str]]:
    """Each tokenizer-file set on disk -> the names referring to it."""
    store = registry.tokenizer_files
    out: dict[str, set[str]] = {d: set() for d in store.digests()}
    for digest, name in store.references():
        out.setdefault(digest, set()).add(name)
    return out


async def _pulled(registry: AdapterRegistry, name: str) -> dict[str, bytes]:
    async with registry.open_pull(name) as handle:
        return handle.files


def test_many_names_sharing_a_set_keep_one_copy_and_the_last_delete_removes_it(store, sources, redis_server):
    files = _files(sources["marker"])
    tokenizer_bytes = len(files["tokenizer.json"])
    assert tokenizer_bytes > 1_500_000
    names = [f"ft-{i}" for i in range(N)]

    async def run():
        records = [await store.register(n, str(sources["marker"])) for n in names]
        for n in names:
            assert await _pulled(store, n) == files
        digest = records[0].files_digest
        assert {r.files_digest for r in records} == {digest} == {tokenizer_files.files_digest(files)}
        # Redis: metadata only. Every key of this store together is far below one tokenizer.json.
        held = _redis_bytes(redis_server, store.index.p)
        assert sum(held.values()) < tokenizer_bytes / 10, sorted(held.items(), key=lambda kv: -kv[1])[:3]
        assert max(held[f"{store.index.p}adapter:{n}"] for n in names) < 8192
        # Disk: one set, one reference per name; the names' record files do not hold the files.
        assert _sets_on_disk(store) == {digest: set(names)}
        assert store.tokenizer_files.blobs.path(digest).stat().st_size < 2 * tokenizer_bytes
        record_files = list(store.blobs.records_dir(records[0].digest).glob("*.json"))
        assert len(record_files) == N and max(p.stat().st_size for p in record_files) < 8192

        for n in names[:-1]:
            assert await store.delete(n)
        assert await _pulled(store, names[-1]) == files
        assert _sets_on_disk(store) == {digest: {names[-1]}}
        assert await store.delete(names[-1])
        assert _sets_on_disk(store) == {}
        assert not store.tokenizer_files.blobs.records_dir(digest).exists()

    asyncio.run(run())


def test_re_registering_with_other_files_moves_the_reference(store, sources):
    marker, templated = sources["marker"], sources["templated"]

    async def run():
        a = await store.register("a", str(marker))
        await store.register("b", str(marker))
        a2 = await store.register("a", str(templated))  # a alone moves to another set
        after_a = _sets_on_disk(store)
        await store.register("b", str(sources["plain"]))  # the last user of the first set leaves it
        return a, a2, after_a, await _pulled(store, "a"), await _pulled(store, "b")

    a, a2, after_a, pulled_a, pulled_b = asyncio.run(run())
    assert a.files_digest != a2.files_digest
    assert after_a == {a.files_digest: {"b"}, a2.files_digest: {"a"}}
    assert _sets_on_disk(store) == {a2.files_digest: {"a"}}
    assert pulled_a == _files(templated) and pulled_b == {}


def test_a_lost_set_is_fetched_again_from_the_source_on_pull(store, sources, tmp_path):
    src = shutil.copytree(sources["marker"], tmp_path / "src")

    async def run():
        record = await store.register("lost", str(src))
        path = store.tokenizer_files.blobs.path(record.files_digest)
        path.unlink()  # e.g. a cache dir restored without it
        assert await _pulled(store, "lost") == _files(sources["marker"])
        assert path.is_file() and _sets_on_disk(store) == {record.files_digest: {"lost"}}
        # Lost again, and the source's files changed meanwhile: refused, saying what changed.
        path.unlink()
        (src / "chat_template.jinja").write_text("changed")
        with pytest.raises(FailedPrecondition, match="now has different content \\(tokenizer files sha256:"):
            await _pulled(store, "lost")

    asyncio.run(run())


def test_concurrent_registrations_of_one_set_and_a_delete_racing_a_registration(store, sources):
    marker = str(sources["marker"])

    async def run():
        # Two names registering the same (not yet stored) set at once.
        first = await asyncio.gather(store.register("x", marker), store.register("y", marker))
        two = _sets_on_disk(store)
        # The set's only user deleted while another name registers it, both orders of arrival.
        await store.delete("y")
        rounds = []
        for i in range(4):
            old, new = ("x", f"n{i}") if i % 2 == 0 else (f"n{i - 1}", "x")
            steps = [store.delete(old), store.register(new, marker)]
            await asyncio.gather(*(steps if i < 2 else steps[::-1]))
            rounds.append((_sets_on_disk(store), await _pulled(store, new)))
        return first, two, rounds

    first, two, rounds = asyncio.run(run())
    digest = first[0].files_digest
    assert first[1].files_digest == digest and two == {digest: {"x", "y"}}
    names_left = [{"n0"}, {"x"}, {"n2"}, {"x"}]
    for (sets, pulled), left in zip(rounds, names_left, strict=True):
        assert sets == {digest: left} and pulled == _files(sources["marker"])


def test_threads_adding_and_dropping_references_never_leave_a_set_without_its_file(tmp_path):
    """The per-digest lock: whatever the interleaving, a set is on disk exactly while a reference is,
    and a reference added is never left pointing at a removed file."""
    store = TokenizerFileStore(tmp_path)
    files = {"chat_template.jinja": b"{{ messages }}", "special_tokens_map.json": b'{"eos_token": "</s>"}'}
    text = tokenizer_files.encode({n: d.decode() for n, d in files.items()})
    digest = tokenizer_files.files_digest(files)
    broken: list[str] = []

    def worker(k: int) -> None:
        for i in range(150):
            store.add(digest, f"w{k}", text)
            if store.read(digest) is None:
                broken.append(f"w{k} added but the set is gone (round {i})")
            if i % 3 != 2:
                store.drop(digest, f"w{k}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert broken == []
    # Rounds end on an add (149 % 3 == 2): every worker keeps its reference, and the file.
    assert {n for _d, n in store.references()} == {f"w{k}" for k in range(6)}
    assert store.read(digest) == files
    for k in range(6):
        store.drop(digest, f"w{k}")
    assert store.digests() == set() and not store.has(digest)


def test_a_record_of_the_older_format_is_served_then_moved_out_of_redis(store, sources, redis_server):
    """Before: the record held its files inline in Redis (`files_json`) and in its record file. Such a
    record pulls as before; `move_inline_files` (run at start) puts them in the set store and
    removes both inline copies."""
    files = _files(sources["marker"])
    key = f"{store.index.p}adapter:legacy"

    async def make_legacy():
        record = await store.register("legacy", str(sources["marker"]))
        inline = record.with_(files_json=json.dumps({n: d.decode() for n, d in files.items()}))
        store.blobs.add_record(record.digest, "legacy", inline.to_json())
        await store.index.r.hset(key, "files_json", inline.files_json)
        store.tokenizer_files.drop(record.files_digest, "legacy")  # the old layout had no set store
        return record

    async def run():
        record = await make_legacy()
        assert _sets_on_disk(store) == {}
        assert _redis_bytes(redis_server, key)[key] > len(files["tokenizer.json"])
        assert await _pulled(store, "legacy") == files  # served from the inline copy

        assert await move_inline_files(store.index, store.blobs, store.tokenizer_files) == 1
        assert _redis_bytes(redis_server, key)[key] < 8192
        assert _sets_on_disk(store) == {record.files_digest: {"legacy"}}
        on_disk = json.loads((store.blobs.records_dir(record.digest) / "legacy.json").read_text())
        assert on_disk["files_json"] == "" and on_disk["files_digest"] == record.files_digest
        assert await _pulled(store, "legacy") == files
        assert await move_inline_files(store.index, store.blobs, store.tokenizer_files) == 0

    asyncio.run(run())


def test_references_no_record_stands_for_are_dropped_at_start(store, sources):
    """What a store killed mid-registration leaves: references of a name whose record names other
    files, and of a name with no record at all, are dropped; a name whose record file outlived Redis
    keeps its reference (--reindex will restore it)."""
    marker = _files(sources["marker"])
    marker_json = tokenizer_files.encode({n: d.decode() for n, d in marker.items()})
    digest = tokenizer_files.files_digest(marker)

    async def run():
        plain = await store.register("plain", str(sources["plain"]))
        await store.register("user", str(sources["marker"]))
        lost = await store.register("lost-redis", str(sources["marker"]))
        await store.index.r.delete(f"{store.index.p}adapter:lost-redis")  # as after losing Redis
        for name in ("plain", "ghost"):  # killed after writing the reference
            store.tokenizer_files.add(digest, name, marker_json)
        assert _sets_on_disk(store) == {digest: {"plain", "user", "lost-redis", "ghost"}}
        dropped = await drop_stale_references(store.index, store.blobs, store.tokenizer_files)
        assert dropped == 2 and _sets_on_disk(store) == {digest: {"user", "lost-redis"}}
        assert plain.files_digest == "" and lost.files_digest == digest
        assert await _pulled(store, "user") == marker

    asyncio.run(run())


def test_over_grpc_pulls_send_each_names_files_and_a_restart_moves_old_records(
    tmp_path, sources, redis_server
):
    """A real store process: names sharing a set and one with another set pull their own files in
    the PullAdapter header; an older-format record put in Redis while it was down is served after a
    restart, with its files moved out of Redis."""
    prefix = f"g{next(_prefixes)}:"
    flags = ("--redis-url", redis_server.url, "--key-prefix", prefix)
    cache = tmp_path / "store"
    shares = {"s0": "marker", "s1": "marker", "s2": "marker", "other": "templated", "none": "plain"}
    with start_store(cache, *flags) as proc, store_stub(proc.address) as stub:
        records = {
            n: stub.RegisterAdapter(pb.RegisterAdapterRequest(name=n, source=str(sources[s])), timeout=30)
            for n, s in shares.items()
        }
        for n, s in shares.items():
            header, _ = pull(stub, n)
            assert {f.name: f.content for f in header.files} == _files(sources[s])
            assert header.record.files_digest == records[n].files_digest
    assert len({records[n].files_digest for n in ("s0", "s1", "s2")}) == 1
    sets = list((cache / "tokenizer_files" / "sha256").glob("?" * 64))
    assert len(sets) == 2

    # An older store's record: its files inline in Redis.
    plain = redis.Redis(unix_socket_path=str(redis_server.socket), decode_responses=True)
    fields = plain.hgetall(f"{prefix}adapter:s0")
    files = _files(sources["marker"])
    fields.update(name="legacy", files_json=json.dumps({n: d.decode() for n, d in files.items()}))
    plain.hset(f"{prefix}adapter:legacy", mapping=fields)
    plain.zadd(f"{prefix}names", {"legacy": 0})
    plain.hset(f"{prefix}digests", "legacy", fields["digest"])
    plain.hset(f"{prefix}generations", "legacy", fields["generation"])
    with start_store(cache, *flags) as proc, store_stub(proc.address) as stub:
        header, _ = pull(stub, "legacy")
        assert {f.name: f.content for f in header.files} == files
        assert not plain.hget(f"{prefix}adapter:legacy", "files_json")
        assert stub.DeleteAdapter(pb.DeleteAdapterRequest(name="s0"), timeout=30).deleted
        assert {f.name: f.content for f in pull(stub, "s1")[0].files} == files
    refs = cache / "tokenizer_files" / "sha256" / (records["s1"].files_digest.split(":")[1] + ".records")
    assert sorted(p.name for p in refs.glob("*.json")) == ["legacy.json", "s1.json", "s2.json"]

    # Redis loses everything of this store: --reindex restores the records from their record files,
    # and the sets on disk serve them.
    plain.delete(*plain.keys(prefix + "*"))
    with start_store(cache, *flags, "--reindex") as proc, store_stub(proc.address) as stub:
        for n in ("legacy", "s1", "other"):
            header, _ = pull(stub, n)
            assert {f.name: f.content for f in header.files} == _files(sources[shares.get(n, "marker")])
    assert sorted(p.name for p in refs.glob("*.json")) == ["legacy.json", "s1.json", "s2.json"]
