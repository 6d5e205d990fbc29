"""LLMEngine: admission, and one `step()` = schedule, forward, sample, update, emit outputs.

The engine decides what runs and in which order; its parts do the work: the scheduler picks a
step's requests, the model runner computes their logits, the OutputProcessor (request_outputs.py)
samples them and turns the tokens into RequestOutputs. startup.py builds the parts. This module
is the requests' way in and what the engine reports; the step itself is engine/step_loop.py's.

Not thread-safe: AsyncEngine drives it from a single engine thread.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch

from loraplex.kernels.compile_watch import compile_counter
from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.draft_runner import check_draft_adapter, load_draft_for
from loraplex.services.inference.engine.grammar import GrammarState
from loraplex.services.inference.engine.grammar_cache import GrammarCache
from loraplex.services.inference.engine.loading import LoadedModel, load
from loraplex.services.inference.engine.overlap import InFlightStep
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.request_outputs import OutputProcessor
from loraplex.services.inference.engine.speculative import Speculator
from loraplex.services.inference.engine.startup import build_kv_cache, build_runner, build_scheduler
from loraplex.services.inference.engine.step_loop import StepLoop
from loraplex.services.inference.engine.types import EngineStats, RequestOutput, SamplingParams
from loraplex.services.inference.engine.unified_blocks import UnifiedBlocks
from loraplex.services.inference.errors import CapacityExceeded, ContextLengthExceeded, InvalidRequest
from loraplex.services.inference.lora.adapter_slots import AdapterSlots, NoAdapters
from loraplex.services.inference.lora.backend import LoRABackend
from loraplex.services.inference.lora.unified import bind


class Completion(NamedTuple):
    """A finished request, for the synchronous `generate` helper."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


