"""What `pip install .` puts in an environment: one top-level import package, `loraplex`; and the
embedded model directory is a plain Hugging Face directory (no key that does not describe its files)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("src") / "loraplex"
    # Build from a copy of the tracked files, so a build/ folder from an earlier run cannot leak in.
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    for name in files.stdout.split():
        if (ROOT / name).is_file():
            (build / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, build / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(build),
        ],
        check=True,
        timeout=300,
    )
    (path,) = out.glob("loraplex-*.whl")
    return path


def test_the_wheel_installs_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top_level).decode().split() == ["loraplex"]
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"loraplex"}
    for module in (
        "loraplex/v1/inference_pb2.py",
        "loraplex/services/inference/__main__.py",
        "loraplex/services/openai/__main__.py",
        "loraplex/kernels/lora_plan.py",
        "loraplex/adapter_store/__main__.py",
        "loraplex/clients/cli.py",
        "loraplex/clients/grpcurl/generate.sh",
        "loraplex/bench/workload.py",
    ):
        assert module in names, module


def test_the_wheel_imports_outside_the_checkout(wheel, tmp_path):
    """Unpacked on its own (no checkout anywhere on sys.path), the subpackages import by their one name."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")
    code = (
        "import kernels, loraplex.kernels.lora_plan, loraplex.services.inference.server_args;"
        "import loraplex.clients;"
        "import loraplex; assert len(loraplex.__path__) == 1, loraplex.__path__;"
        "from transformers import LlamaForCausalLM; import peft; print(kernels.__name__)"
    )
    env = {"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    # the services start by their one name too (what `loraplex up` and docker-compose run)
    for module in ("loraplex.adapter_store", "loraplex.services.inference", "loraplex.services.openai"):
        run = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert run.returncode == 0 and "usage" in run.stdout, (module, run.stderr[-2000:])


def test_the_embedded_model_directory_is_plain(smollm2_path):
    from transformers import AutoModelForCausalLM

    config = json.loads((smollm2_path / "config.json").read_text())
    assert not {"quantization_config", "_name_or_path", "_model_name_or_path"} & config.keys()
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)
    assert getattr(model.config, "quantization_config", None) is None


def test_an_old_cache_is_repaired_on_the_next_start(smollm2_path, tmp_path):
    from loraplex.services.inference.default_model import DIGEST_FILE, _digest, ensure_model, is_converted

    old = tmp_path / "models" / smollm2_path.name
    old.mkdir(parents=True)
    for f in smollm2_path.iterdir():
        if f.name == "model.safetensors":
            (old / f.name).symlink_to(f)
        elif f.name != DIGEST_FILE:
            shutil.copy2(f, old / f.name)
    config = json.loads((old / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    (old / "config.json").write_text(json.dumps(config))
    (old / DIGEST_FILE).write_text(_digest(old) + "\n")

    assert ensure_model(tmp_path) == old
    assert "quantization_config" not in json.loads((old / "config.json").read_text())
    assert is_converted(old)
