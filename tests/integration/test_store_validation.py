"""Every validation rule of the store, each with a broken adapter made for it, registered
through gRPC while a good adapter keeps being served by the same store."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from loraplex.v1 import adapter_store_pb2 as pb
from tests.support.store_helpers import (
    CONFIG,
    WEIGHTS,
    copy_adapter,
    edit_config,
    pull,
    read_safetensors,
    rpc_error_details,
    start_store,
    store_stub,
    write_safetensors,
)

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
MAX_ADAPTER_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def good(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(tiny_llama_path, "store-valid", r=4, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def stub(tmp_path_factory, tiny_llama_path, good):
    cache = tmp_path_factory.mktemp("store-validation")
    with start_store(
        cache, "--base-model", str(tiny_llama_path), "--max-adapter-bytes", str(MAX_ADAPTER_BYTES)
    ) as p:
        with store_stub(p.address) as s:
            s.RegisterAdapter(pb.RegisterAdapterRequest(name="served", source=str(good)), timeout=60)
            s.cache_dir = cache
            yield s


def tensors_edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        tensors = load_file(str(d / WEIGHTS))
        change(tensors)
        save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})

    return edit


def header_edit(change: Callable[[dict, bytes], tuple[dict, bytes]]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        header, data = read_safetensors(d / WEIGHTS)
        write_safetensors(d / WEIGHTS, *change(header, data))

    return edit


def truncate(d: Path) -> None:
    raw = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(raw[:-100])


def huge_header(d: Path) -> None:
    raw = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])


def header_past_end(d: Path) -> None:
    raw = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw[8:])


def not_json_header(d: Path) -> None:
    raw = bytearray((d / WEIGHTS).read_bytes())
    raw[8:12] = b"\x00\xff{["
    (d / WEIGHTS).write_bytes(bytes(raw))


def with_magnitudes(q0_value: float):
    """A DoRA magnitude (ones) beside every lora_B, with `q0_value` in q_proj of layer 0."""

    def change(t: dict) -> None:
        for key in [k for k in t if k.endswith(".lora_B.weight")]:
            magnitude = np.ones(t[key].shape[0], np.float32)
            if key.startswith(Q0 + "."):
                magnitude[5] = q0_value
            t[key.removesuffix(".lora_B.weight") + ".lora_magnitude_vector"] = magnitude

    return change


def set_value(key: str, value: float, dtype=np.float32):
    def change(t: dict) -> None:
        arr = t[key].astype(dtype)
        arr.flat[3] = value
        t[key] = arr

    return change


def bf16_nan(d: Path) -> None:
    # numpy has no bfloat16: write the bits. 0x3F80 = 1.0, 0x7FC0 = NaN.
    header, _ = read_safetensors(d / WEIGHTS)
    data, offset = bytearray(), 0
    for name, entry in sorted(
        ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
    ):
        n = int(np.prod(entry["shape"]))
        bits = np.full(n, 0x3F80, dtype="<u2")
        if name == f"{Q0}.lora_B.weight":
            bits[5] = 0x7FC0
        entry.update(dtype="BF16", data_offsets=[offset, offset + 2 * n])
        data += bits.tobytes()
        offset += 2 * n
    write_safetensors(d / WEIGHTS, header, bytes(data))


def pickle_only(d: Path) -> None:
    import torch
    from safetensors.torch import load_file as load_torch

    torch.save(load_torch(str(d / WEIGHTS)), d / "adapter_model.bin")
    (d / WEIGHTS).unlink()


def grow(d: Path) -> None:
    with open(d / WEIGHTS, "ab") as f:
        f.write(b"\0" * MAX_ADAPTER_BYTES)


def swap(header: dict, data: bytes, key: str, **entry) -> tuple[dict, bytes]:
    header[key].update(entry)
    return header, data


# (id, how to break the good adapter, expected field (prefix) in the BadRequest violation, text in
# the message)
BROKEN = [
    ("truncated", truncate, f"{WEIGHTS}:", "truncated"),
    ("huge-header", huge_header, f"{WEIGHTS}:header", "cap"),
    ("header-past-end", header_past_end, f"{WEIGHTS}:header", "past the end"),
    ("header-not-json", not_json_header, f"{WEIGHTS}:header", "JSON"),
    (
        "offsets-mismatch-dtype",
        header_edit(lambda h, d: swap(h, d, f"{Q0}.lora_A.weight", shape=[4, 32])),
        f"{WEIGHTS}:{Q0}.lora_A.weight.data_offsets",
        "needs",
    ),
    ("gap-in-data", header_edit(lambda h, d: (h, d + b"\0" * 16)), f"{WEIGHTS}:data", "trailing"),
    (
        "wrong-dtype",
        tensors_edit(
            lambda t: t.update({f"{Q0}.lora_A.weight": t[f"{Q0}.lora_A.weight"].astype(np.float64)})
        ),
        f"{WEIGHTS}:{Q0}.lora_A.weight.dtype",
        "F64",
    ),
    (
        "mixed-dtype",
        tensors_edit(
            lambda t: t.update({f"{Q0}.lora_A.weight": t[f"{Q0}.lora_A.weight"].astype(np.float16)})
        ),
        f"{WEIGHTS}:dtype",
        "mixed",
    ),
    ("rank-mismatch-config", lambda d: edit_config(d, r=8), f"{WEIGHTS}:{Q0}.lora_A.weight.shape", "rank 4"),
    (
        "rank-pattern-mismatch",
        lambda d: edit_config(d, rank_pattern={"v_proj": 2}),
        f"{WEIGHTS}:base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight.shape",
        "rank_pattern",
    ),
    (
        "a-b-rank-disagree",
        tensors_edit(lambda t: t.update({f"{Q0}.lora_B.weight": np.ones((64, 3), np.float32)})),
        f"{WEIGHTS}:{Q0}.lora_B.weight.shape",
        "rank 3",
    ),
    (
        "in-features-vs-base",
        tensors_edit(lambda t: t.update({f"{Q0}.lora_A.weight": np.ones((4, 32), np.float32)})),
        f"{WEIGHTS}:{Q0}.lora_A.weight.shape",
        "in_features 32 != 64",
    ),
    (
        "out-features-vs-base",
        tensors_edit(lambda t: t.update({f"{Q0}.lora_B.weight": np.ones((48, 4), np.float32)})),
        f"{WEIGHTS}:{Q0}.lora_B.weight.shape",
        "out_features 48 != 64",
    ),
    (
        "layer-beyond-base",
        tensors_edit(
            lambda t: t.update(
                {
                    Q0.replace("layers.0", "layers.7") + ".lora_A.weight": np.ones((4, 64), np.float32),
                    Q0.replace("layers.0", "layers.7") + ".lora_B.weight": np.ones((64, 4), np.float32),
                }
            )
        ),
        f"{WEIGHTS}:" + Q0.replace("layers.0", "layers.7"),
        "layer 7",
    ),
    (
        "missing-lora-b",
        tensors_edit(lambda t: t.pop(f"{Q0}.lora_B.weight")),
        f"{WEIGHTS}:{Q0}.lora_A.weight",
        "no matching lora_B",
    ),
    (
        "bad-tensor-name",
        tensors_edit(lambda t: t.update({"model.layers.0.mlp.weird": np.ones((2, 2), np.float32)})),
        f"{WEIGHTS}:model.layers.0.mlp.weird",
        "PEFT",
    ),
    (
        "untargeted-module",
        lambda d: edit_config(d, target_modules=["q_proj"]),
        f"{WEIGHTS}:base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
        "target_modules",
    ),
    (
        "nan-f32",
        tensors_edit(set_value(f"{Q0}.lora_B.weight", float("nan"))),
        f"{WEIGHTS}:{Q0}.lora_B.weight.values",
        "NaN",
    ),
    (
        "inf-f32",
        tensors_edit(set_value(f"{Q0}.lora_A.weight", float("-inf"))),
        f"{WEIGHTS}:{Q0}.lora_A.weight.values",
        "Inf",
    ),
    ("nan-bf16", bf16_nan, f"{WEIGHTS}:{Q0}.lora_B.weight.values", "NaN"),
    # issue 59: finite but past float16's range (the inference server's bound): NaN logits when served
    (
        "huge-lora-b",
        tensors_edit(set_value(f"{Q0}.lora_B.weight", 1e30)),
        f"{WEIGHTS}:{Q0}.lora_B.weight.values",
        "magnitude past 65504",
    ),
    (
        "huge-negative-lora-a-f16-range",
        tensors_edit(set_value(f"{Q0}.lora_A.weight", -70000.0)),
        f"{WEIGHTS}:{Q0}.lora_A.weight.values",
        "magnitude past 65504",
    ),
    ("config-alpha-huge", lambda d: edit_config(d, lora_alpha=1e30), f"{CONFIG}:lora_alpha", "65504"),
    (
        "config-alpha-pattern-huge",
        lambda d: edit_config(d, alpha_pattern={"q_proj": 1e30}),
        f"{CONFIG}:alpha_pattern.q_proj",
        "65504",
    ),
    ("pickle-only", pickle_only, "adapter_model.bin", "--allow-pickle"),
    ("too-big", grow, "size_bytes", "--max-adapter-bytes"),
    ("config-not-json", lambda d: (d / CONFIG).write_text("{r: 4"), f"{CONFIG}:json", "JSON"),
    ("config-not-lora", lambda d: edit_config(d, peft_type="IA3"), f"{CONFIG}:peft_type", "LORA"),
    ("config-r-zero", lambda d: edit_config(d, r=0), f"{CONFIG}:r", "positive"),
    ("config-alpha-negative", lambda d: edit_config(d, lora_alpha=-2), f"{CONFIG}:lora_alpha", "positive"),
    (
        "config-no-targets",
        lambda d: edit_config(d, target_modules=[]),
        f"{CONFIG}:target_modules",
        "non-empty",
    ),
    ("config-dora-not-bool", lambda d: edit_config(d, use_dora="yes"), f"{CONFIG}:use_dora", "true or false"),
    (
        "dora-without-magnitudes",
        lambda d: edit_config(d, use_dora=True),
        f"{WEIGHTS}:model.layers.0.self_attn.q_proj.lora_magnitude_vector",
        "use_dora is true",
    ),
    (
        "magnitude-without-dora",
        tensors_edit(with_magnitudes(1.0)),
        f"{WEIGHTS}:{Q0}.lora_magnitude_vector",
        "use_dora is not true",
    ),
    (
        "dora-negative-magnitude",
        lambda d: (edit_config(d, use_dora=True), tensors_edit(with_magnitudes(-0.5))(d)),
        f"{WEIGHTS}:{Q0}.lora_magnitude_vector.values",
        "finite and positive",
    ),
    (
        "dora-magnitude-shape",
        lambda d: (
            edit_config(d, use_dora=True),
            tensors_edit(with_magnitudes(1.0))(d),
            tensors_edit(lambda t: t.update({f"{Q0}.lora_magnitude_vector": np.ones(63, np.float32)}))(d),
        ),
        f"{WEIGHTS}:{Q0}.lora_magnitude_vector.shape",
        "64 output rows",
    ),
    (
        "config-bad-rank-pattern",
        lambda d: edit_config(d, rank_pattern={"q_proj": -1}),
        f"{CONFIG}:rank_pattern.q_proj",
        "positive",
    ),
    ("no-config", lambda d: (d / CONFIG).unlink(), "source", CONFIG),
]


@pytest.mark.parametrize("case, breaker, field, text", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_adapter_is_refused_and_good_one_still_served(
    stub, good, tmp_path, case, breaker, field, text
):
    broken = copy_adapter(good, tmp_path / case)
    breaker(broken)
    with pytest.raises(grpc.RpcError) as e:
        stub.RegisterAdapter(pb.RegisterAdapterRequest(name=f"broken-{case}", source=str(broken)), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    violations = rpc_error_details(e.value)["field_violations"]
    assert len(violations) == 1 and violations[0][0].startswith(field), violations
    assert text in e.value.details(), e.value.details()
    # Nothing was indexed for the broken one; the good one is still there and pulls intact.
    with pytest.raises(grpc.RpcError) as missing:
        stub.GetAdapter(pb.GetAdapterRequest(name=f"broken-{case}"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    header, data = pull(stub, "served")
    assert data == (good / WEIGHTS).read_bytes()


def test_broken_files_leave_no_blob_or_staging_behind(stub, good):
    listing = stub.ListAdapters(pb.ListStoreAdaptersRequest(page_size=1000))
    assert [a.name for a in listing.adapters] == ["served"]
    blobs = sorted(p.name for p in (stub.cache_dir / "blobs" / "sha256").iterdir())
    digest = listing.adapters[0].digest.removeprefix("sha256:")
    assert blobs == [digest, digest + ".records"]  # the blob and its per-name record files
    assert list((stub.cache_dir / "staging").iterdir()) == []


def test_dora_adapter_is_accepted(stub, tiny_llama_path, adapter_factory):
    """A PEFT DoRA adapter (lora_magnitude_vector beside each pair) registers and pulls intact."""
    dora = adapter_factory(
        tiny_llama_path, "store-dora", r=4, target_modules=["q_proj", "v_proj"], use_dora=True
    )
    record = stub.RegisterAdapter(pb.RegisterAdapterRequest(name="ok-dora", source=str(dora)), timeout=60)
    assert record.rank == 4
    _, data = pull(stub, "ok-dora")
    assert data == (dora / WEIGHTS).read_bytes()
    stub.DeleteAdapter(pb.DeleteAdapterRequest(name="ok-dora"))


def test_good_bf16_and_fp16_adapters_are_accepted(stub, good, tmp_path):
    f16 = copy_adapter(good, tmp_path / "f16")
    tensors_edit(lambda t: t.update({k: v.astype(np.float16) for k, v in t.items()}))(f16)
    record = stub.RegisterAdapter(pb.RegisterAdapterRequest(name="ok-f16", source=str(f16)), timeout=60)
    assert record.dtype == "F16"
    bf16_ok = copy_adapter(good, tmp_path / "bf16-ok")
    bf16_nan(bf16_ok)
    # Same file with the NaN replaced by 1.0 is fine.
    raw = bytearray((bf16_ok / WEIGHTS).read_bytes())
    i = raw.rfind(struct.pack("<H", 0x7FC0))
    raw[i : i + 2] = struct.pack("<H", 0x3F80)
    (bf16_ok / WEIGHTS).write_bytes(bytes(raw))
    record = stub.RegisterAdapter(pb.RegisterAdapterRequest(name="ok-bf16", source=str(bf16_ok)), timeout=60)
    assert record.dtype == "BF16"
    # The largest weight and alpha allowed (float16's largest value) are accepted.
    edge = copy_adapter(good, tmp_path / "edge")
    tensors_edit(set_value(f"{Q0}.lora_B.weight", -65504.0))(edge)
    edit_config(edge, lora_alpha=65504)
    stub.RegisterAdapter(pb.RegisterAdapterRequest(name="ok-edge", source=str(edge)), timeout=60)
    for name in ("ok-f16", "ok-bf16", "ok-edge"):
        stub.DeleteAdapter(pb.DeleteAdapterRequest(name=name))
