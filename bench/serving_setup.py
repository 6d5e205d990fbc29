"""Artifacts for the serving benchmark: a Llama-3.1-8B-shaped HF directory with random bf16 weights,
a word-level tokenizer covering its whole vocabulary, and random rank-r PEFT adapters.

Everything is written as the real files (config.json, safetensors shards with an index,
tokenizer.json, adapter_config.json + adapter_model.safetensors) so the engine, transformers and
PEFT all load it through their ordinary paths. Random tensors are drawn on the GPU (fast) and
saved with safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
)
PROJECTIONS = {  # module -> (parent, in, out) as functions of the shape dict
    "q_proj": ("self_attn", "h", "q"),
    "k_proj": ("self_attn", "h", "kv"),
    "v_proj": ("self_attn", "h", "kv"),
    "o_proj": ("self_attn", "q", "h"),
    "gate_proj": ("mlp", "h", "i"),
    "up_proj": ("mlp", "h", "i"),
    "down_proj": ("mlp", "i", "h"),
}
BOS, EOS = 128000, 128001


def _dims(shape: dict) -> dict[str, int]:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return dict(
        h=shape["hidden_size"],
        q=shape["num_attention_heads"] * head_dim,
        kv=shape["num_key_value_heads"] * head_dim,
        i=shape["intermediate_size"],
    )


def write_config(path: Path, shape: dict) -> None:
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        dtype="bfloat16",
        torch_dtype="bfloat16",
        **shape,
    )
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps(dict(bos_token_id=BOS, eos_token_id=EOS)))


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A real fast tokenizer: one word `t<id>` per id, so any generated id detokenizes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=f"t{BOS}", eos_token=f"t{EOS}", unk_token="t0", pad_token=f"t{EOS}"
    )
    fast.save_pretrained(path)


def write_model_dir(
    path: Path, shape: dict = LLAMA_8B, seed: int = 0, shard_bytes: int = 4 << 30, device: str = "cuda"
) -> Path:
    """Random bf16 weights (std 0.02, norms 1) in safetensors shards + index, config and tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    dims = _dims(shape)
    gen = torch.Generator(device=device).manual_seed(seed)
    names: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (shape["vocab_size"], dims["h"]))
    ]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}"
        names += [
            (f"{p}.input_layernorm.weight", (dims["h"],)),
            (f"{p}.post_attention_layernorm.weight", (dims["h"],)),
        ]
        names += [
            (f"{p}.{parent}.{m}.weight", (dims[o], dims[n])) for m, (parent, n, o) in PROJECTIONS.items()
        ]
    names += [("model.norm.weight", (dims["h"],)), ("lm_head.weight", (shape["vocab_size"], dims["h"]))]
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_size, shards = 0, []

    def flush() -> None:
        nonlocal shard, shard_size
        fname = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        shards.append(fname)
        shard, shard_size = {}, 0

    for name, dims_ in names:
        if len(dims_) == 1:
            t = torch.ones(dims_, dtype=torch.bfloat16)
        else:
            t = torch.empty(dims_, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen).cpu()
        shard[name] = t
        shard_size += t.numel() * 2
        if shard_size >= shard_bytes:
            flush()
    if shard:
        flush()
    total = sum((path / s).stat().st_size for s in shards)
    index = dict(metadata=dict(total_size=total), weight_map=weight_map)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    write_config(path, shape)
    write_tokenizer(path, shape["vocab_size"])
    return path


def write_adapters(
    root: Path,
    base: Path,
    count: int,
    shape: dict = LLAMA_8B,
    rank: int = 16,
    seed: int = 1,
    device: str = "cuda",
    modules: tuple[str, ...] = tuple(PROJECTIONS),
) -> list[Path]:
    """`count` PEFT LoRA adapters of rank `rank` on `modules` (all seven projections), nonzero A and B."""
    dims = _dims(shape)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for a in range(count):
        d = root / f"adapter{a:02d}"
        d.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i in range(shape["num_hidden_layers"]):
            for m in modules:
                parent, n, o = PROJECTIONS[m]
                key = f"base_model.model.model.layers.{i}.{parent}.{m}"
                a_t = torch.empty(rank, dims[n], dtype=torch.bfloat16, device=device).normal_(
                    0, dims[n] ** -0.5, generator=gen
                )
                b_t = torch.empty(dims[o], rank, dtype=torch.bfloat16, device=device).normal_(
                    0, 0.01, generator=gen
                )
                tensors[f"{key}.lora_A.weight"] = a_t.cpu()
                tensors[f"{key}.lora_B.weight"] = b_t.cpu()
        save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = dict(
            peft_type="LORA",
            task_type="CAUSAL_LM",
            r=rank,
            lora_alpha=2 * rank,
            lora_dropout=0.0,
            target_modules=list(modules),
            bias="none",
            base_model_name_or_path=str(base),
            fan_in_fan_out=False,
            inference_mode=True,
            use_rslora=False,
            modules_to_save=None,
        )
        (d / "adapter_config.json").write_text(json.dumps(config, indent=1))
        out.append(d)
    return out


def adapter_bytes(shape: dict = LLAMA_8B, rank: int = 16, dtype_bytes: int = 2) -> int:
    """Bytes of one adapter's A and B over all layers and the seven projections."""
    dims = _dims(shape)
    per_layer = sum(rank * (dims[n] + dims[o]) for _, n, o in PROJECTIONS.values())
    return per_layer * shape["num_hidden_layers"] * dtype_bytes


def weight_bytes(shape: dict = LLAMA_8B, dtype_bytes: int = 2) -> int:
    """Bytes a decode step reads of the base weights (all linears + lm_head; the embedding row
    gather and norms are negligible)."""
    dims = _dims(shape)
    per_layer = sum(dims[n] * dims[o] for _, n, o in PROJECTIONS.values())
    return (per_layer * shape["num_hidden_layers"] + shape["vocab_size"] * dims["h"]) * dtype_bytes


def kv_bytes_per_token(shape: dict = LLAMA_8B, dtype_bytes: int = 2) -> int:
    dims = _dims(shape)
    return 2 * dims["kv"] * shape["num_hidden_layers"] * dtype_bytes
