"""Embedding / lm_head LoRA and trainable tokens at load on the inference side (lora/embedding_lora.py,
lora/trainable_tokens.py): what is read, and each refusal naming its field. PEFT exactness:
tests/integration/test_lora_kinds.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid
from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
from loraplex.services.inference.lora.config import parse_adapter_config
from loraplex.services.inference.lora.shapes import ModelShapes

BASE_CFG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}


@pytest.fixture(scope="module")
def shapes(tiny_llama_path) -> ModelShapes:
    return ModelShapes.from_model_dir(tiny_llama_path)


@pytest.fixture(scope="module")
def tokens_adapter(tiny_llama_path, adapter_factory) -> Path:
    layers = {"embed_tokens": [3, 5, 9], "lm_head": [3, 7]}
    return adapter_factory(
        tiny_llama_path, "vocab-unit-tokens", r=4, target_modules=["q_proj"], trainable_token_indices=layers
    )


def with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_rows_read_per_layer(tokens_adapter, shapes):
    w = load_adapter_weights(tokens_adapter, shapes)
    assert w.has_vocab_parts and not w.embedding
    assert w.token_rows["model.embed_tokens"].ids.tolist() == [3, 5, 9]
    assert tuple(w.token_rows["lm_head"].values.shape) == (2, shapes.hidden_size)


@pytest.mark.parametrize(
    "value",
    [{"encoder": [1]}, [1, 1], [-1], "3", {"lm_head": []}],
)
def test_config_refusals_name_the_field(value):
    with pytest.raises(AdapterInvalid) as e:
        parse_adapter_config({**BASE_CFG, "trainable_token_indices": value})
    assert e.value.field == "trainable_token_indices"


def test_ids_past_the_vocabulary_and_added_tokens_are_refused(tokens_adapter, shapes, tmp_path):
    beyond = with_config(
        tokens_adapter, tmp_path / "beyond", trainable_token_indices={"embed_tokens": [3, 5, 49152]}
    )
    with pytest.raises(AdapterIncompatible, match="past this base model's vocabulary") as e:
        load_adapter_weights(beyond, shapes)
    assert e.value.field == "trainable_token_indices"
    added = tmp_path / "added"
    shutil.copytree(tokens_adapter, added)
    (added / "added_tokens.json").write_text(json.dumps({"<tool_call>": 49152}))
    with pytest.raises(AdapterIncompatible, match="'<tool_call>' \\(id 49152\\)") as e:
        load_adapter_weights(added, shapes)
    assert e.value.field == "tokenizer"


def test_tied_lm_head_rows_must_be_the_embeddings(tokens_adapter, shapes, tmp_path):
    import dataclasses

    tied = dataclasses.replace(shapes, tie_word_embeddings=True)
    with pytest.raises(AdapterInvalid, match="tied to embed_tokens"):
        load_adapter_weights(tokens_adapter, tied)
    same = with_config(
        tokens_adapter,
        tmp_path / "same",
        trainable_token_indices={"embed_tokens": [3, 5, 9], "lm_head": [3, 5, 9]},
    )
    with pytest.raises(AdapterInvalid, match="lm_head"):  # its lm_head rows tensor is now unlisted
        load_adapter_weights(same, tied)


def test_embedding_lora_refusals(tiny_llama_path, adapter_factory, shapes, tmp_path):
    emb = adapter_factory(tiny_llama_path, "vocab-unit-emb", r=4, target_modules=["embed_tokens", "q_proj"])
    w = load_adapter_weights(emb, shapes)
    assert tuple(w.embedding["model.embed_tokens"].a.shape) == (4, shapes.vocab_size)
    with pytest.raises(AdapterInvalid, match="DoRA on embed_tokens"):
        load_adapter_weights(with_config(emb, tmp_path / "dora", use_dora=True), shapes)
    with pytest.raises(AdapterIncompatible, match="another base model"):
        import dataclasses

        load_adapter_weights(emb, dataclasses.replace(shapes, vocab_size=100))


def test_added_tokens_within_the_vocabulary_load(tokens_adapter, shapes, tmp_path):
    """A token the adapter's tokenizer adds at an id the embedding has a row for is served (its
    requests use the adapter's tokenizer, engine/adapter_tokenizers.py): no longer refused."""
    new = tmp_path / "new"
    shutil.copytree(tokens_adapter, new)
    (new / "added_tokens.json").write_text(json.dumps({"<tool_call>": 5}))
    assert load_adapter_weights(new, shapes).token_rows["model.embed_tokens"].ids.tolist() == [3, 5, 9]
