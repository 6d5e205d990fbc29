"""The inference service over real gRPC on the embedded SmolLM2 (CPU), no adapter store.

One server for the module, started with two adapters (--lora-paths); a third is loaded
and unloaded at run time. Every greedy output is checked token for token against
transformers + PEFT run per sequence.
"""

from __future__ import annotations

import time

import grpc
import pytest

from loraplex.clients.errors import from_rpc_error
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.service_stack import PeftReference, scrape, shared, start_inference

MAX_NEW = 12
PROMPTS = [
    "List 3 countries and their capitals.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
]
SHAPE = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


@pytest.fixture(scope="module")
def adapters(smollm2_path, adapter_factory):
    return {
        "alpha": adapter_factory(smollm2_path, "alpha", seed=1, **SHAPE),
        "beta": adapter_factory(smollm2_path, "beta", seed=2, **SHAPE),
        "gamma": adapter_factory(smollm2_path, "gamma", seed=3, **SHAPE),
        "wide": adapter_factory(
            smollm2_path, "wide", r=16, lora_alpha=32, target_modules="all-linear", seed=4
        ),
    }


@pytest.fixture(scope="module")
def server(request, smollm2_path, adapters):
    return shared(
        request.config,
        "smollm2-basic",
        lambda: start_inference(
            smollm2_path,
            "--lora-paths",
            f"alpha={adapters['alpha']}",
            f"beta={adapters['beta']}",
            "--context-length",
            "512",
            "--max-inputs-per-request",
            "8",
            "--max-new-tokens-limit",
            "1024",
            "--max-message-bytes",
            "65536",
        ),
    )


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.InferenceStub(channel)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return PeftReference(smollm2_path)


def greedy(n: int = MAX_NEW, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_new_tokens=n, temperature=0, **kw)


def check_against_peft(resp, texts, names, adapters, reference):
    assert len(resp.completions) == len(texts)
    for c, text, name in zip(resp.completions, texts, names, strict=True):
        want = reference.greedy(text, adapters[name] if name else None, MAX_NEW)
        assert list(c.token_ids) == want, (text, name)
        assert c.adapter == name
        assert c.prompt_tokens == len(reference.tokenizer(text).input_ids)
        assert c.completion_tokens == len(c.token_ids)
        assert c.finish_reason in ("stop", "length")
        assert c.text == reference.tokenizer.decode(want, skip_special_tokens=True)


