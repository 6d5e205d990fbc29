"""loraplex.v1.AdapterStore over gRPC: proto <-> registry calls, errors -> status codes.

Errors carry google.rpc rich details: BadRequest field violations for INVALID_ARGUMENT /
FAILED_PRECONDITION (the field names the file, tensor and attribute at fault) and
ResourceInfo naming the adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import re
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc._cython import cygrpc
from grpc_status import rpc_status
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from loraplex.adapter_store import errors
from loraplex.adapter_store.index_events import stream_position
from loraplex.adapter_store.records import StoreRecord
from loraplex.adapter_store.registry import AdapterRegistry
from loraplex.adapter_store.watch_hub import WatchHub
from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
# How long one XREAD waits: also the longest a shutdown waits for open watch streams.
WATCH_BLOCK_MS = 1000
EVENT_ID_RE = re.compile(r"^\d+(-\d+)?$")
# The event a resuming watcher gets when the stream no longer holds every event after its id.
RESYNC = "resync"

_CODES = {
    errors.InvalidArgument: code_pb2.INVALID_ARGUMENT,
    errors.NotFound: code_pb2.NOT_FOUND,
    errors.PermissionDenied: code_pb2.PERMISSION_DENIED,
    errors.FailedPrecondition: code_pb2.FAILED_PRECONDITION,
    errors.ResourceExhausted: code_pb2.RESOURCE_EXHAUSTED,
    errors.Unavailable: code_pb2.UNAVAILABLE,
}


def record_to_proto(r: StoreRecord) -> pb.AdapterRecord:
    return pb.AdapterRecord(
        name=r.name,
        source=r.source,
        revision=r.revision,
        digest=r.digest,
        base_model=r.base_model,
        rank=r.rank,
        alpha=r.alpha,
        target_modules=list(r.target_modules),
        use_rslora=r.use_rslora,
        dtype=r.dtype,
        size_bytes=r.size_bytes,
        created_at=r.created_at,
        last_used_at=r.last_used_at,
        generation=r.generation,
        config_digest=r.config_digest,
        files_digest=r.files_digest,
    )


def rich_status(error: errors.StoreError, resource: str = "") -> grpc.Status:
    code = next(c for cls, c in _CODES.items() if isinstance(error, cls))
    details = []
    if error.field and code in (code_pb2.INVALID_ARGUMENT, code_pb2.FAILED_PRECONDITION):
        violation = error_details_pb2.BadRequest.FieldViolation(field=error.field, description=error.message)
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    resource = resource if len(resource) <= 128 else ""  # longer is no adapter name; keep the trailer small
    if error.name or resource:
        details.append(
            error_details_pb2.ResourceInfo(
                resource_type="loraplex.v1.Adapter",
                resource_name=error.name or resource,
                description=error.message,
            )
        )
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    return rpc_status.to_status(status_pb2.Status(code=code, message=error.message, details=packed))


def _to_store_error(e: Exception) -> errors.StoreError | None:
    if isinstance(e, errors.StoreError):
        return e
    if isinstance(e, RedisConnectionError | RedisTimeoutError):
        log.warning("Redis unreachable: %s", e)
        return errors.Unavailable("the store's Redis index is unreachable; retry shortly")
    if isinstance(e, RedisError):
        # The full text (script SHA, script line, server internals) goes to the log, not the client.
        log.warning("Redis error: %s", e)
        return errors.Unavailable(f"the store's Redis index {redis_failure(e)}; retry shortly")
    if isinstance(e, TimeoutError):
        return errors.Unavailable(str(e) or "timed out waiting for another registration of this adapter")
    if isinstance(e, OSError):  # the store's own disk (cache dir full, unwritable, ...)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return errors.ResourceExhausted(
                f"the store's cache directory is out of space ({os.strerror(e.errno)}); free space or "
                "lower --cache-max-bytes"
            )
        return errors.Unavailable(f"the store's cache directory failed: {os.strerror(e.errno or 0)}")
    return None


# Redis error codes a client can act on, in words; anything else is "failed".
_REDIS_REFUSALS = {
    "MISCONF": "refused the write: Redis cannot persist to its disk (is it full?)",
    "READONLY": "refused the write: it is a read-only replica",
    "NOREPLICAS": "refused the write: not enough replicas to write to",
    "OOM": "refused the write: Redis is out of memory (maxmemory)",
    "BUSY": "is busy running a script",
    "LOADING": "is loading its data set",
}


def redis_failure(e: Exception) -> str:
    """What went wrong in Redis, in words, without the server's text (script SHAs, lines)."""
    text = str(e)
    for code, words in _REDIS_REFUSALS.items():
        if re.search(rf"(^|[\s:]){code}\b", text):
            return words
    return f"failed ({type(e).__name__})"


