"""`--speculative-algorithm draft` on a device's own kernels (Triton attention, the Triton LoRA backend
of the target and of the draft's pool, decode CUDA graphs beside eager verify steps): greedy outputs
with a draft model equal speculation off, base and two adapters in one batch, the target as its own
draft with the target's adapters as draft adapters (so nearly every draft token is accepted).

Run as `PYTHONPATH=protos:. python tests/support/speculative_draft_check.py DIR [cuda|cpu|interpret]`,
where DIR holds `model/` (a tiny model with a tokenizer) and `a/`, `b/` (PEFT adapters of it), which
`--make SMOLLM2_DIR DIR` writes (16 MB, on a machine with the embedded model). Prints one line and
exits non-zero on a mismatch or an acceptance below 0.9. `interpret` (TRITON_INTERPRET=1, the CPU):
the GPU's path without a GPU, Triton attention and LoRA backends, and the decode graphs of the target
and of the draft run eagerly (`use_graphs=False`); tests/integration/test_decode_graphs_eager.py runs
it. On an H100 (2026-12-08) the draft's catch-up step crashed in the decode graphs' glue, which the
`interpret` mode now reaches.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 11, 13, 5, 9, 11], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def make(smollm2: Path, out: Path) -> None:
    import torch

    from tests.support.factories import make_peft_adapter, make_tiny_model

    model = make_tiny_model(out / "model", tokenizer_from=smollm2, tie_word_embeddings=True)
    for name, seed in (("a", 3), ("b", 4)):
        make_peft_adapter(model, out / name, r=8, seed=seed)
    print("made", out, torch.__version__)


def check(root: Path, device: str) -> int:
    from loraplex.kernels.placement import run_triton_on_cpu
    from loraplex.services.inference.engine.types import SamplingParams
    from tests.support.lora_reference import server_args, sync_engine

    model = root / "model"
    adapters = {"a": root / "a", "b": root / "b"}
    interpret = device == "interpret"
    kw = dict(device="cpu" if interpret else device, dtype="float32", max_total_tokens=4096)
    if interpret:
        run_triton_on_cpu(True)
        kw.update(lora_backend="triton", startup_warm_up=False)
    off = sync_engine(server_args(model, adapters, **kw))
    on = sync_engine(
        server_args(
            model,
            adapters,
            speculative_algorithm="draft",
            speculative_draft_model_path=str(model),
            speculative_draft_lora_paths=(f"da={adapters['a']}", f"db={adapters['b']}"),
            **kw,
        )
    )
    served = _eager_graphs(on) if interpret else None
    params = SamplingParams(max_new_tokens=12 if interpret else 24, ignore_eos=True)
    names, drafts = [None, "a", "b"], [None, "da", "db"]
    want = [o.token_ids for o in off.generate(PROMPTS, params, names)]
    start = time.perf_counter()
    got = [o.token_ids for o in on.generate(PROMPTS, params, names, drafts)]
    seconds = time.perf_counter() - start
    stats = on.stats()
    rates = {k: stats.spec_accepted_tokens[k] / v for k, v in stats.spec_draft_tokens.items() if v}
    print(f"{device}: equal={got == want} acceptance={rates} ({seconds:.2f} s)")
    if served is not None:  # both runners' decode steps went through the graphs' path
        print(f"decode graph steps: target {served['target']}, draft {served['draft']}")
        if not (served["target"] and served["draft"]):
            return 1
    if got != want:
        for w, g in zip(want, got, strict=True):
            print("  off", w, "\n  on ", g)
        return 1
    return 0 if all(r >= 0.9 for r in rates.values()) and len(rates) == 3 else 1


def _eager_graphs(engine) -> dict[str, int]:
    """Decode graphs run eagerly on the target's and the draft's runners; counts of the steps each
    served, filled in as the engine steps."""
    from tests.support.decode_graphs_check import graphs_eagerly

    served = {"target": 0, "draft": 0}
    graphs_eagerly(engine.runner, 32, served, "target")  # verify rows: K + 1 per request
    graphs_eagerly(engine.speculator.draft_runner.runner, 8, served, "draft")
    return served


if __name__ == "__main__":
    if sys.argv[1] == "--make":
        make(Path(sys.argv[2]), Path(sys.argv[3]))
        sys.exit(0)
    sys.exit(check(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cuda"))
