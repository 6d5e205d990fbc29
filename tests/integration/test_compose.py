"""docker-compose.yml is accepted by a compose implementation and has the promised shape.

No Docker engine runs on these machines; `docker-compose config` (Debian's v1 package,
installed by `make tools`) parses, interpolates and validates the file without one.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
# `make tools` installs it; its absence is a failure, not a skip (the compose check is required).
COMPOSE = shutil.which("docker-compose") or "docker-compose"


def _config(*args: str) -> dict:
    out = subprocess.run([COMPOSE, *args, "config"], cwd=ROOT, check=True, capture_output=True, text=True)
    return yaml.safe_load(out.stdout)


def test_compose_file_is_valid():
    subprocess.run([COMPOSE, "config", "-q"], cwd=ROOT, check=True)
    subprocess.run([COMPOSE, "--profile", "cpu", "config", "-q"], cwd=ROOT, check=True)
    subprocess.run([COMPOSE, "--profile", "fleet", "config", "-q"], cwd=ROOT, check=True)


def test_compose_services_and_gpu_reservation():
    config = _config("--profile", "cpu")
    services = config["services"]
    assert {"redis", "adapter-store", "inference", "inference-cpu", "openai", "openai-cpu"} <= set(services)
    assert (
        "inference:50051" in services["openai"]["command"]
        and "inference-cpu:50051" in services["openai-cpu"]["command"]
    )
    assert services["redis"]["image"].startswith("redis")
    devices = services["inference"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["inference-cpu"]["profiles"] == ["cpu"]
    assert "deploy" not in services["inference-cpu"]
    for name in ("adapter-store", "inference", "inference-cpu"):
        assert "grpc_health" in " ".join(services[name]["healthcheck"]["test"])
        assert any("loraplex-cache" in str(v) for v in services[name]["volumes"])
    assert "--adapter-store" in services["inference"]["command"]


def test_compose_router_in_front_of_two_replicas():
    services = _config("--profile", "fleet")["services"]
    router = services["router"]
    assert router["image"].startswith("nginx")
    mounts = " ".join(str(v) for v in router["volumes"])
    assert "deploy/nginx/loraplex.conf" in mounts and "/etc/nginx/templates/" in mounts
    assert "deploy/nginx/compose-replicas.conf" in mounts
    replicas_conf = (ROOT / "deploy/nginx/compose-replicas.conf").read_text()
    ids = []
    for name in ("inference-a", "inference-b"):
        assert name in router["depends_on"] and f"{name}:50051" in replicas_conf
        command = services[name]["command"]
        assert "adapter-store:50052" in command  # one store (and its Redis) for the fleet
        ids.append(command[command.index("--replica-id") + 1])
        assert services[name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert ids == ["inference-a", "inference-b"]
    assert [
        services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for n in ("inference-a", "inference-b")
    ] == [["0"], ["1"]]
