"""The Python clients (sync and asyncio) and the `loraplex` CLI against the real stack."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.clients import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from loraplex.v1 import inference_pb2 as pb
from tests.support.service_stack import STORE_STACK_SHAPE, store_stack

PROMPT = "List 3 countries and their capitals."
LORAPLEX = Path(sys.executable).parent / "loraplex"


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory, smollm2_path):
    return store_stack(request.config, tmp_path_factory, smollm2_path)


@pytest.fixture(scope="module")
def client(stack):
    store, inference = stack
    with Client(inference.address, store=store.address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def adapter_path(smollm2_path, adapter_factory):
    return adapter_factory(smollm2_path, "cli-a", seed=31, **STORE_STACK_SHAPE)


def test_sync_client_roundtrip(client, adapter_path, smollm2_path):
    from transformers import AutoTokenizer

    info = client.load_adapter("py-a", str(adapter_path))
    assert info.name == "py-a" and info.rank == 8
    outs = client.generate([PROMPT, PROMPT], ["py-a", ""], max_new_tokens=8, temperature=0)
    assert [o.adapter for o in outs] == ["py-a", ""]
    deltas = list(client.generate_stream([PROMPT, PROMPT], ["py-a", ""], max_new_tokens=8))
    for i, out in enumerate(outs):
        assert "".join(d.text for d in deltas if d.index == i) == out.text
    assert "py-a" in {a.name for a in client.list_adapters()}
    assert client.model_info().max_lora_rank == 8
    assert (
        client.tokenize("Hello world") == AutoTokenizer.from_pretrained(smollm2_path)("Hello world").input_ids
    )
    assert client.health() == "SERVING"
    assert client.get_adapter("py-a").rank == 8
    client.unload_adapter("py-a")
    assert "py-a" not in {a.name for a in client.list_adapters() if a.location != pb.ADAPTER_LOCATION_STORE}


def test_sync_client_typed_errors(client, smollm2_path, adapter_factory):
    with pytest.raises(InvalidArgument) as bad:
        client.generate(["a", "b", "c"], ["", ""])
    assert "adapter" in bad.value.field_violations
    with pytest.raises(NotFound) as missing:
        client.generate("a", "missing-adapter")
    assert missing.value.resource == "missing-adapter"
    wide = adapter_factory(smollm2_path, "py-wide", r=32, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    with pytest.raises(FailedPrecondition):
        client.load_adapter("py-wide", str(wide))
    with pytest.raises(DeadlineExceeded):
        client.generate(PROMPT, max_new_tokens=500, ignore_eos=True, timeout=1.0)
    with pytest.raises(TypeError):
        client.generate("a", temprature=0.5)


def test_sync_client_inputs_chat_logprobs(client, smollm2_path):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2_path)(PROMPT).input_ids
    by_text, by_ids, sampled = client.generate_inputs(
        [
            {"text": PROMPT},
            {"token_ids": ids},
            {"text": PROMPT, "sampling_params": {"temperature": 1.0, "seed": 1}},
        ],
        max_new_tokens=4,
        temperature=0,
    )
    assert by_text.token_ids == by_ids.token_ids and [c.index for c in (by_text, by_ids, sampled)] == [
        0,
        1,
        2,
    ]
    answers = client.chat(
        [{"role": "user", "content": PROMPT}],
        max_new_tokens=4,
        n=2,
        temperature=1.0,
        seed=9,
        logprobs=True,
        top_logprobs=2,
    )
    assert [a.sample for a in answers] == [0, 1]
    assert all(len(a.logprobs) == len(a.token_ids) and len(a.logprobs[0].top) == 2 for a in answers)
    assert answers[0].time_to_first_token_s > 0


def test_async_client(stack, adapter_path):
    store, inference = stack

    async def run():
        async with AsyncClient(inference.address, store=store.address, timeout=120) as c:
            await c.load_adapter("aio-a", str(adapter_path))
            outs = await c.generate([PROMPT, PROMPT], ["aio-a", ""], max_new_tokens=6)
            deltas = [d async for d in c.generate_stream([PROMPT, PROMPT], ["aio-a", ""], max_new_tokens=6)]
            chat = await c.chat([{"role": "user", "content": PROMPT}], "aio-a", max_new_tokens=3)
            by_ids = await c.generate_inputs([{"token_ids": [1, 2, 3]}], max_new_tokens=3)
            assert chat[0].adapter == "aio-a" and by_ids[0].prompt_tokens == 3
            with pytest.raises(NotFound):
                await c.generate("a", "nope-aio")
            names = {a.name for a in await c.list_adapters()}
            info = await c.model_info()
            records = await c.list_store_adapters()
            return outs, deltas, names, info, records

    outs, deltas, names, info, records = asyncio.run(run())
    for i, out in enumerate(outs):
        assert "".join(d.text for d in deltas if d.index == i) == out.text
        assert [t for d in deltas if d.index == i for t in d.token_ids] == list(out.token_ids)
    assert "aio-a" in names and info.context_length > 0 and "aio-a" in {r.name for r in records}


def cli(stack, *args: str) -> subprocess.CompletedProcess:
    store, inference = stack
    return subprocess.run(
        [str(LORAPLEX), "--target", inference.address, "--store", store.address, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli(stack, adapter_path):
    out = cli(stack, "load", "cli-a", str(adapter_path))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["name"] == "cli-a"
    out = cli(stack, "generate", "--adapter", "cli-a", "--max-new-tokens", "6", "--json", PROMPT)
    assert out.returncode == 0, out.stderr
    [completion] = json.loads(out.stdout)
    assert completion["adapter"] == "cli-a"
    streamed = cli(stack, "generate", "--adapter", "cli-a", "--max-new-tokens", "6", "--stream", PROMPT)
    assert streamed.returncode == 0 and streamed.stdout.rstrip("\n") == completion.get("text", "").rstrip(
        "\n"
    )
    listed = cli(stack, "list")
    assert listed.returncode == 0 and "cli-a" in listed.stdout
    assert json.loads(cli(stack, "info").stdout)["maxLoraRank"] == 8
    assert cli(stack, "unload", "cli-a").returncode == 0
    missing = cli(stack, "generate", "--adapter", "never-there", "x")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
    chat = cli(
        stack,
        "generate",
        "--chat",
        "--system",
        "Be brief.",
        "-n",
        "2",
        "--temperature",
        "1",
        "--seed",
        "4",
        "--logprobs",
        "1",
        "--max-new-tokens",
        "3",
        "--json",
        PROMPT,
    )
    assert chat.returncode == 0, chat.stderr
    answers = json.loads(chat.stdout)
    assert [a.get("sample", 0) for a in answers] == [0, 1] and len(answers[0]["logprobs"]) == 3
    ids = cli(stack, "generate", "--ids", "--max-new-tokens", "2", "--json", "1,2,3")
    assert ids.returncode == 0 and json.loads(ids.stdout)[0]["promptTokens"] == 3
    bad = cli(stack, "generate", "--adapter", "a", "--adapter", "b", "x", "y", "z")
    assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr
