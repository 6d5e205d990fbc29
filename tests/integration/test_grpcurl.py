"""The real grpcurl binary against both servers, through reflection only (no .proto files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.service_stack import STORE_STACK_SHAPE, store_stack

REPO = Path(__file__).resolve().parents[2]
GRPCURL = Path(sys.executable).parent / "grpcurl"
EXAMPLES = REPO / "clients" / "grpcurl"


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory, smollm2_path):
    return store_stack(request.config, tmp_path_factory, smollm2_path)


def grpcurl(*args: str, data: dict | None = None) -> str:
    cmd = [str(GRPCURL), "-plaintext"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one pretty JSON object per message."""
    decoder, pos, out = json.JSONDecoder(), 0, []
    text = text.strip()
    while pos < len(text):
        obj, end = decoder.raw_decode(text, pos)
        out.append(obj)
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


def test_reflection_lists_both_services(stack):
    store, inference = stack
    assert "loraplex.v1.Inference" in grpcurl(inference.address, "list").split()
    assert "loraplex.v1.AdapterStore" in grpcurl(store.address, "list").split()
    described = grpcurl(inference.address, "describe", "loraplex.v1.Inference")
    for rpc in (
        "Generate",
        "GenerateStream",
        "LoadAdapter",
        "UnloadAdapter",
        "ListAdapters",
        "GetModelInfo",
        "Tokenize",
        "Detokenize",
    ):
        assert f"rpc {rpc}" in described


def test_generate_stream_and_load_adapter_with_json(stack, smollm2_path, adapter_factory):
    _, inference = stack
    path = adapter_factory(smollm2_path, "curl", seed=21, **STORE_STACK_SHAPE)
    loaded = json.loads(
        grpcurl(
            inference.address, "loraplex.v1.Inference/LoadAdapter", data={"name": "curl", "source": str(path)}
        )
    )
    assert loaded["adapter"]["name"] == "curl" and loaded["adapter"]["rank"] == 8
    request = {
        "text": ["List 3 countries and their capitals.", "Hello"],
        "adapter": ["curl", ""],
        "sampling_params": {"max_new_tokens": 8},
    }
    unary = json.loads(grpcurl(inference.address, "loraplex.v1.Inference/Generate", data=request))
    assert [c.get("adapter", "") for c in unary["completions"]] == ["curl", ""]
    assert all(c["finish_reason"] in ("stop", "length") for c in unary["completions"])
    messages = json_stream(grpcurl(inference.address, "loraplex.v1.Inference/GenerateStream", data=request))
    for i, c in enumerate(unary["completions"]):
        mine = [m for m in messages if m.get("index", 0) == i]
        assert "".join(m.get("text", "") for m in mine) == c.get("text", "")
        assert [t for m in mine for t in m.get("token_ids", [])] == c["token_ids"]
        assert mine[-1]["finish_reason"] == c["finish_reason"]


def test_example_scripts_run(stack):
    store, inference = stack
    env = {**os.environ, "INFERENCE": inference.address, "STORE": store.address, "GRPCURL": str(GRPCURL)}
    for script, args in [
        ("list.sh", []),
        ("health.sh", []),
        ("get_model_info.sh", []),
        ("tokenize.sh", ["hi"]),
        ("detokenize.sh", ["19556", "28"]),
        ("list_adapters.sh", []),
        ("generate.sh", ["", "Hello"]),
        ("generate_stream.sh", ["", "Hello"]),
        ("store_list_adapters.sh", []),
        ("generate_inputs.sh", []),
        ("chat_stream.sh", ["", "Hi"]),
        ("generate_json_schema.sh", []),
    ]:
        out = subprocess.run(
            ["bash", str(EXAMPLES / script), *args], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, (script, out.stderr)
        assert out.stdout.strip(), script
        if script == "generate_inputs.sh":
            completions = json.loads(out.stdout)["completions"]
            assert [(c.get("index", 0), c.get("sample", 0)) for c in completions] == [
                (0, 0),
                (1, 0),
                (1, 1),
                (2, 0),
            ]
            assert len(completions[3]["logprobs"]) == len(completions[3]["token_ids"])
        if script == "generate_json_schema.sh":
            constrained, _, choice = json.loads(out.stdout)["completions"]
            answer = json.loads(constrained["text"])
            assert constrained["finish_reason"] == "stop" and set(answer) == {"country", "capital"}
            assert choice["text"] in ("yes", "no")
        if script == "chat_stream.sh":
            final = json_stream(out.stdout)[-1]
            assert final["finish_reason"] and final["time_to_first_token_s"] > 0
