"""An adapter's own tokenizer: built from the tokenizer files it ships, checked against the base
model's embedding rows, and used for that adapter's requests wherever text meets ids.

Fine-tunes that teach new markers (PEFT `trainable_token_indices`) ship a tokenizer that maps the
marker's text to one id; the base tokenizer would split that text into pieces. The files
(`TOKENIZER_FILES`) are read once, at load, with the adapter (never later from its directory),
laid over the base model's tokenizer files (an adapter shipping only a `tokenizer_config.json` keeps
the base vocabulary; its settings files are merged key by key over the base's), and loaded with
transformers. Every id the result can produce (its vocabulary
and added tokens) must be below the base model's embedding rows, and every added token must land on
the id its files state; else the load is refused, naming the token.

A tokenizer equal to the base's (same serialized pipeline and special tokens: most adapters saved
with their tokenizer) is not kept: those requests use the base tokenizer, at no cost. Distinct ones
are cached by the digest of their files, shared by the adapters that ship the same files, and
dropped with the last adapter using them; at most `MAX_ADAPTER_TOKENIZERS` at once (a tokenizer of
Llama 3's size holds tens of MB in memory, twice: the engine thread decodes with its own copy, as it
does for the base, because a fast tokenizer must not be used from two threads at once).
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.services.inference.engine.token_bytes import TokenBytes
from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid

# What an adapter's tokenizer is made of, as `save_pretrained` writes it (the fast tokenizer's
# `tokenizer.json`; a slow tokenizer's vocabulary files are not read: the base's serve).
TOKENIZER_FILES = ("tokenizer.json", "added_tokens.json", "tokenizer_config.json", "special_tokens_map.json")
# The store's bound (adapter_store/tokenizer_files.py: Llama 3's tokenizer.json is 9 MB, Qwen2.5's
# 7 MB), so an adapter loads the same from a directory as through the store.
MAX_TOKENIZER_JSON_BYTES = 16 * 2**20
MAX_OTHER_FILE_BYTES = 4 * 2**20  # as the chat template's files (lora/adapter_files.py)
# Base files copied under an adapter's, so an adapter shipping some of them keeps the rest.
_BASE_FILES = (*TOKENIZER_FILES, "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
MAX_ADAPTER_TOKENIZERS = 8
_MERGED = ("tokenizer_config.json", "special_tokens_map.json")
MAX_BASE_KEYS = 4096  # digests of files known to make the base's tokenizer


def file_limit(name: str) -> int:
    return MAX_TOKENIZER_JSON_BYTES if name == "tokenizer.json" else MAX_OTHER_FILE_BYTES


def files_key(files: dict[str, bytes]) -> str:
    """The files' digest: one tokenizer per distinct set."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return "sha256:" + h.hexdigest()


def read_tokenizer_files(directory: str | Path, read_file) -> dict[str, bytes]:
    """The tokenizer files the directory ships; `read_file(path, limit)` (lora/adapter_files.py
    `read_side_file`): a regular file's bytes or None, AdapterInvalid past the limit."""
    out = {}
    for name in TOKENIZER_FILES:
        data = read_file(Path(directory) / name, file_limit(name))
        if data is not None:
            out[name] = data
    return out


@dataclass(eq=False)
class AdapterTokenizer:
    """One distinct adapter tokenizer: `caller` for request threads (under `lock`), `engine` for
    the engine thread's streaming detokenization."""

    key: str
    caller: object
    engine: object
    lock: threading.Lock = field(default_factory=threading.Lock)
    token_bytes: TokenBytes | None = None
    template_variables: dict = field(default_factory=dict)
    # xgrammar's compiler on this tokenizer's token strings (engine/grammar_cache.py builds it on the
    # first constrained request, under `grammar_lock`): it goes with the entry.
    grammar_compiler: object = None
    grammar_lock: threading.Lock = field(default_factory=threading.Lock)
    dropped: bool = False  # no adapter uses it any more (its compiled grammars are not kept)

    def __post_init__(self):
        self.token_bytes = TokenBytes(self.caller)
        self.template_variables = dict(self.caller.special_tokens_map)


