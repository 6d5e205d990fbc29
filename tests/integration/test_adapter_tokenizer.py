"""An adapter that brings its own tokenizer (issue 56, trainable tokens): a PEFT
`trainable_token_indices` adapter of the embedded SmolLM2 whose tokenizer maps a new marker to one
id within the embedding (tests/support/adapter_tokenizer.py: SmolLM2 leaves no id free, so the marker
takes id 49151's place). Real store (embedded Redis) and inference server, real gRPC, the door
through the `openai` package; transformers + PEFT with the adapter's tokenizer as the reference.

- Registered, its tokenizer files travel through the store; its text inputs are tokenized by its
  tokenizer (the marker is one id) and a base request in the same call by the base's (split).
- Greedy outputs equal transformers + PEFT's; the output text (unary, streamed, Detokenize, the door)
  is the adapter tokenizer's, the marker shown; a stop string is matched in that text.
- A constraint (regex, choice; gRPC and the door) is compiled on the adapter's tokenizer: the marker
  is one token under the adapter, pieces under the base.
- A tokenizer with an id past the embedding rows is refused by the store (FAILED_PRECONDITION naming
  the token and id) and by the inference server at load.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from loraplex.clients import Client, FailedPrecondition
from loraplex.services.inference.errors import AdapterIncompatible
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc
from tests.support.adapter_tokenizer import MARKER, MARKER_ID, REPLACED, write_marker_tokenizer
from tests.support.door import running_door
from tests.support.factories import make_peft_adapter
from tests.support.service_stack import STORE_STACK_SHAPE, store_stack

pytestmark = pytest.mark.timeout(300)
MAX_NEW = 8
TEXT = f"Write the marker {MARKER} then"
NAME = "tok-marker"


@pytest.fixture(scope="module")
def adapter(smollm2_path, tmp_path_factory) -> Path:
    """q_proj LoRA (within the shared server's rank and modules) and trainable rows for the marker."""
    out = tmp_path_factory.mktemp("tok-marker")
    make_peft_adapter(
        smollm2_path,
        out,
        r=STORE_STACK_SHAPE["r"],
        target_modules=["q_proj"],
        trainable_token_indices=[MARKER_ID, 1000],
        seed=56,
    )
    write_marker_tokenizer(smollm2_path, out)
    return out


@pytest.fixture(scope="module")
def past_rows(adapter, tmp_path_factory, smollm2_path) -> Path:
    out = tmp_path_factory.mktemp("tok-past") / "a"
    shutil.copytree(adapter, out)
    write_marker_tokenizer(smollm2_path, out, past_rows=True)
    return out


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory, smollm2_path):
    return store_stack(request.config, tmp_path_factory, smollm2_path)


@pytest.fixture(scope="module")
def client(stack, adapter):
    store, inference = stack
    with Client(inference.address, store=store.address, timeout=120) as c:
        c.register_adapter(NAME, str(adapter))
        yield c


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack[1].address) as channel:
        yield pb_grpc.InferenceStub(channel)


@pytest.fixture(scope="module")
def tokenizers(smollm2_path, adapter):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path), AutoTokenizer.from_pretrained(adapter)