def code_of(call, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def test_one_adapter_beside_base(stub, adapters, reference):
    texts, names = [PROMPTS[0], PROMPTS[0]], ["alpha", ""]
    resp = stub.Generate(pb.GenerateRequest(text=texts, adapter=names, sampling_params=greedy()))
    check_against_peft(resp, texts, names, adapters, reference)
    assert resp.completions[0].token_ids != resp.completions[1].token_ids, (
        "the adapter must change the output"
    )


def test_two_adapters_in_one_call(stub, adapters, reference):
    texts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    names = ["alpha", "beta", "", "beta"]
    resp = stub.Generate(pb.GenerateRequest(text=texts, adapter=names, sampling_params=greedy()))
    check_against_peft(resp, texts, names, adapters, reference)


def test_one_adapter_entry_applies_to_all(stub, adapters, reference):
    resp = stub.Generate(pb.GenerateRequest(text=PROMPTS[:2], adapter=["beta"], sampling_params=greedy()))
    check_against_peft(resp, PROMPTS[:2], ["beta", "beta"], adapters, reference)


def test_dynamic_load_and_unload(stub, adapters, reference):
    err = code_of(stub.Generate, pb.GenerateRequest(text=[PROMPTS[1]], adapter=["gamma"]))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "gamma" in err.details()
    info = stub.LoadAdapter(pb.LoadAdapterRequest(name="gamma", source=str(adapters["gamma"]))).adapter
    assert (info.name, info.rank) == ("gamma", 8)
    listed = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    assert {"alpha", "beta", "gamma"} <= set(listed)
    assert listed["gamma"].location in (pb.ADAPTER_LOCATION_GPU, pb.ADAPTER_LOCATION_HOST)
    assert listed["gamma"].source == str(adapters["gamma"])
    texts, names = [PROMPTS[1], PROMPTS[1], PROMPTS[1]], ["gamma", "alpha", ""]
    resp = stub.Generate(pb.GenerateRequest(text=texts, adapter=names, sampling_params=greedy()))
    check_against_peft(resp, texts, names, adapters, reference)
    assert stub.UnloadAdapter(pb.UnloadAdapterRequest(name="gamma")).name == "gamma"
    assert "gamma" not in {a.name for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    err = code_of(stub.Generate, pb.GenerateRequest(text=[PROMPTS[1]], adapter=["gamma"]))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert from_rpc_error(err).resource == "gamma"
    # the others are untouched
    resp = stub.Generate(pb.GenerateRequest(text=[PROMPTS[1]], adapter=["alpha"], sampling_params=greedy()))
    check_against_peft(resp, [PROMPTS[1]], ["alpha"], adapters, reference)


def test_adapter_that_does_not_fit_is_failed_precondition(stub, adapters):
    # The server's pool was sized from --lora-paths (rank 8, attention only): a rank-16 MLP adapter
    # cannot fit.
    err = code_of(stub.LoadAdapter, pb.LoadAdapterRequest(name="wide", source=str(adapters["wide"])))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert "--max-lora-rank" in err.details() or "--lora-target-modules" in err.details()
    assert "'wide'" in err.details() and from_rpc_error(err).resource == "wide"


def test_stream_deltas_concatenate_to_unary(stub, adapters, reference):
    texts, names = [PROMPTS[0], PROMPTS[1], PROMPTS[2]], ["alpha", "", "beta"]
    request = pb.GenerateRequest(text=texts, adapter=names, sampling_params=greedy())
    unary = stub.Generate(request)
    text = {i: "" for i in range(3)}
    ids: dict[int, list[int]] = {i: [] for i in range(3)}
    finals = {}
    messages = 0
    for msg in stub.GenerateStream(request):
        messages += 1
        assert msg.index not in finals, "nothing may follow an index's final message"
        text[msg.index] += msg.text
        ids[msg.index] += list(msg.token_ids)
        if msg.finish_reason:
            finals[msg.index] = msg
    assert messages > 3, "deltas should arrive as tokens are produced"
    for i, c in enumerate(unary.completions):
        assert text[i] == c.text and ids[i] == list(c.token_ids)
        assert finals[i].finish_reason == c.finish_reason
        assert (finals[i].prompt_tokens, finals[i].completion_tokens) == (
            c.prompt_tokens,
            c.completion_tokens,
        )
    check_against_peft(unary, texts, names, adapters, reference)


def test_tokenize_matches_tokenizer(stub, reference):
    for text in [PROMPTS[0], "héllo wörld 🙂", "  two  spaces\nnewline"]:
        resp = stub.Tokenize(pb.TokenizeRequest(text=text))
        assert list(resp.token_ids) == reference.tokenizer(text).input_ids
        assert list(resp.tokens) == reference.tokenizer.convert_ids_to_tokens(list(resp.token_ids))


def test_model_info(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert "SmolLM2" in info.model and info.device == "cpu"
    assert info.architecture == "LlamaForCausalLM" and info.family == "llama"
    assert (
        info.context_length == 512 and info.max_inputs_per_request == 8 and info.max_new_tokens_limit == 1024
    )
    assert info.max_lora_rank == 8 and set(info.lora_target_modules) == set(SHAPE["target_modules"])


@pytest.mark.parametrize(
    "request_kwargs, code, field",
    [
        (dict(text=[]), grpc.StatusCode.INVALID_ARGUMENT, "text"),
        (dict(text=["a", "b", "c"], adapter=["alpha", "beta"]), grpc.StatusCode.INVALID_ARGUMENT, "adapter"),
        (
            dict(text=["a"], sampling_params=pb.SamplingParams(max_new_tokens=5000)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling_params.max_new_tokens",
        ),
        (
            dict(text=["a"], sampling_params=pb.SamplingParams(temperature=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling_params.temperature",
        ),
        (dict(text=["a"] * 9), grpc.StatusCode.INVALID_ARGUMENT, "text"),
        (dict(text=["hello " * 600]), grpc.StatusCode.INVALID_ARGUMENT, "text[0]"),
        (dict(text=["a", "hello " * 600]), grpc.StatusCode.INVALID_ARGUMENT, "text[1]"),
        (dict(text=["x" * 70000]), grpc.StatusCode.INVALID_ARGUMENT, "text"),
        (dict(text=["a", ""]), grpc.StatusCode.INVALID_ARGUMENT, "text[1]"),
        (dict(text=["a", "b"], adapter=["alpha", "nope"]), grpc.StatusCode.NOT_FOUND, None),
    ],
    ids=[
        "no-text",
        "adapter-length",
        "max-new-tokens",
        "temperature",
        "too-many-inputs",
        "too-long",
        "second-too-long",
        "message-bytes",
        "empty-text",
        "unknown-adapter",
    ],
)
def test_bad_requests(stub, server, request_kwargs, code, field):
    before = scrape(server).get('loraplex_prompt_tokens_total{adapter="alpha"}', 0.0)
    err = code_of(stub.Generate, pb.GenerateRequest(**request_kwargs))
    assert err.code() == code, err.details()
    typed = from_rpc_error(err)
    if field:
        assert field in typed.field_violations, typed.field_violations
    else:
        assert typed.resource == "nope"
    # a rejected call starts no engine work
    assert scrape(server).get('loraplex_prompt_tokens_total{adapter="alpha"}', 0.0) == before


def test_unload_unknown_is_not_found(stub):
    assert (
        code_of(stub.UnloadAdapter, pb.UnloadAdapterRequest(name="never")).code() == grpc.StatusCode.NOT_FOUND
    )


def wait_kv_free(server, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server)
        if (
            m.get("loraplex_requests_running") == 0
            and m.get("loraplex_queue_waiting") == 0
            and m["loraplex_kv_blocks_free"] == m["loraplex_kv_blocks_total"]
        ):
            return m
        assert time.monotonic() < deadline, f"KV not freed: {m}"
        time.sleep(0.25)


def busy_kv(server, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while scrape(server)["loraplex_kv_blocks_free"] == scrape(server)["loraplex_kv_blocks_total"]:
        assert time.monotonic() < deadline, "the long request never held KV"
        time.sleep(0.1)


LONG = dict(max_new_tokens=400, temperature=0, ignore_eos=True)


def test_cancel_frees_kv_and_server_keeps_serving(stub, server, adapters, reference):
    wait_kv_free(server)
    aborted = scrape(server).get('loraplex_aborted_requests_total{reason="cancelled"}', 0.0)
    call = stub.GenerateStream(
        pb.GenerateRequest(text=[PROMPTS[0]], adapter=["alpha"], sampling_params=pb.SamplingParams(**LONG))
    )
    got = [next(call) for _ in range(3)]
    assert all(m.index == 0 for m in got)
    busy_kv(server)
    listed = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    assert listed["alpha"].requests_in_flight == 1
    call.cancel()
    m = wait_kv_free(server)
    assert m['loraplex_aborted_requests_total{reason="cancelled"}'] == aborted + 1
    listed = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    assert listed["alpha"].requests_in_flight == 0
    resp = stub.Generate(pb.GenerateRequest(text=[PROMPTS[2]], adapter=["alpha"], sampling_params=greedy()))
    check_against_peft(resp, [PROMPTS[2]], ["alpha"], adapters, reference)


def test_deadline_frees_kv_and_server_keeps_serving(stub, server, adapters, reference):
    wait_kv_free(server)
    aborted = scrape(server).get('loraplex_aborted_requests_total{reason="deadline"}', 0.0)
    err = code_of(
        stub.Generate,
        pb.GenerateRequest(
            text=[PROMPTS[1]] * 2, adapter=["beta", ""], sampling_params=pb.SamplingParams(**LONG)
        ),
        timeout=2.0,
    )
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    m = wait_kv_free(server)
    assert m['loraplex_aborted_requests_total{reason="deadline"}'] == aborted + 2
    resp = stub.Generate(pb.GenerateRequest(text=[PROMPTS[1]], adapter=["beta"], sampling_params=greedy()))
    check_against_peft(resp, [PROMPTS[1]], ["beta"], adapters, reference)


def test_metrics_cover_requests_latency_kv_and_adapters(stub, server):
    stub.Generate(pb.GenerateRequest(text=[PROMPTS[0]], adapter=["alpha"], sampling_params=greedy(4)))
    time.sleep(1.5)  # engine gauges refresh once a second
    m = scrape(server)
    assert m['loraplex_requests_total{adapter="alpha",code="OK"}'] >= 1
    assert m['loraplex_completion_tokens_total{adapter="alpha"}'] >= 4
    assert m["loraplex_time_to_first_token_seconds_count"] >= 1
    assert m["loraplex_inter_token_latency_seconds_count"] >= 3
    assert m["loraplex_kv_blocks_total"] > 0 and "loraplex_queue_waiting" in m
    assert m["loraplex_lora_slots_total"] >= 1 and "loraplex_lora_slots_used" in m
    assert m['loraplex_adapter_requests_total{adapter="alpha"}'] >= 1
    assert (
        sum(m[f'loraplex_adapter_resident{{adapter="alpha",location="{loc}"}}'] for loc in ("gpu", "host"))
        == 1
    )
    assert m['loraplex_rpcs_total{code="OK",method="Generate"}'] >= 1
