"""A ModelRunner over a random-weight Llama of any shape, in memory (no files), with an adapter pool of
random adapters and the Triton LoRA backend: what the mixed-step benchmark, the compile check and
the mixed-graph check drive. Tiny shapes (TINY) run on the CPU (Triton under the interpreter); the
Llama-3.1-8B shape (bench/serving_setup.py's LLAMA_8B) on the GPU.
"""

from __future__ import annotations

import torch

from loraplex.services.inference.engine.kv_cache import allocate_kv_cache
from loraplex.services.inference.engine.model_runner import ModelRunner
from loraplex.services.inference.lora.backend_check import MODULE_SETS, random_adapter
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes
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


def model_config(shape: dict, context_length: int) -> ModelConfig:
    return parse_config(
        dict(
            architectures=["LlamaForCausalLM"],
            hidden_act="silu",
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=context_length,
            **shape,
        )
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
            p.data.normal_(0, 0.02 if p.dim() == 2 and p.shape[0] > 1024 else 0.2)
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
) -> ModelRunner:
    """A runner with `slots` random adapters of rank <= `rank` resident (slots 0: no LoRA backend).
    `lora_backend` "torch": the CPU backend (no Triton interpreter needed). `fp8`: the base linears
    quantized to FP8 E4M3 per output channel (models/quantization/), adapters in `dtype`."""
    cfg = model_config(shape, context_length)
    model = random_model(cfg, dtype, device, seed)
    if fp8:
        quantize_loaded(model)
    blocks = num_blocks or (max_num_seqs + 4) * (-(-context_length // page_size))
    kv_cache = allocate_kv_cache(cfg, blocks, page_size, dtype, device)
    backend = None
    if slots:
        shapes = ModelShapes(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            q_size=cfg.q_size,
            kv_size=cfg.kv_size,
        )
        pool = AdapterPool(
            shapes, slots=slots, max_rank=rank, target_modules=ALL_MODULES, dtype=dtype, device=device
        )
        for s in range(slots):
            pool.upload(s, random_adapter(shapes, MODULE_SETS[s % len(MODULE_SETS)], rank, seed + s, dtype))
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
