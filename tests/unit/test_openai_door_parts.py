"""The OpenAI door's pieces that a live door cannot easily be driven into: the catch-all error
handler (a bug), the accept-error log limit, and the small rules the door and server share."""

from __future__ import annotations

import logging
import typing

import grpc
from starlette.testclient import TestClient

from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.errors import InvalidRequest
from loraplex.services.inference.generate_inputs import CHAT_ROLES
from loraplex.services.inference.local_sources import public_model_name
from loraplex.services.inference.reply_size import check_reply, check_reply_floor
from loraplex.services.openai.app import create_app
from loraplex.services.openai.backend import Backend
from loraplex.services.openai.chat_schema import ChatRole
from loraplex.services.openai.limits import AcceptErrorFilter
from loraplex.services.openai.responses import public_source
from loraplex.services.openai.schema import field_param
from loraplex.v1 import inference_pb2 as pb


class BrokenBackend(Backend):
    """A backend with a bug in it: what the catch-all handler is for."""

    async def base_names(self, metadata):
        raise KeyError("a bug")


def test_unforeseen_exception_is_500_in_openai_shape():
    app = create_app(BrokenBackend("127.0.0.1:1", None, None))
    with TestClient(app, raise_server_exceptions=False) as client:
        for resp in (
            client.get("/v1/models"),
            client.post("/v1/completions", json={"model": "m", "prompt": "hi"}),
        ):
            assert resp.status_code == 500
            assert resp.json()["error"]["type"] == "server_error"
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
            assert "a bug" not in resp.text  # the exception's text stays in the log


def test_accept_errors_are_logged_once_per_interval():
    now = [0.0]
    flt = AcceptErrorFilter(10.0, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, (), None)

    kept = []
    for i in range(1000):
        now[0] = i * 0.01  # 1000 failures in 10 s, as a loop turning with no descriptors left
        r = record("socket.accept() out of system resource")
        if flt.filter(r):
            kept.append(r.getMessage())
    assert len(kept) == 1
    now[0] = 10.5
    r = record("socket.accept() out of system resource")
    assert flt.filter(r) and "999 more like it" in r.getMessage()
    assert flt.filter(record("something else entirely"))  # other records pass untouched


def test_door_and_server_accept_the_same_roles():
    assert typing.get_args(ChatRole) == CHAT_ROLES


def test_field_param_spells_openai_paths():
    assert field_param(("messages", 0, "content", "str")) == "messages[0].content"
    assert (
        field_param(("messages", 2, "content", "list[TextPart]", 0, "text")) == "messages[2].content[0].text"
    )
    assert field_param(("max_tokens",)) == "max_tokens"
    assert field_param(()) is None


def test_public_names_hide_local_paths():
    assert public_source("/srv/secret/adapters/alpha", "alpha") == "alpha"
    assert public_source("file:///srv/x", "alpha") == "alpha"
    assert public_source("../up/x", "alpha") == "alpha"
    assert public_source("org/repo", "alpha") == "org/repo"
    assert public_source("hf://org/repo@main", "alpha") == "hf://org/repo@main"
    assert public_model_name("/home/me/.cache/models/SmolLM2-135M-Instruct/") == "SmolLM2-135M-Instruct"
    assert public_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_reply_floor_refuses_what_cannot_fit_and_passes_what_can():
    big = SamplingParams(max_new_tokens=4000, logprobs=20)
    try:
        check_reply_floor([(10, big)] * 128, 8192, 64 * 1024 * 1024)
        raise AssertionError("128 x 4000 tokens x 21 log-probs fit in 64 MiB?")
    except InvalidRequest as exc:
        assert "GenerateStream" in exc.message and exc.field == "sampling_params.max_new_tokens"
    check_reply_floor([(10, SamplingParams(max_new_tokens=4000))] * 256, 8192, 64 * 1024 * 1024)
    # the context bounds the tokens: a prompt that leaves room for 10 new ones counts 10
    check_reply_floor([(8182, big)] * 8, 8192, 64 * 1024)
    reply = pb.GenerateResponse(completions=[pb.Completion(text="x" * 2000)])
    check_reply(reply, 4096)
    try:
        check_reply(reply, 1000)
        raise AssertionError("a 2000-byte reply passed a 1000-byte limit")
    except InvalidRequest as exc:
        assert "GenerateStream" in exc.message


def test_grpc_message_size_limit_is_413_not_429():
    from loraplex.services.openai.errors import from_grpc

    class TooLarge(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return "Received message larger than max (70000000 vs. 68157440)"

        def trailing_metadata(self):
            return ()

    assert from_grpc(TooLarge(), "m").status == 413
