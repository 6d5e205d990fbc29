"""Rank pages inside the KV cache's blocks (issue 57, stage B, lora/unified.py): the fit of a page in
KV blocks for real shapes, and the pool's tensors as views of the cache computing what the pool's own
buffers compute, for a cache in the adapters' dtype and for an FP8 cache (1-byte elements)."""

from __future__ import annotations

import pytest
import torch

from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes
from loraplex.services.inference.lora.unified import fit_page, kv_chunk_bytes, page_views, part_bytes
from tests.unit.test_lora_pages import check_backend
from tests.unit.test_lora_pool_backend import SHAPES, random_adapter

LLAMA_8B = ModelShapes(num_layers=32, hidden_size=4096, intermediate_size=14336, q_size=4096, kv_size=1024)
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize(
    ("kv_dtype", "modules", "blocks"),
    [
        (torch.bfloat16, ALL_MODULES, 21),  # 1.25 MiB per layer in 21 blocks of 2 x 32 KiB: 4.8% unused
        (torch.bfloat16, QKVO, 7),
        (torch.float8_e4m3fn, ALL_MODULES, 42),
        (torch.float8_e4m3fn, QKVO, 14),
    ],
)
def test_llama_8b_rank_page_fits_in_few_kv_blocks(kv_dtype, modules, blocks):
    chunk = kv_chunk_bytes(16, 8, 128, kv_dtype)
    fit = fit_page(LLAMA_8B, 64, modules, torch.bfloat16, chunk)
    assert fit.blocks == blocks and fit.waste < 0.08
    # the parts never overlap and stay inside their half of the run
    sizes = part_bytes(LLAMA_8B, 64, modules, torch.bfloat16)
    spans = sorted((half, off, off + sizes[key]) for key, (half, off) in fit.parts.items())
    for (h0, _, end0), (h1, start1, _) in zip(spans, spans[1:], strict=False):
        assert h0 != h1 or end0 <= start1
    assert all(end <= fit.blocks * chunk for _, _, end in spans)
    assert sum(sizes.values()) == fit.page_bytes


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_pool_in_kv_blocks_computes_as_its_own_buffers(kv_dtype):
    L, page, kv_heads, head_dim = SHAPES.num_layers, 4, 2, 8
    fit = fit_page(SHAPES, 16, ALL_MODULES, torch.float32, kv_chunk_bytes(page, kv_heads, head_dim, kv_dtype))
    num_pages, num_blocks = 7, 8 * fit.blocks + 3  # the blocks past the pages' runs stay the cache's alone
    kv = torch.zeros(L, 2, num_blocks, page, kv_heads, head_dim, dtype=kv_dtype)
    lora_a, lora_b = page_views(kv, fit, SHAPES, 16, ALL_MODULES, torch.float32, num_pages)
    pool = AdapterPool(
        SHAPES,
        slots=4,
        max_rank=16,
        target_modules=ALL_MODULES,
        dtype=torch.float32,
        device="cpu",
        num_pages=num_pages,
    )
    own = AdapterPool(
        SHAPES, slots=4, max_rank=16, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
    )
    pool.adopt(lora_a, lora_b)
    adapters = {
        s: random_adapter(SHAPES, list(ALL_MODULES), rank=r, seed=s) for s, r in enumerate((4, 8, 16, 12))
    }
    for slot, weights in adapters.items():
        pool.upload(slot, weights)
        own.upload(slot, weights)
    check_backend(pool, adapters)
    for g in pool.groups:  # the same rows, read through the same page table
        for slot in adapters:
            pages = pool.host_pages[slot]
            assert torch.equal(pool.lora_a[g][:, pages], own.lora_a[g][:, own.host_pages[slot]])
            assert torch.equal(pool.lora_b[g][:, pages], own.lora_b[g][:, own.host_pages[slot]])
    # the uploads wrote into the cache's blocks of the pages' runs, and nowhere else
    used = {
        b for s in adapters for p in pool.host_pages[s] for b in range(p * fit.blocks, (p + 1) * fit.blocks)
    }
    raw = kv.view(torch.uint8).view(L, 2, num_blocks, -1)
    written = {b for b in range(num_blocks) if bool(raw[:, :, b].any())}
    assert written and written <= used
    with pytest.raises(RuntimeError, match="no adapter"):
        pool.adopt(lora_a, lora_b)
