"""CUDA graphs for decode steps at a ladder of batch sizes, with LoRA inside the graph.

A decode step (one new token per sequence) at batch `n` replays the graph captured for the
smallest ladder size `bs >= n`; rows `n..bs` are padding (slot -1: no KV write; context 0:
zero attention; adapter slot -1: no LoRA work). Every per-step input lives in static device
buffers that the graph reads: token ids, positions, KV slots, block tables, context lengths
and the per-token adapter slots. The LoRA backend's `prepare` (grouping tokens by adapter) is
captured too, so one graph serves any mix of adapters; a step where no token has an adapter
replays the graph captured without LoRA and does no LoRA work at all. LoRA graphs come in two
tiers (`loraplex.kernels.lora_plan.lora_tier`): up to MANY_ADAPTERS distinct adapters, and (batch sizes
above it) more, whose launch plan takes the `decode_many` entries of kernels/lora_configs.py (the
expand with one program per token: faster when tokens do not share adapters, slower when they do;
docs/benchmarks.md). Each graph's `prepare` plans with its tier's bound (`tier_distinct_bound`).
The upper tier is captured only where a step can hold more than MANY_ADAPTERS distinct adapters
(`graph_tiers` of the backend's `max_step_distinct()`: the pool's slots, or --max-loras-per-batch
below them); a step whose graph was not captured runs eagerly.

Kinds variant: a step holding a DoRA adapter's tokens or one with vocabulary parts (embedding /
lm_head LoRA, trainable tokens) replays a graph captured with those parts (the backend's
`kinds_step`: DoRA factors per group, lora/vocab_tables.py around the embedding and the logits),
keyed (batch size, tier, 1). Such graphs are captured lazily, on the first step that needs one,
into the same memory pool; when the pool allocates DoRA or vocabulary tables the variant graphs
captured before are dropped (they lack those parts) and captured again on use. Steps without such
adapters replay the plain graphs (variant 0) and pay nothing.

Host work per step: fill two pinned buffers (numpy views), two host-to-device copies, one
replay. Capture time and the memory the graphs took are logged.

With `use_graphs=False` nothing is captured: every step runs the forward a graph would hold, over the
same static buffers, eagerly (the CPU tests, under the Triton interpreter, check the glue around the
graphs that way: padding rows, tiers, verify rows, steps that sample no row).
"""

from __future__ import annotations

import logging
import time

import torch

