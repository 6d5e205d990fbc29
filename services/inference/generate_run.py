"""A Generate call's engine requests: prepared, then run.

`prepare_call` checks the whole call and opens its streams (generate_inputs.py), then resolves
every adapter it names (which may pull from the store), all before any engine work; a call
naming an adapter that was not here builds its prompts again once it is. `run_call` runs every
(input, sample) as one engine request and yields the outputs as they arrive; when the call ends
early (cancel, deadline, error) it aborts the unfinished ones, which frees their KV blocks and
adapter references. The servicer gathers (Generate) or forwards (GenerateStream) what it yields.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

import grpc

from loraplex.services.inference.adapter_resolver import AdapterResolver
from loraplex.services.inference.engine.api import Engine
from loraplex.services.inference.engine.types import RequestOutput
from loraplex.services.inference.generate_inputs import EngineWork, engine_work, open_streams
from loraplex.services.inference.metrics import Metrics
from loraplex.services.inference.reply_size import check_reply_floor
from loraplex.services.inference.server_args import ServerArgs
from loraplex.v1 import inference_pb2 as pb

log = logging.getLogger(__name__)

DEADLINE_SLACK_S = 0.5


class PreparedCall(NamedTuple):
    """A Generate call checked and ready: engine request `{rpc_id}-{k}` runs `work[k]` via `streams[k]`."""

    rpc_id: str
    work: list[EngineWork]
    streams: list[AsyncIterator[RequestOutput]]


async def prepare_call(
    engine: Engine,
    resolver: AdapterResolver,
    request: pb.GenerateRequest,
    args: ServerArgs,
    unary: bool = False,
) -> PreparedCall:
    """Check everything, then resolve every adapter (which may pull), before any engine work."""
    named = {*request.adapter, *(inp.adapter for inp in request.inputs)}
    absent = {n for n in named if n and not engine.has_adapter(n)}
    # Tokenizing and rendering chat templates is CPU work that grows with the prompt: off the
    # event loop, so other calls' streams keep flowing meanwhile.
    work = await asyncio.to_thread(engine_work, engine, request, args)
    if unary:  # one reply message: refuse before running what could only fail at the end
        check_reply_floor(
            [(len(w.prompt_ids), w.params) for w in work],
            engine.model_info().context_length,
            args.max_message_bytes,
        )
    rpc_id = uuid.uuid4().hex[:12]
    streams = open_streams(engine, rpc_id, work)
    await resolver.ensure({w.adapter for w in work})
    if absent:
        # Their prompts were built before they were here, with the base model's tokenizer and
        # template: again, now with their own (engine/adapter_tokenizers.py). Nothing was queued.
        work = await asyncio.to_thread(engine_work, engine, request, args)
        streams = open_streams(engine, rpc_id, work)
    return PreparedCall(rpc_id, work, streams)


async def run_call(
    context: grpc.aio.ServicerContext,
    engine: Engine,
    resolver: AdapterResolver,
    prepared: PreparedCall,
    metrics: Metrics,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run every work item as one engine request; yield (item index, output) as they arrive."""
    rpc_id, work, streams = prepared
    queue: asyncio.Queue = asyncio.Queue()
    unfinished = {f"{rpc_id}-{k}" for k in range(len(work))}

    async def pump(k: int) -> None:
        rid = f"{rpc_id}-{k}"
        last, first = time.monotonic(), True
        try:
            async for out in streams[k]:
                if out.new_token_ids:
                    now = time.monotonic()
                    if first:
                        metrics.observe_queue_time(work[k].adapter, out.queue_time)
                    (metrics.ttft if first else metrics.itl).observe(now - last)
                    last, first = now, False
                if out.finished:
                    unfinished.discard(rid)
                await queue.put((k, out))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((k, exc))

    for item in work:
        if item.adapter:
            resolver.acquire(item.adapter)
    tasks = [asyncio.create_task(pump(k)) for k in range(len(work))]
    done = 0
    try:
        while done < len(tasks):
            k, out = await queue.get()
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                done += 1
                _count(metrics, work[k].adapter, out)
            yield k, out
    finally:
        for task in tasks:
            task.cancel()
        if unfinished:
            # The client's deadline fires (and cancels) a little before the server's copy of
            # it, which starts when the request arrives: count "nearly out of time" as deadline.
            remaining = context.time_remaining()
            reason = "deadline" if remaining is not None and remaining < DEADLINE_SLACK_S else "cancelled"
            metrics.aborted.labels(reason).inc(len(unfinished))
            for rid in unfinished:
                try:
                    engine.abort(rid)
                except Exception:  # noqa: BLE001 - aborting is best effort, the KV is the engine's
                    log.exception("abort %s failed", rid)
            log.info("aborted %d unfinished engine requests of rpc %s (%s)", len(unfinished), rpc_id, reason)
        for item in work:
            if item.adapter:
                resolver.release(item.adapter)


def _count(metrics: Metrics, adapter: str, out: RequestOutput) -> None:
    """One finished engine request, counted by its adapter's label."""
    label = metrics.label(adapter)
    metrics.requests.labels(label, "OK").inc()
    metrics.prompt_tokens.labels(label).inc(out.prompt_tokens)
    metrics.completion_tokens.labels(label).inc(out.completion_tokens)
