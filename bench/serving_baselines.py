"""The alternatives users have without a server, measured on the same model, prompts and adapters.

1. transformers + PEFT, mixed batch: one `generate` over a batch whose rows name different
   adapters (`adapter_names=`), eager, dynamic cache.
2. transformers alone (base model): `generate` with its static cache, which transformers compiles
   with torch.compile (mode reduce-overhead, CUDA graphs) for the decode steps.

Decode throughput: a streamer syncs and timestamps the first new token (prefill done), and
decode tokens/s = batch * (new tokens - 1) / (time from the first new token to generate()'s
return). Prefill and the first token stay out of it, as in the engine's decode numbers; no
per-step sync is added, so transformers' host may run ahead of the GPU as it normally does.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)


class GenerateTiming(NamedTuple):
    batch: int
    new_tokens: int
    decode_tokens_per_s: float
    ms_per_step: float
    first_token_s: float  # prompt in to first new token (prefill + one step)
    total_s: float


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _StepClock:
    """A generate() streamer that syncs and timestamps the first new token, then only counts.

    Later tokens are not synced, so the host may run ahead of the GPU as generate() lets it;
    the decode time is from the first token to generate()'s return (synced by the caller).
    """

    def __init__(self) -> None:
        self.first: float | None = None
        self.tokens = 0
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        if self.first is None:
            _sync()
            self.first = time.perf_counter()
        self.tokens += 1

    def end(self) -> None:
        pass


def _timed_generate(model, input_ids: torch.Tensor, new_tokens: int, **kwargs) -> GenerateTiming:
    clock = _StepClock()
    attention_mask = torch.ones_like(input_ids)
    _sync()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
            **kwargs,
        )
    _sync()
    end = time.perf_counter()
    steps = clock.tokens - 1
    decode_s = end - clock.first
    batch = input_ids.shape[0]
    return GenerateTiming(
        batch,
        clock.tokens,
        batch * steps / decode_s,
        1e3 * decode_s / steps,
        clock.first - start,
        end - start,
    )


def load_hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, device_map="cuda" if torch.cuda.is_available() else "cpu"
    )
    model.generation_config.pad_token_id = model.config.eos_token_id
    return model.eval()


def peft_mixed_batch(model, adapter_dirs: list[Path], input_ids: torch.Tensor, new_tokens: int) -> tuple:
    """transformers + PEFT with `adapter_names`: row i uses adapter i % len(adapter_dirs).

    Returns (timing, the PEFT model) so the caller can unload it afterwards.
    """
    from peft import PeftModel

    names = [f"a{i}" for i in range(len(adapter_dirs))]
    peft_model = PeftModel.from_pretrained(model, str(adapter_dirs[0]), adapter_name=names[0])
    for name, d in zip(names[1:], adapter_dirs[1:], strict=True):
        peft_model.load_adapter(str(d), adapter_name=name)
    peft_model.eval()
    rows = [names[i % len(names)] for i in range(input_ids.shape[0])]
    _timed_generate(peft_model, input_ids[:, :64], 2, adapter_names=rows)  # warm-up: kernels, allocator
    timing = _timed_generate(peft_model, input_ids, new_tokens, adapter_names=rows)
    log.info("transformers+PEFT mixed batch: %s", timing)
    return timing, peft_model


def static_cache_compiled(model, input_ids: torch.Tensor, new_tokens: int) -> tuple[GenerateTiming, float]:
    """Base model, `cache_implementation="static"` (auto torch.compile). Returns (timing, warm-up s)."""
    start = time.perf_counter()
    _timed_generate(model, input_ids, new_tokens, cache_implementation="static")  # compiles
    warmup_s = time.perf_counter() - start
    timing = _timed_generate(model, input_ids, new_tokens, cache_implementation="static")
    log.info("transformers static cache + compile: %s (warm-up %.1f s)", timing, warmup_s)
    return timing, warmup_s


def greedy_reference(
    peft_model, prompts: list[list[int]], adapters: list[int | None], new_tokens: int
) -> list:
    """transformers + PEFT greedy tokens for a correctness comparison (adapter index or None = base)."""
    ids = torch.tensor(prompts, device=peft_model.device)
    names = ["__base__" if a is None else f"a{a}" for a in adapters]
    with torch.inference_mode():
        out = peft_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            adapter_names=names,
        )
    return out[:, ids.shape[1] :].tolist()


def run_baselines(
    model_dir: Path,
    adapter_dirs: list[Path],
    input_ids: torch.Tensor,
    new_tokens: int,
    skip_compile: bool = False,
    check: tuple | None = None,
) -> dict:
    """Both baselines at the batch of `input_ids`; frees the model before returning.

    `check` = (prompts, adapter indices, new tokens): also returns PEFT's greedy tokens for them.
    """
    results: dict = {}
    model = load_hf_model(model_dir)
    timing, peft_model = peft_mixed_batch(model, adapter_dirs, input_ids, new_tokens)
    results["hf_peft_mixed"] = timing._asdict() | {"adapters": len(adapter_dirs)}
    if check is not None:
        results["greedy_reference"] = greedy_reference(peft_model, *check)
    model = peft_model.unload()  # the plain base modules back, LoRA layers removed
    del peft_model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if not skip_compile:
        try:
            timing, warmup_s = static_cache_compiled(model, input_ids, new_tokens)
            results["hf_static_compile"] = timing._asdict() | {"warmup_s": warmup_s}
        except Exception as exc:  # report, do not lose the rest of the run
            log.exception("static cache + compile baseline failed")
            results["hf_static_compile"] = {"error": f"{type(exc).__name__}: {exc}"}
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results
