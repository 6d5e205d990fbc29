"""Notebook flow 4: adapters of different ranks and target modules in one server.

With `--max-lora-rank` and `--lora-target-modules` sized for the largest, a rank-4
attention-only adapter and a rank-16 all-projection adapter serve side by side (and beside
the base model) in one call, each equal to PEFT token for token. The FAILED_PRECONDITION
side (a server sized without those flags) is in test_service_inference.py.
"""

from __future__ import annotations

import grpc
import pytest

from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.service_stack import PeftReference, shared, start_inference

MAX_NEW = 12
PROMPTS = ["List 3 countries and their capitals.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def adapters(smollm2_path, adapter_factory):
    return {
        "small": adapter_factory(
            smollm2_path, "small", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=41
        ),
        "large": adapter_factory(
            smollm2_path, "large", r=16, lora_alpha=16, target_modules="all-linear", use_rslora=True, seed=42
        ),
        "mlp": adapter_factory(
            smollm2_path, "mlp", r=8, lora_alpha=32, target_modules=["gate_proj", "down_proj"], seed=43
        ),
    }


@pytest.fixture(scope="module")
def stub(request, smollm2_path):
    server = shared(
        request.config,
        "smollm2-shapes",
        lambda: start_inference(
            smollm2_path,
            "--max-lora-rank",
            "16",
            "--lora-target-modules",
            "all",
            "--max-loras-per-batch",
            "2",
        ),
    )
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.InferenceStub(channel)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return PeftReference(smollm2_path)


def test_different_shapes_side_by_side(stub, adapters, reference):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_lora_rank == 16 and len(info.lora_target_modules) == 7
    for name, path in adapters.items():
        loaded = stub.LoadAdapter(pb.LoadAdapterRequest(name=name, source=str(path))).adapter
        assert loaded.name == name
    listed = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    assert (listed["small"].rank, listed["large"].rank, listed["mlp"].rank) == (4, 16, 8)
    # three adapters and the base in one call with only 2 slots per batch: the scheduler rotates them
    texts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0]]
    names = ["small", "large", "mlp", "", "large"]
    resp = stub.Generate(
        pb.GenerateRequest(
            text=texts, adapter=names, sampling_params=pb.SamplingParams(max_new_tokens=MAX_NEW)
        )
    )
    outputs = []
    for c, text, name in zip(resp.completions, texts, names, strict=True):
        want = reference.greedy(text, adapters[name] if name else None, MAX_NEW)
        assert list(c.token_ids) == want, name
        outputs.append(tuple(want))
    assert len({outputs[0], outputs[1], reference_base(reference, PROMPTS[0])}) == 3, (
        "each adapter must matter"
    )


def reference_base(reference: PeftReference, prompt: str) -> tuple[int, ...]:
    return tuple(reference.greedy(prompt, None, MAX_NEW))
