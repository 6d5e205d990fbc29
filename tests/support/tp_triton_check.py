"""Child process for test_tp.py: `--lora-backend triton` under `--tp-size 2` (Triton's CPU
interpreter, so TRITON_INTERPRET=1 must be set before triton is imported) equals the torch
backend at `--tp-size 1`, and so does the Triton backend at `--tp-size 1` (its side-stream delta
path, which on the CPU runs on the one stream). Prints one JSON line:
{"tp1_torch": [...], "tp1_triton": [...], "tp2_triton": [...]}."""

from __future__ import annotations

import json
import os
import sys

from tests.integration.test_tp import mixed_jobs, outputs, tp_args


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    base = sys.argv[1]
    adapters = dict(item.split("=", 1) for item in sys.argv[2:])
    jobs = mixed_jobs()
    small = dict(max_total_tokens=512, context_length=64, max_num_batched_tokens=64)
    want = outputs(tp_args(base, 1, adapters, lora_backend="torch", **small), jobs, 4)
    single = outputs(tp_args(base, 1, adapters, lora_backend="triton", **small), jobs, 4)
    got = outputs(tp_args(base, 2, adapters, lora_backend="triton", **small), jobs, 4)
    print(json.dumps({"tp1_torch": want, "tp1_triton": single, "tp2_triton": got}))


if __name__ == "__main__":
    main()
