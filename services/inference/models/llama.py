"""The shared decoder over a paged KV cache: Llama 2/3.x, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3 (text) and Phi-3/Phi-4. What sets a family apart is a named switch of models/families.py
(`cfg.family`): q/k norms, (1 + weight) norms, the sandwich norms around attention and the MLP,
scaled embeddings, GeGLU, a local rope for sliding-window layers, fused checkpoint tensors; the
attention's windows and soft-capping live in the Attention object (engine/attention*.py).

Linears are fused per LoRA group (`qkv`, `o`, `gate_up`, `down`, see lora/backend.py GROUPS);
around each group's base matmul the LoRA backend, when the batch has adapters, computes its
delta: added in place, or (the side-stream backend) handed back as a float32 `Addend.delta`
that the next fused kernel adds (the q/k/v split with rotary, the RMSNorm after the residual
add, SiLU-and-mul). A layer returns its down projection unadded, so the residual add fuses with
the next layer's norm.
The linears, norms and `Addend` are models/layers.py's. Checkpoint tensors are copied straight into the
fused parameters by `load_weights` (models/checkpoint_load.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels.fp8_quant import QuantizedRows
from loraplex.kernels.fused_ops import silu_and_mul
from loraplex.kernels.placement import triton_runs_on
from loraplex.kernels.qkv_rotary import qkv_rotary, qkv_rotary_ref
from loraplex.kernels.skinny_gemm import skinny_gated, skinny_serves
from loraplex.services.inference.models.checkpoint_load import PROJECTIONS, load_checkpoint
from loraplex.services.inference.models.config import ModelConfig
from loraplex.services.inference.models.context import ForwardContext
from loraplex.services.inference.models.layers import Addend, FusedLinear, RMSNorm, empty_param
from loraplex.services.inference.models.moe import SparseMoE
from loraplex.services.inference.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from loraplex.services.inference.lora.backend import LoRABackend


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        family = cfg.family
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)  # the MLP's input norm
        # Qwen3 / Gemma 3: q and k normalised per head before rotary.
        self.q_norm = _norm(cfg, cfg.head_dim) if family.qk_norm else None
        self.k_norm = _norm(cfg, cfg.head_dim) if family.qk_norm else None
        # Gemma 2/3: attention and MLP outputs normalised before their residual adds.
        self.attn_output_norm = _norm(cfg, cfg.hidden_size) if family.sandwich_norms else None
        self.mlp_output_norm = _norm(cfg, cfg.hidden_size) if family.sandwich_norms else None
        self.activation = cfg.activation
        # Gemma 3: sliding-window layers read the second (local) rope table.
        self.rope_table = 1 if cfg.local_rope is not None and cfg.window_of(index) is not None else 0
        self.qkv_proj = FusedLinear(cfg.hidden_size, (cfg.q_size, cfg.kv_size, cfg.kv_size), cfg.qkv_bias)
        self.o_proj = FusedLinear(cfg.q_size, (cfg.hidden_size,), cfg.o_bias)
        inter = cfg.intermediate_size
        self.inter = inter
        # Mixtral / Qwen3-MoE: the experts in place of the dense MLP (Qwen3-MoE keeps a dense MLP in
        # its `mlp_only_layers`); LoRA reaches attention and the experts there (lora/expert_lora.py).
        self.moe = None
        if cfg.layer_is_sparse(index):
            self.moe = SparseMoE(
                cfg.hidden_size, cfg.moe, cfg.activation, float_weights=family.moe == "mixtral"
            )
            self.gate_up_proj = self.down_proj = None
        else:
            self.gate_up_proj = FusedLinear(cfg.hidden_size, (inter, inter), cfg.mlp_bias)
            self.down_proj = FusedLinear(inter, (cfg.hidden_size,), cfg.mlp_bias)

    def _linear(
        self,
        group: str,
        module: FusedLinear,
        x: torch.Tensor,
        ctx: ForwardContext,
        xq: QuantizedRows | None = None,
    ) -> Addend:
        """`xq`: x quantized per token for an FP8 base's GEMM (`module.input_quant`), filled with x."""
        lora = ctx.lora
        base = module if xq is None else partial(module, xq=xq)
        if lora is None:
            return Addend(base(x))
        # The backend may compute the delta while the base matmul runs (lora/triton_backend.py).
        started = lora.begin(self.index, group, x)
        out = base(x)
        delta = lora.finish(self.index, group, x, out, started)
        if lora.dora_step:  # a step holding a DoRA adapter's tokens (lora/dora.py)
            return Addend(lora.dora(self.index, group, out, delta, module.bias))
        return Addend(out, delta)

    def forward(
        self,
        h: torch.Tensor,
        addend: Addend | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, Addend]:
        """`addend`: the previous layer's down projection, added to `h` here (None for the first
        layer). Returns the residual stream and this layer's own down projection, not yet added."""
        # The split-and-rotary launch stores k/v itself where Triton runs (None: not here)
        target = ctx.attention.fused_store_target(self.index) if triton_runs_on(h) else None
        h, q, k, v = self.pre_attention(h, addend, cos, sin, ctx, kv_cache=target)
        if target is not None:
            attn = ctx.attention.attend(self.index, q)
        else:
            attn = ctx.attention.forward(self.index, q, k, v)
        return self.post_attention(h, attn, ctx)

    def pre_attention(
        self,
        h: torch.Tensor,
        addend: Addend | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        bufs: StepBuffers | None = None,
        kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Residual add + norm, q/k/v projection, split and rotary: (h, q, k, v). With `bufs`, h, q, k
        and v are written into those static buffers (what a CUDA-graph piece leaves for the next).
        `kv_cache` (Attention.fused_store_target): k and v go straight into the cache (k, v None)."""
        xq = self.qkv_proj.input_quant(h)
        h, x = self.input_layernorm.add_forward(h, addend, h_out=None if bufs is None else bufs.h, quant=xq)
        qkv = self._linear("qkv", self.qkv_proj, x, ctx, xq)
        if cos.dim() == 3:  # two rope tables (global, local): this layer's
            cos, sin = cos[self.rope_table], sin[self.rope_table]
        out = None if bufs is None else (bufs.q, bufs.k, bufs.v)
        qk_norm = None
        if self.q_norm is not None:  # Qwen3 / Gemma 3: per-head q/k norms, inside the same launch
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.unit_offset)
        # Split, delta, q/k norms and rotary: one launch on CUDA, the torch code it replaces elsewhere.
        split_rotary = qkv_rotary if triton_runs_on(qkv.out) else qkv_rotary_ref
        q, k, v = split_rotary(
            qkv.out,
            cos,
            sin,
            self.num_heads,
            self.num_kv_heads,
            qkv.delta,
            out=out,
            qk_norm=qk_norm,
            kv_cache=kv_cache,
        )
        return h, q, k, v

    def post_attention(
        self, h: torch.Tensor, attn: torch.Tensor, ctx: ForwardContext, bufs: StepBuffers | None = None
    ) -> tuple[torch.Tensor, Addend]:
        """o projection, residual add + norm, the MLP: (h, the down projection not yet added)."""
        o = self._linear("o", self.o_proj, attn, ctx)
        if self.attn_output_norm is not None:
            o = Addend(self.attn_output_norm(o.materialize()))
        xq = None if self.moe is not None else self.gate_up_proj.input_quant(h)
        h, x = self.post_attention_layernorm.add_forward(
            h, o, h_out=None if bufs is None else bufs.h, quant=xq
        )
        if self.moe is not None:
            return h, Addend(self.moe(x, None if ctx.lora is None else ctx.lora.expert_layer(self.index)))
        weight = self.gate_up_proj.weight
        plain = ctx.lora is None or not ctx.lora.targets("gate_up")
        if plain and type(self.gate_up_proj) is FusedLinear and skinny_serves(x, weight):
            # The matmul and SwiGLU / GeGLU in one launch (no delta to add between)
            act = skinny_gated(x, weight, self.gate_up_proj.bias, self.activation)
            return h, self._down(act, ctx)
        gate_up = self._linear("gate_up", self.gate_up_proj, x, ctx, xq)
        xq = None
        if triton_runs_on(gate_up.out):  # SwiGLU or GeGLU, one launch
            xq = self.down_proj.input_quant(gate_up.out)
            act = silu_and_mul(gate_up.out, gate_up.delta, self.activation, xq)
        else:
            gate, up = gate_up.materialize().split((self.inter, self.inter), dim=-1)
            act = (F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")) * up
        return h, self._down(act, ctx, xq)

    def _down(self, act: torch.Tensor, ctx: ForwardContext, xq: QuantizedRows | None = None) -> Addend:
        down = self._linear("down", self.down_proj, act, ctx, xq)
        if self.mlp_output_norm is not None:
            down = Addend(self.mlp_output_norm(down.materialize()))
        return down


def _norm(cfg: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, cfg.rms_norm_eps, unit_offset=cfg.family.norm_unit_offset)


class StepBuffers(NamedTuple):
    """Static tensors a piecewise step passes between its CUDA-graph pieces and the eager attention
    (views of the step's bucket: `[T, hidden]`, `[T, heads, head_dim]`, `[T, kv_heads, head_dim]` x2)."""

    h: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class LlamaForCausalLM(nn.Module):
    """Serves every architecture of models/families.py (the name is the family it started from)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = _norm(cfg, cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else empty_param(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.local_rotary = None if cfg.local_rope is None else RotaryEmbedding(cfg.local_rope, cfg.head_dim)
        self.embed_scale = cfg.hidden_size**0.5 if cfg.family.embed_scale else None

    def embed(self, input_ids: torch.Tensor, lora: LoRABackend | None = None) -> torch.Tensor:
        """`lora`: the step's backend, whose adapters' embedding parts (on a kinds step: lora/vocab_tables.py)
        are applied before a Gemma's scale (PEFT scales them too); None where the step has no LoRA."""
        h = self.embed_tokens(input_ids)
        if lora is not None:
            h = lora.add_embedding(h, input_ids)
        if self.embed_scale is not None:  # Gemma: times sqrt(hidden) rounded to the model dtype
            # (a host scalar: no device tensor is made inside a CUDA-graph capture)
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype).item()
        return h

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, head_dim/2]`; with a local rope `[2, T, head_dim/2]` (global, local), each
        layer picking its own (`DecoderLayer.rope_table`)."""
        cos, sin = self.rotary.cos_sin(positions, dtype)
        if self.local_rotary is None:
            return cos, sin
        local_cos, local_sin = self.local_rotary.cos_sin(positions, dtype)
        return torch.stack((cos, local_cos)), torch.stack((sin, local_sin))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed)."""
        h = self.embed(input_ids, ctx.lora)
        cos, sin = self.rope_tables(positions, h.dtype)
        addend = None
        for layer in self.layers:
            h, addend = layer(h, addend, cos, sin, ctx)
        return self.norm.add_forward(h, addend)[1]

    # The forward cut at attention: piece 0, attention 0, piece 1, ..., attention L-1, piece L
    # (engine/mixed_graphs.py captures each piece as a CUDA graph and runs attention between them).
    def first_piece(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, bufs: StepBuffers
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding, rotary tables and layer 0 up to attention (into `bufs`); returns (cos, sin)."""
        h = self.embed(input_ids)
        cos, sin = self.rope_tables(positions, h.dtype)
        self.layers[0].pre_attention(h, None, cos, sin, ctx, bufs)
        return cos, sin

    def middle_piece(
        self,
        index: int,
        attn: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        bufs: StepBuffers,
    ) -> None:
        """Layer `index - 1` after its attention (`attn`), then layer `index` up to attention (into
        `bufs`)."""
        h, addend = self.layers[index - 1].post_attention(bufs.h, attn, ctx, bufs)
        self.layers[index].pre_attention(h, addend, cos, sin, ctx, bufs)

    def last_piece(
        self, attn: torch.Tensor, ctx: ForwardContext, bufs: StepBuffers, out: torch.Tensor
    ) -> None:
        """The last layer after its attention and the final norm, into `out` `[T, hidden]`."""
        h, addend = self.layers[-1].post_attention(bufs.h, attn, ctx, bufs)
        self.norm.add_forward(h, addend, h_out=bufs.h, out=out)

    def lora_base_weight(self, layer: int, module: str) -> torch.Tensor:
        """The base rows `[out, in]` of one LoRA-targetable projection (`q_proj`, ...; an FP8 base's
        dequantized to float32): what DoRA's per-row norms are computed from (lora/dora.py)."""
        attr, index = PROJECTIONS[module]
        fused: FusedLinear = getattr(self.layers[layer], attr)
        dequantized = getattr(fused, "dequantized", None)  # models/quantization/fp8_linear.py
        weight = fused.weight if dequantized is None else dequantized(torch.float32)
        start = fused.offsets[index]
        return weight[start : start + fused.out_sizes[index]]

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None, lora: LoRABackend | None = None
    ) -> torch.Tensor:
        """float32 logits; `out`: write them there (one conversion kernel instead of a convert and a copy).
        `lora`: a kinds step's backend, whose adapters' lm_head parts are applied before the soft-cap."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        logits = F.linear(hidden, weight)
        if lora is not None:
            logits = lora.add_head(logits, hidden)
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2, in the model dtype as transformers computes it
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if out is None else out.copy_(logits)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into our (fused) parameters; refuse gaps and strangers
        (models/checkpoint_load.py)."""
        load_checkpoint(self, weights)
