"""Overlap scheduling (engine/overlap.py) forced on for the CPU gives the same outputs as without it.

Every check runs the real engine with `overlap_schedule=True` and compares with transformers'
greedy `generate` or with the same engine run step by step without overlap: whole output streams
(text deltas, token ids, finish reasons, token counts), preemption, stop strings and stop ids,
max_new_tokens, aborts mid-flight, seeded sampling, penalties and a mixed LoRA batch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.types import RequestOutput, SamplingParams
from tests.integration.test_engine_correctness import PROMPTS, hf_greedy
from tests.support.lora_reference import BATCH as LORA_BATCH
from tests.support.lora_reference import make_adapters, server_args, sync_engine

NEW_TOKENS = 24


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


def make_engine(path: Path, overlap: bool, **overrides) -> LLMEngine:
    options = dict(
        model_path=str(path),
        device=torch.device("cpu"),
        dtype="float32",
        chunked_prefill_size=8,
        max_num_batched_tokens=64,
        max_total_tokens=4096,
        context_length=1024,
        page_size=4,
        overlap_schedule=overlap,
    )
    options.update(overrides)
    engine = LLMEngine.from_config(EngineConfig(**options))
    assert engine._overlap is overlap
    return engine


def count_overlapped_steps(engine: LLMEngine) -> list[int]:
    """Counts forwards launched while the previous step's tokens were still unread."""
    counter = [0]
    forward = engine.runner.forward

    def counting(chunks, prev_tokens=None):
        counter[0] += prev_tokens is not None
        return forward(chunks, prev_tokens)

    engine.runner.forward = counting
    return counter


