"""A real TCP proxy that can cut connections: the network fault of the reliability tests.

It forwards bytes both ways between loopback sockets (TLS and HTTP/2 pass through
untouched). `arm(nbytes, times)` cuts whichever connection next carries `nbytes`
server→client bytes after arming, `times` times over, so a long PullAdapter stream
breaks halfway; `refuse = True` drops every new connection and `cut_all()` the open ones.
"""

from __future__ import annotations

import contextlib
import socket
import threading


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
                server = socket.create_connection(self.upstream, timeout=5)
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
                data = src.recv(65536)
                if not data:
                    break
                if downstream and self._spend(len(data)):
                    break
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
