"""The sparse MoE block (models/moe.py), both of its paths, against transformers' Mixtral and
Qwen3-MoE blocks on the same weights: float32, within 1e-5."""

from __future__ import annotations

import pytest
import torch

from loraplex.services.inference.models import moe as moe_module
from loraplex.services.inference.models.loader import load_model
from tests.support.factories import make_tiny_model


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("tokens", [5, moe_module.DENSE_MAX_TOKENS + 37])  # dense, sorted
def test_moe_block_matches_transformers(arch, tokens, tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / arch, arch=arch, vocab_size=64)
    ours, cfg = load_model(path, torch.device("cpu"), torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
    sparse = [i for i in range(cfg.num_layers) if cfg.layer_is_sparse(i)]
    assert sparse
    with torch.no_grad():
        for i in sparse:
            block = ours.layers[i].moe
            ref = theirs.model.layers[i].mlp(x[None])
            ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
            got = block(x)
            assert (got - ref).abs().max().item() < 1e-5, (arch, i, tokens)
            weights, experts = block.route(x)
            # the other path gives the same numbers too
            other = block._sorted if tokens <= moe_module.DENSE_MAX_TOKENS else block._dense
            assert (other(x, weights, experts) - ref).abs().max().item() < 1e-5
            assert len(torch.unique(experts)) > 1  # the routing spreads over experts


def test_a_missing_or_stray_expert_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from loraplex.services.inference.models.config import UnsupportedModelError

    path = make_tiny_model(tmp_path / "mixtral", arch="mixtral", vocab_size=64)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.7.w3.weight"
    missing = {k: v for k, v in tensors.items() if k != name}
    save_file(missing, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="missing 1 tensors.*layers.1.moe.gate_up.7.1"):
        load_model(path, torch.device("cpu"), torch.float32)
    stray = {**tensors, "model.layers.0.block_sparse_moe.experts.8.w1.weight": tensors[name].clone()}
    save_file(stray, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="experts.8.w1"):
        load_model(path, torch.device("cpu"), torch.float32)
