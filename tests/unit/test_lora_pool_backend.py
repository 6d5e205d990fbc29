"""AdapterPool layout/size and the torch backend against a naive per-token LoRA reference."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.backend import GROUPS
from loraplex.services.inference.lora.config import AdapterSpec, ModuleLoRA
from loraplex.services.inference.lora.packed_groups import pack_groups
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.pool_layout import PAGE_ROWS, pool_nbytes
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes
from loraplex.services.inference.lora.torch_backend import TorchLoRABackend

SHAPES = ModelShapes(num_layers=3, hidden_size=48, intermediate_size=80, q_size=48, kv_size=16)


def random_adapter(
    shapes: ModelShapes, modules: list[str], rank: int, seed: int, rank_jitter: bool = False
) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    targets, lora_a, lora_b = {}, {}, {}
    for layer in range(shapes.num_layers):
        for m in modules:
            r = rnd.randint(1, rank) if rank_jitter else rank
            alpha = rnd.choice([4.0, 16.0, 32.0])
            d_in, d_out = shapes.module_dims(m)
            targets[(layer, m)] = ModuleLoRA(r, alpha, alpha / r)
            lora_a[(layer, m)] = torch.randn(r, d_in, generator=gen) / d_in**0.5
            lora_b[(layer, m)] = torch.randn(d_out, r, generator=gen) / r**0.5
    spec = AdapterSpec(r=rank, lora_alpha=16.0, target_modules=tuple(modules))
    return AdapterWeights(spec, targets, lora_a, lora_b, digest=f"sha256:{seed}")


def test_pool_nbytes_equals_documented_formula():
    # docs/architecture.md: pages * sum_g L*P*(n*d + sum(w))*dtype_bytes + L*slots*n*(4+4) rank/scaling
    # tables + slots*ceil(R/P)*4 page table; by default every slot can hold a rank-R adapter at once.
    L, S, R, P = SHAPES.num_layers, 5, 12, PAGE_ROWS
    h, i, q, kv = SHAPES.hidden_size, SHAPES.intermediate_size, SHAPES.q_size, SHAPES.kv_size
    groups = {"qkv": (3, h, q + 2 * kv), "o": (1, q, h), "gate_up": (2, h, 2 * i), "down": (1, i, h)}
    pages = S * -(-R // P)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        expected = sum(pages * L * P * (n * d + w) * size + L * S * n * 8 for n, d, w in groups.values())
        expected += S * -(-R // P) * 4
        pool = AdapterPool(SHAPES, slots=S, max_rank=R, target_modules=ALL_MODULES, dtype=dtype, device="cpu")
        assert pool.nbytes == expected == pool_nbytes(SHAPES, S, R, ALL_MODULES, dtype)
        assert pool.lora_a["qkv"].shape == (L, pages, 3 * P, h)
        assert pool.lora_b["gate_up"].shape == (L, pages, P, 2 * i)
        assert pool.page_table.shape == (S, 2) and pool.page_table.dtype == torch.int32
        assert pool.rank["qkv"].shape == (L, S, 3) and pool.rank["qkv"].dtype == torch.int32
    # fewer pages than slots x max rank: the pages bound the bytes, the slots only the tables
    small = AdapterPool(
        SHAPES,
        slots=S,
        max_rank=R,
        target_modules=ALL_MODULES,
        dtype=torch.float32,
        device="cpu",
        num_pages=3,
    )
    assert small.nbytes == pool_nbytes(SHAPES, S, R, ALL_MODULES, torch.float32, num_pages=3)
    assert (
        small.nbytes - S * 2 * 4 - sum(L * S * n * 8 for n, _, _ in groups.values()) == 3 * small.page_nbytes
    )
    # only groups holding a targeted module are allocated
    only_qv = AdapterPool(
        SHAPES, slots=S, max_rank=R, target_modules=["q_proj", "v_proj"], dtype=torch.float32, device="cpu"
    )
    assert only_qv.groups == ["qkv"]
    n, d, w = groups["qkv"]
    assert only_qv.nbytes == pages * L * P * (n * d + w) * 4 + L * S * n * 8 + S * 2 * 4


def slot_rows(
    pool: AdapterPool, group: str, layer: int, slot: int, stack: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot's A rows `[k*P, d]` and B^T rows `[k*P, w]` of one stacked module, through its pages."""
    pages, P = pool.host_pages[slot], pool.page_rows
    lo, hi = pool.offsets[group][stack], pool.offsets[group][stack + 1]
    a = pool.lora_a[group][layer, pages, stack * P : (stack + 1) * P].reshape(
        -1, pool.lora_a[group].shape[-1]
    )
    b = pool.lora_b[group][layer, pages, :, lo:hi].reshape(-1, hi - lo)
    assert torch.equal(pool.page_table[slot, : len(pages)], torch.tensor(pages, dtype=torch.int32))
    return a, b


