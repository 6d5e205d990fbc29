"""Child server processes: start one, learn its port from its "listening on HOST:PORT" log
line, wait for gRPC health SERVING, stop it with SIGTERM. Used by `loraplex up` and the tests.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

LISTENING = re.compile(r"listening on (\S+):(\d+)")


# Linux: the child asks for SIGTERM when its parent dies (even by SIGKILL), then becomes the
# server by exec (same pid). Done in the child's own interpreter, not in a preexec_fn: a
# preexec_fn forces fork() instead of vfork(), and fork() deadlocks in grpc's pre-fork handler
# once the parent has live gRPC channels (seen: a test hung in Popen for minutes).
_BOOTSTRAP = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)  # the parent died before the prctl\n"
    "if sys.argv[2] == '--exec':\n"
    "    os.execvp(sys.argv[3], sys.argv[3:])  # another program (the nginx router)\n"
    "os.execv(sys.executable, [sys.executable, '-u', '-m', *sys.argv[2:]])\n"
)


def _command(module: str, args: Sequence[str]) -> list[str]:
    if sys.platform.startswith("linux"):
        return [sys.executable, "-u", "-c", _BOOTSTRAP, str(os.getpid()), module, *args]
    return [sys.executable, "-u", "-m", module, *args]


class ServerProcess:
    """A `python -m MODULE ARGS...` child whose output is echoed with a prefix (and kept)."""

    def __init__(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        echo: bool = True,
        program: str | None = None,
        address: str | None = None,
    ) -> None:
        """`program`: run that executable with `args` instead of `python -m module` (it then
        prints no "listening on" line, so give its `address`)."""
        self.name = name
        self.lines: list[str] = []
        self.address: str | None = address
        self._bound = threading.Event()
        if address is not None:
            self._bound.set()
        self._echo = echo
        if program is None:
            command = _command(module, args)
        elif sys.platform.startswith("linux"):
            command = [sys.executable, "-u", "-c", _BOOTSTRAP, str(os.getpid()), "--exec", program, *args]
        else:
            command = [program, *args]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
            # Own process group: a terminal's Ctrl-C reaches only the parent, which stops
            # the children in order with one SIGTERM each; they die with the parent regardless.
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"{name}-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self._echo:
                sys.stderr.write(f"[{self.name}] {line}")
            match = LISTENING.search(line)
            if match and not self._bound.is_set():
                self.address = f"{match.group(1)}:{match.group(2)}"
                self._bound.set()
        self._bound.set()  # exited: wake waiters

    @property
    def port(self) -> int:
        assert self.address is not None
        return int(self.address.rsplit(":", 1)[1])

    def output(self) -> str:
        return "".join(self.lines)

    def wait_bound(self, timeout: float) -> str:
        if not self._bound.wait(timeout) or self.address is None:
            raise RuntimeError(
                f"{self.name} did not start listening within {timeout:.0f}s:\n{self.output()[-4000:]}"
            )
        return self.address

    def wait_serving(self, timeout: float, service: str = "", tls_ca: str | None = None) -> None:
        """Block until grpc.health.v1 says SERVING (the process exiting first is an error)."""
        from loraplex.clients.requests import make_channel

        address = self.wait_bound(timeout)
        deadline = time.monotonic() + timeout
        with make_channel(address, tls_ca=tls_ca) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode}:\n{self.output()[-4000:]}"
                    )
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"{self.name} not SERVING after {timeout:.0f}s:\n{self.output()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, then SIGKILL if it will not go; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", self.name, timeout)
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        return self.proc.returncode
