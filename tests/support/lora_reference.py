"""The PEFT reference and engine wiring the multi-LoRA tests share: adapters of several ranks and
module sets, PEFT's greedy tokens one sequence at a time, and the engine `build_engine` wires."""

from __future__ import annotations

from pathlib import Path

import torch

from loraplex.services.inference.engine.async_engine import AsyncEngine
from loraplex.services.inference.engine.build import build_engine, build_llm_engine
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.lora.settings import LoRASettings
from loraplex.services.inference.lora.setup import resolve_lora_settings
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes
from loraplex.services.inference.server_args import ServerArgs
from tests.support.factories import files_key

NEW_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "List 3 countries and their capitals.",
    "def fibonacci(n):",
    "Once upon a time, in a land far far away, there lived a",
    "Water boils at",
    "Translate to French: I would like a cup of coffee, please.",
    "1, 2, 3, 4,",
]
# name -> adapter_factory kwargs: ranks 4, 8 (rslora), 16, 64 on different module sets
ADAPTERS = {
    "r4": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"], seed=1
    ),
    "r8rs": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"], seed=2),
    "r16": dict(r=16, lora_alpha=16, target_modules=["up_proj", "down_proj"], seed=3),
    "r64": dict(
        r=64,
        lora_alpha=32,
        target_modules=list(ALL_MODULES),
        seed=4,
        rank_pattern={"down_proj": 32},
        alpha_pattern={r"layers\.1\.self_attn\.o_proj": 8},
    ),
}
# one continuous batch: base + all four adapters (twice for r4), more adapters than slots
BATCH = [None, "r4", "r8rs", "r16", "r64", "r4", None]


def make_adapters(adapter_factory, base: Path, tag: str) -> dict[str, Path]:
    return {name: adapter_factory(base, f"{tag}-{name}", **kw) for name, kw in ADAPTERS.items()}


# PEFT's greedy reference is a pure function of the base's and adapters' files, the jobs and the
# length: tests parametrized over engine settings (slot rotation, overlap, ...) ask for the same one.
_REFERENCES: dict[tuple, list[list[int]]] = {}


def peft_greedy(
    base: Path,
    adapters: dict[str, Path],
    jobs: list[tuple[list[int], str | None]],
    new_tokens: int = NEW_TOKENS,
) -> list[list[int]]:
    """PEFT's greedy tokens for each (prompt, adapter), one sequence at a time, cut after EOS
    (computed once per session for the same files, jobs and length)."""
    names = sorted({a for _, a in jobs if a is not None}) or sorted(adapters)[:1]
    key = (
        str(base),
        files_key(Path(base)),
        tuple((n, str(adapters[n]), files_key(Path(adapters[n]))) for n in names),
        tuple((tuple(ids), name) for ids, name in jobs),
        new_tokens,
        torch.get_num_threads(),  # float sums may round apart across thread counts: no tie flips
    )
    if key not in _REFERENCES:
        _REFERENCES[key] = _peft_greedy(base, adapters, jobs, new_tokens)
    return [list(tokens) for tokens in _REFERENCES[key]]


def _peft_greedy(
    base: Path,
    adapters: dict[str, Path],
    jobs: list[tuple[list[int], str | None]],
    new_tokens: int,
) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    names = sorted({a for _, a in jobs if a is not None}) or sorted(adapters)[:1]
    peft = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(adapters[name], adapter_name=name)
    outs = []
    with torch.no_grad():
        for ids, name in jobs:
            x = torch.tensor([ids])
            if name is None:
                with peft.disable_adapter():
                    gen = peft.generate(input_ids=x, max_new_tokens=new_tokens, do_sample=False)
            else:
                peft.set_adapter(name)
                gen = peft.generate(input_ids=x, max_new_tokens=new_tokens, do_sample=False)
            tokens = gen[0, len(ids) :].tolist()
            cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            outs.append(tokens[:cut])
    return outs


def server_args(base: Path, adapters: dict[str, Path] | None = None, **kw) -> ServerArgs:
    options = dict(
        model_path=str(base),
        device="cpu",
        dtype="float32",
        chunked_prefill_size=8,
        max_num_batched_tokens=64,
        max_total_tokens=8192,
        context_length=1024,
        # At most 2 distinct adapters per step (they take turns); the pool stays sized from memory.
        # Tests of a scarce pool pass max_gpu_loras.
        max_loras_per_batch=2,
        lora_paths=tuple(f"{n}={p}" for n, p in (adapters or {}).items()),
    )
    options.update(kw)
    return ServerArgs.from_fields(**options)


def sync_engine(args: ServerArgs) -> LLMEngine:
    """The engine build_engine wires, driven synchronously so all prompts share one batch."""
    return build_llm_engine(args.engine, args.lora)[0]


def async_engine(args: ServerArgs) -> AsyncEngine:
    """The serving engine, built the way the server builds it from its flags."""
    return build_engine(args.engine, args.lora)


def lora_settings(args: ServerArgs, shapes: ModelShapes, device: torch.device) -> LoRASettings:
    """The LoRA flags resolved the way the engine builder resolves them."""
    return resolve_lora_settings(
        args.lora, shapes, device, mem_fraction_static=args.engine.mem_fraction_static
    )
