"""A progress object huggingface_hub accepts as `tqdm_class`, writing to the service log; its
bounded form is also where a Hub download is counted and stopped (see `bounded_progress`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from loraplex.adapter_store.errors import InvalidArgument
from loraplex.adapter_store.local_files import Stopped

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


class DownloadBudget:
    """The bytes one adapter's Hub downloads may write in all, counted as they arrive."""

    def __init__(
        self,
        limit: int,
        where: str,
        stop: Callable[[], bool] | None = None,
        limit_name: str = "--max-adapter-bytes",
    ):
        self.limit, self.where, self.stop, self.limit_name = limit, where, stop, limit_name
        self.used = 0

    def take(self, n: int) -> None:
        # n < 0 when huggingface_hub restarts a file whose server ignored a Range request.
        self.used += n
        if self.used > self.limit:
            raise InvalidArgument(
                f"{self.where}: download stopped past {self.limit} bytes, over {self.limit_name} "
                "(the endpoint sent more than it advertised, or more than the limit)",
                field="size_bytes",
            )
        if self.stop is not None and self.stop():
            raise Stopped(f"{self.where}: download abandoned (caller gone or store shutting down)")


def bounded_progress(budget: DownloadBudget) -> type[LogProgress]:
    """A `tqdm_class` whose `update` (called with each chunk before it is written) charges
    `budget`: past the limit, or once `budget.stop` is set, the download raises and stops."""

    class BoundedProgress(LogProgress):
        def update(self, n: int = 1) -> None:
            budget.take(n)
            super().update(n)

    return BoundedProgress
