"""The pool's vocabulary tables (lora/vocab_tables.py): the graph-safe embedding / lm_head functions
against a per-adapter torch reference (random adapters, random batches), a vocab slot released and
reused without stale values, adapters beyond the vocab slots waiting for one in the manager, and a
step without such adapters choosing no graph variant. PEFT exactness: tests/integration/test_lora_kinds.py."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from loraplex.services.inference.errors import AdapterIncompatible, CapacityExceeded
from loraplex.services.inference.lora.adapter_weights import AdapterWeights
from loraplex.services.inference.lora.backend_check import random_adapter
from loraplex.services.inference.lora.embedding_lora import EMBED_PATH, HEAD_PATH, EmbeddingLoRA
from loraplex.services.inference.lora.manager import LoRAManager
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.shapes import ModelShapes
from loraplex.services.inference.lora.torch_backend import TorchLoRABackend
from loraplex.services.inference.lora.trainable_tokens import TokenRows
from loraplex.services.inference.lora.vocab_tables import check_vocab_fits

SHAPES = ModelShapes(num_layers=1, hidden_size=16, intermediate_size=32, q_size=16, kv_size=8, vocab_size=40)
MAX_RANK = 8


def with_vocab_parts(seed: int, embed: str | None, head: str | None, rank: int = 4) -> AdapterWeights:
    """A random plain adapter given `embed` / `head` parts: "lora" (rank `rank`) or "tokens"."""
    gen = torch.Generator().manual_seed(seed)
    base = random_adapter(SHAPES, ["q_proj"], 4, seed, torch.float32)
    vocab, hidden = SHAPES.vocab_size, SHAPES.hidden_size
    embedding, rows = {}, {}

    def tokens() -> TokenRows:
        ids = torch.randperm(vocab, generator=gen)[: 3 + seed % 3]
        return TokenRows(ids, torch.randn(len(ids), hidden, generator=gen))

    if embed == "lora":
        embedding[EMBED_PATH] = EmbeddingLoRA(
            torch.randn(rank, vocab, generator=gen), torch.randn(hidden, rank, generator=gen), 0.5 + seed
        )
    elif embed == "tokens":
        rows[EMBED_PATH] = tokens()
    if head == "lora":
        embedding[HEAD_PATH] = EmbeddingLoRA(
            torch.randn(rank, hidden, generator=gen), torch.randn(vocab, rank, generator=gen), 2.0 / rank
        )
    elif head == "tokens":
        rows[HEAD_PATH] = tokens()
    return dataclasses.replace(base, embedding=embedding, token_rows=rows, digest=f"sha256:v{seed}")


def reference_embed(h, ids, adapters: list[AdapterWeights | None]):
    """Per token, its adapter's own rows and LoRA delta (what PEFT does for one request)."""
    out = h.clone()
    for i, (t, w) in enumerate(zip(ids.tolist(), adapters, strict=True)):
        if w is None:
            continue
        rows = w.token_rows.get(EMBED_PATH)
        if rows is not None and t in rows.ids.tolist():
            out[i] = rows.values[rows.ids.tolist().index(t)]
        lora = w.embedding.get(EMBED_PATH)
        if lora is not None:
            out[i] += (lora.b @ lora.a[:, t]) * lora.scaling
    return out


def reference_head(logits, hidden, adapters: list[AdapterWeights | None]):
    out = logits.clone()
    for i, w in enumerate(adapters):
        if w is None:
            continue
        rows = w.token_rows.get(HEAD_PATH)
        if rows is not None:
            out[i, rows.ids] = rows.values @ hidden[i]
        lora = w.embedding.get(HEAD_PATH)
        if lora is not None:
            out[i] += (lora.b @ (lora.a @ hidden[i])) * lora.scaling
    return out


def step(pool: AdapterPool, token_slots: list[int], ids: torch.Tensor, hidden: torch.Tensor):
    """The graph-safe functions as a kinds step runs them (prepare, embedding, logits of every token)."""
    backend = TorchLoRABackend(pool)
    assert backend.step_has_kinds(token_slots)
    backend.kinds_step = True
    backend.prepare(torch.tensor(token_slots, dtype=torch.int32))
    h = backend.add_embedding(torch.zeros(len(ids), SHAPES.hidden_size), ids)
    logits = backend.add_head(torch.zeros(len(ids), SHAPES.vocab_size), hidden)
    return h, logits


