"""`--speculative-algorithm draft` on a device's own kernels (Triton attention, the Triton LoRA backend
of the target and of the draft's pool, decode CUDA graphs beside eager verify steps): greedy outputs
with a draft model equal speculation off, base and two adapters in one batch, the target as its own
draft with the target's adapters as draft adapters (so nearly every draft token is accepted).

Run as `PYTHONPATH=protos:. python tests/support/speculative_draft_check.py DIR [cuda|cpu]`, where
DIR holds `model/` (a tiny model with a tokenizer) and `a/`, `b/` (PEFT adapters of it), which
`--make SMOLLM2_DIR DIR` writes (16 MB, on a machine with the embedded model). Prints one line and
exits non-zero on a mismatch or an acceptance below 0.9. Run on the CPU (2 s); not yet on a GPU.
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
    from loraplex.services.inference.engine.types import SamplingParams
    from tests.support.lora_reference import server_args, sync_engine

    model = root / "model"
    adapters = {"a": root / "a", "b": root / "b"}
    kw = dict(device=device, dtype="float32", max_total_tokens=4096)
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
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    names, drafts = [None, "a", "b"], [None, "da", "db"]
    want = [o.token_ids for o in off.generate(PROMPTS, params, names)]
    start = time.perf_counter()
    got = [o.token_ids for o in on.generate(PROMPTS, params, names, drafts)]
    seconds = time.perf_counter() - start
    stats = on.stats()
    rates = {k: stats.spec_accepted_tokens[k] / v for k, v in stats.spec_draft_tokens.items() if v}
    print(f"{device}: equal={got == want} acceptance={rates} ({seconds:.2f} s)")
    if got != want:
        for w, g in zip(want, got, strict=True):
            print("  off", w, "\n  on ", g)
        return 1
    return 0 if all(r >= 0.9 for r in rates.values()) and len(rates) == 3 else 1


if __name__ == "__main__":
    if sys.argv[1] == "--make":
        make(Path(sys.argv[2]), Path(sys.argv[3]))
        sys.exit(0)
    sys.exit(check(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cuda"))
