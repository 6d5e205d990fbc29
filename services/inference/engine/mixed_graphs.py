"""Piecewise CUDA graphs for steps that carry prefill chunks (mixed steps): everything but attention
replays from graphs captured per (token-count bucket, LoRA tier); attention runs eagerly between
the pieces with the step's own metadata.

Why piecewise: a mixed step's attention depends on how its tokens split into sequences (decode
count, chunk lengths, contexts), which no fixed graph can cover, while everything else in a
layer (norms, projections, rotary, the KV write, the MLP and every LoRA shrink/expand with its
segment metadata) depends only on the token count. Eagerly, a layer of such a step costs about 18
launches from Python, 8 of them LoRA kernels of 30-70 us host time each; piecewise it costs one
graph replay and the attention launches (decode: 2, prefill: 1).

The model is cut at attention (models/llama.py `first_piece`/`middle_piece`/`last_piece`):
piece 0 = embedding, rotary tables, LoRA `prepare`, layer 0 up to and including its KV write;
piece i = layer i-1 after attention and layer i up to its KV write; piece L = the last layer after
attention and the final norm. Pieces hand the residual stream and q/k/v over in static buffers
(`StepBuffers`), attention writes its output into a static buffer the next piece reads. A step of
T tokens replays the smallest bucket >= T; rows T.. are padding (KV slot -1: no write; adapter
slot -1: no LoRA work; attention leaves them alone). Buckets line up with the LoRA kernels'
family boundaries (16, DECODE_MAX_TOKENS), so a graph launches the kernels the eager step would.
LoRA tiers as in the decode graphs (engine/cuda_graph.py, `loraplex.kernels.lora_plan.lora_tier`): none,
up to MANY_ADAPTERS distinct adapters, more (only where a step can hold more: `graph_tiers`).

Memory: the graphs of all buckets share one pool, sized by the largest bucket's activations; the
static buffers are sized by the largest bucket. Both are logged at capture; `max_tokens` (the
`--mixed-cuda-graph-max-tokens` flag) bounds them, 0 turns the path off. With `use_graphs=False`
the pieces run eagerly in the same order over the same buffers (the CPU tests check the cut and
the padding that way).
"""

from __future__ import annotations

import logging
import time

import torch

from loraplex.kernels.lora_configs import DECODE_MAX_TOKENS, MANY_ADAPTERS
from loraplex.kernels.lora_plan import graph_tiers, lora_tier, tier_distinct_bound
from loraplex.services.inference.engine.overlap import fill_placeholders
from loraplex.services.inference.lora.backend import LoRABackend
from loraplex.services.inference.models.context import Attention, ForwardContext
from loraplex.services.inference.models.llama import LlamaForCausalLM, StepBuffers

