"""Trainable tokens (PEFT 0.21 `trainable_token_indices`): an adapter's own rows for a few token ids
of the embedding (and of lm_head), the way fine-tunes teach new chat or tool-call markers without
saving the whole matrix.

Config: a list of token ids (the input embedding's), or an object naming the layer of each list
(`embed_tokens`, `lm_head`). Weights: `...<layer>.token_adapter.trainable_tokens_delta` `[n, hidden]`,
the rows' new values (PEFT `index_copy`s them over the base rows, despite the name). Where the base
ties lm_head to the embedding, the embedding's rows serve lm_head too (PEFT ties the adapter); an
lm_head list of its own is then refused unless it is the embedding's.

For the adapter's requests only: a token whose id is listed is looked up in the adapter's rows;
the logits of a listed id are `h · row`. Ids are checked against the base vocabulary at load, and
an adapter whose tokenizer files add tokens past the base vocabulary is refused. Its requests are
tokenized by its own tokenizer when it ships one (engine/adapter_tokenizers.py, which checks every
id that tokenizer can produce against the embedding rows).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.services.inference.errors import AdapterIncompatible, AdapterInvalid

WEIGHTS_FILE = "adapter_model.safetensors"
FIELD = "trainable_token_indices"
EMBED_PATH, HEAD_PATH = "model.embed_tokens", "lm_head"
ROWS_KEY = re.compile(
    r"^base_model\.model\.(?P<path>model\.embed_tokens|lm_head)\.token_adapter\.trainable_tokens_delta$"
)
_LAYERS = {"embed_tokens": EMBED_PATH, "model.embed_tokens": EMBED_PATH, "lm_head": HEAD_PATH}
# Tokenizer files an adapter may ship, read for their added tokens (bounded: Llama 3's is 9 MB).
TOKENIZER_FILES = ("added_tokens.json", "tokenizer.json", "tokenizer_config.json")
MAX_TOKENIZER_BYTES = 64 * 2**20


def _invalid(why: str) -> AdapterInvalid:
    return AdapterInvalid(f"adapter_config.json: {FIELD}: {why}", field=FIELD)


def parse_trainable_tokens(value: Any) -> dict[str, tuple[int, ...]]:
    """The config value as {layer path: token ids}; AdapterInvalid naming the field."""
    if value is None or value == [] or value == {}:
        return {}
    layers = {"embed_tokens": value} if isinstance(value, list) else value
    if not isinstance(layers, dict):
        raise _invalid(f"must be a list of token ids or an object of layer -> ids (got {value!r})")
    out = {}
    for name, ids in layers.items():
        if name not in _LAYERS:
            raise _invalid(f"layer {name!r}: only embed_tokens and lm_head rows are served")
        ok = (
            isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        )
        if not ok or min(ids) < 0 or len(set(ids)) != len(ids):
            raise _invalid(
                f"{name}: must be a non-empty list of distinct non-negative token ids (got {ids!r})"
            )
        out[_LAYERS[name]] = tuple(ids)
    return out


@dataclass(frozen=True)
class TokenRows:
    """An adapter's rows of one layer: the token ids and their new values `[n, hidden]`."""

    ids: torch.Tensor  # int64 [n]
    values: torch.Tensor


def check_token_layers(
    layers: dict[str, tuple[int, ...]], vocab: int, tied: bool
) -> dict[str, tuple[int, ...]]:
    """The layers whose rows are read from the weights, checked against the base vocabulary and tying."""
    if not layers:
        return {}
    if not vocab:
        raise AdapterIncompatible(
            f"adapter_config.json: {FIELD}: the base model's vocabulary size is unknown here", field=FIELD
        )
    for ids in layers.values():
        if max(ids) >= vocab:
            raise AdapterIncompatible(
                f"adapter_config.json: {FIELD}: token id {max(ids)} is past this base model's vocabulary of "
                f"{vocab}: the adapter was trained on a resized embedding (added tokens), which this base "
                "does not have",
                field=FIELD,
            )
    if tied and HEAD_PATH in layers:
        if EMBED_PATH not in layers or layers[HEAD_PATH] != layers[EMBED_PATH]:
            raise AdapterInvalid(
                f"adapter_config.json: {FIELD}: lm_head is tied to embed_tokens in this base model, so its "
                "rows are the embedding's; a different lm_head list is not supported",
                field=FIELD,
            )
        return {EMBED_PATH: layers[EMBED_PATH]}  # PEFT ties lm_head to the embedding's adapter
    return dict(layers)


