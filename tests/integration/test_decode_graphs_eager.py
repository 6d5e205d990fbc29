"""The decode CUDA graphs' path run eagerly on the CPU under the Triton interpreter: the glue around
the graphs (static buffers, padding rows, LoRA tiers, verify rows, steps that sample no row) gives the
logits of the same Triton runner without graphs (tests/support/decode_graphs_check.py), and
`--speculative-algorithm draft` with draft adapters, the target's and the draft's decode steps both on
that path, gives the tokens of speculation off (tests/support/speculative_draft_check.py `interpret`,
the GPU check's CPU mode). A draft model's catch-up crashed in this glue on an H100 (2026-12-08) while
every CPU test passed; both checks fail on that bug.
"""

from __future__ import annotations

from tests.support.child import child_env, run_child


def test_decode_graphs_path_matches_the_eager_runner():
    proc = run_child(["-m", "tests.support.decode_graphs_check"], env=child_env(interpret=True))
    assert "FAIL" not in proc.stdout, proc.stdout
    assert proc.stdout.count(" ok") == 7, proc.stdout
    assert "decode, no row sampled: (0, 128) rows" in proc.stdout


def test_draft_model_on_the_decode_graphs_path(tmp_path, smollm2_path):
    from tests.support.speculative_draft_check import make

    make(smollm2_path, tmp_path)
    argv = ["-m", "tests.support.speculative_draft_check", str(tmp_path), "interpret"]
    proc = run_child(argv, env=child_env(interpret=True), timeout=600)
    assert "interpret: equal=True" in proc.stdout, proc.stdout
    assert "decode graph steps: target" in proc.stdout, proc.stdout
