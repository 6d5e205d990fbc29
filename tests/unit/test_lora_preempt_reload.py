"""A request preempted (KV full) while its adapter is reloaded with other content resumes on the
version it started with: no request ever mixes two versions of an adapter."""

from __future__ import annotations

from loraplex.services.inference.engine.types import SamplingParams
from tests.support.lora_reference import peft_greedy, server_args, sync_engine

NEW = 24


def test_preempted_request_keeps_its_adapter_version(tiny_llama_path, adapter_factory, one_torch_thread):
    v1 = adapter_factory(
        tiny_llama_path, "reload-v1", r=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=11
    )
    v2 = adapter_factory(
        tiny_llama_path, "reload-v2", r=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=12
    )
    # KV for about two sequences: four requests force preemptions while they decode.
    engine = sync_engine(
        server_args(
            tiny_llama_path,
            {"a": v1},
            max_total_tokens=96,
            page_size=4,
            max_loras_per_batch=2,
            max_num_batched_tokens=64,
        )
    )
    prompts = [
        engine.tokenizer(p).input_ids
        for p in ["The capital of France is", "Water boils at", "def fibonacci(n):", "1, 2, 3, 4,"]
    ]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params, "a")
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    reloaded = False
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
        if not reloaded and engine.scheduler.num_preemptions > 0:
            engine.adapter_slots.load_adapter("a", v2)  # the new content, mid-flight
            reloaded = True
    assert reloaded, "the KV cap did not force a preemption; the test proves nothing"
    # Every request started on v1 must equal v1 alone, token for token.
    expected = peft_greedy(tiny_llama_path, {"a": v1}, [(ids, "a") for ids in prompts], new_tokens=NEW)
    expected_v2 = peft_greedy(tiny_llama_path, {"a": v2}, [(ids, "a") for ids in prompts], new_tokens=NEW)
    assert expected != expected_v2, "v1 and v2 must differ for the check to mean anything"
    assert [outs[f"r{i}"] for i in range(len(prompts))] == expected
    # and a request arriving after the reload gets v2
    engine.add_request("late", prompts[0], params, "a")
    late: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            late.extend(out.new_token_ids)
    assert late == expected_v2[0]
