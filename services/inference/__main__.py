"""`python -m loraplex.services.inference --model-path PATH [flags]` (design brief §5)."""

from __future__ import annotations

import logging
import sys

from loraplex.services.inference.server import main
from loraplex.services.inference.server_flags import parse_args


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return main(args)


if __name__ == "__main__":
    sys.exit(run())
