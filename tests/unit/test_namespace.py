"""One import namespace: the project imports as `loraplex.*` beside Hugging Face's own top-level
`kernels` (which transformers >= 5.25 requires), in one process, with this checkout on sys.path."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_checkout_is_on_sys_path_here():
    """The coexistence below means something only when the repo root can shadow (pytest puts it there)."""
    assert str(ROOT) in [str(Path(p).resolve()) for p in sys.path if p]


def test_hugging_face_kernels_is_not_shadowed_by_ours():
    import kernels

    assert importlib.metadata.version("kernels")
    installed = Path(importlib.metadata.distribution("kernels").locate_file("")).resolve()
    assert Path(kernels.__file__).resolve().is_relative_to(installed)
    assert not Path(kernels.__file__).resolve().is_relative_to(ROOT / "kernels")


def test_peft_transformers_models_and_the_engine_in_one_process(tiny_llama_path):
    import peft
    from transformers import LlamaForCausalLM

    from loraplex.kernels import lora_plan
    from loraplex.services.inference.engine.types import SamplingParams
    from tests.support.lora_reference import server_args, sync_engine

    assert peft.LoraConfig and LlamaForCausalLM and lora_plan.LoRAPlan
    engine = sync_engine(server_args(tiny_llama_path))
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(out[0].token_ids) == 3


def test_project_folders_carry_no_top_level_init():
    """Without `__init__.py` a folder on sys.path is only a namespace portion, and any installed
    package of the same name wins; with one, `import kernels` from the repo root would load ours."""
    for folder in ("services", "kernels", "adapter_store", "bench"):
        assert not (ROOT / folder / "__init__.py").exists(), folder
