"""Tokenizer files for adapters that bring a new token, made from SmolLM2's tokenizer.

SmolLM2's tokenizer uses every id of its 49,152-row embedding (no id is free), so a fine-tune that
adds a marker within the embedding gives it an existing id: here the last one, 49151 ("ectable",
made by the last BPE merge, which no other merge builds on). Its vocabulary entry is renamed to the
marker, that merge is dropped, and the marker is an added token at that id, as a fine-tune that
repurposes a rare token does. `past_rows` instead appends it at id 49152, which the embedding has no
row for (the adapter must be refused).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MARKER = "<|marker|>"
MARKER_ID = 49151
REPLACED = "ectable"


def write_marker_tokenizer(base: Path, adapter_dir: Path, *, past_rows: bool = False) -> int:
    """Write tokenizer.json (and the base's tokenizer_config.json and chat template) into
    `adapter_dir`; the marker's id."""
    doc = json.loads((base / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    if past_rows:
        token_id = len(vocab)
    else:
        token_id = MARKER_ID
        assert vocab.pop(REPLACED) == MARKER_ID and doc["model"]["merges"][-1] in (
            ["ect", "able"],
            "ect able",
        )
        doc["model"]["merges"].pop()
        vocab[MARKER] = MARKER_ID
    doc["added_tokens"].append(
        {
            "id": token_id,
            "content": MARKER,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
    )
    (adapter_dir / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    for name in ("tokenizer_config.json", "chat_template.jinja"):  # as save_pretrained writes them
        if (base / name).is_file():
            shutil.copyfile(base / name, adapter_dir / name)
    return token_id
