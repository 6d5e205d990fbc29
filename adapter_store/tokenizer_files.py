"""The small tokenizer files an adapter may ship beside its config and weights, carried to servers.

An adapter saved with its tokenizer (`save_pretrained`) may bring its own chat template
(`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`) and special-token files.
The inference server renders chats with the adapter's template; without these files travelling
through the store, a server with a store lost the template silently. Only the names in
`CARRIED_FILES` are read (another file is added there, with its check); each is at most
`MAX_FILE_BYTES`, UTF-8, and a JSON object when it is `.json`. They live in the record (Redis and
the record files, like the config's text) and go out in the PullAdapter header; `files_digest`
names them, so a change to them alone is a new content, seen by every watcher.
`tokenizer.json` (megabytes) is not carried: it belongs in the blob store, not in a record.
"""

from __future__ import annotations

import hashlib
import json

from loraplex.adapter_store.errors import InvalidArgument

# Read when present; the inference side writes the same names into its cached copy.
CARRIED_FILES = ("chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json")
# The inference side reads a template file up to 4 MiB (lora/adapter.py); Gemma's
# tokenizer_config.json, with its added tokens, is about 1 MiB.
MAX_FILE_BYTES = 4 * 2**20


def check_file(name: str, data: bytes) -> str:
    """The file's text, or InvalidArgument naming it and why."""
    if name not in CARRIED_FILES:
        raise InvalidArgument(f"{name} is not a tokenizer file the store carries", field=name)
    if len(data) > MAX_FILE_BYTES:
        raise InvalidArgument(
            f"{name} is {len(data)} bytes; at most {MAX_FILE_BYTES} are carried", field=name
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:  # its message would echo the file's bytes
        raise InvalidArgument(f"{name} is not UTF-8 (at byte {e.start})", field=name) from None
    if "\0" in text:
        raise InvalidArgument(f"{name} holds a NUL character", field=name)
    if name.endswith(".json"):
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):
            raise InvalidArgument(f"{name} is not valid JSON", field=name) from None
        if not isinstance(parsed, dict):
            raise InvalidArgument(f"{name} is not a JSON object", field=name)
    return text


def files_digest(files: dict[str, bytes]) -> str:
    """ "sha256:<hex>" over each file's name and sha256, in name order; "" for no files. The inference
    side computes the same over what it received."""
    if not files:
        return ""
    lines = "".join(f"{name}\0{hashlib.sha256(files[name]).hexdigest()}\n" for name in sorted(files))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def encode(files: dict[str, str]) -> str:
    """The record's `files_json`: name -> text ("" for none)."""
    return json.dumps(files, sort_keys=True) if files else ""


def decode(files_json: str) -> dict[str, bytes]:
    return {n: t.encode() for n, t in json.loads(files_json).items()} if files_json else {}