@pytest.fixture(scope="module")
def peft_greedy(smollm2_path, adapter):
    """`peft_greedy(prompt ids, with_adapter)`: transformers + PEFT's greedy new ids."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(model, adapter).eval()

    @torch.inference_mode()
    def greedy(ids: list[int], with_adapter: bool) -> list[int]:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # beside a server process on 2 shared cores
        try:
            x = torch.tensor([ids])
            if with_adapter:
                out = peft.generate(input_ids=x, max_new_tokens=MAX_NEW, do_sample=False)
            else:
                with peft.disable_adapter():
                    out = peft.generate(input_ids=x, max_new_tokens=MAX_NEW, do_sample=False)
            return out[0, len(ids) :].tolist()
        finally:
            torch.set_num_threads(threads)

    return greedy


@pytest.fixture(scope="module")
def reference(tokenizers, peft_greedy):
    """(prompt ids, greedy new ids) of TEXT, with the adapter (its tokenizer) and without (the base's)."""
    base_tok, own_tok = tokenizers
    out = {}
    for with_adapter, tok in ((True, own_tok), (False, base_tok)):
        ids = tok(TEXT).input_ids
        out[with_adapter] = (ids, peft_greedy(ids, with_adapter))
    return out


def test_the_store_carries_the_tokenizer_and_refuses_ids_past_the_rows(client, stack, past_rows):
    record = client.get_adapter(NAME)
    assert record.files_digest.startswith("sha256:")
    with pytest.raises(FailedPrecondition, match=f"{MARKER!r} at id 49152, past the 49152 embedding rows"):
        client.register_adapter("tok-past", str(past_rows))


def test_text_is_tokenized_by_each_requests_own_tokenizer_in_one_batch(client, stub, reference, tokenizers):
    """One Generate call, the adapter's text and the base's: the marker is one id for the adapter
    only; greedy ids equal PEFT's, and each text is its own tokenizer's decode of its ids."""
    own_prompt, own_ids = reference[True]
    base_prompt, base_ids = reference[False]
    assert MARKER_ID in own_prompt and MARKER_ID not in base_prompt
    tok = stub.Tokenize(pb.TokenizeRequest(text=TEXT, adapter=NAME), timeout=60)
    assert list(tok.token_ids) == own_prompt and MARKER in tok.tokens
    assert list(stub.Tokenize(pb.TokenizeRequest(text=TEXT), timeout=60).token_ids) == base_prompt
    own, base = client.generate([TEXT, TEXT], [NAME, ""], max_new_tokens=MAX_NEW, temperature=0)
    assert (own.prompt_tokens, base.prompt_tokens) == (len(own_prompt), len(base_prompt))
    assert list(own.token_ids) == own_ids and list(base.token_ids) == base_ids
    base_tok, own_tok = tokenizers
    assert MARKER_ID in own_ids  # the adapter's row for the marker makes it likely: shown as the marker
    assert own.text == own_tok.decode(own_ids) and MARKER in own.text
    assert base.text == base_tok.decode(base_ids)


def test_a_cold_adapters_first_request_is_tokenized_by_its_tokenizer(client, reference):
    """A Generate that pulls the adapter from the store builds its prompt again once the adapter
    (and its tokenizer) is here: the first request is not tokenized by the base's."""
    own_prompt, own_ids = reference[True]
    client.register_adapter("tok-cold", str(client.get_adapter(NAME).source))
    [out] = client.generate([TEXT], ["tok-cold"], max_new_tokens=MAX_NEW, temperature=0)
    assert out.prompt_tokens == len(own_prompt) and list(out.token_ids) == own_ids


def test_streamed_text_detokenize_and_stop_strings_read_the_adapters_tokens(stub, reference):
    _, own_ids = reference[True]
    request = pb.GenerateRequest(
        text=[TEXT], adapter=[NAME], sampling_params=pb.SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    )
    request.sampling_params.logprobs = True
    messages = list(stub.GenerateStream(request, timeout=60))
    assert MARKER in "".join(m.text for m in messages)
    # log probabilities name each token by the adapter's tokenizer too
    named = {lp.token_id: lp.token for m in messages for lp in m.logprobs}
    assert named[MARKER_ID] == MARKER
    ids = [MARKER_ID, 28120]
    own = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, adapter=NAME), timeout=60).text
    base = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=60).text
    assert own.startswith(MARKER) and base.startswith(REPLACED)
    request.sampling_params.stop.append(MARKER)
    [stopped] = stub.Generate(request, timeout=60).completions
    cut = own_ids.index(MARKER_ID)
    assert stopped.finish_reason == "stop" and MARKER not in stopped.text
    assert list(stopped.token_ids) == own_ids[: cut + 1]


def test_a_constraint_is_compiled_on_the_adapters_tokenizer(client, stub, tokenizers):
    """Output exactly the marker's text, its id pushed up by logit_bias, in one call: the adapter's
    mask (from its tokenizer's strings) allows the marker's one id, which is the whole output; the
    base's id 49151 is "ectable", forbidden there, so the base writes the marker's text in pieces.
    (Compiled on the base's strings for both, the adapter's output was pieces too.)"""
    for kind, value in (("regex", re.escape(MARKER)), ("choice", pb.Choices(choices=[MARKER]))):
        params = pb.SamplingParams(max_new_tokens=MAX_NEW, temperature=0, **{kind: value})
        params.logit_bias[MARKER_ID] = 100
        request = pb.GenerateRequest(text=[TEXT, TEXT], adapter=[NAME, ""], sampling_params=params)
        own, base = stub.Generate(request, timeout=60).completions
        eos = [tokenizers[0].eos_token_id]  # the grammar ends: EOS is all it allows
        assert (list(own.token_ids), own.text, own.finish_reason) == ([MARKER_ID, *eos], MARKER, "stop"), kind
        assert (base.text, base.finish_reason, list(base.token_ids[-1:])) == (MARKER, "stop", eos), kind
        assert MARKER_ID not in base.token_ids and len(base.token_ids) > 2, kind  # pieces, then EOS