def test_upload_places_rows_and_tables():
    pool = AdapterPool(
        SHAPES, slots=3, max_rank=8, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
    )
    ad = random_adapter(SHAPES, ["k_proj", "up_proj"], rank=8, seed=1, rank_jitter=True)
    pool.upload(2, ad)
    r = ad.targets[(1, "k_proj")].rank
    a, b = slot_rows(pool, "qkv", 1, 2, 1)
    assert torch.equal(a[:r], ad.lora_a[(1, "k_proj")])
    assert torch.equal(b[:r], ad.lora_b[(1, "k_proj")].t())
    assert pool.rank["qkv"][1, 2].tolist() == [0, r, 0]
    assert pool.scaling["gate_up"][0, 2, 1].item() == pytest.approx(ad.targets[(0, "up_proj")].scaling)
    assert pool.rank["o"][:, 2].sum() == 0 and pool.rank["down"][:, 2].sum() == 0
    assert torch.equal(pool.host_rank["qkv"], pool.rank["qkv"])
    assert pool.pages_in_use == 1 and pool.host_pages[2] == [0]


def naive_delta(
    x: torch.Tensor, slots: list[int], adapters: dict[int, AdapterWeights], layer: int, group: str
):
    """Per token, per stacked module: scale * B @ (A @ x), from the adapters' own tensors."""
    widths = SHAPES.group_widths(group)
    out = torch.zeros(x.shape[0], sum(widths), dtype=torch.float64)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        off = 0
        for m, w in zip(GROUPS[group], widths, strict=True):
            ad = adapters[s]
            if (layer, m) in ad.targets:
                a, b = ad.lora_a[(layer, m)].double(), ad.lora_b[(layer, m)].double()
                out[t, off : off + w] = ad.targets[(layer, m)].scaling * (b @ (a @ x[t].double()))
            off += w
    return out


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_torch_backend_matches_naive_reference(layout):
    R, S = 16, 4
    pool = AdapterPool(
        SHAPES, slots=S, max_rank=R, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
    )
    adapters = {
        0: random_adapter(SHAPES, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"], 4, seed=10),
        1: random_adapter(SHAPES, ["q_proj", "v_proj"], 8, seed=11, rank_jitter=True),
        2: random_adapter(SHAPES, ["up_proj", "down_proj"], 16, seed=12),
        3: random_adapter(SHAPES, list(ALL_MODULES), 16, seed=13, rank_jitter=True),
    }
    for slot, ad in adapters.items():
        pool.upload(slot, ad)
    rnd = random.Random(0)
    if layout == "contiguous":  # requests laid out one after another, like a real batch
        slots = [s for s, n in [(-1, 3), (0, 5), (2, 1), (-1, 1), (3, 7), (1, 2)] for _ in range(n)]
    else:
        slots = [rnd.randint(-1, S - 1) for _ in range(29)]
    backend = TorchLoRABackend(pool)
    backend.prepare(torch.tensor(slots, dtype=torch.int32))
    gen = torch.Generator().manual_seed(5)
    for layer in range(SHAPES.num_layers):
        for group in GROUPS:
            x = torch.randn(len(slots), SHAPES.group_in(group), generator=gen)
            base = torch.randn(len(slots), sum(SHAPES.group_widths(group)), generator=gen)
            out = base.clone()
            backend.apply(layer, group, x, out)
            expected = base.double() + naive_delta(x, slots, adapters, layer, group)
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
            untouched = [t for t, s in enumerate(slots) if s < 0]
            assert torch.equal(out[untouched], base[untouched])


def test_torch_backend_skips_unallocated_groups():
    pool = AdapterPool(
        SHAPES, slots=2, max_rank=4, target_modules=["q_proj"], dtype=torch.float32, device="cpu"
    )
    pool.upload(0, random_adapter(SHAPES, ["q_proj"], 4, seed=3))
    backend = TorchLoRABackend(pool)
    backend.prepare(torch.tensor([0, 0, -1], dtype=torch.int32))
    out = torch.zeros(3, SHAPES.hidden_size)
    backend.apply(0, "down", torch.randn(3, SHAPES.intermediate_size), out)
    assert out.abs().sum() == 0
    qkv = torch.zeros(3, SHAPES.q_size + 2 * SHAPES.kv_size)
    backend.apply(0, "qkv", torch.randn(3, SHAPES.hidden_size), qkv)
    assert qkv[:2, : SHAPES.q_size].abs().sum() > 0 and qkv[:, SHAPES.q_size :].abs().sum() == 0


def test_switching_the_side_stream_never_frees_a_buffer_a_graph_may_read():
    """Captured graphs (decode and mixed-step) hold raw pointers into the backend's buffers; a
    benchmark that switches the side stream recaptures only some graph kinds, so switching must not
    reallocate or free the delta buffer."""
    from loraplex.services.inference.lora.triton_backend import TritonLoRABackend

    pool = AdapterPool(
        SHAPES, slots=2, max_rank=4, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
    )
    backend = TritonLoRABackend(pool, max_tokens=32, side_stream=True)
    buffer = backend._delta.data_ptr()
    for on in (False, True, False):
        backend.set_side_stream(on)
        assert backend.side_stream is on
        assert backend._delta is not None and backend._delta.data_ptr() == buffer


def test_a_step_holds_at_most_the_batch_cap_or_the_pool_of_distinct_adapters():
    """LoRABackend.max_step_distinct: what the CUDA graphs' and the warm-up's LoRA tiers follow
    (--max-loras-per-batch, set by lora/setup.py, where it is below the pool's slots)."""
    pool = AdapterPool(
        SHAPES, slots=24, max_rank=8, target_modules=["q_proj"], dtype=torch.float32, device="cpu"
    )
    backend = TorchLoRABackend(pool)
    assert backend.max_step_distinct() == 24
    backend.step_distinct_cap = 4
    assert backend.max_step_distinct() == 4
    backend.step_distinct_cap = 64
    assert backend.max_step_distinct() == 24
    # Under tensor parallelism the same cap (parallel/lora.py), for both backends.
    from loraplex.services.inference.parallel.lora import make_tp_backend

    for kind in ("torch", "triton"):
        assert make_tp_backend(pool, kind, 64, 4).max_step_distinct() == 4
        assert make_tp_backend(pool, kind, 64).max_step_distinct() == 24


@pytest.mark.parametrize("rank, jitter", [(2 * PAGE_ROWS - 3, True), (2 * PAGE_ROWS, False)])
def test_a_packed_upload_fills_the_pool_as_the_per_module_copies_do(rank, jitter):
    # lora/packed_groups.py: mixed ranks within a group (zero padding), layers where a group is
    # untargeted, and ranks spanning pages must land exactly where the per-(layer, module) path puts
    # them; a rank filling whole pages uploads the pack as the staging itself.
    R = 2 * PAGE_ROWS
    ad = random_adapter(SHAPES, ["q_proj", "v_proj", "down_proj"], rank=rank, seed=7, rank_jitter=jitter)
    del ad.targets[(1, "down_proj")], ad.lora_a[(1, "down_proj")], ad.lora_b[(1, "down_proj")]
    packed = pack_groups(ad, SHAPES)
    assert set(packed.packed) == {"qkv", "down"}
    for key in ad.targets:  # the views read as the originals
        assert torch.equal(packed.lora_a[key], ad.lora_a[key])
        assert torch.equal(packed.lora_b[key], ad.lora_b[key])
    # views, not a second copy: the packs (padded to each group's largest rank) are all it holds
    assert packed.nbytes == sum(t.numel() * 4 for p in packed.packed.values() for t in p)
    pools = []
    for weights in (ad, packed):
        pool = AdapterPool(
            SHAPES, slots=2, max_rank=R, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
        )
        for g in pool.groups:  # stale rows past a rank must read the same too: start from one fill
            pool.lora_a[g].fill_(0.5)
            pool.lora_b[g].fill_(0.5)
        pool.upload(1, weights)
        pools.append(pool)
    for g in pools[0].groups:
        for buf in ("lora_a", "lora_b", "rank", "scaling"):
            assert torch.equal(getattr(pools[0], buf)[g], getattr(pools[1], buf)[g]), (g, buf)
