"""The store's end of an adapter's own tokenizer (issue 56): `tokenizer.json` is carried like the
other tokenizer files, bounded, checked at registration (it loads; with a base model, no id past its
embedding rows), and read only by a pull (from its set on disk: test_store_shared_tokenizer_files.py),
never by GetAdapter or ListAdapters (a page of records must not drag megabytes of tokenizers along).
In process: a real redis-server, the real registry, blob cache and index; SmolLM2's real tokenizer
files.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from loraplex.adapter_store import tokenizer_files
from loraplex.adapter_store.base_model import BaseModelShapes
from loraplex.adapter_store.blobs import BlobCache
from loraplex.adapter_store.cli.args import StoreConfig
from loraplex.adapter_store.errors import FailedPrecondition, InvalidArgument
from loraplex.adapter_store.index import AdapterIndex
from loraplex.adapter_store.redis_embedded import connect
from loraplex.adapter_store.registry import AdapterRegistry
from loraplex.adapter_store.source_fetcher import SourceFetcher
from tests.support.adapter_tokenizer import MARKER, write_marker_tokenizer
from tests.support.store_helpers import RedisServer, write_random_adapter

pytestmark = pytest.mark.timeout(120)
ROWS = 49152


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer()
    server.start()
    yield server.url
    server.close()


@pytest.fixture()
def registry(tmp_path_factory, redis_url) -> AdapterRegistry:
    """Per test (its Redis client belongs to the test's event loop): a store whose base has
    SmolLM2's 49,152 embedding rows (what the check reads) and the tiny adapter's projections."""
    cache = tmp_path_factory.mktemp("store")
    config = StoreConfig(cache_dir=cache, redis_url=redis_url)
    index = AdapterIndex(connect(redis_url), config.key_prefix)
    base = BaseModelShapes("smollm2", 1, {"q_proj": (16, 16), "v_proj": (16, 16), "lm_head": (16, ROWS)})
    return AdapterRegistry(config, index, BlobCache(cache), SourceFetcher(config), base)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return write_random_adapter(tmp_path_factory.mktemp("plain") / "a", hidden=16, layers=1, r=2)


def _with_tokenizer(plain: Path, dst: Path, smollm2: Path, past_rows: bool = False) -> Path:
    shutil.copytree(plain, dst)
    write_marker_tokenizer(smollm2, dst, past_rows=past_rows)
    return dst


def test_tokenizer_json_is_carried_but_only_a_pull_reads_it(registry, plain, tmp_path, smollm2_path):
    src = _with_tokenizer(plain, tmp_path / "marker", smollm2_path)

    async def run():
        record = await registry.register("marker", str(src))
        got = await registry.get("marker")
        listed, _ = await registry.list(100, "")
        async with registry.open_pull("marker") as handle:
            pulled = handle.files
        return record, got, listed, pulled

    record, got, listed, pulled = asyncio.run(run())
    assert pulled["tokenizer.json"] == (src / "tokenizer.json").read_bytes()
    assert set(pulled) == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert record.files_digest == tokenizer_files.files_digest(pulled)
    assert got.files_json == "" and got.files_digest == record.files_digest  # GetAdapter: no files
    assert [r.files_json for r in listed if r.name == "marker"] == [""]


def test_a_tokenizer_past_the_embedding_rows_is_refused_naming_the_token(
    registry, plain, tmp_path, smollm2_path
):
    src = _with_tokenizer(plain, tmp_path / "past", smollm2_path, past_rows=True)
    with pytest.raises(
        FailedPrecondition, match=f"{MARKER!r} at id {ROWS}, past the {ROWS} embedding rows"
    ) as e:
        asyncio.run(registry.register("past", str(src)))
    assert e.value.field == "tokenizer"


def test_added_tokens_past_the_rows_are_refused_from_any_file(registry, plain, tmp_path):
    src = shutil.copytree(plain, tmp_path / "added")
    (src / "added_tokens.json").write_text(json.dumps({"<tool>": ROWS + 3}))
    with pytest.raises(FailedPrecondition, match=f"'<tool>' at id {ROWS + 3}"):
        asyncio.run(registry.register("added", str(src)))


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b'{"model": {"type": "nothing"}}', "tokenizer.json does not load as a tokenizer"),
        (b" " * (tokenizer_files.MAX_TOKENIZER_JSON_BYTES + 1), "at most 16777216 are carried"),
    ],
)
def test_a_broken_or_oversized_tokenizer_json_is_refused(registry, plain, tmp_path, content, why):
    src = shutil.copytree(plain, tmp_path / "broken")
    (src / "tokenizer.json").write_bytes(content)
    with pytest.raises(InvalidArgument, match=why) as e:
        asyncio.run(registry.register("broken", str(src)))
    assert e.value.field == "tokenizer.json"