from loraplex.kernels.lora_configs import MANY_ADAPTERS
from loraplex.kernels.lora_plan import graph_tiers, lora_tier, tier_distinct_bound
from loraplex.services.inference.engine.attention import AttentionMetadata
from loraplex.services.inference.engine.attention_triton import TritonPagedAttention
from loraplex.services.inference.engine.overlap import fill_placeholders
from loraplex.services.inference.lora.backend import LoRABackend
from loraplex.services.inference.models.context import ForwardContext
from loraplex.services.inference.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def batch_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `max_bs` (which is always included)."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1 to capture graphs (got {max_bs})")
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 16)) + [max_bs]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        eager_attention: TritonPagedAttention,
        lora: LoRABackend | None,
        *,
        max_bs: int,
        max_blocks_per_seq: int,
        use_graphs: bool = True,
    ):
        self.model = model
        self.use_graphs = use_graphs
        # The graphs' own attention (its metadata is the graphs' static buffers), with the eager
        # one's scale, per-layer windows and soft-capping.
        a = eager_attention
        self.attention = TritonPagedAttention(kv_cache, a.scale, a.windows, a.softcap)
        # A backend whose prepare reads slots on the host cannot be captured: such batches run eagerly.
        self.lora = lora if lora is not None and lora.cuda_graph_safe else None
        self.ladder = batch_ladder(max_bs)
        self.max_bs = self.ladder[-1]
        self.max_blocks = max_blocks_per_seq
        dev = kv_cache.device
        n, mb = self.max_bs, max_blocks_per_seq
        # int64 inputs: ids, positions, KV slots. int32: context lengths, adapter slots, tables.
        self._host64 = torch.zeros(3 * n, dtype=torch.int64, pin_memory=use_graphs)
        self._host32 = torch.zeros(2 * n + n * mb, dtype=torch.int32, pin_memory=use_graphs)
        self._np64, self._np32 = self._host64.numpy(), self._host32.numpy()
        self._dev64 = torch.zeros(3 * n, dtype=torch.int64, device=dev)
        self._dev32 = torch.zeros(2 * n + n * mb, dtype=torch.int32, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self._dev64.view(3, n)
        self.context_lens, self.token_slots = self._dev32[:n], self._dev32[n : 2 * n]
        self.block_tables = self._dev32[2 * n :].view(n, mb)
        self.slot_mapping.fill_(-1)
        self.token_slots.fill_(-1)
        self.logits = torch.empty(n, model.config.vocab_size, dtype=torch.float32, device=dev)
        # (batch size, LoRA tier, kinds variant 0/1); None: the step runs eagerly (`use_graphs=False`)
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph | None] = {}
        self._kinds_tables = None  # the pool tables the kinds-variant graphs were captured with
        self.kinds_captures: list[tuple[tuple[int, int, int], float, int]] = []  # key, seconds, bytes
        self._pool = None  # one memory pool for every graph, made by the first capture
        self._inputs_copied: torch.cuda.Event | None = None

    def _forward(self, bs: int, tier: int, variant: int = 0) -> None:
        self.attention.begin(
            AttentionMetadata(
                self.slot_mapping[:bs],
                bs,
                self.block_tables[:bs],
                self.context_lens[:bs],
                [],
                self.slot_mapping[:0],
            )
        )
        lora = None
        if tier:  # the tier's bound on distinct adapters plans the LoRA launches of every step it serves
            self.lora.kinds_step = bool(variant)
            self.lora.prepare(self.token_slots[:bs], tier_distinct_bound(tier, bs))
            lora = self.lora
        try:
            ctx = ForwardContext(self.attention, lora)
            hidden = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
            self.model.compute_logits(hidden, out=self.logits[:bs], lora=lora if variant else None)
        finally:
            if lora is not None:
                lora.kinds_step = False

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch size, LoRA tier) graph, largest first, in one memory pool."""
        tiers = graph_tiers(None if self.lora is None else self.lora.max_step_distinct())
        keys = [(bs, t, 0) for bs in reversed(self.ladder) for t in tiers if t < 2 or bs > MANY_ADAPTERS]
        if not self.use_graphs:
            self.recapture(keys)
            return
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        self.recapture(keys)
        torch.cuda.synchronize()
        taken = free_before - torch.cuda.mem_get_info()[0]
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s, LoRA %s) in %.1f s, %.0f MiB",
            len(self.graphs),
            self.ladder,
            f"off and on, {len(tiers) - 1} tier(s)" if self.lora is not None else "off",
            time.perf_counter() - start,
            taken / 2**20,
        )
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = taken

    @torch.inference_mode()
    def recapture(self, keys: list[tuple[int, int, int]]) -> None:
        """(Re)capture the graphs for these (batch size, LoRA tier, kinds variant) keys into the
        graphs' memory pool (benchmarks use it after switching a backend option)."""
        if not self.use_graphs:
            self.graphs.update(dict.fromkeys(keys))
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # The buffers hold the last replay's step. The eager warm-up below runs it again, at another
        # size, tier or LoRA mode: it would write that step's KV slots over (a live request's last
        # token; a block the prefix cache shares) and plan LoRA for more distinct adapters than a
        # tier bounds. Capture runs write no KV and do no LoRA work, as the first capture's did.
        self.slot_mapping.fill_(-1)
        self.token_slots.fill_(-1)
        stream = torch.cuda.Stream()
        for bs, tier, variant in keys:
            # Eager warm-up on a side stream (Triton compiles, cuBLAS picks kernels) before capture.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(bs, tier, variant)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(bs, tier, variant)
            self.graphs[(bs, tier, variant)] = graph

    def _capture_kinds(self, key: tuple[int, int, int]) -> None:
        """Capture one kinds-variant graph on first use (see the module docstring), after dropping
        the variant graphs captured before the pool's DoRA / vocabulary tables last changed."""
        tables = self.lora.pool.kinds_tables
        if tables != self._kinds_tables:
            for old in [k for k in self.graphs if k[2]]:
                del self.graphs[old]
            self._kinds_tables = tables
        if not self.use_graphs:
            self.recapture([key])
            return
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        self.recapture([key])
        torch.cuda.synchronize()
        seconds, taken = time.perf_counter() - start, free_before - torch.cuda.mem_get_info()[0]
        self.kinds_captures.append((key, seconds, taken))
        log.info(
            "captured the kinds-variant decode graph (batch %d, LoRA tier %d) in %.2f s, %.0f MiB",
            key[0],
            key[1],
            seconds,
            taken / 2**20,
        )

    def bucket(self, n: int) -> int | None:
        return next((bs for bs in self.ladder if bs >= n), None)

    def key(self, n: int, distinct_adapters: int, kinds: bool = False) -> tuple[int, int, int] | None:
        """The graph a decode step of `n` tokens over that many distinct adapters replays (None: eager):
        (batch size, tier, variant) with tier 0 without LoRA, 1 up to MANY_ADAPTERS distinct adapters,
        2 above; variant 1 for a step holding DoRA or vocabulary-part adapters (`kinds`)."""
        bs = self.bucket(n)
        if bs is None or (distinct_adapters and self.lora is None):
            return None
        tier = lora_tier(distinct_adapters)
        return bs, tier, int(kinds and tier > 0)

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        token_slots: list[int],
        distinct_adapters: int,
        tables: list[list[int]],
        context_lens: list[int],
        sample_rows: list[int],
        prev_tokens: torch.Tensor | None = None,
        kinds: bool = False,
    ) -> torch.Tensor | None:
        """Logits `[len(sample_rows), vocab]` of one decode step, or None when no graph fits.

        `distinct_adapters`: how many different slots >= 0 `token_slots` holds (picks the LoRA tier).
        `prev_tokens`: as in ModelRunner.forward (placeholder ids filled in on the device before the replay).
        `kinds`: the step holds a DoRA or vocabulary-part adapter (`LoRABackend.step_has_kinds`).
        """
        n = len(ids)
        key = self.key(n, distinct_adapters, kinds)
        if key is None or max(map(len, tables)) > self.max_blocks:
            return None
        if key[2] and (key not in self.graphs or self._kinds_tables != self.lora.pool.kinds_tables):
            if self._inputs_copied is not None:
                self._inputs_copied.synchronize()
            self._capture_kinds(key)  # lazily: the first step holding such adapters at this size
        if key not in self.graphs:
            return None
        bs = key[0]
        if self._inputs_copied is not None:
            # Overlap scheduling can get here before the previous step's host-to-device copy
            # ran: do not overwrite the pinned buffers under it.
            self._inputs_copied.synchronize()
        big, small, max_bs = self._np64, self._np32, self.max_bs
        big[:n], big[max_bs : max_bs + n], big[2 * max_bs : 2 * max_bs + n] = ids, positions, slots
        big[n:bs] = 0
        big[max_bs + n : max_bs + bs] = 0
        big[2 * max_bs + n : 2 * max_bs + bs] = -1
        small[:n], small[n:bs] = context_lens, 0
        small[max_bs : max_bs + n], small[max_bs + n : max_bs + bs] = token_slots, -1
        table_rows = small[2 * max_bs : 2 * max_bs + bs * self.max_blocks].reshape(bs, self.max_blocks)
        for row, table in zip(table_rows, tables, strict=False):
            row[: len(table)] = table
        self._dev64.copy_(self._host64, non_blocking=True)
        end32 = 2 * max_bs + bs * self.max_blocks
        self._dev32[:end32].copy_(self._host32[:end32], non_blocking=True)
        if self.use_graphs:
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()
        if prev_tokens is not None:
            fill_placeholders(self.input_ids[:n], prev_tokens)
        graph = self.graphs[key]
        if graph is None:
            self._forward(*key)
        else:
            graph.replay()
        return sampled_logits(self.logits, n, sample_rows)


def sampled_logits(logits: torch.Tensor, n: int, sample_rows: list[int]) -> torch.Tensor:
    """The rows a step samples, of its first `n` rows of `logits`: `[len(sample_rows), vocab]`, also when
    none is sampled (a draft model's catch-up step: `[0, vocab]`)."""
    if len(sample_rows) == n:
        return logits[:n]
    return logits[torch.tensor(sample_rows, dtype=torch.int64, device=logits.device)]
