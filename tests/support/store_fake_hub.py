"""A local stand-in for the Hugging Face Hub's HTTP API, enough for huggingface_hub 2.x.

It answers what `HfApi.model_info` and `hf_hub_download` call, the way the Hub does:
- GET  /api/models/<org>/<repo>[/revision/<rev>]  -> {"id", "sha", "siblings"}; 404 +
  X-Error-Code RepoNotFound / RevisionNotFound; 401 (RepoNotFound) for a private repo
  without the right `Authorization: Bearer` token.
- HEAD /<org>/<repo>/resolve/<rev>/<file>  -> ETag (the file's sha256, as LFS files have),
  X-Repo-Commit, Content-Length; 404 + EntryNotFound for a missing file.
- GET  same -> the bytes, honouring `Range: bytes=N-` (206 + Content-Range) so an interrupted
  download can resume. `cut_next_get(file)` makes the next full GET of that file send half of
  its bytes and drop the connection; `get_delay_s[file]` stalls every GET of it.
- A lying or endless endpoint: `extra_bytes[file] = n` makes every GET of it stream the file and
  then n more bytes with no Content-Length (HEAD still advertises the true size);
  `trickle_s[file]` sleeps that long between 64 KiB pieces of the body. `open_gets` counts the
  GETs still sending.
Every request is logged in `requests` for the tests to count.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple
from urllib.parse import unquote


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> sha
    private: bool = False

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


class LoggedRequest(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names


class FakeHub:
    def __init__(self, token: str = "hf_test_token"):
        self.token = token
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[LoggedRequest] = []
        self._cuts: set[str] = set()
        self.get_delay_s: dict[str, float] = {}  # filename -> seconds to stall before sending its bytes
        self.extra_bytes: dict[str, int] = {}  # filename -> bytes streamed past the file (lying size)
        self.trickle_s: dict[str, float] = {}  # filename -> seconds between 64 KiB pieces
        self.open_gets = 0
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_GET(self):
                hub._handle(self, "GET")

            def do_HEAD(self):
                hub._handle(self, "HEAD")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- test controls ------------------------------------------------------------------------
    def add_commit(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        refs: tuple[str, ...] = ("main",),
        private: bool = False,
    ) -> str:
        repo = self.repos.setdefault(repo_id, FakeRepo(private=private))
        sha = hashlib.sha1(
            repr((repo_id, len(repo.commits), sorted(files))).encode() + b"".join(files.values())
        ).hexdigest()
        repo.commits[sha] = dict(files)
        for ref in refs:
            repo.refs[ref] = sha
        return sha

    def cut_next_get(self, filename: str) -> None:
        with self._lock:
            self._cuts.add(filename)

    def count(self, method: str, suffix: str) -> int:
        return sum(1 for r in self.requests if r.method == method and r.path.endswith(suffix))

    # -- HTTP ---------------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(h.path.split("?", 1)[0])
        with self._lock:
            self.requests.append(LoggedRequest(method, path, {k.lower(): v for k, v in h.headers.items()}))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+?)(?:/revision/(.+))?", path)
        if m and method == "GET":
            return self._model_info(h, m.group(1), m.group(2) or "main")
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(h, method, *m.groups())
        self._error(h, 404, "", "Not found")

    def _authorized(self, h: BaseHTTPRequestHandler, repo: FakeRepo) -> bool:
        return not repo.private or h.headers.get("Authorization") == f"Bearer {self.token}"

    def _repo_or_error(self, h: BaseHTTPRequestHandler, repo_id: str) -> FakeRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", "Repository not found")
            return None
        if not self._authorized(h, repo):
            # What the Hub answers for a private repo without (valid) credentials.
            self._error(h, 401, "RepoNotFound", "Invalid username or password.")
            return None
        return repo

    def _revision_or_error(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str):
        """(repo, commit sha), or None after answering the Hub's 401/404 for a missing repo or revision."""
        repo = self._repo_or_error(h, repo_id)
        if repo is None:
            return None
        sha = repo.resolve(revision)
        if sha is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo, sha

    def _model_info(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str) -> None:
        found = self._revision_or_error(h, repo_id, revision)
        if found is None:
            return
        repo, sha = found
        body = json.dumps(
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": sha,
                "private": repo.private,
                "siblings": [{"rfilename": f} for f in sorted(repo.commits[sha])],
            }
        ).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _resolve(
        self, h: BaseHTTPRequestHandler, method: str, repo_id: str, revision: str, filename: str
    ) -> None:
        found = self._revision_or_error(h, repo_id, revision)
        if found is None:
            return
        repo, sha = found
        data = repo.commits[sha].get(filename)
        if data is None:
            return self._error(h, 404, "EntryNotFound", f"{filename} does not exist", commit=sha)
        start = 0
        rng = h.headers.get("Range")
        if rng and method == "GET":
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
        h.send_response(206 if start else 200)
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("X-Repo-Commit", sha)
        h.send_header("Accept-Ranges", "bytes")
        if method == "HEAD" or start or filename not in self.extra_bytes:
            h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if method == "HEAD":
            return
        time.sleep(self.get_delay_s.get(filename, 0.0))
        with self._lock:
            cut = filename in self._cuts and not start
            self._cuts.discard(filename)
        if not start and (filename in self.extra_bytes or filename in self.trickle_s):
            return self._stream(h, data, self.extra_bytes.get(filename, 0), self.trickle_s.get(filename, 0.0))
        if cut:
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # drop it mid-body: the client sees a short read
            return
        h.wfile.write(data[start:])

    def _stream(self, h: BaseHTTPRequestHandler, data: bytes, extra: int, pause_s: float) -> None:
        """The body after the headers were sent: the file, then `extra` bytes (with `extra` the GET
        had no Content-Length, so the body ends when the connection closes)."""
        body_len = len(data) + extra
        with self._lock:
            self.open_gets += 1
        try:
            sent, piece = 0, 1 << 16
            while sent < body_len:
                chunk = data[sent : sent + piece] if sent < len(data) else b"\0" * min(piece, body_len - sent)
                h.wfile.write(chunk)
                sent += len(chunk)
                if pause_s:
                    time.sleep(pause_s)
        except OSError:
            pass  # the client went away
        finally:
            h.close_connection = True
            with self._lock:
                self.open_gets -= 1

    def _error(
        self, h: BaseHTTPRequestHandler, status: int, code: str, message: str, commit: str = ""
    ) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
