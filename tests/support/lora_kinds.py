"""The PEFT reference and engine driver of the adapter-kind tests (tests/integration/test_lora_kinds.py
and its Triton-interpreter child, tests/support/lora_kinds_triton_check.py): greedy tokens and each
chosen token's log probability."""

from __future__ import annotations

from pathlib import Path

import torch

from loraplex.services.inference.engine.types import SamplingParams

NEW = 12


def peft_reference(base: Path, adapters: dict[str, Path], jobs: list[tuple[list[int], str | None]]):
    """PEFT's greedy tokens and the chosen tokens' log probabilities, one sequence at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    names = sorted(adapters)
    peft = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(adapters[name], adapter_name=name)
    peft.eval()
    out = []
    with torch.no_grad():
        for ids, name in jobs:
            x = torch.tensor([ids])
            if name is None:
                with peft.disable_adapter():
                    gen = peft.generate(
                        input_ids=x,
                        max_new_tokens=NEW,
                        do_sample=False,
                        output_logits=True,
                        return_dict_in_generate=True,
                    )
            else:
                peft.set_adapter(name)
                gen = peft.generate(
                    input_ids=x,
                    max_new_tokens=NEW,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            tokens = gen.sequences[0, len(ids) :].tolist()  # (generate stops after EOS, as we do)
            logprobs = [
                float(torch.log_softmax(step[0].float(), -1)[t])
                for step, t in zip(gen.logits, tokens, strict=True)
            ]
            out.append((tokens, logprobs))
    return out


def engine_run(
    engine, prompts: list[list[int]], batch: list[str | None]
) -> list[tuple[list[int], list[float]]]:
    """Our tokens and their log probabilities, all prompts in one continuous batch."""
    params = SamplingParams(max_new_tokens=NEW, logprobs=0)
    ids = [f"kinds-{i}" for i in range(len(prompts))]
    for rid, prompt, name in zip(ids, prompts, batch, strict=True):
        engine.check_request(prompt, params)
        engine.add_request(rid, prompt, params, name)
    got: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in ids}
    finished: set[str] = set()
    while len(finished) < len(ids):
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(lp.logprob for lp in out.logprobs or ())
            if out.finished:
                finished.add(out.request_id)
    assert not engine.errors, engine.errors
    return [got[rid] for rid in ids]
