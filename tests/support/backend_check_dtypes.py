"""Child process of tests/integration/test_lora_triton.py (TRITON_INTERPRET=1): backend_check's
cases for each dtype named on the command line, in one process, so the torch + Triton import and
the interpreter's set-up are paid once rather than once per dtype. Prints backend_check's JSON
lines (each names its dtype)."""

from __future__ import annotations

import sys

from loraplex.services.inference.lora import backend_check


def main(dtypes: list[str]) -> None:
    for dtype in dtypes:
        sys.argv = ["backend_check", "--dtype", dtype]
        backend_check.main()


if __name__ == "__main__":
    main(sys.argv[1:])
