"""A ModelRunner over a random-weight model of any shape and family, in memory (no files), with an
adapter pool of random adapters and the Triton LoRA backend: what the mixed-step benchmark, the
compile check, the mixed-graph check and the families benchmark drive. Tiny shapes (TINY) run on the
CPU (Triton under the interpreter); the Llama-3.1-8B shape (bench/serving_setup.py's LLAMA_8B) and
the FAMILY_SHAPES on the GPU.
"""

from __future__ import annotations

import torch

from loraplex.services.inference.engine.kv_cache import allocate_kv_cache
from loraplex.services.inference.engine.model_runner import ModelRunner
from loraplex.services.inference.lora.backend_check import MODULE_SETS, random_adapter
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.shapes import ALL_MODULES, ATTN_MODULES, ModelShapes
from loraplex.services.inference.lora.torch_backend import TorchLoRABackend
from loraplex.services.inference.lora.triton_backend import TritonLoRABackend
from loraplex.services.inference.models.config import ModelConfig, parse_config
from loraplex.services.inference.models.llama import LlamaForCausalLM
from loraplex.services.inference.models.loader import default_dtype
from loraplex.services.inference.models.quantization.fp8_linear import quantize_loaded

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
)


# config.json keys that switch a family's features on, for tiny random models (windows shorter than
# the checks' contexts, soft-capping small enough to bite).
TINY_FAMILIES = {
    "llama": {},
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        head_dim=16,
        sliding_window=8,
        use_sliding_window=True,
        max_window_layers=1,
    ),
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"],
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=6.0,
        hidden_activation="gelu_pytorch_tanh",
    ),
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=32,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "full_attention"],
        rope_local_base_freq=100.0,
    ),
    "phi3": dict(architectures=["Phi3ForCausalLM"], sliding_window=8),
    # mixture of experts: 8 experts, top-2; Qwen3-MoE with a dense layer 1 (`mlp_only_layers`)
    "mixtral": dict(architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
}
# Real shapes of the families' common fine-tuning bases (random weights; the GPU benchmarks).
FAMILY_SHAPES = {
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        rope_theta=1000000.0,
    ),
    "gemma2-9b": dict(
        architectures=["Gemma2ForCausalLM"],
        hidden_size=3584,
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        intermediate_size=14336,
        vocab_size=256000,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
}


def model_config(shape: dict, context_length: int) -> ModelConfig:
    """`shape` may name another family (`architectures` and its keys, TINY_FAMILIES / FAMILY_SHAPES)."""
    return parse_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "max_position_embeddings": context_length,
            **shape,
        }
    )


@torch.inference_mode()
def random_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(cfg)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            # small where a matmul sums over many inputs (a real model's scale), so activations stay finite
            wide = (p.dim() == 2 and p.shape[0] > 1024) or (p.dim() == 3 and p.shape[-1] > 1024)  # 3: experts
            p.data.normal_(0, 0.02 if wide else 0.2)
    return model


def build_runner(
    shape: dict,
    *,
    dtype: torch.dtype,
    device: torch.device,
    slots: int,
    rank: int,
    max_num_tokens: int,
    max_num_seqs: int,
    context_length: int = 2048,
    page_size: int = 16,
    num_blocks: int | None = None,
    side_stream: bool | None = None,
    seed: int = 0,
    lora_backend: str = "triton",
    fp8: bool = False,
    kv_dtype: torch.dtype | None = None,
    target_modules: tuple[str, ...] | None = None,
) -> ModelRunner:
    """A runner with `slots` random adapters of rank <= `rank` resident (slots 0: no LoRA backend).
    `lora_backend` "torch": the CPU backend (no Triton interpreter needed). `fp8`: the base linears
    quantized to FP8 E4M3 per output channel (models/quantization/), adapters in `dtype`. A
    mixture-of-experts shape gets adapters on q/k/v/o, all that LoRA reaches on such a base.
    `kv_dtype`: the KV cache's element type (default `dtype`; torch.float8_e4m3fn: an FP8 cache).
    `target_modules`: the pool's modules (default: every module, q/k/v/o on a mixture of experts);
    each adapter targets its share of them."""
    cfg = model_config(shape, context_length)
    model = random_model(cfg, dtype, device, seed)
    if fp8:
        quantize_loaded(model)
    blocks = num_blocks or (max_num_seqs + 4) * (-(-context_length // page_size))
    kv_cache = allocate_kv_cache(cfg, blocks, page_size, kv_dtype or dtype, device)
    backend = None
    if slots:
        shapes = ModelShapes(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            q_size=cfg.q_size,
            kv_size=cfg.kv_size,
            fused_checkpoint=cfg.family.fused_checkpoint,
            moe=cfg.is_moe,
            vocab_size=cfg.vocab_size,  # the vocabulary tables (lora/vocab_tables.py)
            tie_word_embeddings=cfg.tie_word_embeddings,
        )
        targets = target_modules or (ATTN_MODULES if cfg.is_moe else ALL_MODULES)
        pool = AdapterPool(
            shapes, slots=slots, max_rank=rank, target_modules=targets, dtype=dtype, device=device
        )
        for s in range(slots):
            modules = list(ATTN_MODULES) if cfg.is_moe else MODULE_SETS[s % len(MODULE_SETS)]
            modules = [m for m in modules if m in targets] or list(targets)
            pool.upload(s, random_adapter(shapes, modules, rank, seed + s, dtype))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # uploads run on a side stream
        side = device.type == "cuda" if side_stream is None else side_stream
        if lora_backend == "torch":
            backend = TorchLoRABackend(pool)
        else:
            backend = TritonLoRABackend(pool, max_tokens=max_num_tokens, side_stream=side)
    return ModelRunner(
        model,
        cfg,
        kv_cache,
        max_num_tokens=max_num_tokens,
        max_num_seqs=max_num_seqs,
        context_length=context_length,
        lora_backend=backend,
    )
