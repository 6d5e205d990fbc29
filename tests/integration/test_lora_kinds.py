"""Adapters as people train them, against PEFT (float32, CPU): DoRA beside plain adapters and the base
model in one continuous batch. Greedy tokens equal PEFT's and each token's log probability is within
1e-4 of PEFT's (its own logits, one sequence at a time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.child import REPO, child_env, json_lines, run_child
from tests.support.factories import make_tiny_model
from tests.support.lora_kinds import engine_run, peft_reference
from tests.support.lora_reference import PROMPTS, server_args, sync_engine

LOGPROB_TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """See conftest.one_torch_thread."""


def check_batch(
    base: Path, adapters: dict[str, Path], batch: list[str | None], **kw
) -> list[tuple[list[int], list[float]]]:
    """Our tokens and log probabilities (torch backend) against PEFT's; returns ours."""
    engine = sync_engine(server_args(base, adapters, max_loras_per_batch=len(adapters), **kw))
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[: len(batch)]]
    ours = engine_run(engine, prompts, batch)
    expected = peft_reference(base, adapters, list(zip(prompts, batch, strict=True)))
    for (tokens, logprobs), (ref_tokens, ref_logprobs), name in zip(ours, expected, batch, strict=True):
        assert tokens == ref_tokens[: len(tokens)], f"adapter {name}: engine {tokens} != PEFT {ref_tokens}"
        assert len(tokens) == len(ref_tokens) or tokens[-1] == engine.tokenizer.eos_token_id
        worst = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=False))
        assert worst < LOGPROB_TOL, f"adapter {name}: logprobs differ by {worst}"
    # every adapter really changes its prompt's output (else the comparison proves little)
    rows = [i for i, name in enumerate(batch) if name is not None]
    base_only = peft_reference(base, adapters, [(prompts[i], None) for i in rows])
    for i, (tokens, _) in zip(rows, base_only, strict=True):
        assert expected[i][0] != tokens, f"adapter {batch[i]} leaves prompt {i} as the base model does"
    return ours


def check_triton_backend(
    base: Path, adapters: dict[str, Path], batch: list[str | None], torch_backend: list, graphs: bool = False
) -> None:
    """The Triton backend (interpreter, child process) gives the torch backend's tokens and logprobs.
    `graphs`: its decode steps on the decode graphs' path (eagerly), the kinds variant among them."""
    script = str(REPO / "tests" / "support" / "lora_kinds_triton_check.py")
    argv = [script, *(["--graphs"] if graphs else []), str(base), *(f"{n}={p}" for n, p in adapters.items())]
    argv.append(",".join(n or "-" for n in batch))
    stdout = run_child(argv, env=child_env(interpret=True), timeout=600).stdout
    if graphs:  # decode steps went through the graphs, the kinds variant's too
        assert "variants [0, 1]" in stdout or "variants [1]" in stdout, stdout
        assert "graphs: 0 steps" not in stdout, stdout
    got = json_lines(stdout)
    assert len(got) == len(batch)
    for row, (tokens, logprobs), name in zip(got, torch_backend, batch, strict=True):
        assert row["tokens"] == tokens, f"adapter {name}: triton {row['tokens']} != torch {tokens}"
        worst = max(abs(a - b) for a, b in zip(row["logprobs"], logprobs, strict=True))
        assert worst < LOGPROB_TOL, f"adapter {name}: triton logprobs differ by {worst}"


def test_dora_beside_plain_and_base_qwen2(tiny_qwen2_path, adapter_factory):
    """Qwen2 has q/k/v biases: PEFT adds them after the magnitude scale."""
    adapters = {
        "dora": adapter_factory(
            tiny_qwen2_path,
            "kinds-dora",
            r=4,
            lora_alpha=8,
            target_modules="all-linear",
            use_dora=True,
            seed=5,
        ),
        "plain": adapter_factory(
            tiny_qwen2_path, "kinds-plain", r=8, target_modules=["q_proj", "v_proj"], seed=6
        ),
    }
    batch = [None, "dora", "plain", "dora"]
    ours = check_batch(tiny_qwen2_path, adapters, batch)
    check_triton_backend(tiny_qwen2_path, adapters, batch, ours)


