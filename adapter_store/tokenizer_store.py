"""Each distinct set of adapter tokenizer files, kept once on disk however many names ship it.

Platform teams register hundreds of fine-tunes of one model that all ship the same `tokenizer.json`
(Llama 3's is 9 MB): a copy per name would put gigabytes in Redis. So a set is a content-addressed
blob, `tokenizer_files/sha256/<hex of files_digest>` (the record's `files_digest`, which the
inference side also computes; the blob holds the files as the JSON object `tokenizer_files.encode`
writes), and each name that uses it has a reference file `<hex>.records/<name>.json`: the weight
blobs' mechanism (blobs.py), so adding a reference writes the blob under the same per-digest lock
that removes it with its last reference. Redis and the adapter's record file hold only the digest.
The sets are record data, not cache: they count neither toward nor against `--cache-max-bytes`
and are never evicted (the store evicts weight blobs, never records).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from loraplex.adapter_store.blobs import BlobCache
from loraplex.adapter_store.tokenizer_files import decode, files_digest

log = logging.getLogger(__name__)
SUBDIR = "tokenizer_files"


class TokenizerFileStore:
    def __init__(self, root: Path):
        self.blobs = BlobCache(root, SUBDIR)

    def add(self, digest: str, name: str, files_json: str) -> None:
        """`name` uses the set `digest` (its files as `tokenizer_files.encode` wrote them): the set is
        written unless present, and the reference added, together."""
        content = files_json.encode()
        if files_digest(decode(files_json)) != digest:  # a caller's bug: never file a set under another name
            raise ValueError(f"tokenizer files do not hash to {digest}")
        self.blobs.add_record(digest, name, {"name": name, "files_digest": digest}, content)

    def drop(self, digest: str, name: str) -> bool:
        """`name` no longer uses the set; the set goes with its last reference. Whether it stays."""
        return self.blobs.drop_record(digest, name)

    def read(self, digest: str) -> dict[str, bytes] | None:
        """The set's files, or None when it is missing or no longer hashes to its digest."""
        try:
            files = decode(self.blobs.path(digest).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.error("tokenizer files %s are unreadable: %s", digest[:19], e)
            return None
        if files_digest(files) != digest:
            log.error("tokenizer files %s no longer hash to their digest", digest[:19])
            return None
        return files

    def has(self, digest: str) -> bool:
        return self.blobs.has(digest)

    def references(self) -> Iterator[tuple[str, str]]:
        """(digest, name) of every reference on disk."""
        for ref in self.blobs.iter_records():
            if isinstance(ref, dict) and "files_digest" in ref and "name" in ref:
                yield ref["files_digest"], ref["name"]

    def digests(self) -> set[str]:
        """Sets on disk (with or without references)."""
        return {"sha256:" + p.name for p in self.blobs.blob_dir.iterdir() if len(p.name) == 64}
