"""The tokenizer files an adapter may ship beside its config and weights, carried to servers.

An adapter saved with its tokenizer (`save_pretrained`) may bring its own chat template
(`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`), special-token files, and its
own tokenizer (`tokenizer.json`; `added_tokens.json`): a fine-tune that teaches new markers maps each
to one id, which the base tokenizer would split. The inference server tokenizes that adapter's
requests with it (services/inference/engine/adapter_tokenizers.py). Only the names in
`CARRIED_FILES` are read; each is bounded (`file_limit`), UTF-8, and a JSON object when it is
`.json`. Each distinct set is kept once on disk (tokenizer_store.py); the record names it by
`files_digest` (so a change to the files alone is a new content, seen by every watcher), and a pull
sends the files in the PullAdapter header. `check_vocabulary` refuses at registration a tokenizer
that does not load, or that can produce an id past the base model's embedding rows (with
--base-model), naming the token and id.
"""

from __future__ import annotations

import hashlib
import json

from loraplex.adapter_store.base_model import BaseModelShapes
from loraplex.adapter_store.errors import FailedPrecondition, InvalidArgument

# Read when present; the inference side writes the same names into its cached copy.
CARRIED_FILES = (
    "chat_template.jinja",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "added_tokens.json",
)
# The inference side reads a template file up to 4 MiB (lora/adapter_files.py); Gemma's
# tokenizer_config.json, with its added tokens, is about 1 MiB.
MAX_FILE_BYTES = 4 * 2**20
# tokenizer.json: Llama 3's is 9 MB, Qwen2.5's 7 MB, Mistral Nemo's 9 MB. It travels in the one
# PullAdapter header message (and is read whole at registration and pull), so it is bounded
# well below the 64 MiB a server accepts per message; Gemma's (17-33 MB) are over it and refused.
MAX_TOKENIZER_JSON_BYTES = 16 * 2**20


def file_limit(name: str) -> int:
    return MAX_TOKENIZER_JSON_BYTES if name == "tokenizer.json" else MAX_FILE_BYTES


def check_file(name: str, data: bytes) -> str:
    """The file's text, or InvalidArgument naming it and why."""
    if name not in CARRIED_FILES:
        raise InvalidArgument(f"{name} is not a tokenizer file the store carries", field=name)
    if len(data) > file_limit(name):
        raise InvalidArgument(
            f"{name} is {len(data)} bytes; at most {file_limit(name)} are carried", field=name
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


def _stated_ids(name: str, doc: dict) -> list[tuple[int, str]]:
    """(id, token) of the added tokens a file states."""
    if name == "added_tokens.json":
        return [(i, str(t)) for t, i in doc.items() if isinstance(i, int) and not isinstance(i, bool)]
    if name == "tokenizer_config.json" and isinstance(doc.get("added_tokens_decoder"), dict):
        return [
            (int(i), str(t.get("content") if isinstance(t, dict) else t))
            for i, t in doc["added_tokens_decoder"].items()
            if str(i).isdigit()
        ]
    return []


def check_vocabulary(texts: dict[str, str], base: BaseModelShapes | None) -> None:
    """`tokenizer.json` loads as a tokenizer (InvalidArgument naming it), and no id it or the other
    files state is at or past the base model's embedding rows (FailedPrecondition naming the token
    and id; checked only with --base-model, which gives the rows)."""
    ids: list[tuple[int, str]] = []
    if "tokenizer.json" in texts:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_str(texts["tokenizer.json"])
        except Exception as exc:  # noqa: BLE001 - any parse failure: its message names no bytes of ours
            raise InvalidArgument(
                f"tokenizer.json does not load as a tokenizer: {str(exc)[:200]}", field="tokenizer.json"
            ) from None
        ids += [(i, t) for t, i in tokenizer.get_vocab(with_added_tokens=True).items()]
    for name, text in texts.items():
        if name.endswith(".json") and name != "tokenizer.json":
            ids += _stated_ids(name, json.loads(text))
    rows = base.linears["lm_head"][1] if base is not None and "lm_head" in base.linears else None
    past = sorted(t for t in ids if rows is not None and t[0] >= rows)
    if past:
        token_id, token = past[0]
        raise FailedPrecondition(
            f"the adapter's tokenizer has token {token[:40]!r} at id {token_id}, past the {rows} embedding "
            f"rows of the base model {base.name}: adapters whose tokenizer adds ids past the embedding are "
            "not served (trainable rows of existing ids are: map the new token onto one of them)",
            field="tokenizer",
        )


def files_digest(files: dict[str, bytes]) -> str:
    """ "sha256:<hex>" over each file's name and sha256, in name order; "" for no files. The inference
    side computes the same over what it received."""
    if not files:
        return ""
    lines = "".join(f"{name}\0{hashlib.sha256(files[name]).hexdigest()}\n" for name in sorted(files))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def encode(files: dict[str, str]) -> str:
    """A set's stored form (and an older record's inline `files_json`): name -> text ("" for none)."""
    return json.dumps(files, sort_keys=True) if files else ""


def decode(files_json: str) -> dict[str, bytes]:
    return {n: t.encode() for n, t in json.loads(files_json).items()} if files_json else {}
