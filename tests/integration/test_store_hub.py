"""Registering from the Hugging Face Hub, with the real huggingface_hub client talking to a
local HTTP server that answers the Hub's endpoints (tests/support/store_fake_hub.py): revision
pinning, a 404 repo, a 401 without token, a download cut halfway and resumed, and 50
concurrent registrations that fetch once."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from loraplex.clients.processes import ServerProcess
from loraplex.v1 import adapter_store_pb2 as pb
from tests.support.store_fake_hub import FakeHub
from tests.support.store_helpers import (
    WEIGHTS,
    adapter_files,
    pull,
    sha256_file,
    start_store,
    start_store_process,
    store_stub,
    write_random_adapter,
)

TOKEN = "hf_store_test_token"


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, adapter_factory) -> dict[str, Path]:
    return {
        "v1": adapter_factory(tiny_llama_path, "hub-v1", r=4, seed=1),
        "v2": adapter_factory(tiny_llama_path, "hub-v2", r=4, seed=2),
    }


@pytest.fixture(scope="module")
def hub():
    with FakeHub(token=TOKEN) as h:
        yield h


@pytest.fixture(scope="module")
def store(tmp_path_factory, hub):
    with start_store(
        tmp_path_factory.mktemp("store-hub"), env={"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": ""}
    ) as p:
        yield p


@pytest.fixture()
def stub(store):
    with store_stub(store.address) as s:
        yield s


def register(stub, name, source, revision=""):
    return stub.RegisterAdapter(
        pb.RegisterAdapterRequest(name=name, source=source, revision=revision), timeout=120
    )


def test_register_from_hub_records_commit_and_pulls(stub, hub, adapters):
    sha = hub.add_commit("org/plain", adapter_files(adapters["v1"]))
    record = register(stub, "hub-plain", "org/plain")
    assert record.source == "hf://org/plain" and record.revision == sha
    assert record.digest == sha256_file(adapters["v1"] / WEIGHTS)
    _, data = pull(stub, "hub-plain")
    assert data == (adapters["v1"] / WEIGHTS).read_bytes()
    # Only the adapter files were fetched, each at the resolved commit.
    gets = [
        r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path and "org/plain" in r.path
    ]
    assert sorted(p.rsplit("/", 1)[1] for p in gets) == ["adapter_config.json", WEIGHTS]
    assert all(f"/resolve/{sha}/" in p for p in gets)


def test_a_hub_adapter_chat_template_is_fetched_and_pulled(stub, hub, adapters):
    """Issue 59 L4: the tokenizer files a Hub repo has beside the adapter travel with it, at the
    resolved commit; other files are not fetched."""
    template = b"{% for m in messages %}{{ m.content }}{% endfor %}"
    files = {**adapter_files(adapters["v1"]), "chat_template.jinja": template, "README.md": b"# hi"}
    sha = hub.add_commit("org/templated", files)
    record = register(stub, "hub-templated", "org/templated")
    assert record.revision == sha and record.files_digest.startswith("sha256:")
    header, _ = pull(stub, "hub-templated")
    assert {f.name: f.content for f in header.files} == {"chat_template.jinja": template}
    gets = [
        r.path
        for r in hub.requests
        if r.method == "GET" and "/resolve/" in r.path and "org/templated" in r.path
    ]
    fetched = sorted(p.rsplit("/", 1)[1] for p in gets)
    assert fetched == ["adapter_config.json", WEIGHTS, "chat_template.jinja"]


def test_revision_pinning_branch_tag_and_commit(stub, hub, adapters):
    sha1 = hub.add_commit("org/pinned", adapter_files(adapters["v1"]), refs=("main", "v1.0"))
    sha2 = hub.add_commit("org/pinned", adapter_files(adapters["v2"]), refs=("main",))
    d1, d2 = sha256_file(adapters["v1"] / WEIGHTS), sha256_file(adapters["v2"] / WEIGHTS)
    by_tag = register(stub, "pin-tag", "org/pinned", "v1.0")
    by_sha = register(stub, "pin-sha", f"hf://org/pinned@{sha1}")
    main = register(stub, "pin-main", "hf://org/pinned")
    assert (by_tag.revision, by_tag.digest) == (sha1, d1)
    assert (by_sha.revision, by_sha.digest) == (sha1, d1)
    assert (main.revision, main.digest) == (sha2, d2)
    # Re-registering a pinned revision fetches nothing; a moved branch is followed on re-register.
    weight_gets = hub.count("GET", f"/{WEIGHTS}")
    assert register(stub, "pin-tag", "org/pinned", "v1.0").generation == by_tag.generation
    assert hub.count("GET", f"/{WEIGHTS}") == weight_gets
    hub.repos["org/pinned"].refs["main"] = sha1
    moved = register(stub, "pin-main", "hf://org/pinned")
    assert (moved.revision, moved.digest, moved.generation) == (sha1, d1, main.generation + 1)


def test_unknown_repo_and_revision_are_not_found(stub, hub, adapters):
    hub.add_commit("org/exists", adapter_files(adapters["v1"]))
    for source, revision in (("org/missing", ""), ("org/exists", "no-such-branch")):
        with pytest.raises(grpc.RpcError) as e:
            register(stub, "hub-missing", source, revision)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()


def test_repo_without_adapter_files_is_invalid(stub, hub):
    hub.add_commit("org/not-adapter", {"README.md": b"# hi", "model.safetensors": b"x"})
    with pytest.raises(grpc.RpcError) as e:
        register(stub, "hub-not-adapter", "org/not-adapter")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config.json" in e.value.details()


def test_pickle_only_repo_is_refused_without_allow_pickle(stub, hub, adapters):
    files = adapter_files(adapters["v1"])
    hub.add_commit(
        "org/pickled", {"adapter_config.json": files["adapter_config.json"], "adapter_model.bin": b"x"}
    )
    with pytest.raises(grpc.RpcError) as e:
        register(stub, "hub-pickled", "org/pickled")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--allow-pickle" in e.value.details()
    assert hub.count("GET", "org/pickled/resolve/") == 0  # refused before downloading anything


def test_private_repo_needs_token(stub, hub, adapters, tmp_path):
    hub.add_commit("org/private", adapter_files(adapters["v2"]), private=True)
    with pytest.raises(grpc.RpcError) as e:
        register(stub, "hub-private", "org/private")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "HF_TOKEN" in e.value.details()
    with start_store(tmp_path / "cache", env={"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN}) as proc:
        with store_stub(proc.address) as authed:
            record = register(authed, "hub-private", "org/private")
    assert record.digest == sha256_file(adapters["v2"] / WEIGHTS)
    private = [r for r in hub.requests if "org/private" in r.path]
    assert private[-1].headers.get("authorization") == f"Bearer {TOKEN}"


def test_download_cut_halfway_resumes_with_range(stub, store, hub, tmp_path):
    # Over 10 MiB, huggingface_hub's read chunk, so half the file is on disk when the cut comes.
    big = write_random_adapter(tmp_path / "big", hidden=4096, layers=24, r=16, seed=7)  # ~25 MB
    size = (big / WEIGHTS).stat().st_size
    hub.add_commit("org/big", adapter_files(big))
    hub.cut_next_get(WEIGHTS)
    record = register(stub, "hub-big", "org/big")
    assert record.digest == sha256_file(big / WEIGHTS) and record.size_bytes == size
    gets = [
        r
        for r in hub.requests
        if r.method == "GET" and r.path.endswith(f"org/big/resolve/{record.revision}/{WEIGHTS}")
    ]
    assert len(gets) == 2 and "range" not in gets[0].headers
    resumed_at = int(gets[1].headers["range"].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at < size
    assert "resuming" in store.output() or "Trying to resume" in store.output()
    _, data = pull(stub, "hub-big")
    assert data == (big / WEIGHTS).read_bytes()


def test_fifty_concurrent_hub_registrations_download_once(stub, hub, adapters):
    hub.add_commit("org/popular", adapter_files(adapters["v2"]))
    with ThreadPoolExecutor(50) as pool:
        records = list(pool.map(lambda _: register(stub, "hub-popular", "org/popular"), range(50)))
    assert len({(r.digest, r.revision, r.generation, r.created_at) for r in records}) == 1
    assert hub.count("GET", f"org/popular/resolve/{records[0].revision}/{WEIGHTS}") == 1


def test_lock_is_extended_during_a_long_download(hub, adapters, tmp_path):
    # The per-name lock times out after 0.6 s, the download takes 2 s: only extension keeps
    # the waiting registrations from starting a second download.
    hub.add_commit("org/slow", adapter_files(adapters["v1"]))
    hub.get_delay_s[WEIGHTS] = 2.0
    try:
        with (
            start_store(
                tmp_path / "cache", "--lock-timeout", "0.6", env={"HF_ENDPOINT": hub.endpoint}
            ) as proc,
            store_stub(proc.address) as stub,
            ThreadPoolExecutor(8) as pool,
        ):
            records = list(pool.map(lambda _: register(stub, "hub-slow", "org/slow"), range(8)))
    finally:
        hub.get_delay_s.clear()
    assert len({(r.digest, r.generation) for r in records}) == 1
    assert hub.count("GET", f"org/slow/resolve/{records[0].revision}/{WEIGHTS}") == 1


def _staged_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file() and "fetch-" in str(p)]


def test_endpoint_streaming_past_its_advertised_size_is_stopped_at_the_limit(hub, adapters, tmp_path):
    # It advertised the true size (under the limit) and then streamed 300 MB: the whole body was
    # written before the size was checked, filling the store's disk.
    files = adapter_files(adapters["v1"])
    limit = sum(len(b) for b in files.values()) + 4096
    hub.add_commit("org/liar", files)
    hub.extra_bytes[WEIGHTS] = 300 << 20
    cache = tmp_path / "cache"
    try:
        with (
            start_store(cache, "--max-adapter-bytes", str(limit), env={"HF_ENDPOINT": hub.endpoint}) as proc,
            store_stub(proc.address) as stub,
        ):
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                register(stub, "hub-liar", "org/liar")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "--max-adapter-bytes" in err.value.details() and str(limit) in err.value.details()
            assert time.monotonic() - start < 30
            assert _staged_files(cache) == []  # the partial file is gone
            with pytest.raises(grpc.RpcError) as err:
                stub.GetAdapter(pb.GetAdapterRequest(name="hub-liar"), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        hub.extra_bytes.clear()


def test_hub_download_stops_when_the_caller_goes_and_on_sigterm(hub, adapters, tmp_path):
    # An honest but slow download (64 KiB every 0.2 s) outlived its caller's deadline and SIGTERM.
    slow = write_random_adapter(tmp_path / "slow", hidden=2048, layers=8, r=16, seed=5)  # ~15 MB: ~45 s here
    hub.add_commit("org/trickle", adapter_files(slow))
    hub.trickle_s[WEIGHTS] = 0.2
    cache = tmp_path / "cache"
    try:
        proc = start_store_process(cache, "--grace", "2", env={"HF_ENDPOINT": hub.endpoint})
        try:
            with store_stub(proc.address) as stub:
                with pytest.raises(grpc.RpcError) as err:
                    stub.RegisterAdapter(
                        pb.RegisterAdapterRequest(name="hub-trickle", source="org/trickle"), timeout=1.5
                    )
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                deadline = time.monotonic() + 10
                while (hub.open_gets or _staged_files(cache)) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert hub.open_gets == 0 and _staged_files(cache) == [], "the download outlived its caller"
                # Again, then SIGTERM while it runs: the store exits within its grace period.
                call = stub.RegisterAdapter.future(
                    pb.RegisterAdapterRequest(name="hub-trickle", source="org/trickle"), timeout=60
                )
                while not hub.open_gets and time.monotonic() < deadline + 10:
                    time.sleep(0.05)
                assert hub.open_gets
                start = time.monotonic()
                proc.proc.send_signal(signal.SIGTERM)
                assert proc.proc.wait(20) == 0
                assert time.monotonic() - start < 2 + 8, "SIGTERM waited for the download"
                assert call.exception(10) is not None
        finally:
            proc.stop()
    finally:
        hub.trickle_s.clear()


def test_base_model_config_from_a_lying_endpoint_is_cut_off(hub, tmp_path, tiny_llama_path):
    # --base-model from the Hub: its config.json is counted as it arrives like the adapters' files.
    hub.add_commit("org/base-liar", {"config.json": (tiny_llama_path / "config.json").read_bytes()})
    hub.extra_bytes["config.json"] = 100 << 20
    try:
        proc = ServerProcess(
            "store",
            "loraplex.adapter_store",
            ["--port", "0", "--cache-dir", str(tmp_path / "cache"), "--base-model", "org/base-liar"],
            env={"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "NO_PROXY": "127.0.0.1"},
            echo=False,
        )
        try:
            assert proc.proc.wait(60) != 0
        finally:
            proc.stop()
        assert "download stopped past" in proc.output() and "base model config" in proc.output(), (
            proc.output()[-2000:]
        )
    finally:
        hub.extra_bytes.clear()
