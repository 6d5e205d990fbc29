"""`loraplex.v1.Inference` over the engine: proto ⇄ engine types, limits, status codes.

Thin on purpose: the engine schedules and checks each prompt, the resolver finds adapters,
generate_inputs.py checks a request's shape and turns it into engine requests (inputs x samples),
generate_run.py runs them; this file gathers (or streams) the results as protos and maps errors
to status codes. A cancelled or expired RPC aborts every unfinished engine request it started.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import grpc

from loraplex.services.inference import tokenize_rpc
from loraplex.services.inference.adapter_resolver import AdapterResolver
from loraplex.services.inference.engine.api import Engine
from loraplex.services.inference.engine.types import RequestOutput
from loraplex.services.inference.errors import BackendUnavailable, LoraplexError
from loraplex.services.inference.generate_run import prepare_call, run_call
from loraplex.services.inference.local_sources import public_model_name
from loraplex.services.inference.metrics import Metrics
from loraplex.services.inference.proto_convert import (
    adapter_proto,
    first_token_bytes,
    logprobs_proto,
    timing_fields,
)
from loraplex.services.inference.reply_size import check_reply
from loraplex.services.inference.server_args import ServerArgs
from loraplex.services.inference.status import abort_with, build_status, status_for
from loraplex.v1 import inference_pb2 as pb
from loraplex.v1 import inference_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class ServerState:
    """What the servicer needs from the server: the engine once built, why not yet, the drain flag."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.resolver: AdapterResolver | None = None
        self.not_ready: LoraplexError = BackendUnavailable("the model is still loading")
        self.draining = False
        self.active_rpcs = 0
        self.idle = asyncio.Event()
        self.idle.set()


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, args: ServerArgs, state: ServerState, metrics: Metrics) -> None:
        self.args = args
        self.state = state
        self.metrics = metrics

    # -- plumbing ---------------------------------------------------------------------------
    async def _begin(self, context: grpc.aio.ServicerContext, method: str) -> tuple[Engine, AdapterResolver]:
        if self.state.draining:
            self.metrics.rpcs.labels(method, "UNAVAILABLE").inc()
            await abort_with(
                context, build_status(grpc.StatusCode.UNAVAILABLE, "server is draining; retry elsewhere")
            )
        engine, resolver = self.state.engine, self.state.resolver
        if engine is None or resolver is None:
            status = status_for(self.state.not_ready)
            self.metrics.rpcs.labels(method, status.code.name).inc()
            await abort_with(context, status)
            raise AssertionError("unreachable: abort_with raises")
        self.state.active_rpcs += 1
        self.state.idle.clear()
        return engine, resolver

    def _end(self) -> None:
        self.state.active_rpcs -= 1
        if self.state.active_rpcs == 0:
            self.state.idle.set()

    async def _fail(self, context, method: str, exc: LoraplexError) -> None:
        status = status_for(exc)
        self.metrics.rpcs.labels(method, status.code.name).inc()
        log.info("%s failed: %s %s", method, status.code.name, exc.message)
        await abort_with(context, status)

    async def _internal(self, context, method: str, exc: Exception) -> None:
        log.exception("%s failed with an internal error", method)
        self.metrics.rpcs.labels(method, "INTERNAL").inc()
        await abort_with(
            context, build_status(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        )

    # -- generation -------------------------------------------------------------------------
    async def Generate(self, request, context):
        engine, resolver = await self._begin(context, "Generate")
        try:
            prepared = await prepare_call(engine, resolver, request, self.args, unary=True)
            work = prepared.work
            texts = [[] for _ in work]
            ids = [[] for _ in work]
            logprobs = [[] for _ in work]
            prompt_logprobs = [[] for _ in work]
            final: list[RequestOutput | None] = [None] * len(work)
            async with aclosing(run_call(context, engine, resolver, prepared, self.metrics)) as stream:
                async for k, out in stream:
                    texts[k].append(out.new_text)
                    ids[k].extend(out.new_token_ids)
                    if out.logprobs:
                        logprobs[k].extend(out.logprobs)
                    if out.prompt_logprobs:
                        prompt_logprobs[k] = out.prompt_logprobs
                    if out.finished:
                        final[k] = out
            completions = [
                pb.Completion(
                    text="".join(texts[k]),
                    token_ids=ids[k],
                    finish_reason=f.finish_reason or "",
                    prompt_tokens=f.prompt_tokens,
                    completion_tokens=f.completion_tokens,
                    adapter=w.adapter,
                    index=w.index,
                    sample=w.sample,
                    logprobs=logprobs_proto(engine, logprobs[k], w.adapter),
                    prompt_logprobs=logprobs_proto(engine, prompt_logprobs[k], w.adapter),
                    prompt_first_token_bytes=first_token_bytes(engine, w),
                    **timing_fields(f),
                )
                for k, (w, f) in enumerate(zip(work, final, strict=True))
            ]
            reply = pb.GenerateResponse(completions=completions)
            check_reply(reply, self.args.max_message_bytes)
            self.metrics.rpcs.labels("Generate", "OK").inc()
            return reply
        except LoraplexError as exc:
            await self._fail(context, "Generate", exc)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug: say so plainly instead of grpc's bare UNKNOWN
            await self._internal(context, "Generate", exc)
        finally:
            self._end()

    async def GenerateStream(self, request, context):
        engine, resolver = await self._begin(context, "GenerateStream")
        try:
            prepared = await prepare_call(engine, resolver, request, self.args)
            work = prepared.work
            async with aclosing(run_call(context, engine, resolver, prepared, self.metrics)) as stream:
                async for k, out in stream:
                    if not out.finished and not out.new_token_ids and not out.new_text:
                        continue
                    msg = pb.GenerateStreamResponse(
                        index=work[k].index,
                        sample=work[k].sample,
                        text=out.new_text,
                        token_ids=out.new_token_ids,
                        logprobs=logprobs_proto(engine, out.logprobs or [], work[k].adapter),
                        prompt_logprobs=logprobs_proto(engine, out.prompt_logprobs or [], work[k].adapter),
                    )
                    if out.prompt_logprobs is not None:
                        msg.prompt_first_token_bytes = first_token_bytes(engine, work[k])
                    # the counts so far on every message (the door's continuous usage), final on the last
                    msg.prompt_tokens = out.prompt_tokens
                    msg.completion_tokens = out.completion_tokens
                    if out.finished:
                        msg.finish_reason = out.finish_reason or ""
                        for name, value in timing_fields(out).items():
                            setattr(msg, name, value)
                    yield msg
            self.metrics.rpcs.labels("GenerateStream", "OK").inc()
        except LoraplexError as exc:
            await self._fail(context, "GenerateStream", exc)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug: say so plainly instead of grpc's bare UNKNOWN
            await self._internal(context, "GenerateStream", exc)
        finally:
            self._end()

    # -- adapters and model -----------------------------------------------------------------
    async def _simple(self, context, method: str, work):
        engine, resolver = await self._begin(context, method)
        try:
            result = await work(engine, resolver)
            self.metrics.rpcs.labels(method, "OK").inc()
            return result
        except LoraplexError as exc:
            await self._fail(context, method, exc)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug: say so plainly instead of grpc's bare UNKNOWN
            await self._internal(context, method, exc)
        finally:
            self._end()

    async def LoadAdapter(self, request, context):
        async def work(engine, resolver):
            info = await resolver.load(request.name, request.source, request.revision, request.pin)
            return pb.LoadAdapterResponse(adapter=adapter_proto(info))

        return await self._simple(context, "LoadAdapter", work)

    async def UnloadAdapter(self, request, context):
        async def work(engine, resolver):
            await resolver.unload(request.name)
            return pb.UnloadAdapterResponse(name=request.name)

        return await self._simple(context, "UnloadAdapter", work)

    async def ListAdapters(self, request, context):
        async def work(engine, resolver):
            adapters, next_token = await resolver.list(request.page_size, request.page_token)
            return pb.ListAdaptersResponse(
                adapters=[adapter_proto(a) for a in adapters], next_page_token=next_token
            )

        return await self._simple(context, "ListAdapters", work)

    async def GetModelInfo(self, request, context):
        async def work(engine, resolver):
            m = engine.model_info()
            return pb.ModelInfo(
                model=public_model_name(m.model),
                dtype=m.dtype,
                device=m.device,
                max_loras_per_batch=m.max_loras_per_batch,
                max_lora_rank=m.max_lora_rank,
                lora_target_modules=list(m.lora_target_modules),
                lora_backend=m.lora_backend,
                tp_size=m.tp_size,
                context_length=m.context_length,
                max_new_tokens_limit=self.args.engine.max_new_tokens_limit,
                max_inputs_per_request=self.args.max_inputs_per_request,
                architecture=m.architecture,
                family=m.family,
            )

        return await self._simple(context, "GetModelInfo", work)

    async def Tokenize(self, request, context):
        async def work(engine, resolver):
            ids, tokens = await tokenize_rpc.tokenize(engine, resolver, request)
            return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

        return await self._simple(context, "Tokenize", work)

    async def Detokenize(self, request, context):
        async def work(engine, resolver):
            return pb.DetokenizeResponse(text=await tokenize_rpc.detokenize(engine, resolver, request))

        return await self._simple(context, "Detokenize", work)
