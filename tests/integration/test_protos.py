"""The checked-in stubs are exactly what `make protos` generates from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_stubs_are_fresh(tmp_path):
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "loraplex" / "v1").glob("*.proto"))
    assert protos, "no .proto files found"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *protos,
        ],
        check=True,
    )
    fresh = sorted(p for p in (tmp_path / "loraplex" / "v1").iterdir() if p.name.endswith(GENERATED_SUFFIXES))
    assert len(fresh) == 3 * len(protos)
    stale = [p.name for p in fresh if (PROTO_DIR / "loraplex" / "v1" / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"stubs out of date, run `make protos`: {stale}"


def test_contract_names():
    from loraplex.v1 import adapter_store_pb2, inference_pb2

    inference = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    assert {m.name for m in inference.methods} == {
        "Generate",
        "GenerateStream",
        "LoadAdapter",
        "UnloadAdapter",
        "ListAdapters",
        "GetModelInfo",
        "Tokenize",
        "Detokenize",
    }
    store = adapter_store_pb2.DESCRIPTOR.services_by_name["AdapterStore"]
    assert {m.name for m in store.methods} == {
        "RegisterAdapter",
        "GetAdapter",
        "ListAdapters",
        "DeleteAdapter",
        "PullAdapter",
        "WatchAdapters",
    }
    req = inference_pb2.GenerateRequest(text=["a", "b"], adapter=["x", ""])
    req.sampling_params.max_new_tokens = 4
    assert list(req.text) == ["a", "b"] and list(req.adapter) == ["x", ""]
    fields = set(inference_pb2.Completion.DESCRIPTOR.fields_by_name)
    assert {"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "adapter"} <= fields
    assert {
        "index",
        "sample",
        "logprobs",
        "queue_time_s",
        "time_to_first_token_s",
        "cached_prompt_tokens",
    } <= fields
    inp = inference_pb2.Input(messages=[inference_pb2.ChatMessage(role="user", content="hi")], adapter="x")
    assert not inp.HasField("add_generation_prompt") and not inp.HasField("sampling_params")
    params = set(inference_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert {"n", "logprobs", "top_logprobs"} <= params
    assert {"token_id", "logprob", "token", "top"} <= set(
        inference_pb2.TokenLogprob.DESCRIPTOR.fields_by_name
    )
    chunk = adapter_store_pb2.AdapterChunk(data=b"x")
    assert chunk.WhichOneof("payload") == "data"
