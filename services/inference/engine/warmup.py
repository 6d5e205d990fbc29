"""Start-up warm-up: run one eager step of every shape class a served step can launch, so every
Triton kernel variant is compiled before the first request (kernels/compile_watch.py says why).

The classes (what picks a compiled variant, see the kernels):
- the step's token count: the segment build's token tile (`lora_meta.segments_block_ts`) and the
  LoRA block-size family (`lora_configs`: up to 16 tokens, up to DECODE_MAX_TOKENS, more; the
  side-stream delta up to DECODE_MAX_TOKENS), one prefill chunk of each;
- the decode count: the decode attention's (tile, padded split count) (`attention_decode.decode_variants`),
  as decodes beside a small prefill chunk (the eager mixed-step path; pure decode steps replay graphs,
  whose capture compiled theirs);
- LoRA: none, up to MANY_ADAPTERS distinct adapters, more (when the pool has more slots); with LoRA
  on the experts, the grouped expert kernel's delta variant and the per-pair expert LoRA kernel
  too (`_expert_lora_for_warm_up`).

Steps write garbage into KV block 0 and read adapter slots that may be empty (rank 0: no work);
nothing is served yet, and every request writes its KV before reading it.
"""

from __future__ import annotations

import logging
import time

import torch

from loraplex.kernels.attention_decode import decode_variants
from loraplex.kernels.dora_scale import warm_up as dora_warm_up
from loraplex.kernels.lora_configs import MANY_ADAPTERS
from loraplex.kernels.lora_meta import segments_block_ts
from loraplex.kernels.placement import triton_runs_on
from loraplex.services.inference.engine.model_runner import ModelRunner
from loraplex.services.inference.engine.scheduled_batch import SeqChunk

log = logging.getLogger(__name__)


def lora_tiers(num_slots: int) -> list[int]:
    """Distinct-adapter counts that reach every LoRA tier: 0 (no LoRA), 1, and MANY_ADAPTERS + 1."""
    if num_slots <= 0:
        return [0]
    return [0, 1] + ([MANY_ADAPTERS + 1] if num_slots > MANY_ADAPTERS else [])


def token_classes(max_num_tokens: int, num_slots: int) -> list[int]:
    """One token count per token-count class a step of up to `max_num_tokens` tokens can be in."""
    from loraplex.kernels.lora_configs import DECODE_MAX_TOKENS

    counts = {min(b, max_num_tokens) for b in segments_block_ts(max_num_tokens, max(num_slots, 1))}
    counts |= {
        t
        for t in (1, 16, 17, DECODE_MAX_TOKENS, DECODE_MAX_TOKENS + 1, max_num_tokens)
        if t <= max_num_tokens
    }
    return sorted(counts)


def warm_up_steps(
    max_num_tokens: int,
    max_num_seqs: int,
    num_slots: int,
    num_kv_heads: int,
    context_length: int,
    page_size: int,
    device: torch.device,
    max_distinct: int | None = None,
    kv_fp8: bool = False,
) -> list[list[SeqChunk]]:
    """The steps `warm_up` runs: every chunk on KV block 0, decodes first (as the runner wants).
    `max_distinct`: the most distinct adapters a step can hold (--max-loras-per-batch; None: the
    slots): a LoRA tier above it is never served, so nothing of it is compiled. `kv_fp8`: the cache
    is FP8 (its decode attention tiles differ)."""
    max_chunk = max(2, context_length - 1)

    def step(num_decodes: int, num_prefill: int, distinct: int) -> list[SeqChunk]:
        """`num_decodes` decodes then `num_prefill` tokens of prefill, over `distinct` adapter slots
        (0: none): decode i takes slot i % distinct, the prefill chunks the last one."""
        chunks = [SeqChunk([0], 0, [0], i % distinct if distinct else -1, True) for i in range(num_decodes)]
        last = distinct - 1 if distinct else -1
        done = 0
        while done < num_prefill:
            size = min(max_chunk, num_prefill - done)
            # token 0 everywhere: only the shapes matter, and any id past a small vocabulary would be
            # out of the embedding table
            chunks.append(SeqChunk([0] * size, 0, [0] * -(-size // page_size), last, True))
            done += size
        return chunks

    steps = []
    # a step holds at most one adapter per sequence
    tiers = lora_tiers(min(num_slots if max_distinct is None else max_distinct, max_num_seqs))
    for n in token_classes(max_num_tokens, num_slots):
        for distinct in tiers:
            if n == 1:
                steps.append(step(1, 0, min(distinct, 1)))
            elif distinct < n:  # the decodes carry distinct - 1 adapters, the prefill (>= 2 tokens) one more
                steps.append(step(max(distinct - 1, 0), n - max(distinct - 1, 0), distinct))
    for b in decode_variants(min(max_num_seqs, max_num_tokens - 2), num_kv_heads, device, kv_fp8).values():
        for distinct in tiers[:2]:
            # b decodes beside a 2-token prefill, unless that would be one sequence too many
            steps.append(step(b, 2 if b < max_num_seqs else 0, distinct))
    return steps


@torch.inference_mode()
def warm_up(runner: ModelRunner, *, max_num_tokens: int, max_num_seqs: int, context_length: int) -> int:
    """Run every warm-up step on `runner` (eagerly: the decode graphs' capture warmed theirs);
    returns how many ran."""
    backend = runner.lora_backend
    pool = getattr(backend, "pool", None)
    num_slots = pool.slots if pool is not None else 0
    max_distinct = backend.max_step_distinct() if pool is not None else 0
    start = time.perf_counter()
    steps = warm_up_steps(
        max_num_tokens,
        max_num_seqs,
        num_slots,
        runner.config.num_kv_heads,
        context_length,
        runner.page_size,
        runner.device,
        max_distinct,
        runner.kv_cache.element_size() == 1,
    )
    experts = getattr(backend, "experts", None)
    if experts is not None:
        backend.experts = _expert_lora_for_warm_up(experts)
    try:
        for chunks in steps:
            runner.forward(chunks)
    finally:
        if experts is not None:
            backend.experts = experts
    if pool is not None and triton_runs_on(runner.device):
        # DoRA's kernel runs only in steps holding a DoRA adapter (none is loaded yet)
        dtype = runner.model.norm.weight.dtype
        dora_warm_up([pool.offsets[g][-1] for g in pool.groups], dtype, runner.device)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    log.info(
        "warmed up %d step shapes (token counts %s, LoRA tiers %s) in %.1f s",
        len(steps),
        token_classes(max_num_tokens, num_slots),
        lora_tiers(max_distinct),
        time.perf_counter() - start,
    )
    return len(steps)


def _expert_lora_for_warm_up(experts):
    """Expert LoRA that computes in every LoRA step of the warm-up. The host-reading mode skips layers
    whose step holds no expert adapter (none is loaded yet), so the grouped expert kernel's delta
    variant would compile at the first served step with one; the graphs mode always computes (zero
    deltas for empty slots) over the same pool."""
    if experts.graph_safe:
        return experts
    from loraplex.services.inference.lora.expert_lora_graph import GraphExpertLoRA

    try:
        return GraphExpertLoRA(experts.pool)
    except ValueError:  # not bfloat16, or a rank the grouped GEMM cannot take: nothing to warm
        return experts