@pytest.mark.parametrize("seed", range(4))
def test_tables_equal_the_per_adapter_reference(seed):
    """Random mixes of base, plain and each vocabulary kind (ranks below the cap, columns padded)."""
    rnd = random.Random(seed)
    kinds = [(None, None), ("lora", "lora"), ("tokens", "tokens"), ("tokens", "lora"), ("lora", None)]
    pool = AdapterPool(
        SHAPES,
        slots=6,
        max_rank=MAX_RANK,
        target_modules=["q_proj"],
        dtype=torch.float32,
        device="cpu",
        vocab_slots=4,
    )
    adapters = {}
    for slot, (embed, head) in enumerate(kinds):
        w = with_vocab_parts(10 * seed + slot, embed, head, rank=rnd.randint(1, MAX_RANK))
        pool.upload(slot, w)
        adapters[slot] = w
    n = 24
    token_slots = [rnd.choice([-1, *adapters]) for _ in range(n)]
    # half the tokens are ids the adapters list, so the trainable rows are hit
    listed = [int(i) for w in adapters.values() for r in w.token_rows.values() for i in r.ids]
    ids = torch.tensor([rnd.choice(listed) if rnd.random() < 0.5 else rnd.randrange(40) for _ in range(n)])
    base = torch.randn(n, SHAPES.hidden_size)
    hidden = torch.randn(n, SHAPES.hidden_size)
    base_logits = torch.randn(n, SHAPES.vocab_size)
    per_token = [adapters.get(s) for s in token_slots]
    backend = TorchLoRABackend(pool)
    backend.kinds_step = True
    backend.prepare(torch.tensor(token_slots, dtype=torch.int32))
    got_h = backend.add_embedding(base.clone(), ids)
    got_logits = backend.add_head(base_logits.clone(), hidden)
    torch.testing.assert_close(got_h, reference_embed(base, ids, per_token), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        got_logits, reference_head(base_logits, hidden, per_token), rtol=1e-5, atol=1e-5
    )
    # an eager step's logits rows are a subset of its tokens: each row takes its own token's adapter
    rows = torch.tensor([3, 0, n - 1])
    backend.logit_rows = rows
    got_rows = backend.add_head(base_logits[rows].clone(), hidden[rows])
    want = reference_head(base_logits[rows], hidden[rows], [per_token[i] for i in rows.tolist()])
    torch.testing.assert_close(got_rows, want, rtol=1e-5, atol=1e-5)


def test_vocab_slot_released_and_reused_without_stale_values():
    pool = AdapterPool(
        SHAPES,
        slots=3,
        max_rank=MAX_RANK,
        target_modules=["q_proj"],
        dtype=torch.float32,
        device="cpu",
        vocab_slots=1,
    )
    wide = with_vocab_parts(1, "tokens", "lora", rank=MAX_RANK)
    pool.upload(0, wide)
    assert pool.vocab.host_slot_vocab == [0, -1, -1] and not pool.vocab.free_vocab_slot()
    with pytest.raises(RuntimeError, match="no free vocab slot"):  # the manager never asks this
        pool.upload(1, with_vocab_parts(2, "lora", None))
    pool.upload(0, random_adapter(SHAPES, ["q_proj"], 4, 3, torch.float32))  # plain over it: released
    assert pool.vocab.host_slot_vocab == [-1, -1, -1] and pool.vocab.slot_vocab.tolist() == [-1, -1, -1]
    # lower rank over the same vocab slot, embedding rows gone: nothing of `wide` may be left
    narrow = with_vocab_parts(4, "lora", "lora", rank=2)
    pool.upload(2, narrow)
    assert pool.vocab.host_slot_vocab == [-1, -1, 0]
    ids = torch.arange(12)
    hidden = torch.randn(12, SHAPES.hidden_size)
    token_slots = [2] * 6 + [0] * 6  # slot 0 now holds a plain adapter: no vocabulary parts
    h, logits = step(pool, token_slots, ids, hidden)
    per_token = [narrow] * 6 + [None] * 6
    zeros_h, zeros_logits = torch.zeros(12, SHAPES.hidden_size), torch.zeros(12, SHAPES.vocab_size)
    torch.testing.assert_close(h, reference_embed(zeros_h, ids, per_token), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, reference_head(zeros_logits, hidden, per_token), rtol=1e-5, atol=1e-5)


