"""`build_segments`: the slot grouping and token-block maps the LoRA kernels rely on."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.kernels.lora_meta import BLOCK_MS, alloc_segments, build_segments, num_blocks_bound


def check_invariants(slots: torch.Tensor, num_slots: int, max_tokens: int) -> None:
    segs = build_segments(slots, alloc_segments(max_tokens, num_slots, "cpu"))
    T = slots.shape[0]
    sorted_tokens = segs.sorted_tokens[:T].tolist()
    assert sorted(sorted_tokens) == list(range(T)), "sorted_tokens is not a permutation"
    key = [s if s >= 0 else num_slots for s in slots.tolist()]
    # Stable grouping by slot, tokens without an adapter last.
    assert sorted_tokens == sorted(range(T), key=lambda t: (key[t], t))
    assert torch.equal(segs.token_slots[:T], slots)
    counts = [key.count(s) for s in range(num_slots)]
    assert segs.slot_count.tolist() == counts
    starts = segs.slot_start.tolist()
    assert starts == [sum(counts[:s]) for s in range(num_slots)]
    for block_m in BLOCK_MS:
        bslot, btok = (t.tolist() for t in segs.blocks_for(block_m))
        covered = []
        used = [b for b, s in enumerate(bslot) if s >= 0]
        assert len(used) <= num_blocks_bound(T, num_slots, block_m), "grid bound too small"
        assert used == list(range(len(used))), "used blocks must come first"
        assert all(t == -1 for b in range(len(bslot)) if b not in used for t in btok[b]), (
            "unused block has tokens"
        )
        for b in used:
            tokens = [t for t in btok[b][:block_m] if t >= 0]
            assert 0 < len(tokens) and btok[b][: len(tokens)] == tokens, "tokens must be packed first"
            assert all(t == -1 for t in btok[b][len(tokens) :]), "padding must be -1"
            assert all(key[t] == bslot[b] for t in tokens), "block holds another slot's token"
            covered.extend(tokens)
        # Blocks in order cover the slot-sorted token list exactly once.
        assert covered == sorted_tokens[: sum(counts)], "blocks must cover every adapter token exactly once"


@pytest.mark.parametrize(
    "slots,num_slots",
    [
        ([-1, -1, -1], 4),  # nobody has an adapter
        ([0], 1),  # a single token
        ([3, 3, 3, 0, -1, 3, 0, 2], 4),
        ([1] * 130 + [0] * 17 + [-1] * 5, 2),  # a prefill segment longer than every block size
        (list(range(64)), 64),  # decode: 64 distinct adapters, one token each
    ],
)
def test_segments_invariants(slots, num_slots):
    check_invariants(torch.tensor(slots, dtype=torch.int32), num_slots, max_tokens=len(slots) + 7)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 9).flatmap(
        lambda n: st.tuples(st.just(n), st.lists(st.integers(-1, n - 1), min_size=1, max_size=200))
    )
)
def test_segments_invariants_random(args):
    num_slots, slots = args
    check_invariants(torch.tensor(slots, dtype=torch.int32), num_slots, max_tokens=len(slots))


def test_rebuild_reuses_buffers_and_overwrites_stale_blocks():
    segs = alloc_segments(100, 4, "cpu")
    pointers = [t.data_ptr() for t in segs]
    build_segments(torch.arange(100, dtype=torch.int32) % 4, segs)
    build_segments(torch.tensor([2, -1], dtype=torch.int32), segs)
    assert [t.data_ptr() for t in segs] == pointers, "CUDA graphs need fixed addresses"
    bslot, btok = segs.blocks_for(BLOCK_MS[0])
    assert bslot.tolist().count(-1) == len(bslot) - 1 and bslot[0].item() == 2
    assert btok[0].tolist() == [0] + [-1] * (btok.shape[1] - 1)
    assert (btok[1:] == -1).all(), "stale tokens from the previous step survived"


def test_too_many_tokens_is_rejected():
    with pytest.raises(ValueError, match="max_tokens"):
        build_segments(torch.zeros(9, dtype=torch.int32), alloc_segments(8, 2, "cpu"))


@pytest.mark.parametrize("max_tokens", [1, 16, 40, 256, 300, 2048])
def test_shrink_buffer_fits_every_step_size(max_tokens):
    from loraplex.kernels.lora_configs import shrink_splits
    from loraplex.kernels.lora_shrink import alloc_shrink_out, shrink_out_view

    buf = alloc_shrink_out(max_tokens, 3, 16, 14336, "cpu")
    assert buf.shape[1] == 48
    for d in (576, 4096, 14336):
        for T in sorted({1, 16, 17, 256, 257, max_tokens}):
            if T > max_tokens:
                continue
            for many in (False, True):
                splits = shrink_splits(d, T, many)
                y = shrink_out_view(buf, splits, T)[..., :32]  # a group with fewer stacked modules
                assert y.shape == (splits, T, 32)
                assert y.data_ptr() == buf.data_ptr() and y.stride() == (T * 48, 48, 1)


def test_upper_tier_splits_apply_only_above_many_adapters(monkeypatch):
    from loraplex.kernels import lora_configs as cfg
    from loraplex.kernels.lora_plan import GroupShape, plan_step

    monkeypatch.setitem(cfg.SPLITS_TABLE, cfg.SplitsKey("decode_many", in_features=14336), 7)
    cfg.clear_caches()
    try:
        assert cfg.shrink_splits(14336, 64, many=True) == 7
        assert cfg.shrink_splits(14336, 64) == cfg.SPLITS_TABLE[("decode", 14336)]
        assert cfg.shrink_splits(14336, 8, many=True) == cfg.SPLITS_TABLE[("decode_small", 14336)]
        assert cfg.shrink_splits(14336, 2048, many=True) == cfg.SPLITS_TABLE[("prefill", 14336)]
        down = {"down": GroupShape(in_features=14336, widths=(4096,), max_rank=16)}
        many = cfg.MANY_ADAPTERS + 1
        assert plan_step(down, 64, num_slots=64, max_distinct=many).groups["down"].splits == 7
        few = plan_step(down, 64, num_slots=64, max_distinct=cfg.MANY_ADAPTERS).groups["down"]
        assert few.splits == cfg.SPLITS_TABLE[("decode", 14336)]
    finally:
        cfg.clear_caches()