def test_embedding_and_lm_head_lora_beside_dora_plain_and_base(tiny_llama_path, adapter_factory):
    """LoRA on embed_tokens (with q_proj) and on lm_head (with v_proj), DoRA and a plain adapter and
    the base model, all in one batch. The adapters carry PEFT's copies of the base layers."""
    base = tiny_llama_path
    adapters = {
        "emb": adapter_factory(base, "kinds-emb", r=4, target_modules=["embed_tokens", "q_proj"], seed=7),
        "head": adapter_factory(base, "kinds-head", r=8, target_modules=["lm_head", "v_proj"], seed=8),
        "dora": adapter_factory(
            base, "kinds-dora-l", r=4, target_modules=["o_proj", "up_proj"], use_dora=True
        ),
        "plain": adapter_factory(base, "kinds-plain-l", r=4, target_modules=["q_proj", "k_proj"], seed=9),
    }
    batch = [None, "emb", "head", "dora", "plain", "emb"]
    ours = check_batch(base, adapters, batch)
    check_triton_backend(base, adapters, batch, ours, graphs=True)


@pytest.fixture(scope="module")
def tied_llama_path(tmp_path_factory, smollm2_path) -> Path:
    """The tiny Llama with tied embeddings (lm_head is the embedding matrix), as SmolLM2 has."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-tied"), tokenizer_from=smollm2_path, tie_word_embeddings=True, seed=3
    )


def test_lm_head_and_embedding_lora_over_tied_embeddings(tied_llama_path, adapter_factory):
    """Each is its own adapter over the one shared weight, as PEFT serves them."""
    adapters = {
        "head": adapter_factory(tied_llama_path, "kinds-tied-head", r=4, target_modules=["lm_head"], seed=11),
        "both": adapter_factory(
            tied_llama_path, "kinds-tied-both", r=4, target_modules=["lm_head", "embed_tokens"], seed=12
        ),
    }
    check_batch(tied_llama_path, adapters, [None, "head", "both"])


def prompt_token_ids(base: Path, count: int) -> list[int]:
    """Ids that occur in the test prompts (so trainable rows are looked up), most frequent first."""
    from collections import Counter

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    counts = Counter(t for p in PROMPTS for t in tok(p).input_ids)
    return [t for t, _ in counts.most_common(count)]


def test_trainable_tokens_over_tied_embeddings_beside_dora_plain_and_base(tied_llama_path, adapter_factory):
    """The rows replace the embedding's and, the base being tied, lm_head's, for the adapter's requests."""
    ids = prompt_token_ids(tied_llama_path, 6) + [7, 100]
    adapters = {
        "tokens": adapter_factory(
            tied_llama_path,
            "kinds-tokens",
            r=4,
            target_modules=["q_proj"],
            trainable_token_indices=ids,
            seed=13,
        ),
        "dora": adapter_factory(
            tied_llama_path, "kinds-tied-dora", r=4, target_modules=["v_proj"], use_dora=True
        ),
        "plain": adapter_factory(
            tied_llama_path, "kinds-tied-plain", r=4, target_modules=["o_proj"], seed=14
        ),
    }
    check_batch(tied_llama_path, adapters, [None, "tokens", "dora", "plain", "tokens"])


def test_trainable_tokens_of_embedding_and_lm_head_untied(tiny_llama_path, adapter_factory):
    ids = prompt_token_ids(tiny_llama_path, 6)
    layers = {"embed_tokens": ids, "lm_head": ids[:3] + [11, 12]}
    adapters = {
        "tokens": adapter_factory(
            tiny_llama_path,
            "kinds-tokens-u",
            r=4,
            target_modules=["k_proj"],
            trainable_token_indices=layers,
            seed=15,
        ),
        "plain": adapter_factory(tiny_llama_path, "kinds-plain-u", r=4, target_modules=["q_proj"], seed=16),
    }
    check_batch(tiny_llama_path, adapters, [None, "tokens", "plain"])
