"""vLLM's operational routes on the real door (curl-shaped JSON bodies, httpx): adapter load/unload
behind the admin token, /tokenize and /detokenize per adapter, /version, and the door's /metrics."""

from __future__ import annotations

import httpx
import pytest

from loraplex.v1 import inference_pb2 as pb
from tests.integration.test_openai_door import CHAT, base_name, client, door  # noqa: F401
from tests.integration.test_service_inference import SHAPE, adapters, server, stub  # noqa: F401
from tests.support.door import running_door

ADMIN = "door-admin-secret"


@pytest.fixture(scope="module")
def admin_door(server):  # noqa: F811
    with running_door(server.address, "openai-admin", {"LORAPLEX_ADMIN_TOKEN": ADMIN}) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(door):  # noqa: F811
    with httpx.Client(base_url=f"http://{door.address}", timeout=120) as c:
        yield c


def test_lora_routes_need_the_admin_token(admin_door, http, smollm2_path, adapter_factory, base_name):  # noqa: F811
    path = adapter_factory(smollm2_path, "doorlora", seed=11, **SHAPE)
    body = {"lora_name": "doorlora", "lora_path": str(path)}
    off = http.post("/v1/load_lora_adapter", json=body)  # the door without LORAPLEX_ADMIN_TOKEN
    assert off.status_code == 403 and "LORAPLEX_ADMIN_TOKEN" in off.json()["error"]["message"]
    with httpx.Client(base_url=f"http://{admin_door.address}", timeout=120) as admin:
        assert admin.post("/v1/load_lora_adapter", json=body).status_code == 401
        wrong = {"authorization": "Bearer nope"}
        assert admin.post("/v1/load_lora_adapter", json=body, headers=wrong).status_code == 401
        auth = {"authorization": f"Bearer {ADMIN}"}
        bad = admin.post("/v1/load_lora_adapter", json={**body, "extra": 1}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "extra"
        loaded = admin.post("/v1/load_lora_adapter", json=body, headers=auth)
        assert loaded.status_code == 200 and "doorlora" in loaded.text, loaded.text
        assert "doorlora" in [m["id"] for m in admin.get("/v1/models").json()["data"]]
        chat = {"model": "doorlora", "messages": CHAT, "max_tokens": 3, "temperature": 0}
        assert admin.post("/v1/chat/completions", json=chat).status_code == 200
        gone = admin.post("/v1/unload_lora_adapter", json={"lora_name": "doorlora"}, headers=auth)
        assert gone.status_code == 200 and "doorlora" in gone.text
        listed = {m["id"]: m for m in admin.get("/v1/models").json()["data"]}
        assert "doorlora" not in listed
        missing = admin.post("/v1/unload_lora_adapter", json={"lora_name": "doorlora"}, headers=auth)
        assert missing.status_code == 404


def test_tokenize_and_detokenize(http, stub, base_name):  # noqa: F811
    prompt = "What is the capital of France?"
    got = http.post(
        "/tokenize", json={"model": base_name, "prompt": prompt, "return_token_strs": True}
    ).json()
    want = stub.Tokenize(pb.TokenizeRequest(text=prompt))
    assert got["tokens"] == list(want.token_ids) and got["count"] == len(want.token_ids)
    assert got["token_strs"] == list(want.tokens) and got["max_model_len"] == 512
    back = http.post("/detokenize", json={"model": base_name, "tokens": got["tokens"]}).json()
    assert back == {"prompt": prompt}
    # chat: the ids the chat completion's prompt is made of, for the base model and for an adapter
    for model in (base_name, "alpha"):
        chat = http.post("/tokenize", json={"model": model, "messages": CHAT}).json()
        done = http.post(
            "/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 1, "temperature": 0}
        ).json()
        assert (
            chat["count"] == done["usage"]["prompt_tokens"] == len(chat["tokens"])
            and chat["token_strs"] is None
        )
    opened = http.post(
        "/tokenize", json={"model": base_name, "messages": CHAT, "add_generation_prompt": False}
    ).json()
    assert opened["count"] < chat["count"]
    assert http.post("/tokenize", json={"model": "no-such-adapter", "messages": CHAT}).status_code == 404
    bad = http.post("/detokenize", json={"model": base_name, "tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = http.post("/tokenize", json={"model": base_name, "prompt": "x", "bogus": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bogus"


def test_version_and_door_metrics(http, base_name):  # noqa: F811
    version = http.get("/version")
    assert version.status_code == 200 and version.json()["version"]
    http.post("/v1/completions", json={"model": base_name, "prompt": "hi", "max_tokens": 1})
    http.get("/v1/definitely-not-a-route")
    text = http.get("/metrics").text
    assert 'loraplex_door_requests_total{method="POST",route="/v1/completions",status="200"}' in text
    assert 'route="unmatched",status="404"' in text
    assert 'loraplex_door_request_duration_seconds_count{method="POST",route="/v1/completions"}' in text
