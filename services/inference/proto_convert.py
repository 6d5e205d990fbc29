"""Proto ⇄ engine types for the Inference servicer (proto zeros mean "server default" / "off")."""

from __future__ import annotations

from loraplex.v1 import inference_pb2 as pb

from services.inference.engine.types import AdapterInfo, SamplingParams
from services.inference.errors import InvalidRequest
from services.inference.server_args import ServerArgs

LOCATION = {"gpu": pb.ADAPTER_LOCATION_GPU, "host": pb.ADAPTER_LOCATION_HOST, "store": pb.ADAPTER_LOCATION_STORE}


def to_engine_params(p: pb.SamplingParams, args: ServerArgs) -> SamplingParams:
    """Proto → engine; proto zeros mean 'server default' / 'off'."""
    params = SamplingParams(
        max_new_tokens=p.max_new_tokens or args.default_max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
    )
    params.validate(args.max_new_tokens_limit)
    return params


def adapters_per_input(request: pb.GenerateRequest) -> list[str]:
    n, adapters = len(request.text), list(request.adapter)
    if not adapters:
        return [""] * n
    if len(adapters) == 1:
        return adapters * n
    if len(adapters) != n:
        raise InvalidRequest(
            f"adapter has {len(adapters)} entries for {n} texts; give one per text, one for all, or none",
            field="adapter",
        )
    return adapters


def adapter_proto(info: AdapterInfo) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        name=info.name, rank=info.rank, alpha=info.alpha, target_modules=list(info.target_modules),
        location=LOCATION.get(info.location, pb.ADAPTER_LOCATION_UNSPECIFIED), pinned=info.pinned,
        requests_in_flight=info.requests_in_flight, source=info.source, digest=info.digest,
        slot=info.slot if info.location == "gpu" else -1,
    )
