"""`ServerArgs`: every flag of `python -m loraplex.services.inference`, as one frozen dataclass.

`ServerArgs` holds the server's own flags and composes the two configs that own the rest of the
defaults: `EngineConfig` (engine/config.py) and `LoRAConfig` (lora/settings.py). Construction
checks the server's flags and the combinations across the three (server_args_checks.py);
server_flags.py builds the command line from these dataclasses' defaults. Flag names and
defaults follow SGLang's where SGLang has one (design brief §5).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.lora.settings import LoRAConfig
from loraplex.services.inference.server_args_checks import check_server_args


@dataclass(frozen=True)
class ServerArgs:
    """Every flag: the engine's in `engine`, the LoRA ones in `lora`, the server's own here.
    Construction checks the server's flags and the combinations across the three."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # Adapter store
    adapter_store: str = "none"  # HOST:PORT | none
    adapter_cache_dir: str | None = None  # adapters pulled from the store; None = ~/.cache/loraplex/inference
    adapter_store_tls_ca: str | None = None  # PEM: talk TLS to the store, verified with it
    # bytes the adapter cache may hold; None = half the free space of its disk at start
    adapter_cache_max_bytes: int | None = None
    # Request limits
    default_max_new_tokens: int = 128
    max_inputs_per_request: int = 256
    max_message_bytes: int = 64 * 1024 * 1024
    # Server
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    metrics_max_adapters: int = 256  # adapters with series of their own; the rest count as _other
    grace_period: float = 30.0
    listen_when_ready: bool = False
    replica_id: str = ""  # sent as trailing metadata x-loraplex-replica; "" = the hostname
    admin_token: str | None = field(default=None, repr=False)
    api_token: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    allowed_local_dirs: tuple[str, ...] = ()
    log_level: str = "info"

    def __post_init__(self) -> None:
        check_server_args(self)

    @classmethod
    def from_fields(cls, **values: Any) -> ServerArgs:
        """Build from flat field names (one per flag, as `parse_args` and tests use them): each goes
        to the object that owns it. Raises ValueError naming an unknown field."""
        parts: dict[type, dict[str, Any]] = {EngineConfig: {}, LoRAConfig: {}, cls: {}}
        owner = flat_field_owners()
        for key, value in values.items():
            if key not in owner:
                raise ValueError(f"no server flag field {key!r}")
            parts[owner[key]][key] = value
        return cls(
            engine=EngineConfig(**parts[EngineConfig]), lora=LoRAConfig(**parts[LoRAConfig]), **parts[cls]
        )


def flat_field_owners() -> dict[str, type]:
    """Every flat field name -> the dataclass that owns it (and its default)."""
    own = {f.name: ServerArgs for f in dataclasses.fields(ServerArgs) if f.name not in ("engine", "lora")}
    return {
        **{f.name: EngineConfig for f in dataclasses.fields(EngineConfig)},
        **{f.name: LoRAConfig for f in dataclasses.fields(LoRAConfig)},
        **own,
    }


def flat_defaults() -> dict[str, Any]:
    """Every flat field name -> its default, from the dataclass that owns it."""
    args = ServerArgs()
    return {
        **dataclasses.asdict(args.engine),
        **dataclasses.asdict(args.lora),
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(args)
            if f.name not in ("engine", "lora")
        },
    }
