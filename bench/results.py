"""Where a benchmark's JSON goes: the one `--out` flag every benchmark takes.

`--out DIR` is a directory; a benchmark writes `DIR/NAME.json` (NAME: its module, e.g.
`cpu_engine.json`) and any side file (a sweep's `lora_configs.json`) beside it. The default is
`$OUT` when set (the device machine's output folder), else `/tmp/loraplex-bench-results`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path


def default_out_dir() -> Path:
    out = os.environ.get("OUT")
    return Path(out) if out else Path(tempfile.gettempdir()) / "loraplex-bench-results"


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out_dir(),
        metavar="DIR",
        help="directory for the JSON (NAME.json); default: $OUT when set, else "
        + str(Path(tempfile.gettempdir()) / "loraplex-bench-results"),
    )


def write_json(out_dir: Path, name: str, data: object) -> Path:
    """Write `data` to `out_dir/name.json` (creating the directory) and say where."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {path}", flush=True)
    return path
