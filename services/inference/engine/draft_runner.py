"""The draft model of `--speculative-algorithm draft`: a smaller model with the target's tokenizer that
proposes each drafting request's next K tokens with its own forward passes.

It has its own weights, its own paged KV cache and block manager (no prefix cache) and its own
ModelRunner, so the target's cache and scheduler never see it. Per request it keeps the tokens whose
KV it holds; a step's drafting:

1. catch-up: the request's tokens the draft has not computed (its prompt the first time, then the
   target's accepted tokens and bonus token) except the last, as prefill chunks (no sampling), in
   forwards of at most the token budget. The draft KV past what the target accepted is stale and
   is simply overwritten here, as the target's rejected positions are;
2. K decode steps over all drafting requests batched: the first feeds each request's last token,
   each later one the token drafted before. A greedy request drafts the argmax; a sampled one
   samples from the draft's distribution q (its own temperature, top-k, top-p, min-p, from its
   own generator), and q's row is kept for verification's rejection sampling (speculative_verify.verify).

Draft adapters (`--speculative-draft-lora-paths NAME=DIR`): LoRA adapters of the draft model,
loaded at start into a pool of their own (lora/setup.py's machinery, over the draft's shapes),
each holding its slot for good. A request names one as its `draft_adapter`; its draft chunks compute
with that slot, so requests with different draft adapters (and none) share each draft step, as
requests with different adapters share a target step.

A request's draft state goes when it is no longer running (finished, aborted, preempted): a
preempted one catches up again from its first token, like the target's recompute.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.kernels.placement import triton_runs_on
from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.engine.kv_cache import allocate_kv_cache, kv_bytes_per_token
from loraplex.services.inference.engine.loading import LoadedModel
from loraplex.services.inference.engine.model_runner import ModelRunner
from loraplex.services.inference.engine.request import Request
from loraplex.services.inference.engine.sampler import MIN_TEMPERATURE, SamplingInputs, filtered_probs
from loraplex.services.inference.engine.scheduled_batch import SeqChunk
from loraplex.services.inference.engine.startup import decode_graph_max_bs
from loraplex.services.inference.engine.warmup import warm_up
from loraplex.services.inference.errors import AdapterNotFound, InvalidRequest
from loraplex.services.inference.lora.settings import LoRAConfig, parse_lora_paths
from loraplex.services.inference.lora.setup import LoRAStack, build_lora
from loraplex.services.inference.lora.shapes import shapes_of_model
from loraplex.services.inference.models.config import ModelConfig, check_context_length, load_config
from loraplex.services.inference.models.llama import LlamaForCausalLM
from loraplex.services.inference.models.loader import load_model, resolve_model_dir

log = logging.getLogger(__name__)


class DraftModelMismatch(ValueError):
    """The draft model cannot draft for this target (another vocabulary, a shorter context)."""


@dataclass
class LoadedDraft:
    model: LlamaForCausalLM
    config: ModelConfig
    model_dir: Path
    device: torch.device
    dtype: torch.dtype  # the target's activations; also the draft KV's element type
    context_length: int
    lora: LoRAStack | None = None  # the draft adapters' pool and backend
    adapter_slots: dict[str, int] = field(default_factory=dict)  # draft adapter name -> its pool slot

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.config, self.dtype)

    def runner(self, config: EngineConfig, num_blocks: int) -> DraftRunner:
        """The draft runner over a KV cache of `num_blocks` pages (the target's count), its Triton
        kernels compiled now (engine/warmup.py) where they run, so none compiles while serving."""
        draft_runner = DraftRunner(
            self,
            num_blocks=num_blocks,
            page_size=config.page_size,
            max_num_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_running_requests,
        )
        if self.device.type == "cuda" and not config.disable_cuda_graph and config.cuda_graph_max_bs > 0:
            # Its decode steps are the draft's hot path: graphs up to the batch that still speculates.
            max_bs = min(decode_graph_max_bs(config), config.speculative_disable_batch_size)
            try:
                draft_runner.runner.capture_cuda_graphs(max_bs)
            except (RuntimeError, torch.OutOfMemoryError):
                # Slower, not wrong: say so loudly and draft eagerly.
                log.exception("could not capture the draft model's decode CUDA graphs; it drafts eagerly")
                draft_runner.runner.cuda_graphs = None
        if triton_runs_on(self.device) and config.startup_warm_up:
            warm_up(
                draft_runner.runner,
                max_num_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_running_requests,
                context_length=self.context_length,
            )
        return draft_runner


def build_draft_adapters(draft: LoadedDraft, config: EngineConfig, backend: str | None = None) -> None:
    """Load --speculative-draft-lora-paths into a pool sized for them alone, each in its own slot
    for good (before the target's KV cache is sized, so that takes what is left). `backend`: the
    target's LoRA backend (--lora-backend), which the draft adapters run on too (None: the device's
    default)."""
    paths = config.speculative_draft_lora_paths
    if not paths:
        return
    for name, source in parse_lora_paths(paths).items():
        if not Path(source).is_dir():  # the adapter store serves the target's adapters only
            raise ValueError(f"--speculative-draft-lora-paths {name}={source}: not a local adapter directory")
    draft.lora = build_lora(
        LoRAConfig(lora_paths=paths, max_gpu_loras=len(paths), lora_backend=backend),
        shapes_of_model(draft.config),
        dtype=draft.dtype,
        device=draft.device,
        max_tokens=config.max_num_batched_tokens,
        mem_fraction_static=config.mem_fraction_static,
    )
    for name in parse_lora_paths(paths):
        slot = draft.lora.manager.acquire(name)
        if slot is None:  # the pool has a slot per adapter: only a pool memory cannot hold gets here
            raise ValueError(f"--speculative-draft-lora-paths {name}: no pool slot for it (device memory)")
        draft.adapter_slots[name] = slot


def load_draft_for(
    loaded: LoadedModel, config: EngineConfig, lora_backend: str | None = None
) -> LoadedDraft | None:
    """The draft model `config` names (--speculative-draft-model-path), or None. `lora_backend`: the
    target's (its draft adapters run on the same one)."""
    if config.speculative_algorithm != "draft":
        return None
    draft = load_draft(
        config.speculative_draft_model_path, loaded.config, loaded.context_length, loaded.device, loaded.dtype
    )
    build_draft_adapters(draft, config, lora_backend)
    return draft


def load_draft(path: str, target: ModelConfig, context_length: int, device, dtype) -> LoadedDraft:
    """Load the draft model at `path` in the target's dtype, after checking (before its weights are
    read) that it shares the target's vocabulary and serves the target's context length."""
    model_dir = resolve_model_dir(path)
    config = load_config(model_dir)
    if config.vocab_size != target.vocab_size:
        raise DraftModelMismatch(
            f"--speculative-draft-model-path {path} has a vocabulary of {config.vocab_size} tokens and "
            f"the target model {target.vocab_size}: a draft model must use the target's tokenizer"
        )
    if config.max_position_embeddings < context_length:
        raise DraftModelMismatch(
            f"--speculative-draft-model-path {path} serves {config.max_position_embeddings} positions, "
            f"fewer than the context length {context_length}: lower --context-length"
        )
    check_context_length(config, context_length)
    model, config = load_model(model_dir, device, dtype)
    return LoadedDraft(model, config, model_dir, device, dtype, context_length)


@dataclass
class _DraftSeq:
    """What the draft KV holds of one request: `tokens` (its first `num_computed` are in the cache)."""

    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    stable: int = 0  # tokens[:stable] were copied from the request (only drafts after it may differ)


class Drafts(list):
    """The proposals of one drafting step: per request, its draft token ids (`self[i]`) and, for a
    sampled request, `probs[i]`: the draft distribution q of each draft position `[len, vocab]`
    (None: drafted greedily)."""

    def __init__(self, ids: list[list[int]], probs: list[torch.Tensor | None]):
        super().__init__(ids)
        self.probs = probs


class DraftRunner:
    def __init__(
        self,
        draft: LoadedDraft,
        *,
        num_blocks: int,
        page_size: int,
        max_num_tokens: int,
        max_num_seqs: int,
    ):
        self.draft = draft
        kv_cache = allocate_kv_cache(draft.config, num_blocks, page_size, draft.dtype, draft.device)
        self.blocks = BlockManager(num_blocks, page_size)
        self.runner = ModelRunner(
            draft.model,
            draft.config,
            kv_cache,
            max_num_tokens=max_num_tokens,
            max_num_seqs=max_num_seqs,
            context_length=draft.context_length,
            lora_backend=draft.lora.backend if draft.lora is not None else None,
        )
        self.adapter_slots = draft.adapter_slots
        self.max_num_tokens = max_num_tokens
        self.seqs: dict[str, _DraftSeq] = {}

    def release_others(self, running: list[Request]) -> None:
        """Drop the draft state of requests no longer running (their blocks go back)."""
        live = {r.request_id for r in running}
        for rid in [rid for rid in self.seqs if rid not in live]:
            self.blocks.free(self.seqs.pop(rid).block_table)

    def propose(self, reqs: list[Request], rooms: list[int], inp: SamplingInputs) -> Drafts:
        """Up to `rooms[i]` draft tokens for `reqs[i]` (`inp`: their sampling settings, a row each);
        a request whose draft KV does not fit drafts nothing this step."""
        seqs: list[_DraftSeq | None] = []
        for req, room in zip(reqs, rooms, strict=True):
            seqs.append(self._sync(req, room))
        live = [i for i, s in enumerate(seqs) if s is not None]
        ids: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        self._catch_up([(reqs[i], seqs[i]) for i in live])
        last = {i: reqs[i].token_ids[-1] for i in live}
        for step in range(max((rooms[i] for i in live), default=0)):
            rows = [i for i in live if rooms[i] > step]
            chunks = []
            for i in rows:
                seq = seqs[i]
                pos = seq.num_computed
                seq.tokens[pos:] = [last[i]]
                chunks.append(SeqChunk([last[i]], pos, seq.block_table, self._slot(reqs[i]), True))
                seq.num_computed += 1
            logits = self.runner.forward(chunks)
            tokens, q = _draw(logits, _rows(inp, rows))
            for j, i in enumerate(rows):
                ids[i].append(tokens[j])
                last[i] = tokens[j]
                if q is not None and q[j] is not None:
                    probs[i].append(q[j])
        return Drafts(ids, [torch.stack(p) if p else None for p in probs])

    def _slot(self, req: Request) -> int:
        return self.adapter_slots[req.draft_adapter] if req.draft_adapter else -1

    def _sync(self, req: Request, room: int) -> _DraftSeq | None:
        """The request's draft state, its computed count cut back to where its tokens still agree with
        the request's, and blocks for the positions this step writes (None: they do not fit)."""
        seq = self.seqs.setdefault(req.request_id, _DraftSeq())
        limit = min(seq.num_computed, len(req.token_ids))
        # A request's tokens only grow: what was copied from it still agrees; drafts may not.
        agree = min(seq.stable, limit)
        while agree < limit and seq.tokens[agree] == req.token_ids[agree]:
            agree += 1
        seq.num_computed = agree
        seq.tokens[agree:] = req.token_ids[agree:-1]
        seq.stable = len(seq.tokens)
        need = len(req.token_ids) - 1 + room
        if not self.blocks.can_allocate(seq.block_table, need):
            self.blocks.free(self.seqs.pop(req.request_id).block_table)
            return None
        self.blocks.allocate(seq.block_table, need)
        return seq

    def _catch_up(self, pairs: list[tuple[Request, _DraftSeq]]) -> None:
        """Compute each request's tokens but its last into the draft KV, in forwards of at most the
        token budget (single-token chunks first, as the runner wants decodes)."""
        todo = [(req, seq) for req, seq in pairs if seq.num_computed < len(req.token_ids) - 1]
        while todo:
            chunks, budget = [], self.max_num_tokens
            for req, seq in todo:
                if budget == 0:
                    break
                start = seq.num_computed
                end = min(len(req.token_ids) - 1, start + budget)
                ids = req.token_ids[start:end]
                chunks.append(SeqChunk(ids, start, seq.block_table, self._slot(req), False))
                budget -= end - start
                seq.num_computed = end
            chunks.sort(key=lambda c: len(c.token_ids) != 1)
            self.runner.forward(chunks)
            todo = [(req, seq) for req, seq in todo if seq.num_computed < len(req.token_ids) - 1]


def check_draft_adapter(runner: DraftRunner | None, name: str | None) -> None:
    """Raise InvalidRequest (no draft adapters here) / AdapterNotFound for a request's draft adapter."""
    if not name:
        return
    if runner is None or not runner.adapter_slots:
        raise InvalidRequest(
            f"draft_adapter {name!r}: this server has no draft adapters (they need "
            "--speculative-algorithm draft and --speculative-draft-lora-paths)",
            field="draft_adapter",
        )
    if name not in runner.adapter_slots:
        raise AdapterNotFound(
            f"draft_adapter {name!r} is not one of this server's --speculative-draft-lora-paths "
            f"({', '.join(sorted(runner.adapter_slots))})",
            field="draft_adapter",
            adapter=name,
        )


def _rows(inp: SamplingInputs, rows: list[int]) -> SamplingInputs:
    return SamplingInputs(*([getattr(inp, f)[i] for i in rows] for f in SamplingInputs._fields[:10]))


def _draw(logits: torch.Tensor, inp: SamplingInputs) -> tuple[list[int], list[torch.Tensor | None] | None]:
    """One draft token per row: the argmax for greedy rows; for sampled rows a draw from q (the
    request's filtered distribution, from its own generator), with q's row returned."""
    sampled = [i for i, t in enumerate(inp.temperature) if t >= MIN_TEMPERATURE]
    best = logits.max(dim=-1).indices
    if not sampled:
        return best.tolist(), None
    q = filtered_probs(logits, inp)
    races = torch.ones_like(q)
    for i in sampled:
        races[i].exponential_(generator=inp.generators[i])
    drawn = (q / races).max(dim=-1).indices
    is_sampled = torch.zeros(len(inp.temperature), dtype=torch.bool)
    is_sampled[sampled] = True
    tokens = torch.where(is_sampled.to(logits.device), drawn, best).tolist()
    chosen = set(sampled)
    return tokens, [q[i] if i in chosen else None for i in range(len(tokens))]
