"""Shared fixtures: the embedded SmolLM2, tiny random models and a PEFT adapter factory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.factories import make_peft_adapter, make_tiny_model


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers on CI's two cores) each worker's torch takes
    one thread: two processes with a thread per core each fight for the cores (see
    `one_torch_thread`)."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped, with the reason, on machines without it (CI, the dev box)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The converted embedded model (`make model` makes it; this converts if missing)."""
    from loraplex.services.inference.default_model import ensure_model

    return ensure_model()


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, smollm2_path) -> Path:
    """2-layer, hidden-64 random Llama with GQA (4 heads, 2 KV heads) and SmolLM2's tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=smollm2_path)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, smollm2_path) -> Path:
    """2-layer random Qwen2 (q/k/v biases) with SmolLM2's tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", tokenizer_from=smollm2_path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module: on a shared 2-core machine one thread is ~10x faster
    than two fighting for the cores. Restored afterwards."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def adapter_factory(tmp_path_factory) -> Callable[..., Path]:
    """`adapter_factory(base_path, name, r=8, lora_alpha=16, target_modules=[...], ...)` -> dir.

    Adapters are cached per (base, name, kwargs) for the session. Another name with the same base and
    kwargs gets its own directory holding a copy of the files already made (PEFT writes the same
    bytes for the same seed): copying is milliseconds, making one is ~0.1 s.
    """
    import shutil

    cache: dict[tuple, Path] = {}
    made: dict[tuple, Path] = {}  # (base, kwargs) -> the first directory made with them

    def make(base_path: Path, name: str, **kwargs) -> Path:
        content = (str(base_path), repr(sorted(kwargs.items())))
        key = (content[0], name, content[1])
        if key not in cache:
            out = tmp_path_factory.mktemp(f"adapter-{name}")
            if content in made:
                shutil.copytree(made[content], out, dirs_exist_ok=True)
                cache[key] = out
            else:
                cache[key] = made[content] = make_peft_adapter(base_path, out, **kwargs)
        return cache[key]

    return make
