"""Inference + adapter store over real gRPC and real (embedded) Redis.

Adapters registered only in the store are served with no LoadAdapter on the inference
side; concurrent requests for one cold adapter cause one pull; a store delete drops it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import grpc
import pytest

from loraplex.clients import AsyncClient, Client, NotFound
from loraplex.services.inference.store_pull import content_dir_name
from loraplex.v1 import inference_pb2 as pb
from tests.support.service_stack import STORE_STACK_SHAPE, PeftReference, scrape, store_stack
from tests.support.store_helpers import copy_adapter, edit_config

MAX_NEW = 10
PROMPT = "List 3 countries and their capitals."
SHAPE = STORE_STACK_SHAPE


@pytest.fixture(scope="module")
def adapters(smollm2_path, adapter_factory):
    return {
        name: adapter_factory(smollm2_path, name, seed=10 + i, **SHAPE)
        for i, name in enumerate(["s-one", "s-many", "s-load", "s-idle", "s-gone", "s-new"])
    }


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory, smollm2_path, adapters):
    return store_stack(request.config, tmp_path_factory, smollm2_path)


@pytest.fixture(scope="module")
def client(stack):
    store, inference = stack
    with Client(inference.address, store=store.address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return PeftReference(smollm2_path)


def test_store_only_adapter_is_served_without_load(client, stack, adapters, reference, tmp_path_factory):
    record = client.register_adapter("s-one", str(adapters["s-one"]))
    assert record.digest.startswith("sha256:") and record.rank == 8
    assert "s-one" not in {a.name for a in client.list_adapters() if a.location != pb.ADAPTER_LOCATION_STORE}
    [out] = client.generate(PROMPT, "s-one", max_new_tokens=MAX_NEW, temperature=0)
    assert list(out.token_ids) == reference.greedy(PROMPT, adapters["s-one"], MAX_NEW)
    here = {a.name: a for a in client.list_adapters()}
    assert here["s-one"].location in (pb.ADAPTER_LOCATION_GPU, pb.ADAPTER_LOCATION_HOST)
    # the pulled copy is content-addressed (weights and config) and matches the record's digest
    _, inference = stack
    cache = inference.proc.args[inference.proc.args.index("--adapter-cache-dir") + 1]
    local = f"{cache}/{content_dir_name(record.digest, record.config_digest)}/adapter_model.safetensors"
    with open(local, "rb") as f:
        assert "sha256:" + hashlib.sha256(f.read()).hexdigest() == record.digest


def test_concurrent_cold_requests_cause_one_pull(client, stack, adapters, reference):
    store, inference = stack
    client.register_adapter("s-many", str(adapters["s-many"]))
    pulls = scrape(inference).get("loraplex_store_pulls_total", 0.0)

    async def burst():
        async with AsyncClient(inference.address, timeout=120) as c:
            return await asyncio.gather(
                *(c.generate(PROMPT, "s-many", max_new_tokens=4, temperature=0) for _ in range(20))
            )

    results = asyncio.run(burst())
    want = reference.greedy(PROMPT, adapters["s-many"], 4)
    assert all(list(r[0].token_ids) == want for r in results)
    assert scrape(inference)["loraplex_store_pulls_total"] == pulls + 1
    assert inference.output().count("pulled adapter s-many ") == 1


def test_load_adapter_registers_in_store(client, adapters, reference):
    info = client.load_adapter("s-load", str(adapters["s-load"]))
    assert (info.name, info.rank) == ("s-load", 8)
    assert info.location in (pb.ADAPTER_LOCATION_GPU, pb.ADAPTER_LOCATION_HOST)
    record = client.get_adapter("s-load")  # LoadAdapter registered it in the store first
    assert record.name == "s-load" and record.rank == 8 and record.digest.startswith("sha256:")
    assert (info.source, info.digest) == (record.source, record.digest)  # not the local cache path
    [out] = client.generate(PROMPT, "s-load", max_new_tokens=MAX_NEW, temperature=0)
    assert list(out.token_ids) == reference.greedy(PROMPT, adapters["s-load"], MAX_NEW)


def test_list_shows_store_only_adapters(client, adapters):
    client.register_adapter("s-idle", str(adapters["s-idle"]))
    listed = {a.name: a for a in client.list_adapters()}
    assert listed["s-idle"].location == pb.ADAPTER_LOCATION_STORE
    assert listed["s-idle"].rank == 8 and listed["s-idle"].digest.startswith("sha256:")


def test_unknown_everywhere_is_not_found(client):
    with pytest.raises(NotFound) as info:
        client.generate(["a", "b"], ["", "nowhere"], max_new_tokens=2)
    assert info.value.resource == "nowhere"


def test_store_delete_drops_adapter(client, adapters):
    client.register_adapter("s-gone", str(adapters["s-gone"]))
    client.generate(PROMPT, "s-gone", max_new_tokens=2)
    assert client.delete_adapter("s-gone")
    deadline = time.monotonic() + 15
    while "s-gone" in {a.name for a in client.list_adapters()}:
        assert time.monotonic() < deadline, "deleted adapter still listed"
        time.sleep(0.2)
    with pytest.raises(NotFound):
        client.generate(PROMPT, "s-gone", max_new_tokens=2)


def test_health_of_both(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for proc in stack:
        with grpc.insecure_channel(proc.address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_store_reregister_with_new_content_is_picked_up(client, adapters, reference):
    client.register_adapter("s-swap", str(adapters["s-one"]))
    [before] = client.generate(PROMPT, "s-swap", max_new_tokens=MAX_NEW, temperature=0)
    assert list(before.token_ids) == reference.greedy(PROMPT, adapters["s-one"], MAX_NEW)
    assert reference.greedy(PROMPT, adapters["s-new"], MAX_NEW) != list(before.token_ids)
    new = client.register_adapter("s-swap", str(adapters["s-new"]))
    deadline = time.monotonic() + 15
    while True:  # the WatchAdapters event drops the old copy; the next request pulls the new one
        [after] = client.generate(PROMPT, "s-swap", max_new_tokens=MAX_NEW, temperature=0)
        if list(after.token_ids) == reference.greedy(PROMPT, adapters["s-new"], MAX_NEW):
            break
        assert time.monotonic() < deadline, "still serving the old content"
        time.sleep(0.3)
    listed = {a.name: a for a in client.list_adapters()}
    assert listed["s-swap"].digest == new.digest


def _served(client, name: str) -> tuple[float, list[int]]:
    [out] = client.generate(PROMPT, name, max_new_tokens=MAX_NEW, temperature=0)
    alpha = {a.name: a.alpha for a in client.list_adapters()}[name]
    return alpha, list(out.token_ids)


def test_same_weights_with_another_config_are_another_adapter(client, adapters, reference, tmp_path):
    """Identity is content: a copy of s-one's weights with lora_alpha 1 is served with alpha 1,
    under a second name and when the first name is re-registered with it, though s-one's weights
    (with alpha 16) are already in the inference server's cache."""
    low = copy_adapter(adapters["s-one"], tmp_path / "s-one-alpha1")
    edit_config(low, lora_alpha=1)
    want_low = reference.greedy(PROMPT, low, MAX_NEW)
    want_one = reference.greedy(PROMPT, adapters["s-one"], MAX_NEW)
    assert want_low != want_one, "alpha 1 and 16 must give different tokens for this test to mean anything"

    client.register_adapter("s-twin", str(adapters["s-one"]))
    assert _served(client, "s-twin") == (16.0, want_one)
    record = client.register_adapter("s-twin-low", str(low))
    assert record.alpha == 1.0 and record.digest == client.get_adapter("s-twin").digest
    assert record.config_digest != client.get_adapter("s-twin").config_digest
    assert _served(client, "s-twin-low") == (1.0, want_low)
    info = client.load_adapter("s-twin-load", str(low))
    assert info.alpha == 1.0
    assert _served(client, "s-twin-load") == (1.0, want_low)

    client.register_adapter("s-twin", str(low))  # the same name, its alpha fixed
    deadline = time.monotonic() + 15
    while _served(client, "s-twin") != (1.0, want_low):  # the watch event drops the old version
        assert time.monotonic() < deadline, "still serving the old config"
        time.sleep(0.3)


CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
OWN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}ANSWER:{% endif %}"
)


def _chat_prompt_tokens(client, name: str) -> int:
    return client.chat(CHAT, name, max_new_tokens=1, temperature=0)[0].prompt_tokens


def test_an_adapter_chat_template_travels_through_the_store(client, stack, adapters, reference, tmp_path):
    """Issue 59 L4: LoadAdapter of a directory with its own chat template, on a server with a store,
    registers it there; the template travels with the pull (PullAdapter header) and is the one the
    server renders chats with. A re-registration that changes the template alone is new content:
    the watch event drops the old version and the next chat renders with the new template."""
    own = copy_adapter(adapters["s-one"], tmp_path / "templated")
    (own / "chat_template.jinja").write_text(OWN_TEMPLATE)

    def tokens_with(template: str) -> int:
        text = reference.tokenizer.apply_chat_template(
            CHAT, add_generation_prompt=True, tokenize=False, chat_template=template
        )
        return len(reference.tokenizer(text, add_special_tokens=False).input_ids)

    plain = client.register_adapter("s-untemplated", str(adapters["s-one"]))
    model_tokens = _chat_prompt_tokens(client, "s-untemplated")
    client.load_adapter("s-templated", str(own))
    record = client.get_adapter("s-templated")
    assert record.files_digest.startswith("sha256:") and not plain.files_digest
    assert record.digest == plain.digest  # the same weights: only the template differs
    assert _chat_prompt_tokens(client, "s-templated") == tokens_with(OWN_TEMPLATE) != model_tokens

    longer = OWN_TEMPLATE.replace("ANSWER:", "THE ANSWER, BRIEFLY:")
    (own / "chat_template.jinja").write_text(longer)
    again = client.register_adapter("s-templated", str(own))
    assert again.files_digest != record.files_digest and again.config_digest == record.config_digest
    deadline = time.monotonic() + 15
    while _chat_prompt_tokens(client, "s-templated") != tokens_with(longer):
        assert time.monotonic() < deadline, "still rendering with the old template"
        time.sleep(0.3)
