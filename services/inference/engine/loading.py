"""Resolving, checking and loading the model and tokenizer an EngineConfig names."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.models.config import ModelConfig, check_context_length
from loraplex.services.inference.models.llama import LlamaForCausalLM
from loraplex.services.inference.models.loader import load_model, resolve_dtype, resolve_model_dir


class LoadedModel(NamedTuple):
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: object  # a transformers tokenizer
    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    context_length: int


def load(config: EngineConfig) -> LoadedModel:
    """Resolve, check and load the model and tokenizer named by the config."""
    from transformers import AutoTokenizer

    from loraplex.services.inference.models.config import load_config
    from loraplex.services.inference.models.quantization.scheme import (
        read_quantization_config,
        resolve_scheme,
    )

    model_dir = resolve_model_dir(config.model_path)
    model_config = load_config(model_dir)  # refuses before weights are touched
    resolve_scheme(config.quantization, read_quantization_config(model_dir))  # likewise
    context_length = min(
        config.context_length or model_config.max_position_embeddings, model_config.max_position_embeddings
    )
    check_context_length(model_config, context_length)
    dtype = resolve_dtype(config.dtype, model_config.torch_dtype, config.device)
    model, model_config = load_model(model_dir, config.device, dtype, config.quantization)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return LoadedModel(model, model_config, tokenizer, model_dir, config.device, dtype, context_length)
