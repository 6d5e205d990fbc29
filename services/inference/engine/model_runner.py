"""Turns a step's sequence chunks into tensors, runs one forward, returns the sampled rows' logits.

Knows nothing of requests. Per-step metadata is written into buffers allocated once (sized by
the token budget and the request cap), and the forward itself does no host syncs. A step that a
captured graph covers replays it instead (engine/cuda_graph.py for decode steps,
engine/mixed_graphs.py for steps with prefill chunks).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from loraplex.kernels.placement import triton_runs_on
from loraplex.services.inference.engine.attention import (
    AttentionMetadata,
    PrefillSegment,
    TorchPagedAttention,
    effective_windows,
)
from loraplex.services.inference.engine.overlap import fill_placeholders
from loraplex.services.inference.engine.scheduled_batch import SeqChunk
from loraplex.services.inference.lora.backend import LoRABackend
from loraplex.services.inference.models.config import ModelConfig
from loraplex.services.inference.models.context import ForwardContext
from loraplex.services.inference.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        kv_cache: torch.Tensor,
        *,
        max_num_tokens: int,
        max_num_seqs: int,
        context_length: int,
        lora_backend: LoRABackend | None = None,
        max_decode_rows: int | None = None,
    ):
        self.model = model
        self.config = model_config
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.page_size = kv_cache.shape[3]
        self.lora_backend = lora_backend
        if self.device.type == "cuda":
            # Process-wide, before any graph captures a matmul: cuBLASLt's decode GEMMs were never slower
            # than cuBLAS's in any run that timed both (docs/benchmarks.md, "Facts behind defaults").
            torch.backends.cuda.preferred_blas_library("cublaslt")
        scale = model_config.attention_scale
        windows = effective_windows(model_config, context_length)
        if triton_runs_on(self.device):  # Triton kernels (kernels/attention_*.py); torch reference on CPU
            from loraplex.services.inference.engine.attention_triton import TritonPagedAttention

            self.attention = TritonPagedAttention(kv_cache, scale, windows, model_config.attn_softcap)
        else:
            self.attention = TorchPagedAttention(kv_cache, scale, windows, model_config.attn_softcap)
        self.cuda_graphs = None  # DecodeGraphs (engine/cuda_graph.py), set by capture_cuda_graphs
        self.mixed_graphs = None  # MixedGraphs (engine/mixed_graphs.py), set by capture_mixed_graphs
        self.max_blocks_per_seq = -(-context_length // self.page_size)
        dev = self.device
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=dev)
        # Decode rows: one per decoding sequence, or per token of a verify chunk laid out as decode
        # rows (`forward`); `max_decode_rows` (engine/startup.py `decode_rows`) bounds both.
        self.max_decode_rows = max(max_decode_rows or 0, max_num_seqs)
        self.decode_block_tables = torch.zeros(
            self.max_decode_rows, self.max_blocks_per_seq, dtype=torch.int64, device=dev
        )
        self.decode_context_lens = torch.zeros(self.max_decode_rows, dtype=torch.int64, device=dev)
        # A row per sequence, or per token of speculative verify chunks: sized by the token budget.
        self.sample_indices = torch.zeros(max(max_num_seqs, max_num_tokens), dtype=torch.int64, device=dev)
        self._pin = dev.type == "cuda"

    def _upload(self, buffer: torch.Tensor, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=buffer.dtype, pin_memory=self._pin)
        view = buffer[: len(values)]
        view.copy_(host, non_blocking=True)
        return view

    def capture_cuda_graphs(self, max_bs: int, use_graphs: bool = True) -> None:
        """Capture decode CUDA graphs for batch sizes up to `max_bs` (see engine/cuda_graph.py);
        `use_graphs=False` runs the same steps eagerly over the graphs' buffers (CPU tests)."""
        from loraplex.services.inference.engine.cuda_graph import DecodeGraphs

        graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            self.attention,
            self.lora_backend,
            max_bs=max_bs,
            max_blocks_per_seq=self.max_blocks_per_seq,
            use_graphs=use_graphs,
        )
        graphs.capture()
        self.cuda_graphs = graphs

    def capture_mixed_graphs(self, max_tokens: int, use_graphs: bool = True) -> None:
        """Piecewise graphs for steps with prefill chunks of up to `max_tokens` tokens (see
        engine/mixed_graphs.py); `use_graphs=False` runs the same pieces eagerly (CPU tests)."""
        from loraplex.services.inference.engine.mixed_graphs import MixedGraphs

        graphs = MixedGraphs(
            self.model,
            self.attention,
            self.lora_backend,
            max_tokens=max_tokens,
            device=self.device,
            dtype=self.model.norm.weight.dtype,  # activations (the KV cache may be FP8)
            use_graphs=use_graphs,
        )
        graphs.capture()
        self.mixed_graphs = graphs

    def _verify_as_decode_rows(self, chunks: list[SeqChunk]) -> bool:
        """Whether this step's verify chunks run as decode rows: a verify chunk's token at position p
        is a decode row with context p + 1 over the chunk's block table, since the step stores every
        row's KV before any row attends, row p sees the draft tokens before it and none after: the
        causal attention of a prefill chunk. Then a speculating step is a decode step of
        sum(K + 1) rows and replays the decode CUDA graphs (a mixed step costs about 1.4x a decode
        step, docs/benchmarks.md). Only for steps of decodes and verify chunks (a prefill chunk in
        the step keeps the segment layout) whose rows fit the decode buffers."""
        if not any(c.verify for c in chunks):
            return False
        rows = 0
        for c in chunks:
            if c.all_logits or not (c.verify or len(c.token_ids) == 1):
                return False
            rows += len(c.token_ids)
        return rows <= self.max_decode_rows

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Chunks must come decodes (single token) first. Returns [num sampled, vocab] float32 (a
        `verify` chunk samples every one of its tokens' rows), then,
        for the chunks with `all_logits`, one row per token of each (in chunk order).

        `prev_tokens` (overlap scheduling): the previous step's sampled ids, still on the device;
        a token id `-1 - i` in a chunk stands for `prev_tokens[i]` and is filled in on the device.
        """
        page = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        token_slots: list[int] = []
        sample_rows: list[int] = []
        all_rows: list[int] = []  # chunks that want every token's logits
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        segments: list[PrefillSegment] = []
        ctx_parts: list[np.ndarray] = []  # per prefill chunk: the KV slots of its whole context
        num_ctx = 0
        max_decode_blocks = 1
        rows_only = self._verify_as_decode_rows(chunks)
        for chunk in chunks:
            n, start, table = len(chunk.token_ids), chunk.start_pos, chunk.block_table
            q_start = len(ids)
            if chunk.all_logits:
                all_rows.extend(range(q_start, q_start + n))
            if (n == 1 or rows_only) and not segments:  # decode rows: no per-token ranges (the hot case)
                for i, token in enumerate(chunk.token_ids):
                    pos = start + i
                    ids.append(token)
                    positions.append(pos)
                    slots.append(table[pos // page] * page + pos % page)
                    token_slots.append(chunk.lora_slot)
                    nblocks = pos // page + 1
                    decode_tables.append(table[:nblocks])
                    decode_lens.append(pos + 1)
                    max_decode_blocks = max(max_decode_blocks, nblocks)
                if chunk.verify:
                    sample_rows.extend(range(q_start, q_start + n))
                elif chunk.sample:
                    sample_rows.append(q_start)
                continue
            ids.extend(chunk.token_ids)
            positions.extend(range(start, start + n))
            ctx_len = start + n
            # Slots of positions 0..ctx_len-1: each page's block id times the page size plus the offset
            # (vectorized: a long context would otherwise cost a Python loop per position per chunk).
            blocks = np.asarray(table[: -(-ctx_len // page)], dtype=np.int64)
            ctx = (blocks[:, None] * page + np.arange(page)).reshape(-1)[:ctx_len]
            slots.extend(ctx[start:].tolist())
            token_slots.extend([chunk.lora_slot] * n)
            if chunk.verify:
                sample_rows.extend(range(q_start, q_start + n))
            elif chunk.sample:
                sample_rows.append(q_start + n - 1)
            segments.append(PrefillSegment(q_start, n, num_ctx, ctx_len))
            ctx_parts.append(ctx)
            num_ctx += ctx_len

        distinct = len({s for s in token_slots if s >= 0})  # picks the LoRA graph tier and kernels
        # A step with a DoRA adapter's tokens or one with vocabulary parts replays the decode graphs'
        # kinds variant (lora/vocab_tables.py, lora/dora.py); other steps never run those parts.
        kinds = (
            distinct > 0 and self.lora_backend is not None and self.lora_backend.step_has_kinds(token_slots)
        )
        if self.cuda_graphs is not None and not segments and not all_rows:
            logits = self.cuda_graphs.run(
                ids,
                positions,
                slots,
                token_slots,
                distinct,
                decode_tables,
                decode_lens,
                sample_rows,
                prev_tokens,
                kinds=kinds,
            )
            if logits is not None:
                return logits
        num_tokens = len(ids)
        mixed_key = (
            None
            if self.mixed_graphs is None or not segments or kinds  # kinds: eager (docs/architecture.md)
            else self.mixed_graphs.key(num_tokens, distinct)
        )
        if mixed_key is None:
            input_ids = self._upload(self.input_ids, ids)
            if prev_tokens is not None:
                fill_placeholders(input_ids, prev_tokens)
            pos_t = self._upload(self.positions, positions)
            slot_t = self._upload(self.slot_mapping, slots)
        else:  # the mixed graphs upload ids, positions and KV slots into their own static buffers
            slot_t = self.mixed_graphs.slot_mapping[:num_tokens]
        nd = len(decode_lens)
        tables_t = self.decode_block_tables[:nd, :max_decode_blocks]
        if nd:
            padded = [t + [0] * (max_decode_blocks - len(t)) for t in decode_tables]
            host = torch.tensor(padded, dtype=torch.int64, pin_memory=self._pin)
            tables_t.copy_(host, non_blocking=True)
        lens_t = self._upload(self.decode_context_lens, decode_lens)
        ctx_host = (
            torch.from_numpy(np.concatenate(ctx_parts)) if ctx_parts else torch.empty(0, dtype=torch.int64)
        )
        ctx_t = ctx_host.to(self.device, non_blocking=True)
        self.attention.begin(AttentionMetadata(slot_t, nd, tables_t, lens_t, segments, ctx_t))

        if mixed_key is not None:
            # Everything but attention replays from the bucket's graphs; attention runs between them.
            hidden = self.mixed_graphs.run(mixed_key, ids, positions, slots, token_slots, prev_tokens)
            rows = self._upload(self.sample_indices, sample_rows)
            return self.model.compute_logits(hidden[rows])
        lora = None
        if self.lora_backend is not None and distinct:
            self.lora_backend.kinds_step = kinds
            self.lora_backend.prepare(self._upload(self.token_slots, token_slots), distinct)
            lora = self.lora_backend
        ctx = ForwardContext(self.attention, lora)
        try:
            hidden = self.model(input_ids, pos_t, ctx)
            assert hidden.shape[0] == num_tokens
            if all_rows:  # rare (prompt log probabilities): a fresh index tensor, past the sized buffer
                rows = torch.tensor(sample_rows + all_rows, dtype=torch.int64).to(
                    self.device, non_blocking=True
                )
            else:
                rows = self._upload(self.sample_indices, sample_rows)
            if kinds:
                self.lora_backend.logit_rows = rows
            return self.model.compute_logits(hidden[rows], lora=lora if kinds else None)
        finally:
            if kinds:  # graphs captured later must see none of this step's parts
                self.lora_backend.kinds_step = False
                self.lora_backend.logit_rows = None