def _stated_ids(files: dict[str, bytes]) -> list[tuple[str, int]]:
    """(token, id) of every added token the files state (the loaded tokenizer must agree)."""
    stated: list[tuple[str, int]] = []
    for name, data in files.items():
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            raise AdapterInvalid(f"{name} is not valid JSON", field=name) from None
        if not isinstance(doc, dict):
            raise AdapterInvalid(f"{name} is not a JSON object", field=name)
        if name == "added_tokens.json":
            stated += [(str(t), i) for t, i in doc.items() if isinstance(i, int)]
        elif name == "tokenizer.json":
            stated += [
                (str(t.get("content")), t["id"])
                for t in doc.get("added_tokens") or ()
                if isinstance(t, dict) and isinstance(t.get("id"), int)
            ]
        elif name == "tokenizer_config.json" and isinstance(doc.get("added_tokens_decoder"), dict):
            stated += [
                (str(t.get("content") if isinstance(t, dict) else t), int(i))
                for i, t in doc["added_tokens_decoder"].items()
                if str(i).isdigit()
            ]
    return stated


def check_vocabulary(tokenizer, stated: list[tuple[str, int]], rows: int) -> None:
    """AdapterIncompatible naming the first token whose id is at or past the embedding's `rows`;
    AdapterInvalid when an added token is not at the id its files state (`stated`, `_stated_ids`)."""
    vocab = tokenizer.get_vocab()  # the model's vocabulary and the added tokens
    for token, token_id in sorted(stated, key=lambda t: t[1]):
        if token_id >= rows:
            break  # refused below, with the id past the rows
        got = vocab.get(token)
        if got != token_id:
            where = "does not have it" if got is None else f"maps it to id {got}"
            raise AdapterInvalid(
                f"the adapter's tokenizer files state token {token[:40]!r} at id {token_id}, but the "
                f"tokenizer they load {where} (an added token takes the id its model vocabulary gives "
                "it, else the next free one)",
                field="tokenizer",
            )
    past = [(i, t) for t, i in vocab.items() if i >= rows]
    if past:
        token_id, token = min(past)
        raise AdapterIncompatible(
            f"the adapter's tokenizer has token {token[:40]!r} at id {token_id}, past this base model's "
            f"{rows} embedding rows: adapters whose tokenizer adds ids past the embedding are not served "
            "(trainable rows of existing ids are: map the new token onto one of them)",
            field="tokenizer",
        )


def _signature(tokenizer) -> tuple:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pipeline = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return type(tokenizer).__name__, pipeline, sorted(tokenizer.special_tokens_map.items())


def _over_base(base_file: Path, name: str, data: bytes) -> bytes:
    """The adapter's file as loaded: its settings files (`_MERGED`) over the base's, key by key (one
    that sets only `chat_template` keeps the base's special tokens); the others as they are."""
    if name not in _MERGED or not base_file.is_file():
        return data
    try:
        base, own = json.loads(base_file.read_bytes()), json.loads(data)
    except (ValueError, RecursionError):
        raise AdapterInvalid(f"{name} is not valid JSON", field=name) from None
    if not isinstance(base, dict) or not isinstance(own, dict):
        return data
    return json.dumps({**base, **own}).encode()