class LLMEngine(StepLoop):
    """The requests' way in (`check_request`, `add_request`, `abort_request`), the parts built once,
    and what the engine reports; `step()` is StepLoop's (engine/step_loop.py)."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        *,
        adapter_slots: AdapterSlots | None = None,
        lora_backend: LoRABackend | None = None,
        kv_reserved_bytes: int = 0,
    ):
        compile_counter.install()
        compile_counter.mark_starting()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.context_length = loaded.context_length
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids)
        # Weights before the KV cache takes what is left; draft adapters on the target's LoRA backend
        draft = load_draft_for(loaded, config, getattr(lora_backend, "name", None) or None)
        pool = getattr(lora_backend, "pool", None)
        kv_cache, self.block_manager = build_kv_cache(
            loaded, config, kv_reserved_bytes, draft.kv_bytes_per_token() if draft else 0, pool
        )
        if isinstance(self.block_manager, UnifiedBlocks):  # --lora-memory unified: one free list
            bind(pool, adapter_slots, self.block_manager)
        # Built (and warmed up) before the target's runner marks the end of start-up.
        draft_runner = draft.runner(config, self.block_manager.num_blocks) if draft else None
        self.adapter_slots = adapter_slots or NoAdapters()
        self.scheduler = build_scheduler(loaded, config, self.block_manager, self.adapter_slots)
        self.runner, self.config = build_runner(loaded, config, kv_cache, lora_backend)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.eos_token_ids, loaded.config.vocab_size, self.scheduler
        )
        self._seed_rng = random.Random(self.config.seed)
        self.speculator = (
            Speculator(
                self.config.speculative_num_draft_tokens,
                self.config.speculative_disable_batch_size,
                self.context_length,
                draft_runner=draft_runner,
                sampling_inputs=self.output_processor.sampling_inputs,
            )
            if self.config.speculative_algorithm
            else None
        )
        self._in_flight: InFlightStep | None = None  # overlap: the launched step not yet processed
        self.grammars = GrammarCache(
            self.tokenizer,
            loaded.config.vocab_size,
            sorted(self.eos_token_ids),
            tokenizer_name=str(loaded.model_dir),
            max_bytes=self.config.grammar_cache_max_bytes,
            max_grammar_bytes=self.config.grammar_max_bytes,
        )

    @property
    def requests(self) -> dict[str, Request]:
        """The requests queued or running, by id (kept by `output_processor`, which ends them)."""
        return self.output_processor.requests

    @property
    def errors(self) -> dict[str, Exception]:
        """Why a request ended with "abort", when not a client abort; the caller pops it."""
        return self.output_processor.errors

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> LLMEngine:
        return cls(load(config), config, **kwargs)

    # -- requests -------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest / CapacityExceeded for a request that can never run here.

        The one check of a prompt and its sampling parameters against this model; `add_request`
        trusts it was made (by `AsyncEngine.generate`, or `generate` below)."""
        params.validate(self.config.max_new_tokens_limit)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", field="text")
        vocab = self.loaded.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", field="text")
        params.check_token_ids(vocab)
        if len(prompt_ids) >= self.context_length:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.context_length} "
                "tokens including at least one new token",
                field="text",
                prompt_tokens=len(prompt_ids),
                context_length=self.context_length,
            )
        capacity = self.block_manager.capacity_tokens
        if len(prompt_ids) >= capacity:
            raise CapacityExceeded(
                f"the prompt has {len(prompt_ids)} tokens but the whole KV cache holds {capacity}; "
                "raise --max-total-tokens or --mem-fraction-static",
                field="text",
            )

    def check_draft_adapter(self, name: str | None) -> None:
        """Raise InvalidRequest / AdapterNotFound for a draft adapter this server does not serve."""
        check_draft_adapter(self.speculator.draft_runner if self.speculator else None, name)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter: str | None = None,
        arrival_time: float | None = None,
        grammar=None,
        draft_adapter: str | None = None,
        tokenizer=None,
    ) -> None:
        """Queue a request that passed `check_request`. `arrival_time` (time.monotonic()): when the
        caller received it; default now. `grammar`: params.constraint compiled by `self.grammars`
        (AsyncEngine compiles it off this thread); compiled here, blocking, when not given.
        `draft_adapter`: the draft model's adapter, passed `check_draft_adapter`. `tokenizer`: the
        adapter's own (engine/adapter_tokenizers.py, this thread's copy) for its output text; None:
        the base's."""
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        if len(self.scheduler.waiting) >= self.config.max_queued_requests:
            raise CapacityExceeded(f"{len(self.scheduler.waiting)} requests are queued; retry later")
        req = Request(request_id, list(prompt_ids), params, adapter=adapter or None)
        req.draft_adapter = draft_adapter or None
        if arrival_time is not None:
            req.arrival_time = arrival_time
        req.max_new_tokens = min(params.max_new_tokens, self.context_length - len(prompt_ids))
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            req.generator = torch.Generator(device=self.loaded.device).manual_seed(seed)
        if params.constraint is not None:
            req.grammar = GrammarState(
                grammar if grammar is not None else self.grammars.compile(params.constraint)
            )
        self.output_processor.add(req, tokenizer)
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        return self.output_processor.final_output(req, [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- info -----------------------------------------------------------------------------

    def forget_adapter(self, name: str) -> None:
        """Per-adapter state the engine keeps beside the LoRA manager, dropped once `name` is unloaded."""
        self.scheduler.prefix_cache.stats.forget(name)
        if self.speculator is not None:
            self.speculator.stats.forget(name)

    def stats(self) -> EngineStats:
        return EngineStats(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_free=self.block_manager.num_free_blocks,
            lora_slots_total=self.adapter_slots.slots_total(),
            lora_slots_used=self.adapter_slots.slots_used(),
            lora_slots_draining=self.adapter_slots.slots_draining(),
            lora_adapters_waiting=len(self.adapter_slots.slot_queue()),
            lora_suspensions=self.adapter_slots.suspensions(),
            lora_requests_suspended=self.adapter_slots.requests_suspended(),
            prefix_cache_enabled=self.block_manager.prefix_cache,
            prefix_cache_blocks=self.block_manager.num_cached_blocks,
            prefix_cache_evictions=self.block_manager.num_evictions,
            prefix_cache_prompt_tokens=dict(self.scheduler.prefix_cache.stats.prompt_tokens),
            prefix_cache_hit_tokens=dict(self.scheduler.prefix_cache.stats.hit_tokens),
            spec_draft_tokens=dict(self.speculator.stats.drafted) if self.speculator else {},
            spec_accepted_tokens=dict(self.speculator.stats.accepted) if self.speculator else {},
        )

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        adapters: list[str | None] | None = None,
        draft_adapters: list[str | None] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion in one continuous batch (tests, benchmarks)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        adapters = adapters or [None] * len(prompts)
        draft_adapters = draft_adapters or [None] * len(prompts)
        ids = [f"gen-{i}-{random.getrandbits(32):08x}" for i in range(len(prompts))]
        for prompt, p, d in zip(prompts, params_list, draft_adapters, strict=True):
            self.check_request(prompt, p)
            self.check_draft_adapter(d)
        for rid, prompt, p, a, d in zip(ids, prompts, params_list, adapters, draft_adapters, strict=True):
            self.add_request(rid, prompt, p, a, draft_adapter=d)
        texts = {rid: [] for rid in ids}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                texts[out.request_id].append(out.new_text)
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    done[out.request_id] = out
        for rid in ids:
            if rid in self.errors:
                raise self.errors.pop(rid)
        return [
            Completion(
                rid, "".join(texts[rid]), tokens[rid], done[rid].finish_reason or "", done[rid].prompt_tokens
            )
            for rid in ids
        ]
