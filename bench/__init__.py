"""loraplex benchmarks, one package run one way from the repo root: `python -m bench.NAME [...]`
(the device image, with no loraplex install: `PYTHONPATH=.:protos python3 -m bench.NAME [...]`).

Every benchmark prints a table and writes JSON to `--out DIR` as `DIR/NAME.json` (bench/results.py).
Measured numbers and the commands that made them: docs/benchmarks.md.
"""