log = logging.getLogger(__name__)


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets up to `max_tokens` (always included): 16, 32, ..., 256, then steps of
    about 1.5x (384, 512, 768, 1024, 1536, 2048, ...). 16 and DECODE_MAX_TOKENS are always bucket
    edges when they are below the cap, so a bucket never straddles a LoRA kernel family."""
    if max_tokens < 1:
        return []
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        b = b * 2 if b < DECODE_MAX_TOKENS else (b * 3 // 2 if (b & (b - 1)) == 0 else b * 4 // 3)
    edges = {s for s in (16, DECODE_MAX_TOKENS) if s < max_tokens}
    return sorted(set(sizes) | edges | {max_tokens})


class MixedGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attention: Attention,
        lora: LoRABackend | None,
        *,
        max_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        use_graphs: bool = True,
    ):
        self.model = model
        self.attention = attention
        self.use_graphs = use_graphs
        # A backend whose prepare reads slots on the host cannot be captured: its steps run eagerly.
        self.lora = lora if lora is not None and (lora.cuda_graph_safe or not use_graphs) else None
        self.buckets = mixed_buckets(max_tokens)
        self.max_tokens = self.buckets[-1] if self.buckets else 0
        cfg = model.config
        n = max(self.max_tokens, 1)
        self.num_layers = cfg.num_layers
        # Per-step inputs: ids, positions, KV slots (int64, one device tensor so one copy fills them)
        # and adapter slots (int32), staged in pinned host buffers written through numpy views.
        self._pin = device.type == "cuda"
        self._dev64 = torch.zeros(3 * n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._dev64.view(3, n)
        self.slot_mapping.fill_(-1)
        self.token_slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self._host64 = torch.zeros(3 * n, dtype=torch.int64, pin_memory=self._pin)
        self._host32 = torch.zeros(n, dtype=torch.int32, pin_memory=self._pin)
        self._np64, self._np32 = self._host64.numpy(), self._host32.numpy()
        self._inputs_copied: torch.cuda.Event | None = None
        # Zero-filled: padding rows read them and must stay finite.
        self.h = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        self.attn = torch.zeros(n, cfg.num_heads * cfg.head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[tuple[int, int], list[torch.cuda.CUDAGraph]] = {}
        self._rotary: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # cos/sin each set reads
        self._pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.steps_run = 0  # steps served through the pieces

    @property
    def buffer_bytes(self) -> int:
        tensors = (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.token_slots,
            self.h,
            self.q,
            self.k,
            self.v,
            self.attn,
            self.hidden,
        )
        return sum(t.numel() * t.element_size() for t in tensors)

    def tiers(self) -> tuple[int, ...]:
        return graph_tiers(None if self.lora is None else self.lora.max_step_distinct())

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def key(self, num_tokens: int, distinct_adapters: int) -> tuple[int, int] | None:
        """(bucket, LoRA tier) a step replays, or None (runs eagerly: too many tokens, or adapters and
        a backend that cannot be captured)."""
        b = self.bucket(num_tokens)
        if b is None or (distinct_adapters and self.lora is None):
            return None
        tier = lora_tier(distinct_adapters)
        if tier not in self.tiers() or (tier == 2 and b <= MANY_ADAPTERS):
            return None  # more distinct adapters than the pool or the tokens hold: cannot happen
        return b, tier

    def _bufs(self, b: int) -> StepBuffers:
        return StepBuffers(self.h[:b], self.q[:b], self.k[:b], self.v[:b])

    def _ctx(self, b: int, tier: int) -> ForwardContext:
        return ForwardContext(self.attention, self.lora if tier else None)

    def _piece(self, index: int, b: int, tier: int) -> None:
        """Piece `index` of a step in bucket `b` (see the module docstring)."""
        bufs, ctx, model = self._bufs(b), self._ctx(b, tier), self.model
        if index == 0:
            if tier:  # the tier's bound on distinct adapters plans the LoRA launches, as in the decode graphs
                self.lora.prepare(self.token_slots[:b], tier_distinct_bound(tier, b))
            self._rotary[(b, tier)] = model.first_piece(self.input_ids[:b], self.positions[:b], ctx, bufs)
        elif index < self.num_layers:
            cos, sin = self._rotary[(b, tier)]
            model.middle_piece(index, self.attn[:b], cos, sin, ctx, bufs)
        else:
            model.last_piece(self.attn[:b], ctx, bufs, self.hidden[:b])
            return
        self.attention.store(index, bufs.k, bufs.v, self.slot_mapping[:b])

    def _run_pieces(self, b: int, tier: int, graphs: list | None) -> None:
        for index in range(self.num_layers + 1):
            if graphs is None:
                self._piece(index, b, tier)
            else:
                graphs[index].replay()
            if index < self.num_layers:
                self.attention.attend(index, self.q[:b], out=self.attn[:b])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (bucket, tier) set of pieces, largest bucket first, into one memory pool."""
        if not self.use_graphs or not self.buckets:
            return
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        self.slot_mapping.fill_(-1)  # capture runs write no KV and do no LoRA work
        self.token_slots.fill_(-1)
        for b in reversed(self.buckets):
            for tier in self.tiers():
                if tier == 2 and b <= MANY_ADAPTERS:
                    continue
                # Eager warm-up on a side stream (Triton compiles, cuBLAS picks kernels) before capture.
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for index in range(self.num_layers + 1):
                        self._piece(index, b, tier)
                torch.cuda.current_stream().wait_stream(stream)
                pieces = []
                for index in range(self.num_layers + 1):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool):
                        self._piece(index, b, tier)
                    pieces.append(graph)
                self.graphs[(b, tier)] = pieces
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = free_before - torch.cuda.mem_get_info()[0]
        log.info(
            "captured mixed-step CUDA graphs: buckets %s, LoRA tiers %s, %d pieces each, %d graphs in "
            "%.1f s, %.0f MiB (+ %.0f MiB static buffers)",
            self.buckets,
            self.tiers(),
            self.num_layers + 1,
            sum(map(len, self.graphs.values())),
            self.capture_seconds,
            self.capture_bytes / 2**20,
            self.buffer_bytes / 2**20,
        )

    def run(
        self,
        key: tuple[int, int],
        ids: list[int],
        positions: list[int],
        slots: list[int],
        token_slots: list[int],
        prev_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states `[T, hidden]` of a step whose attention metadata is already bound
        (`attention.begin`), replaying the pieces of `key` (`key()`); a view of a static buffer,
        valid until the next step."""
        b, tier = key
        n = len(ids)
        if self._inputs_copied is not None:
            # Overlap scheduling can get here before the previous step's copy ran: do not
            # overwrite the pinned buffers under it.
            self._inputs_copied.synchronize()
        big, small, cap = self._np64, self._np32, self.input_ids.shape[0]
        big[:n], big[n:b] = ids, 0
        big[cap : cap + n], big[cap + n : cap + b] = positions, 0
        big[2 * cap : 2 * cap + n], big[2 * cap + n : 2 * cap + b] = slots, -1
        small[:n], small[n:b] = token_slots, -1
        self._dev64.copy_(self._host64, non_blocking=True)
        self.token_slots[:b].copy_(self._host32[:b], non_blocking=True)
        if self._pin:
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()
        if prev_tokens is not None:
            fill_placeholders(self.input_ids[:n], prev_tokens)
        self._run_pieces(b, tier, self.graphs[key] if self.use_graphs else None)
        self.steps_run += 1
        return self.hidden[:n]
