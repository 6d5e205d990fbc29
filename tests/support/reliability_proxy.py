"""A real TCP proxy that can cut connections: the network fault of the reliability tests.

It forwards bytes both ways between loopback sockets (TLS and HTTP/2 pass through
untouched). `arm(nbytes, times)` cuts whichever connection next carries `nbytes`
server→client bytes after arming, `times` times over, so a long PullAdapter stream
breaks halfway; `refuse = True` drops every new connection and `cut_all()` the open ones;
`throttle_s` slows the server→client direction (a sleep per chunk) so a test can act while a
stream is under way, watching `downstream_bytes`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

UPSTREAM_RCVBUF = 16384


class CuttingProxy:
    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._budget: int | None = None
        self._nbytes = 0
        self._left = 0
        self.cuts = 0
        self.refuse = False
        self.throttle_s = 0.0
        self.downstream_bytes = 0
        self._open: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def arm(self, nbytes: int, times: int = 1) -> None:
        with self._lock:
            self._nbytes, self._budget, self._left = nbytes, nbytes, times

    def disarm(self) -> None:
        with self._lock:
            self._budget, self._left = None, 0

    def cut_all(self) -> None:
        with self._lock:
            conns = list(self._open)
        for s in conns:
            _close(s)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        self.cut_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refuse:
                _close(client)
                continue
            try:
                # A small receive window toward the server: with throttling, most of a long stream
                # then waits inside the server process (lost if it dies), not in kernel buffers.
                server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UPSTREAM_RCVBUF)
                server.settimeout(5)
                server.connect(self.upstream)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open.update((client, server))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        try:
            while True:
                data = src.recv(UPSTREAM_RCVBUF if downstream and self.throttle_s else 65536)
                if not data:
                    break
                if downstream:
                    if self._spend(len(data)):
                        break
                    if self.throttle_s:
                        time.sleep(self.throttle_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            _close(src)
            _close(dst)

    def _spend(self, n: int) -> bool:
        """Count `n` downstream bytes against an armed budget; True = cut this connection now."""
        with self._lock:
            self.downstream_bytes += n
            if self._budget is None or self._left <= 0:
                return False
            self._budget -= n
            if self._budget > 0:
                return False
            self.cuts += 1
            self._left -= 1
            self._budget = self._nbytes if self._left > 0 else None
            return True


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()
