"""StoreRecord: one named adapter as the index, the sidecars and the servicer see it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace


@dataclass(frozen=True)
class StoreRecord:
    name: str
    source: str
    revision: str  # resolved: Hub commit sha, "" for local sources
    digest: str  # "sha256:<hex>" of adapter_model.safetensors
    base_model: str
    rank: int  # the largest rank of any module (r, or a larger rank_pattern entry)
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool
    dtype: str  # safetensors dtype name: BF16, F16, F32
    size_bytes: int
    created_at: float
    last_used_at: float
    config_digest: str
    config_json: str = field(repr=False)
    requested_revision: str = ""
    fingerprint: str = ""
    generation: int = 0
    # The tokenizer files it ships are named by files_digest and kept once per set on disk
    # (tokenizer_store.py). files_json holds them (name -> text as JSON) only in memory between fetch
    # and store, and in records of the older format, which held them inline until moved at start.
    files_json: str = field(default="", repr=False)
    files_digest: str = ""

    @property
    def content(self) -> tuple[str, str, str]:
        """The adapter's identity: its weights, its config (the same weights with another
        lora_alpha are another adapter) and its tokenizer files (another chat template)."""
        return self.digest, self.config_digest, self.files_digest

    def with_(self, **changes) -> StoreRecord:
        return replace(self, **changes)

    def to_redis(self) -> dict[str, str]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "target_modules":
                value = json.dumps(list(value))
            elif f.name == "use_rslora":
                value = "1" if value else "0"
            out[f.name] = str(value)
        return out

    @classmethod
    def from_redis(cls, data: dict[str, str]) -> StoreRecord:
        return cls(
            name=data["name"],
            source=data["source"],
            revision=data.get("revision", ""),
            digest=data["digest"],
            base_model=data.get("base_model", ""),
            rank=int(data["rank"]),
            alpha=float(data["alpha"]),
            target_modules=tuple(json.loads(data["target_modules"])),
            use_rslora=data.get("use_rslora") == "1",
            dtype=data["dtype"],
            size_bytes=int(data["size_bytes"]),
            created_at=float(data["created_at"]),
            last_used_at=float(data.get("last_used_at") or data["created_at"]),
            config_digest=data.get("config_digest", ""),
            config_json=data.get("config_json", ""),
            requested_revision=data.get("requested_revision", ""),
            fingerprint=data.get("fingerprint", ""),
            generation=int(data.get("generation", 0)),
            files_json=data.get("files_json", ""),
            files_digest=data.get("files_digest", ""),
        )

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d

    @classmethod
    def from_json(cls, data: dict) -> StoreRecord:
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in data.items() if k in known}
        d["target_modules"] = tuple(d["target_modules"])
        return cls(**d)
