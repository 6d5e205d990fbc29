"""Read and check a safetensors header without loading any tensor data.

Layout: 8-byte little-endian header length N, N bytes of JSON, then the data buffer. The
header is capped before it is read (a huge N is refused, not allocated) and every tensor's
offsets are checked against its dtype/shape and against the real file size.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import NamedTuple

from loraplex.adapter_store.errors import InvalidArgument

MAX_HEADER_BYTES = 16 * 2**20
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


class TensorInfo(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    # Byte offsets relative to the start of the data buffer.
    begin: int
    end: int


class SafetensorsHeader(NamedTuple):
    data_start: int
    file_size: int
    # In data-buffer order.
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]


def read_header(path: Path, label: str = "adapter_model.safetensors") -> SafetensorsHeader:
    """Parse and check the header of the safetensors file at `path` (`label` names it in errors)."""
    file_size = os.path.getsize(path)
    if file_size < 8:
        raise InvalidArgument(
            f"{label}: file is {file_size} bytes, too short for a safetensors header", field=label
        )
    with open(path, "rb") as f:
        # The length field is never echoed: in a file that is not safetensors it is the file's
        # first 8 bytes (a symlink to /etc/passwd would print "root:x:0").
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES:
            raise InvalidArgument(
                f"{label}: the header length field exceeds the {MAX_HEADER_BYTES}-byte cap (not a "
                "safetensors file?)",
                field=f"{label}:header",
            )
        if 8 + header_len > file_size:
            raise InvalidArgument(
                f"{label}: the header length field runs past the end of the {file_size}-byte file "
                "(truncated file?)",
                field=f"{label}:header",
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InvalidArgument(
            f"{label}: header is not valid JSON: not UTF-8 at byte {e.start}", field=f"{label}:header"
        ) from None
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{label}: header is not valid JSON: {e}", field=f"{label}:header") from None
    except RecursionError:
        raise InvalidArgument(f"{label}: header JSON is nested too deeply", field=f"{label}:header") from None
    if not isinstance(header, dict):
        raise InvalidArgument(f"{label}: header is not a JSON object", field=f"{label}:header")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise InvalidArgument(f"{label}: __metadata__ is not an object", field=f"{label}:__metadata__")
    data_start = 8 + header_len
    tensors = sorted(
        (_tensor_info(label, name, entry) for name, entry in header.items()), key=lambda t: t.begin
    )
    _check_layout(label, tensors, file_size - data_start)
    return SafetensorsHeader(
        data_start, file_size, tuple(tensors), {str(k): str(v) for k, v in metadata.items()}
    )


def _tensor_info(label: str, name: str, entry: object) -> TensorInfo:
    where = f"{label}:{name}"
    if not isinstance(entry, dict):
        raise InvalidArgument(f"{where}: header entry is not an object", field=where)
    dtype = entry.get("dtype")
    if dtype not in DTYPE_BYTES:
        raise InvalidArgument(
            f"{where}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}", field=f"{where}.dtype"
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InvalidArgument(
            f"{where}: shape {shape!r} is not a list of non-negative ints", field=f"{where}.shape"
        )
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise InvalidArgument(
            f"{where}: data_offsets {offsets!r} are malformed", field=f"{where}.data_offsets"
        )
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise InvalidArgument(
            f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {nbytes}",
            field=f"{where}.data_offsets",
        )
    return TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_layout(label: str, tensors: list[TensorInfo], data_size: int) -> None:
    """Tensors must tile the data buffer exactly: no gaps, no overlaps, nothing past the end."""
    position = 0
    for t in tensors:
        if t.begin != position:
            kind = "overlaps the previous tensor" if t.begin < position else "leaves a gap before it"
            raise InvalidArgument(
                f"{label}:{t.name}: data_offsets {kind}", field=f"{label}:{t.name}.data_offsets"
            )
        if t.end > data_size:
            raise InvalidArgument(
                f"{label}:{t.name}: data ends at byte {t.end} of a {data_size}-byte data buffer (truncated "
                "file?)",
                field=f"{label}:{t.name}.data_offsets",
            )
        position = t.end
    if position != data_size:
        raise InvalidArgument(
            f"{label}: {data_size - position} trailing bytes after the last tensor", field=f"{label}:data"
        )
