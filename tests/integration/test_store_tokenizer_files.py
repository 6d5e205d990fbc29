"""Issue 59 L4, the store's end: the small tokenizer files an adapter directory ships (its chat
template) are read with it, checked, kept in its record and sent in the PullAdapter header, named
by `files_digest`; a broken one is INVALID_ARGUMENT naming the file; a symlink out of
--allowed-local-dirs is refused as for any adapter file. A real store subprocess, real gRPC."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import grpc
import pytest

from loraplex.services.inference.adapter_cache import tokenizer_files_digest
from loraplex.v1 import adapter_store_pb2 as pb
from tests.support.store_helpers import (
    copy_adapter,
    pull,
    rpc_error_details,
    start_store,
    store_stub,
    write_random_adapter,
)

pytestmark = pytest.mark.timeout(120)
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}ANSWER:"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok-files")
    good = write_random_adapter(root / "allowed" / "good", hidden=64, layers=2, r=4)
    outside = root / "outside"
    outside.mkdir()
    (outside / "chat_template.jinja").write_text("secret")
    with start_store(root / "store", "--allowed-local-dirs", str(root / "allowed")) as proc:
        with store_stub(proc.address) as stub:
            yield stub, good, root / "allowed", outside, proc.address


def _register(stub, name: str, source: Path) -> pb.AdapterRecord:
    return stub.RegisterAdapter(pb.RegisterAdapterRequest(name=name, source=str(source)), timeout=30)


def test_tokenizer_files_travel_in_the_header(env):
    stub, good, allowed, *_ = env
    src = copy_adapter(good, allowed / "templated")
    files = {
        "chat_template.jinja": TEMPLATE.encode(),
        "tokenizer_config.json": json.dumps({"chat_template": "x", "added_tokens_decoder": {}}).encode(),
        "special_tokens_map.json": b'{"eos_token": "</s>"}',
    }
    for name, data in files.items():
        (src / name).write_bytes(data)
    (src / "notes.txt").write_text("not carried")
    record = _register(stub, "templated", src)
    plain = _register(stub, "plain", good)
    assert plain.files_digest == "" and record.digest == plain.digest
    # The inference side's digest of what it receives is the store's.
    assert record.files_digest == tokenizer_files_digest(files)
    header, data = pull(stub, "templated")
    assert {f.name: f.content for f in header.files} == files
    assert hashlib.sha256(data).hexdigest() == record.digest.split(":")[1]
    assert not pull(stub, "plain")[0].files
    # A change to the template alone is new content for the same name.
    (src / "chat_template.jinja").write_text(TEMPLATE + " ")
    again = _register(stub, "templated", src)
    assert again.files_digest != record.files_digest and again.generation == record.generation + 1


@pytest.mark.parametrize(
    ("name", "content", "why"),
    [
        ("tokenizer_config.json", b"{not json", "not valid JSON"),
        ("tokenizer_config.json", b"[1, 2]", "not a JSON object"),
        ("chat_template.jinja", b"\xff\xfe{{ x }}", "not UTF-8"),
        ("chat_template.jinja", b"x" * (4 * 2**20 + 1), "at most 4194304"),
    ],
)
def test_a_broken_tokenizer_file_is_refused_by_name(env, name, content, why):
    stub, good, allowed, *_ = env
    src = copy_adapter(good, allowed / f"broken-{why.replace(' ', '-')}")
    (src / name).write_bytes(content)
    with pytest.raises(grpc.RpcError) as err:
        _register(stub, "broken", src)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in err.value.details() and why in err.value.details()
    assert rpc_error_details(err.value)["field_violations"][0][0] == name


def test_a_template_symlinked_out_of_the_allowed_dirs_is_refused(env):
    stub, good, allowed, outside, _ = env
    src = copy_adapter(good, allowed / "escape")
    (src / "chat_template.jinja").symlink_to(outside / "chat_template.jinja")
    with pytest.raises(grpc.RpcError) as err:
        _register(stub, "escape", src)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--allowed-local-dirs" in err.value.details()


def _fetch(address: str, cache: Path, name: str):
    import asyncio

    from loraplex.services.inference.store_client import StoreClient

    async def run():
        client = StoreClient(address, cache, cache_max_bytes=1 << 30)
        try:
            return await client.fetch(name), client.pulls
        finally:
            await client.close()

    return asyncio.run(run())


def test_the_inference_cache_keeps_the_files_and_checks_them_on_a_hit(env, tmp_path):
    stub, good, allowed, _, address = env
    src = copy_adapter(good, allowed / "cached")
    (src / "chat_template.jinja").write_text(TEMPLATE)
    record = _register(stub, "cached", src)
    pulled, pulls = _fetch(address, tmp_path / "c", "cached")
    assert pulls == 1 and pulled.path.name.count("-") == 2  # <weights>-<config>-<files>
    assert pulled.path.name.endswith(record.files_digest.split(":")[1])
    assert (pulled.path / "chat_template.jinja").read_text() == TEMPLATE
    again, pulls = _fetch(address, tmp_path / "c", "cached")
    assert pulls == 0 and again.path == pulled.path  # a checked hit
    (pulled.path / "chat_template.jinja").write_text("{{ 'rewritten on disk' }}")
    third, pulls = _fetch(address, tmp_path / "c", "cached")
    assert pulls == 1 and (third.path / "chat_template.jinja").read_text() == TEMPLATE
