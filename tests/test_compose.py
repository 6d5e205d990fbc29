"""docker-compose.yml is accepted by a compose implementation and has the promised shape.

No Docker engine runs on these machines; `docker-compose config` (Debian's v1 package,
installed by `make tools`) parses, interpolates and validates the file without one.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
# `make tools` installs it; its absence is a failure, not a skip (the compose check is required).
COMPOSE = shutil.which("docker-compose") or "docker-compose"


def _config(*args: str) -> dict:
    out = subprocess.run([COMPOSE, *args, "config"], cwd=ROOT, check=True, capture_output=True, text=True)
    return yaml.safe_load(out.stdout)


def test_compose_file_is_valid():
    subprocess.run([COMPOSE, "config", "-q"], cwd=ROOT, check=True)
    subprocess.run([COMPOSE, "--profile", "cpu", "config", "-q"], cwd=ROOT, check=True)


def test_compose_services_and_gpu_reservation():
    config = _config("--profile", "cpu")
    services = config["services"]
    assert {"redis", "adapter-store", "inference", "inference-cpu", "openai", "openai-cpu"} <= set(services)
    assert "inference:50051" in services["openai"]["command"] and "inference-cpu:50051" in services["openai-cpu"]["command"]
    assert services["redis"]["image"].startswith("redis")
    devices = services["inference"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["inference-cpu"]["profiles"] == ["cpu"]
    assert "deploy" not in services["inference-cpu"]
    for name in ("adapter-store", "inference", "inference-cpu"):
        assert "grpc_health" in " ".join(services[name]["healthcheck"]["test"])
        assert any("loraplex-cache" in str(v) for v in services[name]["volumes"])
    assert "--adapter-store" in services["inference"]["command"]