def read_token_rows(
    f: Any, key: str, layers: dict[str, tuple[int, ...]], hidden: int, dtype: torch.dtype, out: dict
) -> bool:
    """Read `key` into `out[path]` if it holds trainable-token rows (True); False otherwise."""
    m = ROWS_KEY.match(key)
    if m is None:
        return False
    path = m["path"]
    if path not in layers:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: {key!r} holds trainable-token rows of {path}, which adapter_config.json "
            f"{FIELD} does not list",
            field=WEIGHTS_FILE,
        )
    shape = tuple(f.get_slice(key).get_shape())
    expected = (len(layers[path]), hidden)
    if shape != expected:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: {key!r} has shape {shape}, expected {expected} ({len(layers[path])} token ids "
            f"in {FIELD}, hidden {hidden})",
            field=WEIGHTS_FILE,
        )
    values = f.get_tensor(key).to(dtype).contiguous()
    out[path] = TokenRows(torch.tensor(layers[path], dtype=torch.int64), values)
    return True


def finish_token_rows(layers: dict[str, tuple[int, ...]], read: dict, tied: bool) -> dict[str, TokenRows]:
    """The adapter's rows per layer (with tied embeddings, the embedding's serve lm_head too)."""
    missing = [p for p in layers if p not in read]
    if missing:
        raise AdapterInvalid(
            f"{WEIGHTS_FILE}: missing tensors for {FIELD}: "
            + ", ".join(f"{p}.token_adapter.trainable_tokens_delta" for p in missing),
            field=WEIGHTS_FILE,
        )
    rows = dict(read)
    if tied and EMBED_PATH in rows:
        rows[HEAD_PATH] = rows[EMBED_PATH]
    return rows


def check_added_tokens(directory: Path, vocab: int, read_file) -> None:
    """AdapterIncompatible when the adapter's tokenizer files add a token past the base vocabulary
    (the embedding has no row for it). Added tokens within it are served: the adapter's own
    tokenizer maps their text to their ids for its requests (engine/adapter_tokenizers.py).

    `read_file(path, limit)`: the bytes of a regular file or None (lora/adapter_files.py `read_side_file`)."""
    found: list[tuple[int, str]] = []
    for name in TOKENIZER_FILES:
        data = read_file(directory / name, MAX_TOKENIZER_BYTES)
        if data is None:
            continue
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            raise AdapterInvalid(f"{name} is not valid JSON", field=name) from None
        if not isinstance(doc, dict):
            continue
        if name == "added_tokens.json":
            found += [(i, t) for t, i in doc.items() if isinstance(i, int)]
        elif name == "tokenizer.json":
            found += [
                (t["id"], str(t.get("content")))
                for t in doc.get("added_tokens") or ()
                if isinstance(t, dict) and isinstance(t.get("id"), int)
            ]
        else:
            decoder = doc.get("added_tokens_decoder") or {}
            if isinstance(decoder, dict):
                found += [
                    (int(i), str(t.get("content") if isinstance(t, dict) else t))
                    for i, t in decoder.items()
                    if str(i).isdigit()
                ]
    beyond = sorted(t for t in found if t[0] >= vocab)
    if beyond:
        token_id, text = beyond[0]
        raise AdapterIncompatible(
            f"the adapter's tokenizer adds token {text[:40]!r} (id {token_id}) past this base model's "
            f"vocabulary of {vocab}; adapters that add tokens to the vocabulary are not served (trainable "
            "rows of existing ids are)",
            field="tokenizer",
        )
