"""Model loading: what is served (Mistral, sharded, Hub cache) and what is refused, with clear messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.engine import LLMEngine
from loraplex.services.inference.engine.types import SamplingParams
from loraplex.services.inference.models.config import UnsupportedModelError, load_config, parse_config
from loraplex.services.inference.models.loader import resolve_model_dir, safetensors_files


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Module-wide: see conftest.one_torch_thread."""


def copy_model(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def engine_for(path: Path, **overrides) -> LLMEngine:
    options = dict(
        model_path=str(path),
        device=torch.device("cpu"),
        dtype="auto",
        max_total_tokens=1024,
        page_size=4,
        chunked_prefill_size=8,
        context_length=256,
    )
    options.update(overrides)
    return LLMEngine.from_config(EngineConfig(**options))


def greedy(engine: LLMEngine, texts: list[str], n: int = 12) -> list[list[int]]:
    prompts = [engine.tokenizer(t).input_ids for t in texts]
    return [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))]


def hf_greedy(path: Path, engine: LLMEngine, texts: list[str], n: int = 12) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for t in texts:
        ids = engine.tokenizer(t).input_ids
        gen = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
        )
        out.append(gen[0, len(ids) :].tolist())
    return out


TEXTS = ["The capital of France is", "def fibonacci(n): return", "Hello"]


def test_mistral_with_and_without_sliding_window_matches_transformers(tmp_path, smollm2_path):
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    torch.manual_seed(0)
    config = MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=len(tok),
        sliding_window=None,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    model = MistralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    path = tmp_path / "mistral"
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    engine = engine_for(path)
    assert engine.loaded.config.architecture == "MistralForCausalLM"
    assert engine.loaded.dtype == torch.float32  # auto on CPU
    assert greedy(engine, TEXTS) == hf_greedy(path, engine, TEXTS)

    # A window shorter than prompt + output (chunked prefill of 8 reads across it too).
    windowed = copy_model(path, tmp_path / "mistral-sw", sliding_window=6)
    windowed_tokens = greedy(engine_for(windowed), TEXTS)
    assert windowed_tokens == hf_greedy(windowed, engine, TEXTS)
    assert windowed_tokens != greedy(engine, TEXTS)  # the window changes the output


def test_sharded_checkpoint_loads_like_single_file(tmp_path, tiny_llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="2MB")
    AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(safetensors_files(sharded)) > 1
    assert greedy(engine_for(sharded), TEXTS) == greedy(engine_for(tiny_llama_path), TEXTS)


def test_hub_id_resolves_from_the_cache_when_offline(tmp_path, tiny_llama_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--acme--tiny-llama"
    shutil.copytree(tiny_llama_path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    assert resolve_model_dir("acme/tiny-llama") == repo / "snapshots" / commit
    with pytest.raises(
        UnsupportedModelError, match="HF_HUB_OFFLINE is set and the model is not in the cache"
    ):
        resolve_model_dir("acme/missing")
    with pytest.raises(UnsupportedModelError, match="neither a model directory nor a Hub id"):
        resolve_model_dir(str(tmp_path / "does-not-exist"))


def test_pickle_weights_are_refused(tmp_path, tiny_llama_path):
    path = tmp_path / "bin-only"
    path.mkdir()
    shutil.copy(tiny_llama_path / "config.json", path / "config.json")
    torch.save({"model.norm.weight": torch.ones(64)}, path / "pytorch_model.bin")
    with pytest.raises(UnsupportedModelError, match="pickle weights.*convert them to safetensors"):
        engine_for(path)


def test_remote_code_is_refused(tmp_path, tiny_llama_path):
    path = copy_model(tiny_llama_path, tmp_path / "remote", auto_map={"AutoModelForCausalLM": "modeling_x.X"})
    with pytest.raises(UnsupportedModelError, match="trust_remote_code"):
        load_config(path)


def test_unknown_architecture_and_rope_are_refused(tmp_path, tiny_llama_path):
    path = copy_model(
        tiny_llama_path, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2"
    )
    with pytest.raises(UnsupportedModelError, match="unsupported architecture.*LlamaForCausalLM"):
        engine_for(path)
    raw = json.loads((tiny_llama_path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    with pytest.raises(UnsupportedModelError, match="'yarn' is not supported"):
        parse_config({**raw, "rope_scaling": {"type": "yarn", "factor": 4.0}})


def test_family_features_we_do_not_implement_are_refused_by_name(tiny_llama_path):
    from loraplex.services.inference.engine.attention import effective_windows
    from loraplex.services.inference.models.config import check_context_length

    raw = json.loads((tiny_llama_path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    with pytest.raises(UnsupportedModelError, match="unsupported architecture.*Gemma3ForCausalLM"):
        parse_config({**raw, "architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.75"):
        parse_config({**raw, "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75})
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    phi3 = parse_config(
        {
            **raw,
            "architectures": ["Phi3ForCausalLM"],
            "rope_scaling": longrope,
            "original_max_position_embeddings": 512,
        }
    )
    check_context_length(phi3, 512)
    with pytest.raises(UnsupportedModelError, match="longrope.*--context-length 512"):
        check_context_length(phi3, 513)
    gemma2 = parse_config(
        {**raw, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 16, "attn_logit_softcapping": 50.0}
    )
    assert gemma2.layer_windows == (16, None) and gemma2.attention_scale == 256**-0.5
    assert gemma2.attn_softcap == 50.0 and gemma2.final_softcap is None
    qwen3 = parse_config(
        {**raw, "architectures": ["Qwen3ForCausalLM"], "sliding_window": 16, "use_sliding_window": True,
         "max_window_layers": 1}
    )  # fmt: skip
    assert effective_windows(qwen3, 16) == (None, None)  # the window covers the whole context
    assert effective_windows(qwen3, 17) == (None, 16)


def test_model_type_names_the_family_when_architectures_is_null(tmp_path, tiny_llama_path):
    # transformers loads such a checkpoint by model_type; so does the engine, with the same tokens.
    path = copy_model(tiny_llama_path, tmp_path / "no-arch", architectures=None, model_type="llama")
    assert greedy(engine_for(path), TEXTS) == hf_greedy(path, engine_for(path), TEXTS)
    raw = json.loads((tiny_llama_path / "config.json").read_text())
    assert (
        parse_config({**raw, "architectures": [], "model_type": "qwen2"}).architecture == "Qwen2ForCausalLM"
    )
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'gpt2'"):
        parse_config({**raw, "architectures": None, "model_type": "gpt2"})


def test_both_rope_config_spellings_are_read(tiny_llama_path):
    raw = json.loads((tiny_llama_path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    old = parse_config({**raw, "rope_theta": 500000.0, "rope_scaling": scaling})
    new = parse_config({**raw, "rope_parameters": {"rope_theta": 500000.0, **scaling}})
    assert old.rope == new.rope
    assert old.rope.theta == 500000.0 and old.rope.rope_type == "llama3" and old.rope.factor == 8.0
    qwen = parse_config({**raw, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None  # use_sliding_window off
