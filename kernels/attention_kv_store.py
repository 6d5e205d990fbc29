"""Write a step's new K and V rows into the paged cache, one launch for both; slot < 0 is skipped.

`slot_mapping[t]` is the flat slot `page * page_size + offset` of token `t`. Skipping negative
slots lets CUDA-graph padding rows (slot -1) run the same launch without touching real pages,
which an `index_copy_` cannot do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_ct,
    stride_ch,
    stride_vcp,
    stride_vct,
    stride_vch,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(
        k_cache_ptr + page * stride_cp + offset * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :],
        k,
        mask=mask,
    )
    tl.store(
        v_cache_ptr
        + page * stride_vcp
        + offset * stride_vct
        + offs_h[:, None] * stride_vch
        + offs_d[None, :],
        v,
        mask=mask,
    )


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v `[T, kv_heads, head_dim]` into caches `[num_pages, page_size, kv_heads, head_dim]`."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k, v and the caches need a contiguous last dimension")
    _store_kv_kernel[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=k_cache.shape[1],
        num_warps=2,
    )


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference: the same writes with index_copy_ over the rows whose slot is >= 0."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep])
