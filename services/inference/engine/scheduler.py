"""Continuous batching: decides which requests compute how many tokens this step. No tensors.

Every step: running requests first (decodes and unfinished chunked prefills, in admission
order), then waiting requests (by `priority`, then FCFS, skipping those whose adapter has no
slot for them yet: requests of other adapters and of the base model behind them are still admitted) while
the token budget, the prefill budget, the request cap and the free KV blocks allow. When a
running request needs a block and none is free, the most recently admitted request is
preempted (its KV freed; it is recomputed when readmitted, from its cached prefix when the
prefix cache is on). Under `--max-loras-per-batch` only the adapters the step's policy picks
(engine/adapter_slices.py) compute: other adapters' running requests sit the step out, keeping
their KV and slot, and their queued requests wait; base requests are never held back. Which
slot each request holds (acquire, suspend when a waiting adapter wants it, resume, release, and
the queue's adapters uploaded ahead) is engine/request_slots.py's; the step's plan it hands the
runner is engine/scheduled_batch.py's.

With the prefix cache on (engine/prefix_cache.py, engine/block_manager.py), a request admitted
starts from the longest run of cached full blocks computed by the same content (its adapter
version's digest, or the base model's) over the same tokens, and prefills only the rest; the
full blocks each running request has computed are registered as it goes, and when it finishes,
aborts or is preempted.
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from loraplex.services.inference.engine.adapter_slices import DemandSlices
from loraplex.services.inference.engine.block_manager import BlockManager
from loraplex.services.inference.engine.config import SchedulerConfig
from loraplex.services.inference.engine.prefix_cache import PrefixCache
from loraplex.services.inference.engine.request import Request, RequestStatus
from loraplex.services.inference.engine.request_slots import RequestSlots
from loraplex.services.inference.engine.scheduled_batch import ScheduledBatch, ScheduledEntry
from loraplex.services.inference.lora.adapter_slots import AdapterSlots

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        adapter_slots: AdapterSlots,
        *,
        base_digest: str = "base:unidentified",
    ):
        self.config = config
        self.blocks = block_manager
        self.adapter_slots = adapter_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache = PrefixCache(block_manager, adapter_slots, base_digest)
        self.slots = RequestSlots(adapter_slots, self.finish)
        cap = adapter_slots.batch_cap()
        self.adapter_slices = DemandSlices(cap) if cap is not None else None

    def add(self, request: Request) -> None:
        """Queue behind every waiting request of the same or a lower `priority` value (lower goes
        first; equal ones keep arrival order). Preempted requests go back to the front (`_preempt`)."""
        priority = request.params.priority
        if not self.waiting or self.waiting[-1].params.priority <= priority:
            self.waiting.append(request)
            return
        at = len(self.waiting)
        while at > 0 and self.waiting[at - 1].params.priority > priority:
            at -= 1
        self.waiting.insert(at, request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str, error: Exception | None = None) -> None:
        """End a request wherever it is, freeing its KV blocks and adapter reference."""
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if error is not None:  # an error set before (`req.error = ...; finish(req, "abort")`) stays
            request.error = error

    def schedule(self) -> ScheduledBatch:
        token_budget = self.config.max_num_batched_tokens
        prefill_budget = self.config.prefill_budget_for(
            any(r.num_uncomputed_tokens == 1 for r in self.running)
        )
        entries: list[ScheduledEntry] = []
        finished: list[Request] = []
        page = self.blocks.page_size
        allowed = self.adapter_slices.select(self.running, self.waiting) if self.adapter_slices else None
        sitting_out = 0
        self.slots.yield_wanted(self.running, self.waiting)
        unresumed: set[str] = set()  # adapters with no slot for their suspended requests this step

        i = 0
        while i < len(self.running) and token_budget > 0:
            req = self.running[i]
            if req.kv_root is not None and req.num_computed_tokens >= (req.num_registered_blocks + 1) * page:
                self.prefix_cache.register(req)
            if allowed is not None and req.adapter is not None and req.adapter not in allowed:
                i += 1  # not its adapter's turn: sits this step out, KV and slot kept
                sitting_out += 1
                continue
            if req.lora_suspended:
                resumed = self.slots.resume(req, unresumed)
                if resumed is None:
                    i += 1  # gave its slot to another adapter: sits out, KV kept, until it has one
                    sitting_out += 1
                    continue
                if not resumed:  # its adapter can never be served again
                    finished.append(req)
                    continue  # req left `running`: the same index now holds the next one
            want = req.num_uncomputed_tokens
            if want == 1 and req.draft_ids:
                n = self._verify_tokens(req, token_budget)
                if n > 1:  # its last token and its drafts, verified in one chunk
                    self.blocks.allocate(req.block_table, req.num_computed_tokens + n)
                    entries.append(ScheduledEntry(req, n))
                    token_budget -= n
                    i += 1
                    continue
            if want == 1 and req.num_computed_tokens < len(req.block_table) * page:
                # The common decode step: its token fits the last block, nothing to allocate.
                entries.append(ScheduledEntry(req, 1))
                token_budget -= 1
                i += 1
                continue
            if want > 1:
                want = min(want, prefill_budget)
            want = min(want, token_budget)
            if want <= 0:
                i += 1
                continue
            n = self._make_room(req, want)
            if n == 0:
                if req.status is RequestStatus.RUNNING:  # alone and the cache is full
                    self.finish(req, "length")
                    finished.append(req)
                continue  # req left `running`: the same index now holds the next one
            self.blocks.allocate(req.block_table, req.num_computed_tokens + n)
            entries.append(ScheduledEntry(req, n))
            token_budget -= n
            if n > 1:
                prefill_budget -= n
            i += 1

        self._admit(entries, finished, token_budget, prefill_budget, allowed, sitting_out)
        self._report_queued()
        self.slots.prefetch(self.waiting)
        entries.sort(key=lambda e: e.num_tokens != 1)  # stable: decodes first
        return ScheduledBatch(entries, finished)

    def _report_queued(self) -> None:
        """Tell the adapter slots how many requests wait per adapter (it prices evictions and drains)."""
        self.adapter_slots.note_queued(Counter(r.adapter for r in self.waiting if r.adapter is not None))

    def _verify_tokens(self, req: Request, token_budget: int) -> int:
        """Tokens of a decoding request with a draft to compute this step: its last token and as many
        draft tokens as the budget and the free KV blocks allow (a draft never preempts anything).
        Trims `req.draft_ids` to what is scheduled."""
        room = self.blocks.max_tokens(req.block_table) - req.num_computed_tokens
        n = min(1 + len(req.draft_ids), token_budget, room)
        req.draft_ids = req.draft_ids[: max(n - 1, 0)]
        return n

    def _make_room(self, req: Request, want: int) -> int:
        """Tokens (<= want) of `req` that fit, preempting later-admitted requests if needed.

        Returns 0 when `req` itself was preempted, or when it is the only running request and
        the whole cache cannot hold even one more of its tokens.
        """
        while True:
            room = self.blocks.max_tokens(req.block_table) - req.num_computed_tokens
            if room >= 1:
                return min(want, room)
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                log.warning("request %s outgrew the whole KV cache; finishing it", req.request_id)
                return 0
            self._preempt(victim)
            if victim is req:
                return 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.draft_ids = []
        # KV goes, the adapter reference stays: the request resumes on the version it started
        # with even if its adapter is reloaded meanwhile (no request mixes two versions).
        self.prefix_cache.register(req)
        self.blocks.free(req.block_table)
        req.num_registered_blocks = 0
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        log.debug("preempted %s (KV full)", req.request_id)

    def _release(self, req: Request) -> None:
        self.prefix_cache.register(req)
        self.blocks.free(req.block_table)
        req.num_registered_blocks = 0
        req.num_computed_tokens = 0
        self.slots.release(req)

    def _admit(
        self,
        entries: list[ScheduledEntry],
        finished: list[Request],
        token_budget: int,
        prefill_budget: int,
        allowed: frozenset[str] | None = None,
        sitting_out: int = 0,
    ) -> None:
        """Admit waiting requests. `--max-running-requests` bounds the requests that compute in a step
        (the decode batch): running requests sitting this step out (`sitting_out`: not their
        adapter's place) hold KV but no place in it, so they do not count; KV bounds them."""
        skipped: list[Request] = []
        refused: set[str] = set()  # adapters with no slot for a new request this step
        while self.waiting and len(self.running) - sitting_out < self.config.max_running_requests:
            want = min(self.waiting[0].num_uncomputed_tokens, token_budget)
            if want > 1:
                want = min(want, prefill_budget)
            if want <= 0:
                break
            req = self.waiting.popleft()
            if req.adapter in refused and req.lora_slot < 0:
                skipped.append(req)  # asked once this step already: others go first
                continue
            if allowed is not None and req.adapter is not None and req.adapter not in allowed:
                skipped.append(req)  # not its adapter's turn (--max-loras-per-batch)
                continue
            want, hit = self._admissible(req, self.prefix_cache.lookup(req), token_budget, prefill_budget)
            if want == 0:
                self.waiting.appendleft(req)
                break
            if req.lora_suspended:  # preempted, then its slot went to another adapter
                resumed = self.slots.resume(req, refused)
                if resumed is None:
                    skipped.append(req)
                    continue
                if not resumed:
                    finished.append(req)
                    continue
            elif req.adapter is not None and req.lora_slot < 0:  # a preempted request keeps its slot
                acquired = self.slots.acquire(req, refused)
                if acquired is None:
                    skipped.append(req)  # not resident yet: let others go first
                    continue
                if not acquired:
                    finished.append(req)
                    continue
                if not self.prefix_cache.confirm_root(req):  # the adapter was reloaded since the lookup
                    want, hit = self._admissible(
                        req, self.prefix_cache.lookup(req), token_budget, prefill_budget
                    )
                    if want == 0:
                        self.slots.release(req)
                        self.waiting.appendleft(req)
                        break
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.prefix_cache.reuse(req, hit)
            self.blocks.allocate(req.block_table, req.num_computed_tokens + want)
            entries.append(ScheduledEntry(req, want))
            token_budget -= want
            if want > 1:
                prefill_budget -= want
        for req in reversed(skipped):
            self.waiting.appendleft(req)

    def _admissible(
        self, req: Request, hit: list[int], token_budget: int, prefill_budget: int
    ) -> tuple[int, list[int]]:
        """Tokens of `req` to compute now, and the cached blocks (a prefix of `hit`) to start from;
        0 tokens: wait for room.

        A cached block nobody holds counts as free, so reusing it takes room. When the chunk does
        not fit after the whole hit, the hit is shortened from its end, down to none: a request is
        never kept waiting where the cache-off scheduler would admit it."""
        page = self.blocks.page_size
        for keep in range(len(hit), -1, -1):
            computed = req.num_computed_tokens + keep * page
            want = min(len(req.token_ids) - computed, token_budget)
            if want > 1:
                want = min(want, prefill_budget)
            if want <= 0:
                return 0, []
            room = self.blocks.max_tokens(req.block_table, hit[:keep]) - computed
            if room >= want:
                return want, hit[:keep]
            if not self.running and room >= 1:
                return room, hit[:keep]  # alone with the whole cache: take what there is
        # Admit only when the chunk fits whole: a partial admission would preempt running
        # requests next step.
        return 0, []
