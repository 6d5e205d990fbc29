"""Child process of tests/integration/test_fp8_kv.py (TRITON_INTERPRET=1): the engine over a tiny
model with `--kv-cache-dtype fp8`, once on the torch attention path and once on the CUDA path's
Triton kernels (store, paged decode, paged prefill, fused ops) run by the interpreter, with
chunked prefill beside running decodes (mixed steps, their piecewise path forced on) and a second
round whose prompts share the first round's prefixes (prefix-cache hits read FP8 blocks written
earlier), with per-layer scales other than 1.0. Prints the greedy tokens of both and how many
cache bytes differ; exits non-zero on a mismatch.

    TRITON_INTERPRET=1 PYTHONPATH=.:protos python -m tests.support.fp8_kv_engine_check MODEL_DIR
"""

from __future__ import annotations

import sys

import torch

from loraplex.kernels.placement import run_triton_on_cpu
from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.types import SamplingParams

FIRST = [list(range(3, 3 + n)) for n in (9, 14, 5)]
SECOND = [FIRST[1][:12] + [40, 41, 42], FIRST[0] + [50]]  # shared prefixes: cached FP8 pages
NEW_TOKENS = 6


def run(model_dir: str, triton: bool) -> tuple[list[list[int]], torch.Tensor, str]:
    run_triton_on_cpu(triton)
    try:
        engine = LLMEngine.from_config(
            EngineConfig(
                model_path=model_dir,
                device=torch.device("cpu"),
                dtype="float32",
                kv_cache_dtype="fp8",
                page_size=4,
                chunked_prefill_size=6,  # prompts arrive in chunks beside running decodes
                max_num_batched_tokens=16,
                max_total_tokens=256,
                context_length=64,
                mixed_graphs=True,
                mixed_cuda_graph_max_tokens=16,
            )
        )
        # calibrated-looking per-layer scales, loaded in place as a calibration would (unit scales
        # would hide a kernel that ignored them)
        layers = engine.runner.kv_cache.shape[0]
        engine.runner.attention.kv_scales.load_(torch.tensor([[0.5, 2.0], [0.25, 1.5]] * (layers // 2)))
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        tokens = [c.token_ids for c in engine.generate(FIRST, params)]
        tokens += [c.token_ids for c in engine.generate(SECOND, params)]
        hits = engine.scheduler.prefix_cache.stats.hit_tokens[""]
        return tokens, engine.runner.kv_cache.clone(), f"{type(engine.runner.attention).__name__} hits={hits}"
    finally:
        run_triton_on_cpu(False)


def main(model_dir: str) -> int:
    want, want_cache, want_path = run(model_dir, triton=False)
    got, got_cache, got_path = run(model_dir, triton=True)
    differ = int((got_cache.view(torch.uint8) != want_cache.view(torch.uint8)).sum())
    written = int((want_cache.view(torch.uint8) != 0).sum())
    print(f"torch path ({want_path}): {want}")
    print(f"triton path ({got_path}): {got}")
    print(f"cache dtype {got_cache.dtype}: {differ} of {written} written bytes differ")
    ok = (
        got == want
        and got_cache.dtype == torch.float8_e4m3fn
        and got_path.startswith("TritonPagedAttention")
        and want_path.startswith("TorchPagedAttention")
        and written > 0
        and "hits=0" not in got_path  # the second round read cached FP8 pages
        and differ <= written // 50  # rounding ties flipped by float32 summation order, no more
    )
    print("ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
