"""lm-evaluation-harness, unchanged, scores a local multiple-choice task through the door
(`local-completions`: token-id prompts, `echo`, `logprobs`, batched) and its per-sample
log-likelihoods equal its own `hf` backend's on the same model directory, base model and a PEFT
adapter (`hf` with `peft=`), with the server's prefix cache on (its default)."""

# ruff: noqa: F811 - the shared fixtures are imported by name
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.integration.test_openai_door import base_name, client, door  # noqa: F401
from tests.integration.test_service_inference import adapters, server  # noqa: F401

lm_eval = pytest.importorskip("lm_eval")

TASK_DIR = Path(__file__).resolve().parents[1] / "support" / "lm_eval_task"
TASK = "loraplex_tiny_mc"
TOL = 1e-4


def _loglikelihoods(tasks, model: str, model_args: str) -> list[list[float]]:
    """Per sample (in document order), the log-likelihood of each choice."""
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=tasks,
        log_samples=True,
        device="cpu",
        batch_size=4,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return [[resp[0] for resp in s["filtered_resps"]] for s in samples]


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.chdir(TASK_DIR)  # the task's data_files path is relative
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("HF_DATASETS_OFFLINE", "1")
    patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    from lm_eval.tasks import TaskManager

    # only this task: indexing the harness's thousands of built-in tasks takes half a minute
    yield TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    patch.undo()


@pytest.mark.parametrize("model", ["base", "alpha"])
def test_door_loglikelihoods_equal_hf_backend(
    offline,
    door,
    client,
    base_name,
    smollm2_path,
    adapters,
    model,
):
    name = base_name if model == "base" else model
    door_args = (
        f"model={name},base_url=http://{door.address}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={smollm2_path},max_retries=1,num_concurrent=1"
    )
    hf_args = f"pretrained={smollm2_path},dtype=float32"
    if model != "base":
        hf_args += f",peft={adapters[model]}"
    got = _loglikelihoods(offline, "local-completions", door_args)
    want = _loglikelihoods(offline, "hf", hf_args)
    assert len(got) == len(want) == 6
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) and g == pytest.approx(w, abs=TOL)
    assert len({round(x, 3) for s in want for x in s}) > 10  # real, varied scores
    # the contexts were in the prefix cache while the harness scored them (choices share one)
    preamble = "The following are short general knowledge questions, each answered with one word or symbol."
    again = client.completions.create(model=name, prompt=preamble + "\n\nQuestion:", max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
