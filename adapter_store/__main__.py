"""`python -m loraplex.adapter_store [flags]`: run the adapter store (see adapter_store/cli/args.py)."""

from __future__ import annotations

import asyncio
import logging
import sys

from loraplex.adapter_store.cli.args import parse_args
from loraplex.adapter_store.server import serve


def main(argv: list[str] | None = None) -> int:
    config, log_level = parse_args(argv)
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