def test_a_step_without_such_adapters_has_no_variant():
    """Plain and base tokens: no kinds step, so the runner replays the plain graphs (variant 0)."""
    from loraplex.services.inference.engine.cuda_graph import DecodeGraphs, batch_ladder

    pool = AdapterPool(
        SHAPES, slots=3, max_rank=MAX_RANK, target_modules=["q_proj"], dtype=torch.float32, device="cpu"
    )
    pool.upload(0, random_adapter(SHAPES, ["q_proj"], 4, 0, torch.float32))
    pool.upload(1, with_vocab_parts(1, "lora", None))
    backend = TorchLoRABackend(pool)
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # key() needs only the ladder and the backend
    graphs.ladder, graphs.lora = batch_ladder(8), backend
    assert not backend.step_has_kinds([0, -1, 0])
    assert graphs.key(3, 1, backend.step_has_kinds([0, -1, 0])) == (4, 1, 0)
    assert backend.step_has_kinds([0, 1, -1])
    assert graphs.key(3, 2, backend.step_has_kinds([0, 1, -1])) == (4, 1, 1)
    # and without a kinds step the backend's embedding / head hooks do nothing at all
    h = torch.randn(2, SHAPES.hidden_size)
    backend.prepare(torch.tensor([1, 1], dtype=torch.int32))
    assert backend.add_embedding(h, torch.tensor([1, 2])) is h


def test_fixed_sizes_refuse_with_the_field():
    w = with_vocab_parts(1, "lora", None, rank=MAX_RANK)
    with pytest.raises(AdapterIncompatible, match="--max-lora-rank") as e:
        check_vocab_fits(w, MAX_RANK - 1)
    assert e.value.field == "r"
    w = with_vocab_parts(1, "tokens", None)
    with pytest.raises(AdapterIncompatible, match="at most 2 per layer") as e:
        check_vocab_fits(w, MAX_RANK, max_token_rows=2)
    assert e.value.field == "trainable_token_indices"


@pytest.fixture(scope="module")
def vocab_adapters(tiny_llama_path, adapter_factory):
    names = ("va", "vb", "vc")
    return {
        n: adapter_factory(tiny_llama_path, f"vocab-tables-{n}", r=4, target_modules=["lm_head", "q_proj"])
        for n in names
    } | {"plain": adapter_factory(tiny_llama_path, "vocab-tables-plain", r=4, target_modules=["q_proj"])}


def test_more_vocab_adapters_than_vocab_slots_wait_for_one(tiny_llama_path, vocab_adapters):
    """Two vocab slots, four pool slots: the third vocab adapter waits while both are busy (a plain
    adapter after it is still served), takes a vocab holder's slot when that one goes idle, and an
    aged waiter drains a busy vocab holder; pinning is capped at the vocab slots - 1."""
    shapes = ModelShapes.from_model_dir(tiny_llama_path)
    pool = AdapterPool(
        shapes,
        slots=4,
        max_rank=8,
        target_modules=["q_proj"],
        dtype=torch.float32,
        device="cpu",
        vocab_slots=2,
    )
    now = [0.0]
    manager = LoRAManager(
        pool,
        base_weight=lambda n, m: torch.ones(1),
        clock=lambda: now[0],
        slot_wait_s=1.0,
        min_resident_s=0.0,
    )
    for name, path in vocab_adapters.items():
        manager.load_adapter(name, path)
    a, b = manager.acquire("va"), manager.acquire("vb")
    assert a is not None and b is not None
    assert manager.acquire("vc") is None  # both vocab slots busy: it waits (its pool slot is free)
    assert manager.slot_queue() == {"vc": 0.0}
    plain = manager.acquire("plain")  # behind it in the queue, and needing no vocab slot: served
    assert plain is not None
    assert manager.slot_queue() == {"vc": 0.0}
    now[0] = 2.0  # aged: a busy vocab holder drains for it
    manager.note_queued({"vc": 1})
    assert manager.slots_draining() == 1 and manager.yielding() <= {"va", "vb"}
    manager.release("va")
    c = manager.acquire("vc")
    assert c == a and pool.vocab.host_slot_vocab[c] >= 0
    assert sorted(v for v in pool.vocab.host_slot_vocab if v >= 0) == [0, 1]
    manager.pin("vb")
    with pytest.raises(CapacityExceeded, match="vocab slots - 1"):
        manager.pin("vc")
