"""Fused element-wise kernels for the decoder layer on CUDA: RMSNorm (alone, or after the residual
add), the q/k/v split with rotary embedding (and the LoRA delta), SiLU-and-mul.

Why: in a CUDA-graph decode step every kernel costs a few microseconds however little it does,
and torch's eager RMSNorm (7 kernels), rotary (6 per tensor) and `silu(gate) * up` (3) made
about 30 of a layer's ~40 kernels. Each function here is one launch and rounds exactly where
the torch code it replaces rounds (services/inference/models/llama.py, rope.py), so results
agree with the torch path to about one unit in the last place of the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_expand import PendingExpand


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    h = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # torch casts back before the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x / rms(x)).to(x.dtype)` over the last dim of a 2-D `x`, as transformers computes it."""
    rows, n = x.shape
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), eps, N=n, BLOCK=block,
                                  num_warps=min(16, max(1, block // 256)))
    return out


@triton.jit
def _add_rms_norm_kernel(h_ptr, y_ptr, d_ptr, w_ptr, h_out_ptr, out_ptr, stride_h, stride_y, stride_d, stride_ho,
                         stride_o, eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = h_out_ptr.dtype.element_ty
    y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:  # the linear's LoRA delta, rounded into its output as the in-place add does
        y = (y + tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)).to(dt).to(tl.float32)
    _add_rms_norm_row(h_ptr, w_ptr, h_out_ptr, out_ptr, row, y, stride_h, stride_ho, stride_o, eps, N, BLOCK)


@triton.jit
def _add_rms_norm_row(h_ptr, w_ptr, h_out_ptr, out_ptr, row, y, stride_h, stride_ho, stride_o, eps,
                      N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = h_out_ptr.dtype.element_ty
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    s = (h + y).to(dt)  # the residual add rounds to the dtype
    tl.store(h_out_ptr + row * stride_ho + offs, s, mask=mask)
    x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * (x * rstd).to(dt).to(tl.float32)).to(dt), mask=mask)


@triton.jit
def _lora_row(y_ptr, ranks_ptr, scal_ptr, slots_ptr, row, stack, sy_s, sy_t, sy_c, sr_s, sr_i, ss_s, ss_i, max_rank,
              DT: tl.constexpr, BLOCK_R: tl.constexpr, N_SPLITS: tl.constexpr):
    """One token's side of a fused LoRA expand for stacked module `stack`: (its slot, the scaling,
    the rank lanes to load, the rank lanes that count, its shrink output rounded to B's dtype `DT`).
    A token without adapter, or a module its adapter does not target, gets rank 0 and scale 0: no
    B bytes are loaded and the delta is 0. Loads past the rank are masked at the rank rounded up to
    8, as in `lora_expand`."""
    slot = tl.load(slots_ptr + row)
    on = slot >= 0
    slot = tl.where(on, slot, 0).to(tl.int64)
    rank = tl.load(ranks_ptr + slot * sr_s + stack * sr_i, mask=on, other=0)
    scale = tl.load(scal_ptr + slot * ss_s + stack * ss_i, mask=on, other=0.0)
    scale = tl.where(rank > 0, scale, 0.0)
    offs_r = tl.arange(0, BLOCK_R)
    k_load = offs_r < tl.minimum((rank + 7) // 8 * 8, max_rank)
    k_real = offs_r < rank
    yv = tl.zeros((BLOCK_R,), dtype=tl.float32)
    y_row = y_ptr + row * sy_t + (stack * max_rank + offs_r) * sy_c
    for p in tl.static_range(N_SPLITS):
        yv += tl.load(y_row + p * sy_s, mask=k_load, other=0.0)
    yv = tl.where(k_real, yv, 0.0).to(DT).to(tl.float32)
    return slot, scale, k_load, k_real, yv


@triton.jit
def _lora_cols(b_ptr, slot, scale, k_load, k_real, yv, cols, mask, sb_s, sb_n, sb_r, BLOCK_R: tl.constexpr):
    """float32 delta over output columns `cols` (B's row index): the slot's B rows times the token's
    `yv` as `lora_expand` computes it (products of B-dtype inputs, fp32 sum, then the scaling)."""
    offs_r = tl.arange(0, BLOCK_R)
    b_rows = b_ptr + slot * sb_s + cols[:, None].to(tl.int64) * sb_n + offs_r[None, :] * sb_r
    bt = tl.load(b_rows, mask=mask[:, None] & k_load[None, :], other=0.0).to(tl.float32)
    return scale * tl.sum(tl.where(k_real[None, :], bt, 0.0) * yv[None, :], axis=1)


@triton.jit
def _add_rms_norm_lora_kernel(h_ptr, y_ptr, ly_ptr, b_ptr, ranks_ptr, scal_ptr, slots_ptr, w_ptr, h_out_ptr,
                              out_ptr, stride_h, stride_y, stride_ho, stride_o, sy_s, sy_t, sy_c, sb_s, sb_n, sb_r,
                              sr_s, ss_s, max_rank, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                              CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, N_SPLITS: tl.constexpr):
    """`_add_rms_norm_kernel` with the group's LoRA expand done here: the delta is computed in
    column chunks (a whole row of B would not fit in registers) and rounded into `y` in place,
    then the row is added and normed as without LoRA, so the result rounds as the unfused path."""
    row = tl.program_id(0)
    dt = h_out_ptr.dtype.element_ty
    slot, scale, k_load, k_real, yv = _lora_row(ly_ptr, ranks_ptr, scal_ptr, slots_ptr, row, 0, sy_s, sy_t, sy_c,
                                                sr_s, 0, ss_s, 0, max_rank, b_ptr.dtype.element_ty, BLOCK_R, N_SPLITS)
    for c in tl.static_range(0, N, CHUNK):  # unrolled: every chunk's B loads can be in flight at once
        offs = c + tl.arange(0, CHUNK)
        mask = offs < N
        d = _lora_cols(b_ptr, slot, scale, k_load, k_real, yv, offs, mask, sb_s, sb_n, sb_r, BLOCK_R)
        y_ptrs = y_ptr + row * stride_y + offs
        tl.store(y_ptrs, (tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + d).to(dt), mask=mask)
    tl.debug_barrier()  # the row's threads read back what the others just wrote
    offs = tl.arange(0, BLOCK)
    y = tl.load(y_ptr + row * stride_y + offs, mask=offs < N, other=0.0).to(tl.float32)
    _add_rms_norm_row(h_ptr, w_ptr, h_out_ptr, out_ptr, row, y, stride_h, stride_ho, stride_o, eps, N, BLOCK)


def add_rms_norm(
    h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
    delta: torch.Tensor | PendingExpand | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h + y` (y plus its LoRA `delta` first, when given) and `rms_norm` of that, in one launch: the
    residual add before each RMSNorm of a decoder layer. `delta`: a float32 tensor of y's shape, or
    the `PendingExpand` of a one-module group, whose expand then runs here and is added to `y` in
    place (last dim contiguous). Returns (new h, normed)."""
    rows, n = h.shape
    h_out, out = torch.empty_like(h), torch.empty_like(h)
    if not rows:
        return h_out, out
    block = triton.next_power_of_2(n)
    warps = min(16, max(1, block // 256))
    if isinstance(delta, PendingExpand):
        ly = delta.y if delta.y.dim() == 3 else delta.y.unsqueeze(0)
        b, ranks, scal = delta.b, delta.ranks, delta.scalings
        _add_rms_norm_lora_kernel[(rows,)](
            h, y, ly, b, ranks, scal, delta.segs.token_slots, weight, h_out, out, h.stride(0), y.stride(0),
            h_out.stride(0), out.stride(0), ly.stride(0), ly.stride(1), ly.stride(2), b.stride(0), b.stride(1),
            b.stride(2), ranks.stride(0), scal.stride(0), b.shape[2], eps, N=n, BLOCK=block,
            CHUNK=min(block, 512), BLOCK_R=max(16, triton.next_power_of_2(b.shape[2])), N_SPLITS=ly.shape[0],
            num_warps=warps)
        return h_out, out
    d = delta if delta is not None else y
    _add_rms_norm_kernel[(rows,)](h, y, d, weight, h_out, out, h.stride(0), y.stride(0), d.stride(0),
                                  h_out.stride(0), out.stride(0), eps, N=n, BLOCK=block,
                                  HAS_DELTA=delta is not None, num_warps=warps)
    return h_out, out


def add_rms_norm_ref(
    h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
    delta: torch.Tensor | PendingExpand | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(delta, PendingExpand):
        delta = delta.delta()
    if delta is not None:
        y = (y.float() + delta).to(y.dtype)
    h = h + y
    return h, rms_norm_ref(h, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@triton.jit
def _qkv_rotary_kernel(qkv_ptr, d_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, stride_t, stride_dt, stride_ct,
                       stride_qt, stride_kt, stride_vt, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DELTA: tl.constexpr):
    t = tl.program_id(0)
    part = tl.program_id(1)  # 0: q, 1: k (both rotated), 2: v (only its LoRA delta added)
    dim = 2 * HALF
    heads = tl.where(part == 0, Q_HEADS, KV_HEADS)
    col0 = tl.where(part == 0, 0, tl.where(part == 1, Q_HEADS * dim, (Q_HEADS + KV_HEADS) * dim))
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HALF)
    cols = col0 + offs_h[:, None] * dim + offs_d[None, :]
    x1 = tl.load(qkv_ptr + t * stride_t + cols, mask=mask, other=0.0)
    x2 = tl.load(qkv_ptr + t * stride_t + cols + HALF, mask=mask, other=0.0)
    dt = q_ptr.dtype.element_ty
    if HAS_DELTA:  # the projection's LoRA delta, rounded in as the in-place add does
        x1 = (x1.to(tl.float32) + tl.load(d_ptr + t * stride_dt + cols, mask=mask, other=0.0)).to(dt)
        x2 = (x2.to(tl.float32) + tl.load(d_ptr + t * stride_dt + cols + HALF, mask=mask, other=0.0)).to(dt)
    heads_d = offs_h[:, None] * dim + offs_d[None, :]
    if part == 2:
        tl.store(v_ptr + t * stride_vt + heads_d, x1, mask=mask)
        tl.store(v_ptr + t * stride_vt + heads_d + HALF, x2, mask=mask)
    else:
        c = tl.load(cos_ptr + t * stride_ct + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
        s = tl.load(sin_ptr + t * stride_ct + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
        # torch rounds each product and each sum to the tensor dtype: do the same.
        a = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
        b = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
        if part == 0:
            tl.store(q_ptr + t * stride_qt + heads_d, a, mask=mask)
            tl.store(q_ptr + t * stride_qt + heads_d + HALF, b, mask=mask)
        else:
            tl.store(k_ptr + t * stride_kt + heads_d, a, mask=mask)
            tl.store(k_ptr + t * stride_kt + heads_d + HALF, b, mask=mask)


@triton.jit
def _qkv_rotary_lora_kernel(qkv_ptr, y_ptr, b_ptr, ranks_ptr, scal_ptr, slots_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr,
                            v_ptr, stride_t, sy_s, sy_t, sy_c, sb_s, sb_n, sb_r, sr_s, sr_i, ss_s, ss_i,
                            stride_ct, stride_qt, stride_kt, stride_vt, max_rank,
                            Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, N_SPLITS: tl.constexpr):
    """`_qkv_rotary_kernel` with the q/k/v LoRA expand done here, one program per (token, head):
    the head's columns of B times the token's shrink output, rounded into q/k/v as the in-place
    expand rounds (fp32 products of B-dtype inputs, fp32 sum, `dtype(float(x) + scale * sum)`)."""
    t = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads: the fused projection's order
    part = (head >= Q_HEADS).to(tl.int32) + (head >= Q_HEADS + KV_HEADS).to(tl.int32)
    in_part = head - tl.where(part == 0, 0, tl.where(part == 1, Q_HEADS, Q_HEADS + KV_HEADS))
    dim = 2 * HALF
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    cols = head * dim + offs_d
    x1 = tl.load(qkv_ptr + t * stride_t + cols, mask=d_mask, other=0.0)
    x2 = tl.load(qkv_ptr + t * stride_t + cols + HALF, mask=d_mask, other=0.0)
    dt = q_ptr.dtype.element_ty
    slot, scale, k_load, k_real, yv = _lora_row(y_ptr, ranks_ptr, scal_ptr, slots_ptr, t, part, sy_s, sy_t, sy_c,
                                                sr_s, sr_i, ss_s, ss_i, max_rank, b_ptr.dtype.element_ty,
                                                BLOCK_R, N_SPLITS)
    x1 = (x1.to(tl.float32) + _lora_cols(b_ptr, slot, scale, k_load, k_real, yv, cols, d_mask, sb_s, sb_n, sb_r,
                                         BLOCK_R)).to(dt)
    x2 = (x2.to(tl.float32) + _lora_cols(b_ptr, slot, scale, k_load, k_real, yv, cols + HALF, d_mask, sb_s, sb_n,
                                         sb_r, BLOCK_R)).to(dt)
    head_d = in_part * dim + offs_d
    if part == 2:
        tl.store(v_ptr + t * stride_vt + head_d, x1, mask=d_mask)
        tl.store(v_ptr + t * stride_vt + head_d + HALF, x2, mask=d_mask)
    else:
        c = tl.load(cos_ptr + t * stride_ct + offs_d, mask=d_mask, other=0.0)
        s = tl.load(sin_ptr + t * stride_ct + offs_d, mask=d_mask, other=0.0)
        a = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
        b = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
        if part == 0:
            tl.store(q_ptr + t * stride_qt + head_d, a, mask=d_mask)
            tl.store(q_ptr + t * stride_qt + head_d + HALF, b, mask=d_mask)
        else:
            tl.store(k_ptr + t * stride_kt + head_d, a, mask=d_mask)
            tl.store(k_ptr + t * stride_kt + head_d + HALF, b, mask=d_mask)


def qkv_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
    delta: torch.Tensor | PendingExpand | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused q/k/v projection `[T, (q_heads + 2 kv_heads) * head_dim]` (last dim contiguous)
    into q, k, v `[T, heads, head_dim]` with the half-split rotary applied to q and k (`cos`/`sin`
    `[T, head_dim/2]` in qkv's dtype), after adding the projection's LoRA delta when given: a float32
    tensor of qkv's width (any row stride), or a `PendingExpand` whose expand then runs here. One
    launch. q and k are new tensors; v is a view of `qkv` without a delta, else a new tensor."""
    tokens, width = qkv.shape
    dim = width // (q_heads + 2 * kv_heads)
    half = dim // 2
    q = torch.empty((tokens, q_heads, dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((tokens, kv_heads, dim), dtype=qkv.dtype, device=qkv.device)
    if delta is None:
        v = qkv[:, (q_heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    else:
        v = torch.empty((tokens, kv_heads, dim), dtype=qkv.dtype, device=qkv.device)
    if not tokens:
        return q, k, v
    cos, sin = cos.contiguous(), sin.contiguous()
    if isinstance(delta, PendingExpand):
        y = delta.y if delta.y.dim() == 3 else delta.y.unsqueeze(0)
        b, ranks, scal, max_rank = delta.b, delta.ranks, delta.scalings, delta.b.shape[2]
        _qkv_rotary_lora_kernel[(tokens, q_heads + 2 * kv_heads)](
            qkv, y, b, ranks, scal, delta.segs.token_slots, cos, sin, q, k, v, qkv.stride(0),
            y.stride(0), y.stride(1), y.stride(2), b.stride(0), b.stride(1), b.stride(2),
            ranks.stride(0), ranks.stride(1), scal.stride(0), scal.stride(1),
            cos.stride(0), q.stride(0), k.stride(0), v.stride(0), max_rank,
            Q_HEADS=q_heads, KV_HEADS=kv_heads, HALF=half, BLOCK_D=triton.next_power_of_2(half),
            BLOCK_R=max(16, triton.next_power_of_2(max_rank)), N_SPLITS=y.shape[0], num_warps=2)
        return q, k, v
    d = qkv if delta is None else delta
    _qkv_rotary_kernel[(tokens, 2 if delta is None else 3)](
        qkv, d, cos, sin, q, k, v, qkv.stride(0), d.stride(0), cos.stride(0), q.stride(0), k.stride(0),
        v.stride(0), Q_HEADS=q_heads, KV_HEADS=kv_heads, HALF=half, BLOCK_H=triton.next_power_of_2(q_heads),
        BLOCK_D=triton.next_power_of_2(half), HAS_DELTA=delta is not None, num_warps=4)
    return q, k, v


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def qkv_rotary_ref(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
    delta: torch.Tensor | PendingExpand | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch code `qkv_rotary` replaces: in-place delta add, split, rotary of q and k."""
    if isinstance(delta, PendingExpand):
        delta = delta.delta()
    if delta is not None:
        qkv = qkv.clone().add_(delta)
    tokens, width = qkv.shape
    dim = width // (q_heads + 2 * kv_heads)
    q, k, v = qkv.split((q_heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    return (rotary_ref(q.reshape(tokens, q_heads, dim), cos, sin),
            rotary_ref(k.reshape(tokens, kv_heads, dim), cos, sin), v.reshape(tokens, kv_heads, dim))


@triton.jit
def _silu_mul_kernel(x_ptr, d_ptr, out_ptr, stride_x, stride_d, stride_o, N: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_DELTA: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if HAS_DELTA:  # gate_up's LoRA delta, rounded in as the in-place add does
        g = (g + tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)).to(dt).to(tl.float32)
        u = (u + tl.load(d_ptr + row * stride_d + N + offs, mask=mask, other=0.0)).to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # torch's silu rounds before the mul
    tl.store(out_ptr + row * stride_o + offs, (act * u).to(dt), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up` = `[T, 2 * inter]` (gate first, as the fused linear stacks them),
    plus its float32 LoRA `delta` (same shape) first, when given."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        d = delta if delta is not None else gate_up
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, d, out, gate_up.stride(0), d.stride(0),
                                                       out.stride(0), N=n, BLOCK=block, HAS_DELTA=delta is not None,
                                                       num_warps=4)
    return out


def silu_and_mul_ref(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    if delta is not None:
        gate_up = (gate_up.float() + delta).to(gate_up.dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
