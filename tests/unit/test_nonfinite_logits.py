"""A request whose logits turn NaN ends with an error naming its adapter; the rest of its batch goes on
(issue 59, M6). The adapter's NaN is put into its host copy after the load check (what a check that
missed would let through), so it reaches the pool on upload."""

from __future__ import annotations

import logging

import grpc
import pytest

from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.errors import NonFiniteLogits
from loraplex.services.inference.status import code_for, status_for
from tests.support.lora_reference import server_args, sync_engine

NEW = 6
PROMPT = "The capital of France is"


def run(engine, requests: dict[str, str | None]) -> dict[str, tuple[list[int], str | None]]:
    """request id -> (token ids, finish reason), all in one batch."""
    ids = engine.tokenizer(PROMPT).input_ids
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2)
    for rid, adapter in requests.items():
        engine.add_request(rid, ids, params, adapter)
    out: dict[str, tuple[list[int], str | None]] = {rid: ([], None) for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, _ = out[o.request_id]
            out[o.request_id] = (tokens + list(o.new_token_ids), o.finish_reason)
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_nan_logits_end_their_request_with_an_error_and_no_other(
    tiny_llama_path, adapter_factory, one_torch_thread, caplog, overlap
):
    good = adapter_factory(tiny_llama_path, "nonfinite-good", target_modules=["q_proj", "v_proj"])
    bad = adapter_factory(tiny_llama_path, "nonfinite-bad", target_modules=["q_proj", "v_proj"], seed=3)
    engine = sync_engine(server_args(tiny_llama_path, {"good": good, "bad": bad}, overlap_schedule=overlap))
    want = run(engine, {"base": None, "good": "good"})
    for t in engine.adapter_slots._active["bad"].weights.lora_b.values():
        t.fill_(float("nan"))  # past the load check: the pool gets it on upload
    with caplog.at_level(logging.ERROR):
        got = run(engine, {"base2": None, "good2": "good", "bad2": "bad"})
    assert got["base2"] == want["base"] and got["good2"] == want["good"]
    tokens, reason = got["bad2"]
    assert reason == "abort" and tokens == []  # ended at its first token: no token 0 served
    error = engine.errors.pop("bad2")
    assert isinstance(error, NonFiniteLogits) and error.adapter == "bad", error
    assert "non-finite" in error.message and "output token 0" in error.message
    assert code_for(error) == grpc.StatusCode.INTERNAL and status_for(error).code == grpc.StatusCode.INTERNAL
    lines = [r.getMessage() for r in caplog.records if "non-finite logits" in r.getMessage()]
    assert len(lines) == 1 and "bad2" in lines[0] and "adapter 'bad'" in lines[0], lines
    assert not engine.errors  # only that request failed
