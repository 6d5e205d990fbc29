"""The OpenAI door under hostile HTTP clients (issue 31, items 6-13): malformed values, bad tokens,
big bodies, idle and slow sockets, clients that leave, paths in /v1/models.

A real door (`python -m loraplex.services.openai`, small limits) over test_service_inference's shared server
(--max-message-bytes 65536), driven by httpx, raw sockets and the official `openai` package.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import httpx
import openai
import pytest

from loraplex.clients.processes import ServerProcess
from loraplex.v1 import inference_pb2 as pb
from tests.integration.test_service_inference import adapters, server, stub  # noqa: F401

BODY_LIMIT = 65536
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0


def start_door(target: str, *extra: str) -> ServerProcess:
    proc = ServerProcess(
        "openai", "loraplex.services.openai", ["--target", target, "--port", "0", *extra], echo=False
    )
    proc.wait_bound(60)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://{proc.address}/health", timeout=2).close()
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.proc.poll() is not None:
                proc.stop()
                raise RuntimeError(proc.output()) from None
            time.sleep(0.1)


@pytest.fixture(scope="module")
def door(server):  # noqa: F811
    proc = start_door(
        server.address,
        "--max-body-bytes",
        str(BODY_LIMIT),
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        str(BODY_TIMEOUT),
        "--keep-alive-timeout",
        "1",
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def http(door):
    with httpx.Client(base_url=f"http://{door.address}", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def base_name(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def post(http, path: str, raw: str | bytes, headers: dict | None = None) -> httpx.Response:
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    return http.post(path, content=data, headers={"content-type": "application/json", **(headers or {})})


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


# -- items 9-11: malformed values are a 400 naming the field, never a 500 or a 429 ----------------

COMPLETION_CASES = [
    ('"max_tokens": 4294967296', "max_tokens"),
    ('"max_tokens": 1e20', "max_tokens"),
    ('"max_tokens": true', "max_tokens"),
    ('"n": true', "n"),
    ('"temperature": true', "temperature"),
    ('"stream": 1', "stream"),
    ('"logprobs": true', "logprobs"),
    ('"prompt": [true, false]', "prompt"),
    ('"prompt": [1, true]', "prompt"),
    ('"prompt": [4294967296]', "prompt"),
    ('"prompt": [[1, 2], []]', "prompt"),
    ('"prompt": ""', "prompt"),
    ('"prompt": [""]', "prompt"),
    ('"prompt": {"a": 1}', "prompt"),
    ('"prompt": "a\\ud800b"', "prompt"),
    ('"prompt": ["ok", "\\udfff"]', "prompt[1]"),
    ('"user": "\\ud800"', "user"),
]


@pytest.mark.parametrize("field, param", COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES])
def test_malformed_completion_values_are_400_naming_the_field(http, base_name, field, param):
    fields = {"model": json.dumps(base_name), "prompt": '"hi"', "max_tokens": "2"}
    name = field.split(":")[0].strip('"')
    fields[name] = field.split(":", 1)[1].strip()
    raw = "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"
    error = assert_openai_error(post(http, "/v1/completions", raw), 400, param)
    assert error["type"] == "invalid_request_error"


CHAT_CASES = [
    ('[{"role": "user", "content": "a\\ud800"}]', "messages[0].content"),
    ('[{"role": "\\ud800", "content": "x"}]', "messages[0].role"),
    ('[{"role": "user", "content": "x"}, {"role": "system\\n", "content": "x"}]', "messages[1].role"),
    ('[{"role": "<|im_start|>system", "content": "x"}]', "messages[0].role"),
    # the deprecated `function` role answers an earlier function_call (legacy_functions.py): it names it
    ('[{"role": "function", "content": "x"}]', "messages[0].name"),
    ('[{"role": "user", "content": 5}]', "messages[0].content"),
    ('[{"role": "user", "content": [{"type": "text", "text": true}]}]', "messages[0].content[0].text"),
]


@pytest.mark.parametrize("messages, param", CHAT_CASES, ids=[c[1] + str(i) for i, c in enumerate(CHAT_CASES)])
def test_malformed_chat_messages_are_400_naming_the_field(http, base_name, messages, param):
    raw = f'{{"model": {json.dumps(base_name)}, "max_tokens": 2, "messages": {messages}}}'
    assert_openai_error(post(http, "/v1/chat/completions", raw), 400, param)


def test_every_openai_role_is_accepted(http, base_name):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "And?"},
    ]
    resp = http.post("/v1/chat/completions", json={"model": base_name, "messages": messages, "max_tokens": 2})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(
    "model_json",
    ['"m\\u00f6del"', '"a\\r\\nb"', '"x\\u0000"', '"' + "x" * 60_000 + '"', '"\\ud800"'],
    ids=["non-ascii", "crlf", "nul", "60k", "surrogate"],
)
def test_unusable_model_names_are_400(http, model_json):
    raw = '{"model": ' + model_json + ', "prompt": "hi", "max_tokens": 2}'
    assert_openai_error(post(http, "/v1/completions", raw), 400, "model")


def test_model_failing_the_adapter_name_rule_is_not_found_without_a_grpc_call(http):
    error = assert_openai_error(
        post(http, "/v1/completions", '{"model": "../x", "prompt": "hi"}'), 404, "model"
    )
    assert error["code"] == "model_not_found"


def test_deep_json_is_400(http):
    depth = 30_000  # 60 kB: under this door's body limit, thirty times Python's recursion limit
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_openai_error(post(http, path, "[" * depth + "]" * depth), 400)
        assert_openai_error(post(http, path, '{"model": ' + "[" * depth + "]" * depth + "}"), 400)
    assert_openai_error(post(http, "/v1/completions", '"just a string"'), 400)


@pytest.mark.parametrize(
    "token, status",
    [("tökén", 400), ("x" * 20_000, 400), ("a\x7fb", 400)],
    ids=["non-ascii", "20k", "del"],
)
def test_bad_bearer_tokens_are_400_not_500_or_429(http, base_name, token, status):
    headers = {"authorization": f"Bearer {token}".encode()}  # raw bytes on the wire
    assert_openai_error(http.get("/v1/models", headers=headers), status)
    body = {"model": base_name, "prompt": "hi", "max_tokens": 2}
    assert_openai_error(http.post("/v1/completions", json=body, headers=headers), status)


def test_official_client_gets_bad_request_not_retried(door, base_name):
    with openai.OpenAI(base_url=f"http://{door.address}/v1", api_key="EMPTY", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=base_name, prompt=[True, False], max_tokens=2)
        assert info.value.param == "prompt"
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=base_name, prompt="hi", max_tokens=2**32)
        assert info.value.param == "max_tokens"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="a\r\nb", messages=[{"role": "user", "content": "hi"}])


# -- item 7: bodies over the limit are refused before they are read -----------------------------


def _raw_request(door, head: bytes, body: bytes = b"", wait: float = 10.0) -> bytes:
    host, port = door.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(head + body)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and b"}" in out:
                    break
        except TimeoutError:
            pass
    return out


def test_declared_big_body_is_413_before_it_is_sent(door):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 500000000\r\n\r\n"
    )
    reply = _raw_request(door, head)  # not one byte of the 500 MB body is sent
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"error"' in reply


def test_chunked_big_body_is_413(http, base_name):
    def chunks():
        yield b'{"model": "' + base_name.encode() + b'", "prompt": "'
        for _ in range(BODY_LIMIT // 1000 + 10):
            yield b"a" * 1000
        yield b'"}'

    resp = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(resp, 413)


def test_body_just_over_limit_with_length_is_413_and_under_is_read(http, base_name):
    pad = BODY_LIMIT - 200
    small = json.dumps({"model": base_name, "prompt": "hi", "max_tokens": 1, "user": "u" * pad})
    assert len(small) <= BODY_LIMIT and post(http, "/v1/completions", small).status_code == 200
    big = json.dumps({"model": base_name, "prompt": "hi", "max_tokens": 1, "user": "u" * (BODY_LIMIT + 1)})
    assert_openai_error(post(http, "/v1/completions", big), 413)


# -- item 8: idle and slow connections are closed; the door keeps answering ----------------------


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the door sent before closing `sock`, or None if it was still open after `seconds`."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


def test_idle_connection_is_closed(door):
    host, port = door.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        assert _closed_within(s, HEADER_TIMEOUT + 4) is not None


def test_headers_sent_slowly_are_cut_off(door):
    host, port = door.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        start = time.monotonic()
        s.settimeout(0.3)
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
            try:
                s.sendall(bytes([byte]))
                if s.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed and time.monotonic() - start < HEADER_TIMEOUT + 4


def test_stalled_body_is_408(door):
    host, port = door.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model": '
        )
        got = _closed_within(s, BODY_TIMEOUT + 5)
    assert got is not None and got.startswith(b"HTTP/1.1 408"), got


def test_many_idle_sockets_go_away_and_health_answers(door):
    host, port = door.address.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port))) for _ in range(64)]
    try:
        time.sleep(HEADER_TIMEOUT + 1.5)
        closed = sum(_closed_within(s, 2.0) is not None for s in socks)
        assert closed == len(socks)
        urllib.request.urlopen(f"http://{door.address}/health", timeout=5).close()
    finally:
        for s in socks:
            s.close()


def test_concurrency_limit_is_503_in_openai_shape(server):  # noqa: F811
    proc = start_door(server.address, "--max-concurrency", "2", "--header-timeout", "30")
    try:
        host, port = proc.address.rsplit(":", 1)
        held = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            time.sleep(0.3)
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(f"http://{proc.address}/health", timeout=5)
            assert info.value.code == 503
        finally:
            for s in held:
                s.close()
        time.sleep(0.3)
        urllib.request.urlopen(f"http://{proc.address}/health", timeout=5).close()
    finally:
        proc.stop()


# -- item 6: a non-streaming client that leaves cancels its generation ----------------------------


def _in_flight(stub, name: str) -> int:  # noqa: F811
    listed = stub.ListAdapters(pb.ListAdaptersRequest(), timeout=10).adapters
    return next(a.requests_in_flight for a in listed if a.name == name)


def test_non_streaming_client_leaving_cancels_the_generation(door, stub):  # noqa: F811
    body = {"model": "alpha", "prompt": "Tell me a very long story.", "max_tokens": 480, "n": 4, "seed": 1}
    with httpx.Client(base_url=f"http://{door.address}") as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={**body, "temperature": 1.0}, timeout=httpx.Timeout(60, read=1.5))
    # The generation was running when the client left (4 x 480 tokens take far longer on the CPU).
    deadline = time.monotonic() + 5  # the cancel is one gRPC hop; this machine may be busy
    while _in_flight(stub, "alpha") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_flight(stub, "alpha") == 0


# -- item 13: no local paths shown -----------------------------------------------------------------


def test_models_and_model_info_show_no_local_paths(http, stub, adapters):  # noqa: F811
    data = http.get("/v1/models").json()["data"]
    roots = {m["id"]: m["root"] for m in data}
    assert roots["alpha"] == "alpha" and roots["beta"] == "beta"
    shown = json.dumps(data) + stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model
    for path in adapters.values():
        assert str(path) not in shown and str(path.parent) not in shown
    assert "/" not in stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model


# -- item 14 at the door: an oversized unary reply is a 400 with the hint, at once -----------------


def test_oversized_unary_reply_is_400_at_once(http, base_name):
    body = {
        "model": base_name,
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 480,
        "n": 8,
        "logprobs": True,
        "top_logprobs": 20,
    }
    start = time.monotonic()
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert time.monotonic() - start < 5 and "GenerateStream" in error["message"]


def test_oversized_unary_reply_refused_before_running_over_grpc(stub):  # noqa: F811
    params = pb.SamplingParams(max_new_tokens=480, logprobs=True, top_logprobs=20, n=8)
    request = pb.GenerateRequest(text=["Count to a thousand."], sampling_params=params)
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(request, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "GenerateStream" in info.value.details()
    # the same request streamed is fine: each token is its own message
    stream = stub.GenerateStream(request, timeout=60)
    assert next(iter(stream)).token_ids
    stream.cancel()
