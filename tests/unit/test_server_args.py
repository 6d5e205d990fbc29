"""The command line: every default comes from the dataclass that owns it, the design brief's
command lines parse, and every flag is checked with a message naming it (exit status 2)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.kernels.settings import reload_kernel_settings
from loraplex.services.inference.engine.config import EngineConfig
from loraplex.services.inference.lora.settings import LoRAConfig
from loraplex.services.inference.server_args import ServerArgs, flat_defaults, flat_field_owners
from loraplex.services.inference.server_flags import build_parser, parse_args

BASE = ["--model-path", "m", "--device", "cpu"]
NOT_FLAGS = {"mixed_graphs", "startup_warm_up"}  # EngineConfig switches for tests and TP only


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_every_flag_is_one_field_and_takes_its_default_from_the_owner():
    dests = {a.dest: a.default for a in build_parser()._actions if a.dest != "help"}
    owners = flat_field_owners()
    assert set(dests) == set(owners) - NOT_FLAGS
    defaults = flat_defaults()
    defaults["device"] = EngineConfig.__dataclass_fields__["device"].default  # "auto", before resolving
    for name, default in dests.items():
        if name != "model_path":  # required
            assert default == defaults[name] or list(defaults[name]) == default, name


def test_defaults_parse_into_the_composed_objects():
    args = parse_args(BASE)
    assert args.engine == EngineConfig(model_path="m", device="cpu")
    assert args.lora == LoRAConfig()
    assert args == ServerArgs(engine=EngineConfig(model_path="m", device="cpu"))
    assert args.engine.device == torch.device("cpu")


def test_the_design_brief_command_line():
    args = parse_args(
        [
            *("--model-path", "HuggingFaceTB/SmolLM2-135M-Instruct"),
            *("--lora-paths", "sql=/adapters/sql", "chat=hub:org/chat"),
            *("--max-loras-per-batch", "8", "--lora-backend", "torch", "--max-lora-rank", "16"),
            *("--lora-target-modules", "q_proj", "k_proj", "--tp-size", "1", "--max-loaded-loras", "4"),
            *("--max-cpu-lora-bytes", "1000000"),
            *("--adapter-store", "127.0.0.1:50052", "--device", "cpu", "--dtype", "float32"),
            *("--host", "127.0.0.1", "--port", "50051"),
        ]
    )
    assert args.lora.path_map == {"sql": "/adapters/sql", "chat": "hub:org/chat"}
    assert (args.lora.max_loras_per_batch, args.lora.lora_backend, args.lora.max_lora_rank) == (
        8,
        "torch",
        16,
    )
    assert args.lora.lora_target_modules == ("q_proj", "k_proj") and args.lora.max_loaded_loras == 4
    assert args.lora.max_cpu_lora_bytes == 1_000_000
    assert (args.engine.tp_size, args.engine.dtype, args.adapter_store) == (1, "float32", "127.0.0.1:50052")


def test_switches_and_environment(monkeypatch):
    monkeypatch.setenv("LORAPLEX_ADMIN_TOKEN", "adm")
    monkeypatch.setenv("LORAPLEX_API_TOKEN", "api")
    args = parse_args(BASE + ["--disable-overlap-schedule", "--disable-prefix-cache", "--log-level", "DEBUG"])
    assert args.engine.overlap_schedule is False and not args.engine.overlap_enabled
    assert args.engine.disable_prefix_cache and args.log_level == "debug"
    assert (args.admin_token, args.api_token) == ("adm", "api")
    assert parse_args(BASE).engine.overlap_schedule is None
    assert parse_args(BASE + ["--api-token", "flag"]).api_token == "flag"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp-size", "0"], "--tp-size must be >= 1"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--page-size", "0"], "--page-size must be >= 1"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
        (["--max-running-requests", "0"], "--max-running-requests must be >= 1"),
        (["--context-length", "0"], "--context-length must be >= 1"),
        (["--max-total-tokens", "-5"], "--max-total-tokens must be >= 1"),
        (["--max-new-tokens-limit", "0"], "--max-new-tokens-limit must be >= 1"),
        (["--max-queued-requests", "0"], "--max-queued-requests must be >= 1"),
        (["--cuda-graph-max-bs", "-1"], "--cuda-graph-max-bs must be >= 0"),
        (["--mixed-cuda-graph-max-tokens", "-1"], "--mixed-cuda-graph-max-tokens must be >= 0"),
        (["--decode-prefill-budget", "-1"], "--decode-prefill-budget must be >= 0"),
        (["--mem-fraction-static", "0"], "--mem-fraction-static must be in (0, 1]"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1]"),
        (["--max-loras-per-batch", "0"], "--max-loras-per-batch must be >= 1"),
        (["--max-gpu-loras", "0"], "--max-gpu-loras must be >= 1"),
        (["--max-lora-rank", "0"], "--max-lora-rank must be >= 1"),
        (["--max-loaded-loras", "0"], "--max-loaded-loras must be >= 1"),
        (["--max-cpu-lora-bytes", "0"], "--max-cpu-lora-bytes must be >= 1"),
        (["--lora-slot-wait", "-1"], "--lora-slot-wait must be in [0, 3600) seconds"),
        (["--lora-rotation-quantum", "1e9"], "--lora-rotation-quantum must be in [0, 3600) seconds"),
        (["--lora-target-modules", "wq"], "--lora-target-modules: unknown wq"),
        (["--lora-target-modules"], "--lora-target-modules needs at least one module"),
        (["--lora-paths", "nosep"], "--lora-paths expects NAME=SOURCE"),
        (["--lora-paths", "=src"], "--lora-paths expects NAME=SOURCE"),
        (["--lora-paths", "../x=src"], "--lora-paths name '../x' is invalid"),
        (["--lora-paths", "a=1", "a=2"], "--lora-paths names 'a' twice"),
        (
            ["--model-path", "/models/Llama-3", "--lora-paths", "llama-3=src"],
            "name 'llama-3' is the model's name",
        ),
        (["--adapter-store", "localhost"], "--adapter-store expects HOST:PORT or 'none'"),
        (["--adapter-store", "h:99999"], "--adapter-store expects HOST:PORT or 'none'"),
        (["--adapter-store-tls-ca", "ca.pem"], "--adapter-store-tls-ca needs --adapter-store"),
        (["--default-max-new-tokens", "0"], "--default-max-new-tokens must be 1..--max-new-tokens-limit"),
        (["--default-max-new-tokens", "200", "--max-new-tokens-limit", "100"], "(100) (got 200)"),
        (["--max-inputs-per-request", "0"], "--max-inputs-per-request must be >= 1"),
        (["--max-message-bytes", "0"], "--max-message-bytes must be 1.."),
        (["--max-message-bytes", str(1 << 31)], "gRPC's 2 GiB limit"),
        (["--host", ""], "--host must not be empty"),
        (["--port", "70000"], "--port must be 0-65535"),
        (["--metrics-port", "-1"], "--metrics-port must be 0-65535"),
        (["--port", "9000", "--metrics-port", "9000"], "--metrics-port and --port are both 9000"),
        (["--grace-period", "-1"], "--grace-period must be >= 0"),
        (["--replica-id", "r\n1"], "--replica-id must be printable ASCII"),
        (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-key", "k.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-ca", "ca.pem"], "--tls-ca needs --tls-cert and --tls-key"),
        (["--allowed-local-dirs", "/a", ""], "--allowed-local-dirs entries must not be empty"),
        (["--model-path", ""], "--model-path must not be empty"),
        (["--log-level", "loud"], "--log-level: invalid choice"),
        (["--device", "tpu"], "--device: invalid choice"),
        (["--dtype", "int8"], "--dtype: invalid choice"),
        (["--quantization", "awq"], "--quantization: invalid choice"),
        (["--lora-backend", "cuda"], "--lora-backend: invalid choice"),
        (["--port", "x"], "--port: invalid int value"),
    ],
)
def test_bad_flags_are_refused_with_a_message_naming_them(argv, message, capsys):
    assert message in refused(argv, capsys)


def test_triton_backend_on_the_cpu_needs_the_interpreter(capsys):
    try:
        reload_kernel_settings({})
        assert "--lora-backend triton needs a CUDA device" in refused(["--lora-backend", "triton"], capsys)
        reload_kernel_settings({"TRITON_INTERPRET": "1"})
        assert parse_args(BASE + ["--lora-backend", "triton"]).lora.lora_backend == "triton"
    finally:
        reload_kernel_settings()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--device", "cuda"])
    assert "--device cuda was requested but no CUDA device is available" in capsys.readouterr().err


def test_from_fields_routes_each_field_to_its_owner_and_names_unknown_ones():
    args = ServerArgs.from_fields(model_path="m", device="cpu", max_lora_rank=8, port=0)
    assert (args.engine.model_path, args.lora.max_lora_rank, args.port) == ("m", 8, 0)
    with pytest.raises(ValueError, match="no server flag field 'max_lora_ranks'"):
        ServerArgs.from_fields(max_lora_ranks=8)
    with pytest.raises(ValueError, match="--max-lora-rank must be >= 1"):
        dataclasses.replace(args.lora, max_lora_rank=0)


def test_quantization_flag_reaches_the_engine_config():
    assert parse_args(["--model-path", "m", "--quantization", "fp8"]).engine.quantization == "fp8"
    assert parse_args(["--model-path", "m"]).engine.quantization is None
    with pytest.raises(ValueError, match="--quantization must be one of fp8"):
        EngineConfig(quantization="int4")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, 256),
        ({"max_num_batched_tokens": 128}, 128),  # a decode step never holds more tokens than this
        ({"max_running_requests": 32}, 32),
        ({"cuda_graph_max_bs": 64, "max_num_batched_tokens": 512}, 64),
    ],
)
def test_decode_graphs_stop_at_the_largest_decode_step(flags, expected):
    """engine/startup.py: capturing a decode graph larger than a step can be overran the runner's
    buffers (found on the H100 with --max-num-batched-tokens 128)."""
    from loraplex.services.inference.engine.startup import decode_graph_max_bs

    assert decode_graph_max_bs(dataclasses.replace(EngineConfig(device="cpu"), **flags)) == expected
