"""The decode CUDA graphs' path run eagerly on the CPU under the Triton interpreter (the graphs'
static buffers, padding rows, LoRA tiers, verify rows and steps that sample no row) gives the logits
of the same Triton runner without graphs. The checks: tests/support/decode_graphs_check.py.
"""

from __future__ import annotations

from tests.support.child import child_env, run_child


def test_decode_graphs_path_matches_the_eager_runner():
    proc = run_child(["-m", "tests.support.decode_graphs_check"], env=child_env(interpret=True))
    assert "FAIL" not in proc.stdout, proc.stdout
    assert proc.stdout.count(" ok") == 7, proc.stdout
    assert "decode, no row sampled: (0, 128) rows" in proc.stdout