def _post(door, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://{door.address}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_the_door_uses_the_adapters_tokenizer(client, stack, reference, tokenizers, peft_greedy):
    from openai import OpenAI

    _, inference = stack
    own_prompt, own_ids = reference[True]
    with running_door(inference.address) as door:
        api = OpenAI(base_url=f"http://{door.address}/v1", api_key="x")
        done = api.completions.create(model=NAME, prompt=TEXT, max_tokens=MAX_NEW, temperature=0)
        assert MARKER in done.choices[0].text and done.usage.prompt_tokens == len(own_prompt)
        assert _post(door, "/tokenize", {"model": NAME, "prompt": TEXT})["tokens"] == own_prompt
        # a structured output by `model`: compiled on the adapter's tokenizer (the marker, one token)
        chose = api.completions.create(
            model=NAME,
            prompt=TEXT,
            max_tokens=MAX_NEW,
            temperature=0,
            logit_bias={str(MARKER_ID): 100},
            extra_body={"guided_choice": [MARKER]},
        )
        assert chose.choices[0].text == MARKER and chose.usage.completion_tokens == 2  # it and EOS
        assert MARKER_ID not in _post(door, "/tokenize", {"prompt": TEXT})["tokens"]
        assert _post(door, "/detokenize", {"model": NAME, "tokens": [MARKER_ID]})["prompt"] == MARKER
        # chat: rendered by the template, tokenized by the adapter's tokenizer, greedy as PEFT's
        messages = [{"role": "user", "content": TEXT}]
        want = tokenizers[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
        assert MARKER_ID in want
        assert _post(door, "/tokenize", {"model": NAME, "messages": messages})["tokens"] == want
        text = tokenizers[1].decode(peft_greedy(want, True), skip_special_tokens=True)
        reply = api.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_NEW, temperature=0)
        assert reply.usage.prompt_tokens == len(want) and reply.choices[0].message.content == text
        answer = api.responses.create(model=NAME, input=TEXT, max_output_tokens=MAX_NEW, temperature=0)
        assert answer.output_text == text


def test_the_inference_server_checks_the_rows_at_load(tiny_llama_path, adapter_factory, tmp_path):
    """Without a store in between (the tiny Llama has SmolLM2's tokenizer and 49,152 rows): the
    marker within the rows loads, with its own tokenizer; past them, AdapterIncompatible
    (FAILED_PRECONDITION) naming the token, and the name stays unloaded. Then its grammars (below)."""
    from tests.support.lora_reference import async_engine, server_args

    made = adapter_factory(
        tiny_llama_path, "tok-tiny", r=4, target_modules=["q_proj"], trainable_token_indices=[MARKER_ID]
    )
    within, past = tmp_path / "within", tmp_path / "past"
    for d, beyond in ((within, False), (past, True)):
        shutil.copytree(made, d)
        write_marker_tokenizer(tiny_llama_path, d, past_rows=beyond)
    engine = async_engine(server_args(tiny_llama_path, max_lora_rank=8))
    try:
        asyncio.run(engine.load_adapter("within", str(within)))
        assert engine.tokenize(TEXT, adapter="within").count(MARKER_ID) == 1
        assert MARKER_ID not in engine.tokenize(TEXT)
        with pytest.raises(
            AdapterIncompatible, match=f"{MARKER!r} at id 49152, past this base model's 49152"
        ):
            asyncio.run(engine.load_adapter("past", str(past)))
        assert not engine.has_adapter("past")
        _check_grammars_follow_the_tokenizer(engine)
    finally:
        asyncio.run(engine.shutdown())


def _check_grammars_follow_the_tokenizer(engine) -> None:
    """In the AsyncEngine: "within"'s constrained request is compiled on its tokenizer (the marker is
    its one token) and cached apart from the base's; unloading it drops that entry, not the base's."""
    from loraplex.services.inference.engine.types import Constraint, SamplingParams

    c = Constraint("regex", re.escape(MARKER))
    params = SamplingParams(max_new_tokens=4, temperature=0, constraint=c, logit_bias=((MARKER_ID, 100.0),))

    async def new_ids(adapter: str | None) -> list[int]:
        return [
            t
            async for out in engine.generate(f"c-{adapter}", TEXT, adapter, params)
            for t in out.new_token_ids
        ]

    own, grammars = engine.tokenizers.adapters.get("within"), engine.engine.grammars
    assert asyncio.run(new_ids("within"))[0] == MARKER_ID
    assert MARKER_ID not in asyncio.run(new_ids(None))
    assert grammars.cached(c, own) and grammars.cached(c)
    asyncio.run(engine.unload_adapter("within"))
    assert own.dropped and not grammars.cached(c, own) and grammars.cached(c)