class AdapterTokenizers:
    """The distinct adapter tokenizers in use, by files digest, and which adapter uses which.

    `get(name)` is a dict lookup (None: the base tokenizer); `prepare` builds (a second or two for
    a large tokenizer) and must run off the engine thread and the event loop."""

    def __init__(
        self,
        base_dir: str | Path,
        rows: int,
        base_tokenizer,
        limit: int = MAX_ADAPTER_TOKENIZERS,
        on_drop=None,
    ):
        self.base_dir = Path(base_dir)
        # on_drop(key): an entry no adapter uses went (GrammarCache.forget_tokenizer drops its grammars).
        self._on_drop = on_drop
        self.rows = rows
        self.limit = limit
        self._base_signature = _signature(base_tokenizer)
        self._lock = threading.Lock()
        self._by_key: dict[str, AdapterTokenizer] = {}
        self._by_name: dict[str, AdapterTokenizer] = {}
        self._base_keys: set[str] = set()  # files whose tokenizer is the base's (small: digests)

    def get(self, name: str | None) -> AdapterTokenizer | None:
        if not name:
            return None
        return self._by_name.get(name)

    def distinct(self) -> int:
        with self._lock:
            return len(self._by_key)

    def prepare(self, files: dict[str, bytes]) -> AdapterTokenizer | None:
        """The tokenizer these files make (None: the base's), or the one already made from them;
        refused as `check_vocabulary` says. `check_room` then says whether it may be kept."""
        if not files:
            return None
        key = files_key(files)
        with self._lock:
            if key in self._base_keys:
                return None
            if key in self._by_key:
                return self._by_key[key]
        stated = _stated_ids(files)  # each file JSON, before anything is loaded
        caller = self._load(files)
        check_vocabulary(caller, stated, self.rows)
        if _signature(caller) == self._base_signature:
            with self._lock:
                if len(self._base_keys) >= MAX_BASE_KEYS:
                    self._base_keys.clear()  # only a cache of "no need to build": rebuilt if asked
                self._base_keys.add(key)
            return None
        entry = AdapterTokenizer(key, caller, copy.deepcopy(caller))  # the engine thread's own copy
        with self._lock:
            return self._by_key.get(key, entry)  # another load of the same files won the race

    def _load(self, files: dict[str, bytes]):
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory(prefix="adapter-tokenizer-") as tmp:
            for name in _BASE_FILES:
                if (self.base_dir / name).is_file():
                    shutil.copyfile(self.base_dir / name, Path(tmp) / name)
            for name, data in files.items():
                (Path(tmp) / name).write_bytes(_over_base(self.base_dir / name, name, data))
            try:
                return AutoTokenizer.from_pretrained(tmp)
            except Exception as exc:  # noqa: BLE001 - any parse failure of the adapter's files
                raise AdapterInvalid(
                    f"the adapter's tokenizer files ({', '.join(sorted(files))}) do not load as a "
                    f"tokenizer: {type(exc).__name__}: {str(exc)[:200]}",
                    field="tokenizer",
                ) from None

    def assign(self, name: str, entry: AdapterTokenizer | None) -> None:
        """`name` uses `entry` from now on (None: the base tokenizer); an entry no adapter uses goes.
        `check_room` first: this never refuses (the adapter is loaded by then)."""
        with self._lock:
            if entry is None:
                self._by_name.pop(name, None)
            else:
                entry.dropped = False  # (an entry prepared before its last user went, assigned again)
                self._by_key[entry.key] = entry
                self._by_name[name] = entry
            used = {e.key for e in self._by_name.values()}
            gone = [self._by_key.pop(k) for k in list(self._by_key) if k not in used]
            for old in gone:
                old.dropped = True
        for old in gone:
            if self._on_drop is not None:
                self._on_drop(old.key)

    def check_room(self, name: str, entry: AdapterTokenizer | None) -> None:
        """Refuse before loading an adapter whose tokenizer would exceed `limit` (see `assign`)."""
        if entry is None:
            return
        with self._lock:
            keys = {e.key for n, e in self._by_name.items() if n != name} | {entry.key}
        if len(keys) > self.limit:
            raise AdapterIncompatible(
                f"{self.limit} distinct adapter tokenizers are in use on this server, the most it "
                "keeps; unload an adapter that ships its own tokenizer first",
                field="tokenizer",
            )

    def forget(self, name: str) -> None:
        self.assign(name, None)