def _handle_errors(method):
    """Turn store and Redis errors into status codes; anything else is a bug (INTERNAL, logged)."""

    @functools.wraps(method)
    async def unary(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except Exception as e:  # noqa: BLE001 - mapped or re-raised as INTERNAL below
            await _abort(e, request, context)

    return unary


class CallerGoneFilter(logging.Filter):
    """grpc logs a write to a stream whose caller went away (a killed client mid-pull) as an ERROR
    with a traceback, from inside grpc where the servicer cannot catch it; it is routine."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, cygrpc.ExecuteBatchError):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args, record.exc_info, record.exc_text = (
                "a stream ended: the caller went away (%s)",
                (type(error).__name__,),
                None,
                None,
            )
        return True


def _caller_gone(request, how: str) -> None:
    """A killed client or a passed deadline is routine: one INFO line, no traceback."""
    log.info(
        "%s of %r ended: the caller went away (%s)",
        type(request).__name__,
        getattr(request, "name", "")[:128],
        how,
    )


async def _abort(e: Exception, request, context: grpc.aio.ServicerContext) -> None:
    if isinstance(e, asyncio.CancelledError):
        raise e
    if isinstance(e, cygrpc.ExecuteBatchError) or context.cancelled():
        _caller_gone(request, type(e).__name__)  # nobody to answer
        return
    store_error = _to_store_error(e)
    if store_error is None:
        log.exception("internal error in %s", type(request).__name__)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
    status = rich_status(store_error, getattr(request, "name", ""))
    if status.code == grpc.StatusCode.UNAVAILABLE:
        log.warning("%s: %s", type(request).__name__, store_error.message)
    await context.abort_with_status(status)


class AdapterStoreServicer(pb_grpc.AdapterStoreServicer):
    def __init__(self, registry: AdapterRegistry, max_watchers: int = 1024):
        self.registry = registry
        self.hub = WatchHub(registry.index, max_watchers, WATCH_BLOCK_MS)

    def begin_shutdown(self) -> None:
        """Watch streams end (UNAVAILABLE, so clients reconnect elsewhere) instead of holding the drain;
        fetches in worker threads stop."""
        self.hub.stop()
        self.registry.begin_shutdown()

    @_handle_errors
    async def RegisterAdapter(self, request: pb.RegisterAdapterRequest, context) -> pb.AdapterRecord:
        record = await self.registry.register(request.name, request.source, request.revision)
        return record_to_proto(record)

    @_handle_errors
    async def GetAdapter(self, request: pb.GetAdapterRequest, context) -> pb.AdapterRecord:
        return record_to_proto(await self.registry.get(request.name))

    @_handle_errors
    async def ListAdapters(
        self, request: pb.ListStoreAdaptersRequest, context
    ) -> pb.ListStoreAdaptersResponse:
        records, next_token = await self.registry.list(request.page_size, request.page_token)
        return pb.ListStoreAdaptersResponse(
            adapters=[record_to_proto(r) for r in records], next_page_token=next_token
        )

    @_handle_errors
    async def DeleteAdapter(self, request: pb.DeleteAdapterRequest, context) -> pb.DeleteAdapterResponse:
        deleted = await self.registry.delete(request.name)
        if not deleted:
            raise errors.NotFound(
                f"no adapter named {request.name!r} to delete", name=request.name, field="name"
            )
        return pb.DeleteAdapterResponse(name=request.name, deleted=True)

    async def PullAdapter(self, request: pb.PullAdapterRequest, context) -> AsyncIterator[pb.AdapterChunk]:
        try:
            async with self.registry.open_pull(request.name) as handle:
                header = pb.AdapterHeader(
                    record=record_to_proto(handle.record),
                    adapter_config_json=handle.record.config_json,
                    files=[pb.AdapterFile(name=n, content=data) for n, data in sorted(handle.files.items())],
                )
                if request.shared_cache:
                    header.local_safetensors_path = str(handle.path)
                    yield pb.AdapterChunk(header=header)
                    return
                # Opened before the header goes out: an open file stays readable even if unlinked later.
                with open(handle.path, "rb") as f:
                    yield pb.AdapterChunk(header=header)
                    while data := await asyncio.to_thread(f.read, CHUNK_BYTES):
                        yield pb.AdapterChunk(data=data)
        except (asyncio.CancelledError, GeneratorExit) as e:  # the stream was closed under us
            _caller_gone(request, type(e).__name__)
            raise
        except Exception as e:  # noqa: BLE001
            await _abort(e, request, context)

    async def WatchAdapters(
        self, request: pb.WatchAdaptersRequest, context
    ) -> AsyncIterator[pb.AdapterEvent]:
        try:
            if request.last_event_id and (
                not EVENT_ID_RE.fullmatch(request.last_event_id)
                or max(stream_position(request.last_event_id)) >= 2**64
            ):
                raise errors.InvalidArgument(
                    f"last_event_id {request.last_event_id[:64]!r} is not a Redis stream id (like "
                    "1700000000000-0)",
                    field="last_event_id",
                )
            async with self.hub.subscribe() as feed:
                # Headers go out once subscribed: a client can tell it is watching before any event.
                await context.send_initial_metadata(())
                index = self.registry.index
                last = request.last_event_id or await index.last_event_id()
                if last == "0":
                    last = "0-0"
                if request.last_event_id and await index.events_missing_after(last):
                    # A gap the stream cannot fill: say so, and carry on from its end once the
                    # caller has re-listed (events from here on are delivered after the marker).
                    gap_from, last = last, await index.last_event_id()
                    log.info("WatchAdapters from %s: events since were trimmed; resync at %s", gap_from, last)
                    yield pb.AdapterEvent(id=last, type=RESYNC, time=time.time())
                # The backlog, in short non-blocking reads; then the shared reader's live feed,
                # which starts no later than where the backlog ends (duplicates are skipped).
                while batch := await index.read_events(last, block_ms=None):
                    for ev in batch:
                        last = ev.id
                        yield _event_proto(ev)
                while True:
                    try:
                        ev = await feed.next()
                    except errors.Unavailable as e:
                        raise errors.Unavailable(
                            f"{e.message}; reconnect with last_event_id={last}"
                        ) from None
                    if stream_position(ev.id) > stream_position(last):
                        last = ev.id
                        yield _event_proto(ev)
        except Exception as e:  # noqa: BLE001
            with contextlib.suppress(asyncio.CancelledError):
                await _abort(e, request, context)


def _event_proto(ev) -> pb.AdapterEvent:
    return pb.AdapterEvent(
        id=ev.id,
        type=ev.type,
        name=ev.name,
        digest=ev.digest,
        generation=ev.generation,
        time=ev.time,
        config_digest=ev.config_digest,
        files_digest=ev.files_digest,
    )
