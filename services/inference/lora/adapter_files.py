"""The files of a PEFT adapter directory the inference side reads, and their bounds.

Which files (`adapter_config.json`, `adapter_model.safetensors`, the chat template's), how much of
each is read, how each is opened (regular files only, a FIFO or device refused), and the adapter's
content digest over the bytes actually read. The tensors themselves are read by adapter_loader.py.

An adapter may ship its own chat template (`chat_template.jinja`, or `chat_template` in its
`tokenizer_config.json`, as `save_pretrained` writes them). It is read here, at load time, with the
weights: a regular file only, size-bounded, and covered by the adapter's content digest, so the
template a request renders is the one that was checked and loaded, not whatever the directory
holds when the first chat arrives.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from pathlib import Path

from loraplex.services.inference.errors import AdapterInvalid, AdapterNotFound
from loraplex.services.inference.lora.config import AdapterSpec, parse_adapter_config

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
MAX_HEADER_BYTES = 16 * 2**20  # same cap as the adapter store's
MAX_CONFIG_BYTES = 1 * 2**20
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Read besides the config and the weights, for the chat template (the first one present wins).
TEMPLATE_FILES = (TEMPLATE_FILE, TOKENIZER_CONFIG_FILE)
# Large enough for any real tokenizer_config.json (Gemma's, with its added tokens, is about 1 MiB).
MAX_TEMPLATE_FILE_BYTES = 4 * 2**20


def check_header_size(path: Path) -> None:
    """Refuse a safetensors header longer than MAX_HEADER_BYTES (or the file) before it is parsed."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE} is {size} bytes, too short for a safetensors header", field=WEIGHTS_FILE
        )
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        # n is not echoed: in a file that is not safetensors it is the file's first 8 bytes.
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: the header length field exceeds the {MAX_HEADER_BYTES}-byte cap "
            f"or the {size}-byte file (truncated, or not safetensors?)",
            field=WEIGHTS_FILE,
        )


def content_digest(directory: Path, side_files: dict[str, bytes]) -> str:
    """sha256 of the config and weights (as the adapter store computes it) and of the other files
    read (`side_files`, the bytes actually used), so a changed template is another version."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode() + b"\0")
        with open(directory / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    for name, data in sorted(side_files.items()):
        h.update(b"\0" + name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return "sha256:" + h.hexdigest()


def read_side_file(path: Path, limit: int) -> bytes | None:
    """The bytes of the regular file `path` (None if absent), at most `limit` of them.

    Symlinks are followed (a Hub cache snapshot is all symlinks); where they may lead is checked
    before loading (`local_sources`, --allowed-local-dirs). A FIFO or device is refused, not
    read: it would block or never end, and `stat` says 0 bytes for both."""
    if not os.path.lexists(path):
        return None
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        reason = "a dangling symlink" if isinstance(e, FileNotFoundError) else e.strerror
        raise AdapterInvalid(f"{path.name} cannot be opened: {reason}", field=path.name) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AdapterInvalid(f"{path.name} is not a regular file", field=path.name)
        data = b""
        while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > limit:
        raise AdapterInvalid(f"{path.name} is over {limit} bytes, the most read", field=path.name)
    return data


def read_chat_template(directory: str | Path) -> tuple[str | None, dict[str, bytes]]:
    """The chat template the directory ships (None: none) and the files read to find it."""
    directory = Path(directory)
    for name in TEMPLATE_FILES:
        data = read_side_file(directory / name, MAX_TEMPLATE_FILE_BYTES)
        if data is None:
            continue
        try:
            text = data.decode("utf-8")
            template = text if name == TEMPLATE_FILE else json.loads(text).get("chat_template")
        except UnicodeDecodeError as e:  # its message would echo the file's bytes
            raise AdapterInvalid(f"{name} is not UTF-8 at byte {e.start}", field=name) from None
        except (ValueError, AttributeError, RecursionError):
            raise AdapterInvalid(f"{name} is not a JSON object", field=name) from None
        if name == TOKENIZER_CONFIG_FILE and not isinstance(template, str):
            template = None  # a tokenizer_config.json without a template (or with a list of named ones)
        return template or None, {name: data}
    return None, {}


def read_config(directory: str | Path) -> tuple[AdapterSpec, Path]:
    """Parse the directory's adapter_config.json (no weights read)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AdapterNotFound(f"adapter directory {directory} does not exist", field="source")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterInvalid(f"{directory} has no {CONFIG_FILE}", field=CONFIG_FILE)
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterInvalid(
            f"{CONFIG_FILE} is {config_path.stat().st_size} bytes; at most {MAX_CONFIG_BYTES} are read",
            field=CONFIG_FILE,
        )
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterInvalid(f"{CONFIG_FILE} is not valid JSON: {e}", field=CONFIG_FILE) from None
    except UnicodeDecodeError as e:  # its message would echo the file's bytes
        raise AdapterInvalid(
            f"{CONFIG_FILE} is not valid JSON: not UTF-8 at byte {e.start}", field=CONFIG_FILE
        ) from None
    except RecursionError:
        raise AdapterInvalid(f"{CONFIG_FILE}: JSON nested too deeply", field=CONFIG_FILE) from None
    return parse_adapter_config(cfg), directory
