"""Adapters arrive before their turn: a queued request's adapter is uploaded while other requests
run, so it is resident when the request is admitted, and the output is unchanged."""

from __future__ import annotations

from loraplex.services.inference.engine.types import SamplingParams
from tests.support.lora_reference import peft_greedy, server_args, sync_engine


def test_queued_requests_adapter_is_resident_before_admission(
    tiny_llama_path, adapter_factory, one_torch_thread
):
    path = adapter_factory(
        tiny_llama_path, "prefetch-a", r=8, target_modules=["q_proj", "down_proj"], seed=21
    )
    engine = sync_engine(server_args(tiny_llama_path, {"a": path}, max_running_requests=1))
    manager = engine.adapter_slots
    prompts = [engine.tokenizer(p).input_ids for p in ["The capital of France is", "Water boils at"]]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.add_request("base", prompts[0], params, None)
    engine.add_request("lora", prompts[1], params, "a")
    outs: dict[str, list[int]] = {"base": [], "lora": []}
    resident_while_queued = False
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
        waiting = [r.request_id for r in engine.scheduler.waiting]
        if "lora" in waiting:
            location = {i.name: i.location for i in manager.list_adapters()}["a"]
            resident_while_queued = resident_while_queued or location == "gpu"
    assert resident_while_queued, "the adapter was not uploaded while its request waited"
    assert outs["lora"] == peft_greedy(tiny_llama_path, {"a": path}, [(prompts[1], "a")], new_tokens=8)[0]