def run_streams(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    abort_after: dict[str, int] | None = None,
) -> dict[str, list[RequestOutput]]:
    """Every output of every request, in order; `abort_after` aborts a request after that many steps."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    streams: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            streams[out.request_id].append(out)
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at and rid in engine.requests:
                streams[rid].append(engine.abort_request(rid))
    return streams


def summary(stream: list[RequestOutput]) -> tuple:
    tokens = [t for out in stream for t in out.new_token_ids]
    assert [out.finished for out in stream] == [False] * (len(stream) - 1) + [True]
    return "".join(o.new_text for o in stream), tokens, stream[-1].finish_reason, stream[-1].completion_tokens


def test_mixed_batch_matches_transformers_and_the_plain_step(tiny_llama_path):
    on, off = make_engine(tiny_llama_path, True), make_engine(tiny_llama_path, False)
    overlapped = count_overlapped_steps(on)
    prompts = [on.tokenizer(p).input_ids for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=NEW_TOKENS)] * len(prompts)
    got, plain = run_streams(on, prompts, params), run_streams(off, prompts, params)
    reference = hf_greedy(tiny_llama_path, prompts, NEW_TOKENS)
    for i, ref in enumerate(reference):
        text, tokens, reason, count = summary(got[f"r{i}"])
        assert tokens == ref
        assert text == on.tokenizer.decode(ref, skip_special_tokens=True)
        assert reason == ("stop" if len(ref) < NEW_TOKENS else "length") and count == len(ref)
        assert [o.new_token_ids for o in got[f"r{i}"]] == [o.new_token_ids for o in plain[f"r{i}"]]
    assert overlapped[0] > NEW_TOKENS // 2, "the decode steps really ran ahead of their outputs"
    assert on.stats().kv_blocks_free == on.stats().kv_blocks_total


def test_preemption_keeps_outputs(tiny_llama_path):
    probe = make_engine(tiny_llama_path, False)
    prompts = [probe.tokenizer(p).input_ids for p in PROMPTS]
    need = max(len(p) for p in prompts) + NEW_TOKENS
    engine = make_engine(tiny_llama_path, True, max_total_tokens=3 * need)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == [
        r.token_ids
        for r in probe.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    ]
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_stops_lengths_and_seeded_sampling_stream_identically(tiny_llama_path):
    probe = make_engine(tiny_llama_path, False)
    prompts = [probe.tokenizer(p).input_ids for p in PROMPTS]
    (free_run,) = probe.generate(prompts[:1], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    stop_text = free_run.text[len(free_run.text) // 2 :][:3]
    assert stop_text.strip()
    params = [
        SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop=(stop_text,)),  # stops mid-run
        SamplingParams(max_new_tokens=1),  # ends at its first token
        SamplingParams(max_new_tokens=7, ignore_eos=True),  # exact length
        SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=(free_run.token_ids[5],)),
        SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.2, top_k=20, seed=12),
        SamplingParams(max_new_tokens=9, temperature=0.7, min_p=0.05, seed=13, ignore_eos=True),
        SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
    ]
    prompts[3] = prompts[0]  # so its stop id (from prompt 0's run) does come up
    got = run_streams(make_engine(tiny_llama_path, True), prompts, params)
    want = run_streams(make_engine(tiny_llama_path, False), prompts, params)
    for rid in want:
        # everything but the timings, which are wall-clock
        untimed = dict(queue_time=0.0, time_to_first_token=0.0)
        assert [o._replace(**untimed) for o in got[rid]] == [o._replace(**untimed) for o in want[rid]], rid
    assert summary(got["r0"])[2] == "stop" and stop_text not in summary(got["r0"])[0]
    assert summary(got["r1"])[3] == 1 and summary(got["r2"])[3] == 7 and summary(got["r3"])[2] == "stop"
    # seeded rows do not depend on the batch: alone, with overlap, they give the same tokens
    alone = run_streams(make_engine(tiny_llama_path, True), prompts[4:5], params[4:5])
    assert summary(alone["r0"])[1] == summary(got["r4"])[1]


def test_abort_mid_flight_frees_kv_and_leaves_the_rest_alone(tiny_llama_path):
    prompts = [make_engine(tiny_llama_path, False).tokenizer(p).input_ids for p in PROMPTS[:4]]
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)] * 4
    engine = make_engine(tiny_llama_path, True)
    got = run_streams(engine, prompts, params, abort_after={"r1": 8})
    want = run_streams(make_engine(tiny_llama_path, False), prompts, params)
    aborted = got["r1"]
    assert aborted[-1].finish_reason == "abort"
    delivered = [t for o in aborted for t in o.new_token_ids]
    assert 0 < len(delivered) < NEW_TOKENS and aborted[-1].completion_tokens == len(delivered)
    assert delivered == summary(want["r1"])[1][: len(delivered)]
    for rid in ("r0", "r2", "r3"):
        assert summary(got[rid]) == summary(want[rid])
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_penalties_fall_back_to_the_plain_step(tiny_llama_path):
    prompts = [make_engine(tiny_llama_path, False).tokenizer(p).input_ids for p in PROMPTS[:3]]
    params = [
        SamplingParams(max_new_tokens=16, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_new_tokens=16, frequency_penalty=1.0, temperature=0.8, seed=3),
        SamplingParams(max_new_tokens=16, ignore_eos=True),
    ]
    got = run_streams(make_engine(tiny_llama_path, True), prompts, params)
    want = run_streams(make_engine(tiny_llama_path, False), prompts, params)
    assert {k: summary(v) for k, v in got.items()} == {k: summary(v) for k, v in want.items()}


def test_mixed_lora_batch_equals_the_plain_step(tiny_llama_path, adapter_factory):
    adapters = make_adapters(adapter_factory, tiny_llama_path, "overlap")
    outs = {}
    for overlap in (False, True):  # more adapters than slots: some requests wait for a slot
        engine = sync_engine(server_args(tiny_llama_path, adapters, max_loras_per_batch=2))
        engine.config = dataclasses.replace(engine.config, overlap_schedule=overlap)
        assert engine._overlap is overlap
        prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[: len(LORA_BATCH)]]
        outs[overlap] = [
            c.token_ids
            for c in engine.generate(
                prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), list(LORA_BATCH)
            )
        ]
        assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
    assert outs[True] == outs[False]
    assert len({tuple(t) for t in outs[True][1:5]}) == 4, "the adapters change the output"
