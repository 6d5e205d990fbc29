"""One PullAdapter stream onto disk, and where pulled adapters live in the cache directory.

`stream_into` writes a pull into a temp dir: the header's config and tokenizer files checked
against the record's digests (known names only, each bounded) and booked under the cache's byte
bound before anything is written, the weights counted as they arrive (never past the record's
size) and hashed. store_client.py renames the finished temp dir to `content_dir_name(...)`, so a
reader never sees a half-written adapter; `remove_stale_pulls` drops what a killed server left.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import AsyncIterable, Awaitable, Callable
from pathlib import Path

import grpc

from loraplex.services.inference.adapter_cache import (
    CARRIED_FILES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    carried_file_limit,
    tokenizer_files_digest,
)
from loraplex.services.inference.errors import AdapterInvalid, BackendUnavailable
from loraplex.services.inference.store_rpc import map_rpc_error
from loraplex.v1 import adapter_store_pb2 as pb

log = logging.getLogger(__name__)


def _hex(digest: str) -> str:
    return digest.split(":", 1)[1] if ":" in digest else digest


def content_dir_name(weights_digest: str, config_digest: str, files_digest: str = "") -> str:
    """The cache directory of one adapter content: every digest, so the same weights under another
    adapter_config.json (another lora_alpha, rank_pattern, ...) or another chat template never
    share a copy."""
    name = f"{_hex(weights_digest)}-{_hex(config_digest)}"
    return f"{name}-{_hex(files_digest)}" if files_digest else name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_pulls(cache_dir: Path) -> list[str]:
    """Drop what a killed server left: `.pull-<pid>-*` temp dirs of processes that are gone, and
    directories named by the weights digest alone (an older layout that ignored the config).
    Pulls of live servers sharing the directory are left alone."""
    removed = []
    for entry in cache_dir.iterdir():
        name = entry.name
        if name.startswith(".pull-"):
            pid = name.split("-")[1]
            if pid.isdecimal() and (int(pid) == os.getpid() or _alive(int(pid))):
                continue
        elif not (len(name) == 64 and all(c in "0123456789abcdef" for c in name)):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(name)
    if removed:
        log.info("removed %d leftover pulls from %s", len(removed), cache_dir)
    return removed


def _header_files(name: str, header: pb.AdapterHeader, record: pb.AdapterRecord) -> dict[str, bytes]:
    """The tokenizer files of a PullAdapter header, checked: known names only (never a path), each
    once and bounded, hashing to the record's files_digest."""
    files: dict[str, bytes] = {}
    for f in header.files:
        if f.name not in CARRIED_FILES or f.name in files or len(f.content) > carried_file_limit(f.name):
            raise AdapterInvalid(
                f"adapter {name!r}: the store sent a file {f.name[:64]!r} ({len(f.content)} bytes) that is "
                f"not one of {', '.join(CARRIED_FILES)} within its bound (tokenizer.json "
                f"{carried_file_limit('tokenizer.json')} bytes, the others {carried_file_limit('')}), "
                "once each",
                adapter=name,
            )
        files[f.name] = f.content
    if tokenizer_files_digest(files) != record.files_digest:
        raise AdapterInvalid(f"adapter {name!r}: tokenizer files digest mismatch", adapter=name)
    return files


def _size(record: pb.AdapterRecord | None) -> str:
    return "(no header yet) size" if record is None else f"{record.size_bytes} bytes"


async def stream_into(
    open_stream: Callable[[str], AsyncIterable[pb.AdapterChunk]],
    name: str,
    tmp: Path,
    book: Callable[[pb.AdapterRecord, bytes, dict[str, bytes]], Awaitable[None]],
) -> tuple[pb.AdapterRecord, int]:
    """The pull's files into `tmp` (`open_stream(name)` starts it once the weights file is open);
    `book(record, config, tokenizer files)` runs once the header arrives, before anything is written."""
    record: pb.AdapterRecord | None = None
    weights = hashlib.sha256()
    nbytes = 0
    call = None
    try:
        with open(tmp / WEIGHTS_FILE, "wb") as out:
            call = open_stream(name)
            async for chunk in call:
                if chunk.WhichOneof("payload") == "header":
                    if record is not None:
                        raise BackendUnavailable(
                            f"adapter store sent a second header for {name!r}; pull abandoned",
                            adapter=name,
                        )
                    record = chunk.header.record
                    config = chunk.header.adapter_config_json.encode()
                    if record.config_digest and hashlib.sha256(config).hexdigest() != _hex(
                        record.config_digest
                    ):
                        raise AdapterInvalid(
                            f"adapter {name!r}: adapter_config.json digest mismatch", adapter=name
                        )
                    files = _header_files(name, chunk.header, record)
                    await book(record, config, files)
                    (tmp / CONFIG_FILE).write_bytes(config)
                    for file_name, data in files.items():
                        (tmp / file_name).write_bytes(data)
                else:
                    # Counted as it arrives: a store (or whatever answers in its place) that sends
                    # more than the record says would otherwise fill this server's disk.
                    if record is None or nbytes + len(chunk.data) > record.size_bytes:
                        raise BackendUnavailable(
                            f"adapter store sent adapter {name!r} past the {_size(record)} its record "
                            "gives; pull abandoned",
                            adapter=name,
                        )
                    weights.update(chunk.data)
                    out.write(chunk.data)
                    nbytes += len(chunk.data)
            out.flush()
            os.fsync(out.fileno())
    except grpc.RpcError as err:
        raise map_rpc_error(err, name, "PullAdapter") from None
    finally:
        # An abandoned pull (past the record's size, a bad header, the caller gone) stops the store's
        # stream now, not when the call is collected: it would go on sending into the receive window.
        if call is not None and hasattr(call, "cancel"):
            call.cancel()
    if record is None:
        raise BackendUnavailable(f"adapter store sent no header for {name!r}", adapter=name)
    if "sha256:" + weights.hexdigest() != record.digest and weights.hexdigest() != record.digest:
        raise BackendUnavailable(
            f"adapter {name!r}: pulled bytes hash to sha256:{weights.hexdigest()}, record says "
            f"{record.digest}",
            adapter=name,
        )
    return record, nbytes
