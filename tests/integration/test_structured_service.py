"""Constrained decoding over real gRPC on the embedded SmolLM2 (shares test_service_inference's
server): a JSON-schema input under an adapter beside free-text and choice inputs in one batch,
streamed and unary; invalid constraints (a constraint that admits nothing, a schema keyword the
grammar engine does not enforce, min_tokens past the grammar's end) are INVALID_ARGUMENT naming
the field, never OK."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from loraplex.v1 import inference_pb2 as pb
from tests.integration.test_service_inference import adapters, server, stub  # noqa: F401

SCHEMA = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "maxLength": 20},
        "capital": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000},
    },
    "required": ["country", "capital", "population_millions"],
    "additionalProperties": False,
}
PROMPT = "Give the country, capital and population of France as JSON."


def test_json_schema_with_an_adapter_in_a_mixed_batch(stub):  # noqa: F811
    constrained = pb.SamplingParams(max_new_tokens=80, json_schema=json.dumps(SCHEMA))
    choice = pb.SamplingParams(
        max_new_tokens=8, temperature=0.8, seed=3, choice=pb.Choices(choices=["yes", "no"])
    )
    resp = stub.Generate(
        pb.GenerateRequest(
            inputs=[
                pb.Input(text=PROMPT, adapter="alpha", sampling_params=constrained),
                pb.Input(text=PROMPT),
                pb.Input(text="Is Paris in France? Answer yes or no.", sampling_params=choice),
            ],
            sampling_params=pb.SamplingParams(max_new_tokens=8),
        )
    )
    js, free, picked = resp.completions
    assert js.finish_reason == "stop" and js.adapter == "alpha"
    jsonschema.validate(json.loads(js.text), SCHEMA)
    assert free.completion_tokens == 8 or free.finish_reason == "stop"
    assert picked.text in ("yes", "no") and picked.finish_reason == "stop"


def test_streamed_schema_output_joins_to_valid_json(stub):  # noqa: F811
    params = pb.SamplingParams(max_new_tokens=80, temperature=0.7, seed=5, json_schema=json.dumps(SCHEMA))
    req = pb.GenerateRequest(text=[PROMPT], adapter=["beta"], sampling_params=params)
    parts, reasons = [], []
    for msg in stub.GenerateStream(req):
        parts.append(msg.text)
        if msg.finish_reason:
            reasons.append(msg.finish_reason)
    assert reasons == ["stop"], "".join(parts)
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


def test_n_samples_each_match(stub):  # noqa: F811
    params = pb.SamplingParams(
        max_new_tokens=80, temperature=1.0, seed=9, n=3, json_schema=json.dumps(SCHEMA)
    )
    resp = stub.Generate(pb.GenerateRequest(text=[PROMPT], adapter=["alpha"], sampling_params=params))
    assert [c.sample for c in resp.completions] == [0, 1, 2]
    for c in resp.completions:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
        else:
            assert c.finish_reason == "length" and c.completion_tokens == 80
    assert sum(c.finish_reason == "stop" for c in resp.completions) >= 2


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        (pb.SamplingParams(regex="[a-"), "sampling_params.regex", "Unclosed"),
        (pb.SamplingParams(json_schema="{oops"), "sampling_params.json_schema", "not valid JSON"),
        (pb.SamplingParams(grammar="root ::= nope"), "sampling_params.grammar", "nope"),
        (pb.SamplingParams(choice=pb.Choices()), "sampling_params.choice", "1-1024"),
        (pb.SamplingParams(grammar="root ::= root"), "sampling_params.grammar", "admits no output"),
        (
            pb.SamplingParams(json_schema='{"$ref": "#"}'),
            "sampling_params.json_schema",
            "admits no output",
        ),
        (
            pb.SamplingParams(json_schema='{"type": "string", "not": {"const": "a"}}'),
            "sampling_params.json_schema",
            "uses 'not' at #",
        ),
        # Found while decoding: the grammar ends after "yes" / "no", min_tokens wants more.
        (
            pb.SamplingParams(max_new_tokens=8, min_tokens=5, choice=pb.Choices(choices=["yes", "no"])),
            "sampling_params.min_tokens",
            "ends after",
        ),
    ],
)
def test_invalid_constraint_is_invalid_argument(stub, params, field, words):  # noqa: F811
    request = pb.GenerateRequest(text=[PROMPT], sampling_params=params)
    for call in (stub.Generate, lambda r: list(stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            call(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details() and words in err.value.details()
