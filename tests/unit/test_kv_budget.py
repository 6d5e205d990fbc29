"""A --max-total-tokens beyond what the device holds is refused at start, naming the flag and the
largest value that fits (issue 32, item 10): the arithmetic here on the CPU, the real refusal on
a GPU (skipped without CUDA)."""

from __future__ import annotations

import re

import pytest
import torch

from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.kv_cache import check_forced_kv_budget, largest_kv_tokens
from loraplex.services.inference.lora.settings import LoRAConfig

GIB = 2**30


def test_largest_fit_leaves_the_pool_and_the_headroom():
    # 10 GiB free of 80, pool 1 GiB, 0.9 static -> headroom 8 GiB: 1 GiB left = 2**30 / 2**16 tokens.
    largest = largest_kv_tokens(2**16, 16, 10 * GIB, 80 * GIB, 0.9, 1 * GIB)
    assert largest == pytest.approx(2**14, abs=16) and largest % 16 == 0
    assert largest_kv_tokens(2**16, 16, 1 * GIB, 80 * GIB, 0.9, 1 * GIB) == 0


def test_a_budget_that_fits_passes_and_one_page_more_is_refused():
    args = dict(per_token=2**16, page_size=16, free=10 * GIB, total=80 * GIB, mem_fraction_static=0.9)
    largest = largest_kv_tokens(reserved_bytes=GIB, **args)
    check_forced_kv_budget(largest, reserved_bytes=GIB, **args)
    with pytest.raises(MemoryError) as caught:
        check_forced_kv_budget(largest + 16, reserved_bytes=GIB, **args)
    message = str(caught.value)
    assert "--max-total-tokens" in message and f"--max-total-tokens {largest}" in message
    assert "--mem-fraction-static" in message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_refuses_a_kv_budget_beyond_its_memory(tiny_llama_path):
    from loraplex.services.inference.engine.build import build_engine

    free, _total = torch.cuda.mem_get_info()
    config = EngineConfig(
        model_path=str(tiny_llama_path), device="cuda", max_total_tokens=free
    )  # >= 1 byte/token
    with pytest.raises(MemoryError) as caught:
        build_engine(config, LoRAConfig())
    largest = int(re.search(r"largest that fits is --max-total-tokens (\d+)", str(caught.value)).group(1))
    assert 0 < largest < free
