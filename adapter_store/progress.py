"""A progress object huggingface_hub accepts as `tqdm_class`, writing to the service log."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("loraplex.adapter_store.download")


class LogProgress:
    """Logs bytes downloaded at most every `every_s` seconds and once at the end."""

    every_s = 2.0

    def __init__(self, *, total: int | None = None, initial: int = 0, desc: str = "", **_: object):
        self.total = total
        self.n = initial
        self.desc = desc
        self._last = time.monotonic()
        if initial:
            log.info("resuming %s at %d bytes", desc, initial)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._log("downloading")

    def _log(self, what: str) -> None:
        if self.total:
            log.info(
                "%s %s: %d / %d bytes (%.0f%%)",
                what,
                self.desc,
                self.n,
                self.total,
                100 * self.n / self.total,
            )
        else:
            log.info("%s %s: %d bytes", what, self.desc, self.n)

    def close(self) -> None:
        self._log("downloaded")

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
