"""docs/walkthrough.md §0–§7, run as a reader would copy them, in order, on one fresh stack.

The commands are read from the document (no second copy here). What the test changes, and only
mechanically: the fixed ports become free ones and `/tmp/` a temporary directory (so parallel
runs and other stacks on the machine do not collide), `make run` gets those ports and a fresh
`--cache-dir`, and the `loraplex` CLI / grpcurl scripts are pointed at the stack through their
environment variables (LORAPLEX_TARGET, INFERENCE, STORE). `loraplex up` lines run in the
background, as in their own terminal; a second stack stops when its section ends ("Stop that
second stack"). A bash block may fail only where the document says so (`# ERROR: Code: X`), with
that code. The sections after §6 (errors, TLS) are reference snippets and are not run.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "walkthrough.md"
LAST_SECTION_END = "\n## Errors, deadlines, keepalive"
# ```sh blocks are shown, not run (§8's, which need a stack of their own with speculation on).
FENCE = re.compile(r"```(bash|python)\n(.*?)```", re.S)
SERVER_LINE = re.compile(r"^(make run|\.venv/bin/loraplex up)\b.*$", re.M)
DOC_PORTS = ("50051", "50052", "8000", "50061", "50062")
READY = "Ctrl-C stops everything"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sections() -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, [(language, code)]) of §0–§6, in document order."""
    text = DOC.read_text().split(LAST_SECTION_END)[0]
    out = []
    for part in text.split("\n## ")[1:]:
        title = part.splitlines()[0]
        out.append((title, [(m.group(1), m.group(2)) for m in FENCE.finditer(part)]))
    return out


class Walk:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.ports = {p: str(_free_port()) for p in DOC_PORTS}
        self.env = dict(
            os.environ,
            PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'protos'}",
            LORAPLEX_TARGET=f"127.0.0.1:{self.ports['50051']}",
            INFERENCE=f"127.0.0.1:{self.ports['50051']}",
            STORE=f"127.0.0.1:{self.ports['50052']}",
        )
        self.servers: list[subprocess.Popen] = []
        self.launched: dict[str, subprocess.Popen] = {}  # launched, not yet claimed by a section
        self.started, self.ran = 0, 0  # stacks started, blocks run

    def localize(self, code: str) -> str:
        code = re.sub(r"(?<!\d)(50051|50052|8000|50061|50062)(?!\d)", lambda m: self.ports[m.group(1)], code)
        return code.replace("/tmp/", f"{self.tmp}/")

    def launch(self, line: str) -> subprocess.Popen:
        """Popen a server line as the reader would run it in its own terminal (not waited for)."""
        line = key = line.split("#")[0].strip()
        if line == "make run":
            p = self.ports
            line = (
                f".venv/bin/loraplex up --port {p['50051']} --store-port {p['50052']} "
                f"--openai-port {p['8000']} --cache-dir {self.tmp}/stack"
            )
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {line}"],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.launched[key] = proc
        return proc

    def prelaunch(self, lines: list[str]) -> None:
        """Launch every stack the document starts at once: they load side by side (the second
        stack's own ports and cache dir keep it apart until its section uses it)."""
        for line in lines:
            self.launch(line)

    def start(self, line: str) -> subprocess.Popen:
        """The section's server line: the prelaunched stack (else a fresh one), once it is ready."""
        key = line.split("#")[0].strip()
        if key not in self.launched:
            self.launch(line)
        proc = self.launched.pop(key)
        self.servers.append(proc)
        self.started += 1
        seen: list[str] = []
        deadline = time.monotonic() + 300
        while not any(READY in s for s in seen):
            assert proc.poll() is None and time.monotonic() < deadline, f"{line}:\n{''.join(seen)}"
            seen.append(proc.stdout.readline())
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in its terminal
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        proc.stdout.close()

    def bash(self, code: str, where: str) -> None:
        expected = re.findall(r"# ERROR: Code: (\w+)", code)
        script = (
            "FAILS=0\ntrap 'FAILS=$((FAILS+1)); echo \"walkthrough: failed: $BASH_COMMAND\"' ERR\n"
            f'{code}\necho "walkthrough-failures=$FAILS"\n'
        )
        out = subprocess.run(
            ["bash", "-c", script], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=300
        )
        text = out.stdout + out.stderr
        fails = int(re.search(r"walkthrough-failures=(\d+)", out.stdout).group(1))
        assert fails == len(expected), (
            f"{where}: {fails} commands failed, the document expects {expected}:\n{text}"
        )
        for code_name in expected:
            assert f"Code: {code_name}" in text, f"{where}: expected {code_name}:\n{text}"

    def python(self, code: str, where: str) -> None:
        out = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "python"), "-"],
            input=code,
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, f"{where}:\n{code}\n{out.stdout}\n{out.stderr}"


def test_the_walkthrough_runs_as_written(tmp_path):
    walk = Walk(tmp_path)
    assert len(sections()) >= 7
    try:
        walk.prelaunch(
            [
                m.group(0)
                for _, blocks in sections()
                for _, code in blocks
                for m in SERVER_LINE.finditer(walk.localize(code))
            ]
        )
        for title, blocks in sections():
            for k, (lang, code) in enumerate(blocks):
                code = walk.localize(code)
                where = f"section {title!r}, block {k + 1}"
                for match in SERVER_LINE.finditer(code):
                    walk.start(match.group(0))
                rest = SERVER_LINE.sub("", code).strip()
                if rest:
                    (walk.bash if lang == "bash" else walk.python)(rest, where)
                    walk.ran += 1
            for proc in walk.servers[1:]:  # a second stack lives for its section only
                walk.stop(proc)
            walk.servers = walk.servers[:1]
    finally:
        for proc in [*walk.servers, *walk.launched.values()]:
            walk.stop(proc)
    assert walk.started == 2 and walk.ran >= 18, (walk.started, walk.ran)  # §0's stack and §4's
