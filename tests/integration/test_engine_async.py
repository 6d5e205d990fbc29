"""AsyncEngine API (the servicer's seam), the adapter-slot hook and the LoRA seam of the runner."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from loraplex.services.inference.engine.async_engine import AsyncEngine
from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.loading import load
from loraplex.services.inference.engine.types import RequestOutput, SamplingParams
from loraplex.services.inference.errors import AdapterNotFound, CapacityExceeded, InvalidRequest
from loraplex.services.inference.lora.adapter_slots import AdapterSlots
from loraplex.services.inference.lora.backend import GROUPS, LoRABackend
from loraplex.services.inference.server_args import ServerArgs
from tests.support.lora_reference import async_engine


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


@pytest.fixture(scope="module")
def aengine(tiny_llama_path: Path):
    args = ServerArgs.from_fields(
        model_path=str(tiny_llama_path), device="cpu", max_total_tokens=512, page_size=4, context_length=256
    )
    engine = async_engine(args)
    yield engine
    asyncio.run(engine.shutdown())


async def collect(engine: AsyncEngine, rid: str, prompt, params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in engine.generate(rid, prompt, None, params)]


def test_generate_streams_and_matches_the_sync_engine(aengine: AsyncEngine):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)

    async def main():
        return await asyncio.gather(
            *(collect(aengine, f"g{i}", t, params) for i, t in enumerate(["Hi", "A b c"]))
        )

    streams = asyncio.run(main())
    for stream, text in zip(streams, ["Hi", "A b c"], strict=True):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        tokens = [t for o in stream for t in o.new_token_ids]
        assert len(tokens) == 16 and stream[-1].completion_tokens == 16
        assert stream[-1].finish_reason == "length"
        assert stream[-1].prompt_tokens == len(aengine.tokenize(text))
        assert "".join(o.new_text for o in stream) == aengine.engine.tokenizer.decode(
            tokens, skip_special_tokens=True
        )
    stats = aengine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0


def test_abort_and_closing_the_stream_free_kv(aengine: AsyncEngine):
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)

    async def main():
        outs = []
        async for out in aengine.generate("abort-me", "Tell me a story", None, long):
            outs.append(out)
            if len(outs) == 2:
                assert aengine.stats().kv_blocks_free < aengine.stats().kv_blocks_total
                aengine.abort("abort-me")
        agen = aengine.generate("close-me", "Another story", None, long)
        await agen.__anext__()
        await agen.aclose()  # what a cancelled RPC does
        for _ in range(100):
            if aengine.stats().running == 0:
                break
            await asyncio.sleep(0.02)
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and len(outs) < 200
    stats = aengine.stats()
    assert stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total


def test_requests_are_validated_before_streaming(aengine: AsyncEngine):
    async def first(prompt, params, adapter=None):
        async for out in aengine.generate("v", prompt, adapter, params):
            return out

    with pytest.raises(InvalidRequest, match="temperature"):
        asyncio.run(first("x", SamplingParams(temperature=-1)))
    with pytest.raises(InvalidRequest, match="context"):
        asyncio.run(first([5] * 300, SamplingParams()))
    with pytest.raises(CapacityExceeded, match="KV cache"):
        _too_big(aengine)
    with pytest.raises(AdapterNotFound, match="not loaded"):
        asyncio.run(first("x", SamplingParams(), adapter="nope"))
    with pytest.raises(InvalidRequest, match="empty"):
        asyncio.run(first([], SamplingParams()))


def _too_big(engine: AsyncEngine) -> None:
    """A prompt that fits the context (256) but not a 64-token KV cache."""
    cfg = engine.engine.config
    small = LLMEngine(engine.engine.loaded, EngineConfig(**{**cfg.__dict__, "max_total_tokens": 64}))
    small.check_request([5] * 100, SamplingParams())


def test_info_and_tokenize(aengine: AsyncEngine, tiny_llama_path):
    from transformers import AutoTokenizer

    info = aengine.model_info()
    assert info.context_length == 256 and info.dtype == "float32" and info.device == "cpu"
    assert (
        aengine.tokenize("Hello world")
        == AutoTokenizer.from_pretrained(tiny_llama_path)("Hello world").input_ids
    )
    assert aengine.list_adapters() == [] and not aengine.has_adapter("x")
    with pytest.raises(AdapterNotFound):  # delegated to the LoRA manager
        asyncio.run(aengine.load_adapter("x", "/nowhere"))
    # a server built without LoRA (same weights, its own KV cache and engine thread)
    bare = AsyncEngine(LLMEngine(aengine.engine.loaded, aengine.engine.config), lora_manager=None)
    try:
        with pytest.raises(AdapterNotFound, match="without LoRA"):
            asyncio.run(bare.load_adapter("x", "/nowhere"))
        assert bare.list_adapters() == [] and not bare.has_adapter("x")
    finally:
        asyncio.run(bare.shutdown())


# -- adapter slots and the LoRA seam ----------------------------------------------------------


class ResidentSet(AdapterSlots):
    """A real (if tiny) slot table: adapters become resident when the test says so."""

    def __init__(self, slots: int):
        self.table: list[str | None] = [None] * slots
        self.refs = [0] * slots
        self.resident: set[str] = set()
        self.log: list[tuple[str, str]] = []

    def acquire(self, adapter_name: str) -> int | None:
        if adapter_name not in self.resident:
            if adapter_name == "unknown":
                raise AdapterNotFound(f"no adapter {adapter_name!r}")
            return None
        slot = self.table.index(adapter_name) if adapter_name in self.table else self.table.index(None)
        self.table[slot] = adapter_name
        self.refs[slot] += 1
        self.log.append(("acquire", adapter_name))
        return slot

    def release(self, adapter_name: str) -> None:
        slot = self.table.index(adapter_name)
        self.refs[slot] -= 1
        self.log.append(("release", adapter_name))
        if self.refs[slot] == 0:
            self.table[slot] = None

    def slots_total(self) -> int:
        return len(self.table)

    def slots_used(self) -> int:
        return sum(1 for r in self.refs if r)


class RecordingBackend(LoRABackend):
    """Records what the runner hands over; adds nothing (deltas are the LoRA engineer's)."""

    def __init__(self):
        self.prepared: list[torch.Tensor] = []
        self.applied: list[tuple[int, str, tuple, tuple]] = []

    def prepare(self, token_slots: torch.Tensor, max_distinct: int | None = None) -> None:
        self.prepared.append(token_slots.clone())

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        self.applied.append((layer, group, tuple(x.shape), tuple(out.shape)))


def test_adapter_requests_wait_for_slots_without_holding_up_base_requests(tiny_llama_path):
    config = EngineConfig(
        model_path=str(tiny_llama_path), device=torch.device("cpu"), dtype="float32",
        max_total_tokens=512, page_size=4, context_length=128,
    )  # fmt: skip
    slots, backend = ResidentSet(2), RecordingBackend()
    engine = LLMEngine(load(config), config, adapter_slots=slots, lora_backend=backend)
    prompt = engine.tokenizer("Hello there").input_ids
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.add_request("lora", prompt, params, adapter="a")
    engine.add_request("base", prompt, params)
    finished: dict[str, RequestOutput] = {}
    for _ in range(5):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"base"}  # the base request ran while "a" was not resident
    assert backend.prepared == [] and backend.applied == []  # no adapter tokens: lora=None
    assert engine.stats().waiting == 1

    slots.resident.add("a")
    engine.add_request("base2", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            finished[out.request_id] = out
    assert finished["lora"].completion_tokens == 4
    assert slots.log == [("acquire", "a"), ("release", "a")] and slots.slots_used() == 0
    # one prepare per step with the adapter's tokens, per-token int32 slots in forward order
    first = backend.prepared[0]
    assert first.dtype == torch.int32 and sorted(set(first.tolist())) == [-1, 0]
    assert (first == 0).sum() == len(prompt) and (first == -1).sum() == len(prompt)
    assert len(backend.prepared) == 4  # one prefill step + three decode steps
    num_layers = engine.loaded.config.num_layers
    groups = [g for _, g, _, _ in backend.applied[: 4 * num_layers]]
    assert groups == list(GROUPS) * num_layers
    layer, group, x_shape, out_shape = backend.applied[0]
    cfg = engine.loaded.config
    assert (layer, group) == (0, "qkv") and x_shape[1] == cfg.hidden_size
    assert out_shape[1] == cfg.q_size + 2 * cfg.kv_size

    engine.add_request("bad", prompt, params, adapter="unknown")
    outs = engine.step()
    assert outs[0].finish_reason == "abort" and isinstance(engine.errors.pop("bad"), AdapterNotFound)
