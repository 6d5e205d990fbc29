"""Property tests: random malformed requests and random broken adapter files at a real server.

Every answer must be a clean status (OK or one of the codes of design brief §4, never
UNKNOWN or INTERNAL) and the server must stay healthy and keep generating. One inference
server on the tiny Llama for the module, no store, `--allowed-local-dirs` set; also the
local-path rules (traversal, symlinks, pickle), an unload while requests run, and load/unload
churn while requests name the adapter.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from loraplex.clients.processes import ServerProcess
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.service_stack import STARTUP_S

CLEAN = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
LIMIT_NEW_TOKENS = 6
FUZZ = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Server:
    def __init__(self, proc: ServerProcess, allowed: Path) -> None:
        self.proc, self.allowed = proc, allowed
        self.channel = grpc.insecure_channel(
            proc.address, options=[("grpc.max_send_message_length", 1 << 26)]
        )
        self.stub = pb_grpc.InferenceStub(self.channel)

    def code_of(self, method, request, timeout: float = 60) -> tuple[grpc.StatusCode, object]:
        try:
            result = method(request, timeout=timeout)
            if not isinstance(
                result,
                (pb.GenerateResponse, pb.LoadAdapterResponse, pb.UnloadAdapterResponse, pb.TokenizeResponse),
            ):
                result = list(result)  # a stream: drain it
            return grpc.StatusCode.OK, result
        except grpc.RpcError as err:
            return err.code(), err.details()

    def assert_healthy(self) -> None:
        assert self.proc.proc.poll() is None, self.proc.output()[-3000:]
        status = (
            health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        )
        assert status == health_pb2.HealthCheckResponse.SERVING
        params = pb.SamplingParams(max_new_tokens=2, ignore_eos=True)
        out = self.stub.Generate(
            pb.GenerateRequest(text=["still there?"], sampling_params=params), timeout=30
        )
        assert out.completions[0].completion_tokens == 2
        assert "internal error" not in self.proc.output(), self.proc.output()[-3000:]


@pytest.fixture(scope="module")
def good_adapter(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(
        tiny_llama_path, "fuzz-good", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_path, good_adapter):
    allowed = tmp_path_factory.mktemp("allowed")
    shutil.copytree(good_adapter, allowed / "good")
    proc = ServerProcess(
        "inference",
        "loraplex.services.inference",
        [
            "--model-path",
            str(tiny_llama_path),
            "--port",
            "0",
            "--device",
            "cpu",
            "--max-total-tokens",
            "2048",
            "--max-lora-rank",
            "8",
            "--max-new-tokens-limit",
            str(LIMIT_NEW_TOKENS),
            "--default-max-new-tokens",
            "4",
            "--max-inputs-per-request",
            "4",
            "--max-queued-requests",
            "64",
            "--max-message-bytes",
            str(1 << 20),
            "--allowed-local-dirs",
            str(allowed),
            "--lora-paths",
            f"good={allowed / 'good'}",
        ],
        echo=False,
    )
    try:
        proc.wait_serving(STARTUP_S)
        srv = Server(proc, allowed)
        yield srv
        srv.channel.close()
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]


# -- random requests -----------------------------------------------------------------------
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
TINY = [1e-45, 1e-40, 1e-38, 1e-30, 1e-10, 1e-6, 2e-5]  # temperatures that once overflowed to NaN
small_f = st.one_of(
    f32,
    st.sampled_from(
        [0.0, 0.5, 1.0, -1.0, 2.5, float("nan"), float("inf"), 1e30, -1e30, *TINY, 3.4e38, -3.4e38]
    ),
)
names = st.one_of(
    st.sampled_from(
        [
            "",
            "good",
            "missing",
            "../good",
            "good/../../etc",
            "/etc/passwd",
            ".hidden",
            "a" * 129,
            "with space",
            "x\x00y",
            "good\n",
            "-dash",
            "ok.name_1-2",
            "x" * 5000,
            "%2E%2E",
        ]
    ),
    st.text(max_size=20),
)
texts = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["Hello", "", "\x00\x01", "🙂" * 50, " " * 300]),
    st.integers(1, 4).map(lambda k: "word " * (3000 * k)),  # far past the 2048-token context
)
u32 = st.integers(0, 2**32 - 1)
unit = st.floats(0.0625, 1.0, width=32)
# Valid values, so that most requests reach the engine...
valid_fields = {
    "max_new_tokens": st.integers(0, LIMIT_NEW_TOKENS),
    "temperature": st.floats(0, 2, width=32),
    "top_p": unit,
    "top_k": st.integers(0, 100),
    "min_p": st.floats(0, 1, width=32),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(u32, max_size=4),
    "ignore_eos": st.booleans(),
    "repetition_penalty": st.floats(0.5, 2, width=32),
    "frequency_penalty": st.floats(-2, 2, width=32),
    "presence_penalty": st.floats(-2, 2, width=32),
    "n": st.integers(0, 2),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "prompt_logprobs": st.booleans(),
}
# ...and for the few fields a request spoils, anything the wire can carry.
bad_fields = {
    "max_new_tokens": u32,
    "temperature": small_f,
    "top_p": small_f,
    "top_k": st.integers(-(2**31), 2**31 - 1),
    "min_p": small_f,
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.one_of(st.lists(st.text(max_size=8), max_size=4), st.just(["x" * 2000]), st.just(["s"] * 40)),
    "stop_token_ids": st.one_of(st.lists(u32, max_size=6), st.just(list(range(1500)))),
    "ignore_eos": st.booleans(),
    "repetition_penalty": small_f,
    "frequency_penalty": small_f,
    "presence_penalty": small_f,
    "n": u32,
    "logprobs": st.booleans(),
    "top_logprobs": u32,
    "prompt_logprobs": st.booleans(),
}


@st.composite
def sampling(draw):
    spoiled = draw(st.sets(st.sampled_from(sorted(bad_fields)), max_size=1))
    values = {
        k: draw(bad_fields[k] if k in spoiled else st.one_of(st.none(), valid_fields[k]))
        for k in valid_fields
    }
    return pb.SamplingParams(**{k: v for k, v in values.items() if v is not None})


good_texts = st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(["Hello", "🙂 hi", "a\x00b"]))
good_names = st.sampled_from(["", "good"])
good_text_lists = st.lists(good_texts, min_size=1, max_size=4)
good_adapter_lists = st.lists(good_names, max_size=1)


@settings(max_examples=80, **FUZZ)
@given(
    text=st.one_of(good_text_lists, good_text_lists, st.lists(texts, max_size=6)),
    adapter=st.one_of(good_adapter_lists, good_adapter_lists, st.lists(names, max_size=6)),
    params=sampling(),
    stream=st.booleans(),
)
def test_random_generate_requests_get_clean_status(server, text, adapter, params, stream):
    request = pb.GenerateRequest(text=text, adapter=adapter, sampling_params=params)
    method = server.stub.GenerateStream if stream else server.stub.Generate
    code, detail = server.code_of(method, request)
    event(code.name)
    assert code in CLEAN, (code, detail)
    if code == grpc.StatusCode.OK and not stream:
        assert len(detail.completions) == len(text) * max(params.n, 1)  # n samples of each prompt


@st.composite
def one_input(draw):
    form = draw(st.sampled_from(["text", "token_ids", "messages", "none", "two"]))
    item = pb.Input()
    if form in ("text", "two"):
        item.text = draw(st.one_of(good_texts, texts))
    if form in ("token_ids", "two"):
        item.token_ids.extend(draw(st.lists(st.one_of(st.integers(0, 200), u32), max_size=6)))
    if form == "messages":
        roles = st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=80))
        item.messages.extend(
            pb.ChatMessage(role=draw(roles), content=draw(st.text(max_size=30)))
            for _ in range(draw(st.integers(0, 3)))
        )
    if draw(st.booleans()):
        item.add_generation_prompt = draw(st.booleans())
    item.adapter = draw(st.one_of(good_names, names))
    if draw(st.booleans()):
        item.sampling_params.CopyFrom(draw(sampling()))
    return item


@settings(max_examples=40, **FUZZ)
@given(
    inputs=st.lists(one_input(), max_size=4),
    adapter=st.one_of(good_adapter_lists, st.lists(names, max_size=2)),
    params=sampling(),
    stream=st.booleans(),
    with_text=st.booleans(),
)
def test_random_input_messages_get_clean_status(server, inputs, adapter, params, stream, with_text):
    request = pb.GenerateRequest(
        inputs=inputs, adapter=adapter, sampling_params=params, text=["also text"] if with_text else []
    )
    method = server.stub.GenerateStream if stream else server.stub.Generate
    code, detail = server.code_of(method, request)
    event(code.name)
    assert code in CLEAN, (code, detail)


@settings(max_examples=40, **FUZZ)
@given(
    name=names,
    source=st.one_of(
        st.sampled_from(
            [
                "",
                "/",
                "/etc",
                "../../..",
                "file:///etc",
                "hf://org/repo",
                "org/repo",
                "~",
                "x" * 5000,
                "a/" * 200,
                "/" + "n" * 300,
                "good\x00",
                "file://" + "../" * 10,
                " /etc",
                " file:///etc",
                "file:///%2E%2E/etc",
                "file:///tmp/%2e%2e/etc",
                "file://remote/etc",
                "file:///%00",
            ]
        ),
        st.text(max_size=40),
    ),
    revision=st.one_of(st.text(max_size=10), st.just("r" * 300)),
)
def test_random_adapter_management_gets_clean_status(server, name, source, revision):
    code, detail = server.code_of(
        server.stub.LoadAdapter, pb.LoadAdapterRequest(name=name, source=source, revision=revision)
    )
    assert code in CLEAN - {grpc.StatusCode.OK}, (code, detail)  # nothing here is a loadable adapter
    code, detail = server.code_of(server.stub.UnloadAdapter, pb.UnloadAdapterRequest(name=name))
    assert code in CLEAN, (code, detail)
    if name == "good" and code == grpc.StatusCode.OK:
        load = pb.LoadAdapterRequest(name="good", source=str(server.allowed / "good"))
        assert server.code_of(server.stub.LoadAdapter, load)[0] == grpc.StatusCode.OK
    code, detail = server.code_of(server.stub.Tokenize, pb.TokenizeRequest(text=source * 3))
    assert code in CLEAN, (code, detail)


@settings(max_examples=12, **FUZZ)
@given(
    temperature=st.sampled_from(TINY[:-1]),
    filters=st.sampled_from([{}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}]),
)
def test_tiny_temperatures_are_greedy(server, temperature, filters):
    def tokens(**params):
        request = pb.GenerateRequest(
            text=["Once upon a time"],
            adapter=["good"],
            sampling_params=pb.SamplingParams(
                max_new_tokens=LIMIT_NEW_TOKENS, ignore_eos=True, seed=7, **params
            ),
        )
        return list(server.stub.Generate(request, timeout=60).completions[0].token_ids)

    assert tokens(temperature=temperature, **filters) == tokens(temperature=0)


# Sampling values at and past the edges of their ranges: past them INVALID_ARGUMENT naming the
# field (1e-38 once divided the logits to inf and sampled token 0 and garbage), at them a clean run.
PAST_EDGES = {
    "repetition_penalty": [1e-45, 1e-38, 1e-10, 0.0099, 100.01, 1e30, 3.4e38, -1.0],
    "frequency_penalty": [-2.01, 2.01, 1e30, -3.4e38],
    "presence_penalty": [-2.01, 2.01, 1e30, -3.4e38],
    "temperature": [-1e-38, -1.0],
    "min_p": [-1e-38, 1.0001],
    "top_p": [-1e-38, 1.0001],
}
AT_EDGES = {
    "repetition_penalty": [0.01, 100.0],
    "frequency_penalty": [-2.0, 2.0],
    "presence_penalty": [-2.0, 2.0],
    "temperature": [1e-5, 100.0],
}


@settings(max_examples=16, **FUZZ)
@given(
    field_value=st.sampled_from([(k, v) for k, vs in PAST_EDGES.items() for v in vs]),
    temperature=st.sampled_from([0.0, 1.0]),
)
def test_sampling_values_past_their_range_are_invalid(server, field_value, temperature):
    name, value = field_value
    params = {"temperature": temperature, name: value}
    request = pb.GenerateRequest(
        text=["Once upon a time"], sampling_params=pb.SamplingParams(max_new_tokens=2, **params)
    )
    code, detail = server.code_of(server.stub.Generate, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, value, code, detail)
    assert name in detail


def test_sampling_values_at_their_range_edges_generate(server):
    for name, values in AT_EDGES.items():
        for value in values:
            for temperature in (0.0, 1.0):
                params = pb.SamplingParams(
                    max_new_tokens=LIMIT_NEW_TOKENS, ignore_eos=True, seed=3, temperature=temperature
                )
                setattr(params, name, value)
                out = server.stub.Generate(
                    pb.GenerateRequest(
                        text=["Once upon a time"] * 2, adapter=["good"], sampling_params=params
                    ),
                    timeout=60,
                )
                for c in out.completions:
                    assert c.completion_tokens == LIMIT_NEW_TOKENS, (name, value)


def test_long_single_adapter_name_is_invalid_and_not_logged(server):
    for n in (5000, 1 << 19):
        code, detail = server.code_of(
            server.stub.Generate, pb.GenerateRequest(text=["a", "b"], adapter=["n" * n])
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and len(detail) < 1000, (code, detail[:200])
    assert "n" * 300 not in server.proc.output()


# -- random broken adapter files ------------------------------------------------------------
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
CONFIG_KEYS = [
    "r",
    "lora_alpha",
    "target_modules",
    "peft_type",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "bias",
    "use_dora",
    "modules_to_save",
    "fan_in_fan_out",
    "layers_to_transform",
    "task_type",
    "layers_pattern",
    "lora_dropout",
]


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@st.composite
def damages(draw):
    kind = draw(
        st.sampled_from(
            [
                "truncate",
                "header_len",
                "flip",
                "config_field",
                "config_bytes",
                "no_weights",
                "pickle_only",
                "no_config",
                "tensor_dtype",
                "tensor_shape",
                "tensor_offsets",
                "extra_tensor",
                "huge_config",
                "fifo_weights",
                "fifo_config",
                "devzero_weights",
                "dir_weights",
                "loop_weights",
                "dangling_weights",
                "nested_config",
                "nested_header",
                "extreme_alpha",
                "fifo_template",
                "devzero_template",
                "loop_template",
                "huge_template",
                "binary_template",
                "nested_tokenizer_config",
                "slow_template",
                "huge_output_template",
                "refusing_template",
            ]
        )
    )
    return (
        kind,
        draw(st.randoms(use_true_random=False)),
        draw(st.sampled_from(CONFIG_KEYS)),
        draw(json_values),
    )


def damage(directory: Path, kind: str, rnd, key: str, value) -> None:
    weights, config = directory / "adapter_model.safetensors", directory / "adapter_config.json"
    raw = weights.read_bytes()
    if kind == "truncate":
        weights.write_bytes(raw[: rnd.randrange(len(raw))])
    elif kind == "header_len":
        weights.write_bytes(
            struct.pack("<Q", rnd.choice([0, 1, 7, 2**24 + 1, 2**63, rnd.randrange(2**64)])) + raw[8:]
        )
    elif kind == "flip":
        b = bytearray(raw)
        for _ in range(rnd.randint(1, 8)):
            b[rnd.randrange(8, min(len(b), 4096))] = rnd.randrange(256)
        weights.write_bytes(bytes(b))
    elif kind == "config_field":
        cfg = json.loads(config.read_text())
        cfg[key] = value
        config.write_text(json.dumps(cfg))
    elif kind == "config_bytes":
        config.write_bytes(rnd.randbytes(rnd.randint(0, 200)))
    elif kind == "no_weights":
        weights.unlink()
    elif kind == "pickle_only":
        weights.rename(directory / "adapter_model.bin")
    elif kind == "no_config":
        config.unlink()
    elif kind in ("fifo_weights", "fifo_config"):
        target = weights if kind == "fifo_weights" else config
        target.unlink()
        os.mkfifo(target)
    elif kind == "devzero_weights":
        weights.unlink()
        weights.symlink_to("/dev/zero")
    elif kind == "dir_weights":
        weights.unlink()
        weights.mkdir()
    elif kind == "loop_weights":
        weights.unlink()
        weights.symlink_to(weights)
    elif kind == "dangling_weights":
        weights.unlink()
        weights.symlink_to(directory / "nowhere")
    elif kind == "nested_config":
        config.write_text("[" * rnd.choice([1000, 100_000]) + "]" * rnd.choice([0, 1000]))
    elif kind == "nested_header":
        depth = rnd.choice([1000, 100_000])
        weights.write_bytes(struct.pack("<Q", depth) + b"[" * depth)
    elif kind == "extreme_alpha":
        cfg = json.loads(config.read_text())
        cfg[rnd.choice(["lora_alpha", "r"])] = rnd.choice([float("inf"), -float("inf"), 1e308, 5e-324, 2**63])
        config.write_text(json.dumps(cfg))
    elif kind == "huge_config":
        cfg = json.loads(config.read_text())
        cfg["padding"] = "x" * (2 * 2**20)
        config.write_text(json.dumps(cfg))
    elif kind.endswith("_template") or kind == "nested_tokenizer_config":
        _damage_template(directory, kind, rnd)
    else:
        header, data = _header(weights)
        name = rnd.choice(sorted(k for k in header if k != "__metadata__"))
        if kind == "tensor_dtype":
            header[name]["dtype"] = rnd.choice(["F64", "I64", "U8", "BOGUS", "BOOL", 7])
        elif kind == "tensor_shape":
            header[name]["shape"] = rnd.choice([[], [1], [4, 4, 4], [2**40, 2], [-1, 4], ["a", 1]])
        elif kind == "tensor_offsets":
            header[name]["data_offsets"] = rnd.choice([[0, 2**50], [5, 1], [0], [-8, 0], [0, len(data) + 4]])
        else:
            header[name.replace("lora_A", "lora_C").replace("lora_B", "lora_D")] = dict(header[name])
        _write_header(weights, header, data)


TEMPLATES = {
    "slow_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "huge_output_template": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
    "refusing_template": "{{ raise_exception('no ' ~ messages[0].role ~ ' here') }}",
}


UNREADABLE_TEMPLATES = ("fifo_template", "devzero_template", "loop_template", "huge_template")


def _damage_template(directory: Path, kind: str, rnd) -> None:
    name = rnd.choice(["chat_template.jinja", "tokenizer_config.json"])
    path = directory / name
    if kind == "fifo_template":
        os.mkfifo(path)
    elif kind == "devzero_template":
        path.symlink_to("/dev/zero")
    elif kind == "loop_template":
        path.symlink_to(path)
    elif kind == "huge_template":
        path.write_bytes(b"{{ 'x' }}" * (5 * 2**20 // 9 + 1))
    elif kind == "binary_template":
        path.write_bytes(rnd.randbytes(rnd.randint(1, 300)))
    elif kind == "nested_tokenizer_config":
        (directory / "tokenizer_config.json").write_text("[" * 100_000)
    else:
        text = TEMPLATES[kind]
        path.write_text(text if name == "chat_template.jinja" else json.dumps({"chat_template": text}))


@settings(max_examples=60, **FUZZ)
@given(d=damages())
def test_random_broken_adapter_files_get_clean_status(server, good_adapter, d):
    kind, rnd, key, value = d
    name = f"broken-{uuid.uuid4().hex[:8]}"
    directory = server.allowed / name
    shutil.copytree(good_adapter, directory)
    try:
        damage(directory, kind, rnd, key, value)
        code, detail = server.code_of(
            server.stub.LoadAdapter, pb.LoadAdapterRequest(name=name, source=str(directory))
        )
        event(f"{kind}: {code.name}")
        assert code in CLEAN, (kind, key, value, code, detail)
        if code == grpc.StatusCode.OK:  # the damage was harmless: the adapter must then work
            assert kind not in UNREADABLE_TEMPLATES, (kind, "an unreadable template file was accepted")
            params = pb.SamplingParams(max_new_tokens=2, ignore_eos=True)
            out = server.stub.Generate(
                pb.GenerateRequest(text=["Hi"], adapter=[name], sampling_params=params), timeout=60
            )
            assert out.completions[0].completion_tokens == 2
            chat = pb.Input(messages=[pb.ChatMessage(role="user", content="Hi")], adapter=name)
            code, detail = server.code_of(
                server.stub.Generate, pb.GenerateRequest(inputs=[chat], sampling_params=params)
            )
            assert code in CLEAN, (kind, code, detail)
            if kind in TEMPLATES:  # slow, huge or refusing: a clear refusal naming the template
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "template" in detail, (kind, detail)
            server.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=30)
        elif kind == "pickle_only":
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "pickle" in detail, detail
        elif kind in (
            "header_len",
            "huge_config",
            "fifo_weights",
            "fifo_config",
            "devzero_weights",
            "dir_weights",
            "loop_weights",
            "nested_config",
            "nested_header",
            *UNREADABLE_TEMPLATES,
            "nested_tokenizer_config",
        ):
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (kind, detail)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- local paths -----------------------------------------------------------------------------
def test_local_sources_stay_under_allowed_dirs(server, good_adapter, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(good_adapter, outside)
    link = server.allowed / "sneaky-link"
    os.symlink(outside, link)
    try:
        linked_file = server.allowed / "linked-file"
        linked_file.mkdir()
        shutil.copyfile(outside / "adapter_config.json", linked_file / "adapter_config.json")
        (linked_file / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
        rel = os.path.relpath(outside, server.allowed)
        for source in (
            str(outside),
            f"file://{outside}",
            str(server.allowed / ".." / outside.name),
            str(link),
            str(server.allowed / "good" / ".." / ".." / "etc"),
            " " + str(outside),
            f"{outside} ",
            f"file://{server.allowed}/{rel.replace('..', '%2E%2E')}",
            f"file://localhost{server.allowed}/{rel.replace('.', '%2e')}",
            str(linked_file),
        ):
            code, detail = server.code_of(
                server.stub.LoadAdapter, pb.LoadAdapterRequest(name="escape", source=source)
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "--allowed-local-dirs" in detail, (
                source,
                detail,
            )
        for name in ("../good", "a/b", ".hidden", "x" * 129):
            code, detail = server.code_of(
                server.stub.LoadAdapter, pb.LoadAdapterRequest(name=name, source=str(server.allowed / "good"))
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter name" in detail, (name, detail)
    finally:
        link.unlink()


def test_adapter_may_not_take_the_models_name(server, tiny_llama_path):
    # The door lists the model under its path's last part: an adapter of that name would be listed
    # twice and mean the base model over HTTP but the adapter over gRPC.
    for name in (tiny_llama_path.name, tiny_llama_path.name.swapcase()):
        load = pb.LoadAdapterRequest(name=name, source=str(server.allowed / "good"))
        code, detail = server.code_of(server.stub.LoadAdapter, load)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "this server's model" in detail, (name, detail)
        request = pb.GenerateRequest(
            text=["hi"], adapter=[name], sampling_params=pb.SamplingParams(max_new_tokens=1)
        )
        code, detail = server.code_of(server.stub.Generate, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "this server's model" in detail, (name, detail)
    listed = server.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters
    assert tiny_llama_path.name.casefold() not in {a.name.casefold() for a in listed}


@pytest.mark.parametrize("template_file", ["chat_template.jinja", "tokenizer_config.json"])
def test_chat_template_symlinked_out_of_allowed_dirs_is_refused(
    server, good_adapter, tmp_path, template_file
):
    # It was read through the symlink at the first chat, and prompt_logprobs spelled the secret back.
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret: do not render me")
    adapter = server.allowed / f"leaky-{template_file}"
    shutil.copytree(good_adapter, adapter)
    (adapter / template_file).symlink_to(secret)
    code, detail = server.code_of(
        server.stub.LoadAdapter, pb.LoadAdapterRequest(name="leaky", source=str(adapter))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT, detail
    assert template_file in detail and "--allowed-local-dirs" in detail and "secret" not in detail.lower()
    assert not any(a.name == "leaky" for a in server.stub.ListAdapters(pb.ListAdaptersRequest()).adapters)


def test_unload_while_requests_use_it(server, good_adapter):
    load = pb.LoadAdapterRequest(name="busy", source=str(server.allowed / "good"))
    assert server.code_of(server.stub.LoadAdapter, load)[0] == grpc.StatusCode.OK
    params = pb.SamplingParams(max_new_tokens=LIMIT_NEW_TOKENS, ignore_eos=True)
    stream = server.stub.GenerateStream(
        pb.GenerateRequest(text=["a", "b", "c"], adapter=["busy"], sampling_params=params), timeout=60
    )
    first = next(stream)
    done = threading.Event()
    unload: list = []

    def do_unload() -> None:
        unload.append(server.code_of(server.stub.UnloadAdapter, pb.UnloadAdapterRequest(name="busy")))
        done.set()

    threading.Thread(target=do_unload, daemon=True).start()
    rest = [first] + list(stream)
    ends = [m for m in rest if m.finish_reason]
    assert sorted(m.index for m in ends) == [0, 1, 2]
    assert all(m.completion_tokens == LIMIT_NEW_TOKENS for m in ends)
    assert done.wait(30) and unload[0][0] == grpc.StatusCode.OK
    code, detail = server.code_of(server.stub.Generate, pb.GenerateRequest(text=["x"], adapter=["busy"]))
    assert code == grpc.StatusCode.NOT_FOUND, (code, detail)
    server.assert_healthy()


# -- bytes that are not a request message at all ---------------------------------------------
RAW_METHODS = {
    "Generate": pb.GenerateRequest(
        text=["Hi"], adapter=["good"], sampling_params=pb.SamplingParams(max_new_tokens=2)
    ),
    "GenerateStream": pb.GenerateRequest(
        text=["Hi", "there"], sampling_params=pb.SamplingParams(max_new_tokens=2)
    ),
    "LoadAdapter": pb.LoadAdapterRequest(name="raw", source="/nonexistent"),
    "UnloadAdapter": pb.UnloadAdapterRequest(name="nope"),
    "Tokenize": pb.TokenizeRequest(text="Hello"),
    "GetModelInfo": pb.GetModelInfoRequest(),
    "ListAdapters": pb.ListAdaptersRequest(),
}


@st.composite
def wire_bytes(draw):
    method = draw(st.sampled_from(sorted(RAW_METHODS)))
    raw = bytearray(RAW_METHODS[method].SerializeToString())
    how = draw(st.sampled_from(["random", "flip", "cut", "append"]))
    if how == "random":
        raw = bytearray(draw(st.binary(max_size=64)))
    elif how == "flip" and raw:
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    elif how == "cut" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    else:
        raw += draw(st.binary(min_size=1, max_size=16))
    return method, bytes(raw)


@settings(max_examples=60, **FUZZ)
@given(call=wire_bytes())
def test_undecodable_request_bytes_get_clean_status(server, call):
    method, raw = call
    path = f"/loraplex.v1.Inference/{method}"
    identity = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        if method == "GenerateStream":
            list(server.channel.unary_stream(path, **identity)(raw, timeout=60))
        else:
            server.channel.unary_unary(path, **identity)(raw, timeout=60)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
        assert code in CLEAN, (method, raw, code, err.details())
    event(f"{method}: {code.name}")


def test_server_healthy_after_fuzzing(server):
    server.assert_healthy()


def test_load_unload_churn_while_generating(server):
    """An adapter loaded and unloaded over and over while requests name it: every request either
    runs or gets NOT_FOUND, never a bare error, and every management call succeeds."""
    import collections
    import time

    stop = threading.Event()
    gen_codes: collections.Counter = collections.Counter()
    admin_codes: collections.Counter = collections.Counter()
    load = pb.LoadAdapterRequest(name="churn", source=str(server.allowed / "good"))
    params = pb.SamplingParams(max_new_tokens=3, ignore_eos=True)

    def churn() -> None:
        while not stop.is_set():
            admin_codes[server.code_of(server.stub.LoadAdapter, load)[0]] += 1
            time.sleep(0.05)
            admin_codes[
                server.code_of(server.stub.UnloadAdapter, pb.UnloadAdapterRequest(name="churn"))[0]
            ] += 1

    def generate(stream: bool) -> None:
        method = server.stub.GenerateStream if stream else server.stub.Generate
        while not stop.is_set():
            request = pb.GenerateRequest(text=["x", "y"], adapter=["churn", ""], sampling_params=params)
            code, detail = server.code_of(method, request)
            gen_codes[code] += 1
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND), (code, detail)

    threads = [
        threading.Thread(target=churn),
        threading.Thread(target=generate, args=(False,)),
        threading.Thread(target=generate, args=(True,)),
    ]
    for t in threads:
        t.start()
    time.sleep(4)
    stop.set()
    for t in threads:
        t.join(60)
    assert set(admin_codes) == {grpc.StatusCode.OK}, admin_codes
    assert set(gen_codes) <= {grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND}, gen_codes
    assert gen_codes[grpc.StatusCode.OK] > 0 and admin_codes[grpc.StatusCode.OK] > 4, (gen_codes, admin_codes)
    server.assert_healthy()
