"""The Triton FP8 GEMMs (kernels/fp8_weight_gemm.py: weight-only and W8A8) against their torch
references, their config table and setting, and the FP8 linear's choice of GEMM
(kernels/fp8_gemm_choice.py).

The kernel runs on the CPU under TRITON_INTERPRET=1, which Triton reads at import, so those checks
run in a fresh subprocess (`python -m tests.integration.test_fp8_weight_gemm`): randomized shapes
(K not a multiple of the K step, rows and columns not multiples of the tiles), per-channel and
128x128-style block scales (small blocks here), split-K on and off, with and without bias, float32
and float16 activations (the interpreter's bfloat16 tl.dot returns garbage; bfloat16 is checked on
the GPU by bench/fp8_gemm.py), each against `fp8_weight_gemm_ref` (float32 over the dequantized
weight). The W8A8 GEMM is fed activations on the E4M3 grid (the interpreter's cast to E4M3 does not
round to nearest, kernels/fp8_quant.py), so its per-token quantization is exact and the reference is
the float32 product. Another child compiles the kernels for sm_90 (the interpreter never runs the
compiler).
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from loraplex.kernels import fp8_gemm_configs
from loraplex.kernels.fp8_gemm_configs import Fp8GemmConfig, Fp8GemmKey, default_config, fp8_gemm_config
from loraplex.kernels.fp8_matmul import dequantize, quantize_rows
from loraplex.kernels.settings import KernelSettings, kernel_settings, reload_kernel_settings
from loraplex.services.inference.models.quantization.fp8_linear import Fp8Linear
from loraplex.services.inference.models.quantization.scheme import Fp8Scheme
from tests.support.child import assert_interpreter_checks_pass, child_env, run_child

CPU = torch.device("cpu")


def _env(s: KernelSettings) -> dict[str, str]:
    """The environment `KernelSettings.from_env` reads back as `s`."""
    return {
        "TRITON_INTERPRET": "1" if s.triton_interpret else "0",
        "LORAPLEX_LORA_CONFIGS": s.lora_configs or "",
        "LORAPLEX_FP8_GEMM": s.fp8_gemm,
        "LORAPLEX_FP8_GEMM_CONFIGS": s.fp8_gemm_configs or "",
    }


@pytest.fixture
def fp8_gemm_setting():
    """`set(mode, configs=None)` re-reads the kernel settings with LORAPLEX_FP8_GEMM=mode; restored after."""
    before = kernel_settings()

    def set_mode(mode: str, configs: str | None = None) -> KernelSettings:
        return reload_kernel_settings(
            {**_env(before), "LORAPLEX_FP8_GEMM": mode, "LORAPLEX_FP8_GEMM_CONFIGS": configs or ""}
        )

    yield set_mode
    reload_kernel_settings(_env(before))
    assert kernel_settings() == before


def test_setting_is_typed_and_defaults_to_auto():
    assert KernelSettings.from_env({}).fp8_gemm == "auto"
    assert KernelSettings.from_env({"LORAPLEX_FP8_GEMM": "scaled_mm"}).fp8_gemm == "scaled_mm"
    with pytest.raises(ValueError, match="weight_only"):
        KernelSettings.from_env({"LORAPLEX_FP8_GEMM": "weight-only"})


def test_default_config_splits_k_until_the_grid_covers_the_chip():
    # Llama-3.1-8B at batch 64, tiles of 128 weight rows: o_proj and down_proj are 32 tiles, split
    # 8 ways (nearest 2 waves of 132 SMs; o_proj's 32 K steps allow 8 splits of 4), gate_up 224
    # tiles, not split; qkv 48 tiles, split 6.
    o = default_config(64, 4096, 4096, CPU)
    assert (o.block_n, o.split_k) == (128, 8) and 4096 // o.block_k // o.split_k >= 4
    assert default_config(64, 4096, 14336, CPU).split_k == 8
    assert default_config(64, 28672, 4096, CPU).split_k == 1
    assert default_config(64, 6144, 4096, CPU).split_k == 6
    assert default_config(3, 64, 64, CPU).block_m == 16 and default_config(40, 64, 64, CPU).block_m == 64
    assert default_config(65, 4096, 4096, CPU).split_k == 1  # prefill


def test_w8a8_has_decode_tiles_up_to_256_rows_and_weight_only_up_to_64():
    prefill = default_config(300, 4096, 4096, CPU)
    # The weight-only GEMM past 64 rows, and both past 256: the one prefill config.
    assert default_config(128, 4096, 4096, CPU) == prefill == default_config(257, 4096, 4096, CPU, "w8a8")
    for rows, block_m in ((65, 128), (128, 128), (200, 256), (256, 256)):
        cfg = default_config(rows, 2048, 4096, CPU, "w8a8")  # (a shape without a table entry)
        assert cfg != prefill and cfg.block_m == block_m  # one rows tile: x read once per program
    assert fp8_gemm_configs.rows_bucket(65) == "128" and fp8_gemm_configs.rows_bucket(256) == "256"
    assert fp8_gemm_configs.rows_bucket(257) == "prefill"


def test_configs_are_fitted_to_the_devices_shared_memory():
    """The tables' deepest entries take 200 KB of shared memory: they stand as they are on an H100 or
    H200 (227 KB a program), and an Ada GPU's ~99 KB gets fewer stages, then shorter K steps."""
    from loraplex.kernels.fp8_gemm_configs import fit_shared_memory, max_shared_memory, shared_memory_bytes

    hopper, ada = 232448, 101376
    tiles = {k: v for k, v in fp8_gemm_configs.TABLE.items() if not isinstance(v, str)}
    assert max(shared_memory_bytes(cfg, key.kernel) for key, cfg in tiles.items()) > ada
    for key, cfg in tiles.items():
        assert fit_shared_memory(cfg, key.kernel, hopper) == cfg
        fitted = fit_shared_memory(cfg, key.kernel, ada)
        assert shared_memory_bytes(fitted, key.kernel) <= ada and fitted.num_stages >= 2
        assert fitted._replace(num_stages=0, block_k=0) == cfg._replace(num_stages=0, block_k=0)
    deep = Fp8GemmConfig(256, 64, 512, 1, 8, 5)  # 160 KB a stage: 2 stages and 128-deep K steps
    assert fit_shared_memory(deep, "w8a8", ada) == Fp8GemmConfig(256, 64, 128, 1, 8, 2)
    assert (
        max_shared_memory(CPU) is None
        and fp8_gemm_config(64, 4096, 14336, CPU, "w8a8") == tiles[Fp8GemmKey("64", 4096, 14336, "w8a8")]
    )


def test_auto_takes_w8a8_up_to_256_rows_but_where_scaled_mm_measured_faster():
    from loraplex.kernels.fp8_gemm_configs import auto_choice

    assert auto_choice(200, 28672, 4096) == "scaled_mm" and auto_choice(100, 28672, 4096) == "scaled_mm"
    assert auto_choice(64, 28672, 4096) is None  # the rule: W8A8
    assert auto_choice(256, 6144, 4096) == "scaled_mm" and auto_choice(128, 6144, 4096) is None
    assert auto_choice(256, 4096, 14336) is None


def test_built_in_table_serves_the_measured_shapes_and_a_file_comes_first(tmp_path, fp8_gemm_setting):
    o = Fp8GemmKey("64", 4096, 4096)
    assert fp8_gemm_config(64, 4096, 4096, CPU) == fp8_gemm_configs.TABLE[o]
    assert fp8_gemm_config(64, 4096, 4096, CPU) != default_config(64, 4096, 4096, CPU)
    assert fp8_gemm_config(16, 2048, 4096, CPU) == default_config(16, 2048, 4096, CPU)  # no entry
    w8a8 = Fp8GemmKey("64", 4096, 4096, "w8a8")
    assert fp8_gemm_config(64, 4096, 4096, CPU, kernel="w8a8") == fp8_gemm_configs.TABLE[w8a8]
    assert fp8_gemm_config(64, 2048, 4096, CPU, kernel="w8a8") == default_config(64, 2048, 4096, CPU, "w8a8")
    entry = Fp8GemmConfig(64, 32, 64, 2, 2, 2)
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(fp8_gemm_configs.table_json({o: entry})))
    fp8_gemm_setting("auto", str(path))
    assert fp8_gemm_config(64, 4096, 4096, CPU) == entry


def test_configs_file_replaces_entries(tmp_path, fp8_gemm_setting):
    path = tmp_path / "fp8.json"
    entry = Fp8GemmConfig(16, 32, 64, 3, 2, 2)
    path.write_text(json.dumps(fp8_gemm_configs.table_json({Fp8GemmKey("32", 4096, 4096): entry})))
    fp8_gemm_setting("auto", str(path))
    assert fp8_gemm_config(20, 4096, 4096, CPU) == entry  # rows 20: bucket 32
    assert fp8_gemm_config(8, 4096, 4096, CPU) == fp8_gemm_configs.TABLE[Fp8GemmKey("16", 4096, 4096)]
    fp8_gemm_setting("auto", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError):
        fp8_gemm_config(20, 4096, 4096, CPU)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"512|4096|4096": [16, 32, 64, 3, 2, 2]}))
    fp8_gemm_setting("auto", str(bad))
    with pytest.raises(ValueError, match="rows bucket"):
        fp8_gemm_config(20, 4096, 4096, CPU)


def test_configs_file_holds_w8a8_tiles_and_auto_choices(tmp_path, fp8_gemm_setting):
    from loraplex.kernels.fp8_gemm_configs import auto_choice

    tiles = Fp8GemmConfig(64, 64, 128, 4, 4, 3)
    path = tmp_path / "fp8.json"
    path.write_text(
        json.dumps(
            fp8_gemm_configs.table_json(
                {Fp8GemmKey("64", 4096, 4096, "w8a8"): tiles, Fp8GemmKey("64", 4096, 4096, "auto"): "w8a8"}
            )
        )
    )
    assert json.loads(path.read_text()) == {"64|4096|4096|w8a8": list(tiles), "64|4096|4096|auto": "w8a8"}
    fp8_gemm_setting("auto", str(path))
    assert fp8_gemm_config(64, 4096, 4096, CPU, kernel="w8a8") == tiles
    assert fp8_gemm_config(64, 4096, 4096, CPU) == fp8_gemm_configs.TABLE[Fp8GemmKey("64", 4096, 4096)]
    assert auto_choice(50, 4096, 4096) == "w8a8" and auto_choice(16, 4096, 4096) is None
    for bad, message in (
        ({"64|4096|4096|auto": "cublas"}, "not one of"),
        ({"64|4096|4096|int8": [64, 64, 128, 4, 4, 3]}, "kernel must be"),
    ):
        path.write_text(json.dumps(bad))
        fp8_gemm_configs._file_table.cache_clear()
        with pytest.raises(ValueError, match=message):
            fp8_gemm_config(64, 4096, 4096, CPU)
    fp8_gemm_configs._file_table.cache_clear()


def _block_linear() -> Fp8Linear:
    lin = Fp8Linear(64, (32, 32), False, Fp8Scheme("fp8 block-wise 16x32", prequantized=True, block=(16, 32)))
    gen = torch.Generator().manual_seed(0)
    lin.weight.data.copy_(torch.randn(64, 64, generator=gen).to(torch.float8_e4m3fn))
    lin.weight_scale.copy_(torch.rand(4, 2, generator=gen) + 0.5)
    return lin


@pytest.mark.parametrize(
    "mode, kept", [("scaled_mm", False), ("auto", False), ("w8a8", False), ("weight_only", True)]
)
def test_block_scales_are_kept_unless_scaled_mm_serves(mode, kept, fp8_gemm_setting):
    """At load on the GPU (`finish(fast=True)`), a block-scaled weight is re-quantized per channel
    where torch._scaled_mm may serve it (`scaled_mm`, `auto`); `weight_only` serves the checkpoint's
    own block scales."""
    fp8_gemm_setting(mode)
    lin = _block_linear()
    before = lin.dequantized()
    lin.finish(fast=True)
    assert (lin.block is not None) == kept
    assert (lin.scale_row is None) == kept
    after = lin.dequantized()
    assert torch.equal(after, before) if kept else not torch.equal(after, before)


def test_kernels_under_triton_interpreter() -> None:
    assert_interpreter_checks_pass("tests.integration.test_fp8_weight_gemm", drop_env=("LORAPLEX_FP8_GEMM",))


def test_kernels_compile_for_sm90(tmp_path) -> None:
    env = child_env(interpret=False, TRITON_CACHE_DIR=str(tmp_path))
    proc = run_child(["-m", "tests.integration.test_fp8_weight_gemm", "--compile"], env=env)
    assert proc.stdout.count("cubin") == len(COMPILE_VARIANTS) + 1, proc.stdout  # + the quantization
    assert "wgmma 0" not in proc.stdout, proc.stdout


# The kernel's variants a GPU serves: per-channel / block scales, split-K (partials, the last program
# adds them) / direct, weight-only / W8A8.
COMPILE_VARIANTS = {
    "per_channel_split": dict(SCALE_BN=0, SCALE_BK=1, HAS_BIAS=False, EVEN_K=True, SPLIT=True),
    "per_channel_bias": dict(SCALE_BN=0, SCALE_BK=1, HAS_BIAS=True, EVEN_K=False, SPLIT=False),
    "block_128": dict(SCALE_BN=128, SCALE_BK=128, HAS_BIAS=False, EVEN_K=True, SPLIT=False),
    # The default decode tile at 32-64 rows: 128 weight rows, 8 warps.
    "per_channel_wide": dict(SCALE_BN=0, SCALE_BK=1, HAS_BIAS=False, EVEN_K=True, SPLIT=True, BLOCK_N=128),
    # W8A8: E4M3 x, an FP8 MMA.
    "w8a8_split_bias": dict(SCALE_BN=0, SCALE_BK=1, HAS_BIAS=True, EVEN_K=True, SPLIT=True, X_FP8=True),
    "w8a8_wide": dict(
        SCALE_BN=0, SCALE_BK=1, HAS_BIAS=False, EVEN_K=True, SPLIT=False, X_FP8=True, BLOCK_N=128, BLOCK_K=256
    ),
    # W8A8 at 65-256 rows: 128 rows of x per program.
    "w8a8_rows_128": dict(
        SCALE_BN=0, SCALE_BK=1, HAS_BIAS=False, EVEN_K=True, SPLIT=True, X_FP8=True, BLOCK_M=128, BLOCK_N=128
    ),
}


def _compile(constexprs: dict, num_warps: int, num_stages: int, arch: int = 90):
    """The GEMM kernel compiled for sm_`arch` with these constexprs (defaults filled in)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loraplex.kernels.fp8_weight_gemm import _fp8_weight_gemm_kernel

    constexprs = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, X_FP8=False) | constexprs
    pointers = {
        "x_ptr": "*fp8e4nv" if constexprs["X_FP8"] else "*bf16",
        "xs_ptr": "*fp32",
        "w_ptr": "*fp8e4nv",
        "s_ptr": "*fp32",
        "out_ptr": "*bf16",
        "bias_ptr": "*bf16",
        "part_ptr": "*fp32",
        "count_ptr": "*i32",
    }
    names = _fp8_weight_gemm_kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    # As the JIT specialises a Llama shape: 16-aligned pointers and sizes (the pipelined path).
    sizes = ("N", "K", "k_per_split", "stride_xm", "stride_wn")
    aligned = [n for n in names if n.endswith("_ptr") or n in sizes]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(
        _fp8_weight_gemm_kernel,
        sig,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _compile_fitted() -> int:
    """The deepest built-in tiles compile within `shared_memory_bytes`' bound: as measured for sm_90,
    and fitted to an Ada GPU's 99 KB for sm_89 (so the fit's bound is one Triton keeps)."""
    from loraplex.kernels.fp8_gemm_configs import TABLE, fit_shared_memory, shared_memory_bytes

    failures = 0
    deepest = sorted(
        ((key, cfg) for key, cfg in TABLE.items() if not isinstance(cfg, str)),
        key=lambda item: -shared_memory_bytes(item[1], item[0].kernel),
    )[:3]
    for arch, limit in ((90, 232448), (89, 101376)):
        for key, cfg in deepest:
            cfg = fit_shared_memory(cfg, key.kernel, limit)
            constexprs = dict(
                SCALE_BN=0, SCALE_BK=1, HAS_BIAS=False, EVEN_K=True, SPLIT=cfg.split_k > 1,
                X_FP8=key.kernel == "w8a8", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            )  # fmt: skip
            shared = _compile(constexprs, cfg.num_warps, cfg.num_stages, arch).metadata.shared
            bound = shared_memory_bytes(cfg, key.kernel)
            ok = shared <= bound <= limit
            failures += not ok
            print(f"sm_{arch} {'|'.join(map(str, key))} {tuple(cfg)}: shared {shared} <= {bound} <= {limit} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return failures


def _compile_checks() -> int:
    for name, variant in COMPILE_VARIANTS.items():
        constexprs = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, X_FP8=False) | variant
        kernel = _compile(constexprs, 8 if constexprs["BLOCK_N"] >= 128 else 4, 4)
        ptx = kernel.asm["ptx"]
        wgmma = ptx.count("wgmma.mma_async")  # Hopper's MMA
        atomics = ptx.count("atom.")
        print(f"{name}: cubin {len(kernel.asm['cubin'])} bytes, wgmma {wgmma}, atomics {atomics}", flush=True)
        if (atomics > 0) != constexprs["SPLIT"]:
            print(f"{name}: FAIL split-K arrival counting")
            return 1
    return _compile_quantize() + _compile_fitted()


def _compile_quantize() -> int:
    """The activation quantization before the W8A8 GEMM: one pass over a Llama-3.1-8B down row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loraplex.kernels.fp8_quant import _quantize_rows_kernel

    names = _quantize_rows_kernel.arg_names
    constexprs = dict(ONE_PASS=True, BLOCK=16384)
    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "fp8_max": "fp32", "min_scale": "fp32"}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(
        _quantize_rows_kernel, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}
    )
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ok = len(kernel.asm["cubin"]) > 0 and "cvt.rn.satfinite.e4m3x2.f32" in kernel.asm["ptx"]
    print(f"quantize_rows one pass: cubin {len(kernel.asm['cubin'])} bytes {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


# ---- run in the subprocess, with TRITON_INTERPRET=1 ----


def _random_case(gen: torch.Generator, block: tuple[int, int] | None):
    m = int(torch.randint(1, 40, (), generator=gen))
    n = int(torch.randint(8, 80, (), generator=gen))
    k = int(torch.randint(20, 300, (), generator=gen))
    w, scale = quantize_rows(torch.randn(n, k, generator=gen))
    if block is not None:
        # Block scales of spread magnitudes, so a block read from the wrong place shows (small
        # enough that float16 outputs stay finite).
        shape = (math.ceil(n / block[0]), math.ceil(k / block[1]))
        scale = torch.exp2(torch.randint(-10, -3, shape, generator=gen).float())
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if torch.rand((), generator=gen) < 0.5 else None
    return x, w, scale, bias


def _check_gemm(seed: int, block, split_k: int, dtype: torch.dtype) -> bool:
    from loraplex.kernels.fp8_weight_gemm import fp8_weight_gemm, fp8_weight_gemm_ref

    gen = torch.Generator().manual_seed(seed)
    x, w, scale, bias = _random_case(gen, block)
    x = x.to(dtype)
    block_m = int(torch.tensor([16, 32])[torch.randint(0, 2, (), generator=gen)])
    cfg = Fp8GemmConfig(block_m, 16 * int(torch.randint(1, 3, (), generator=gen)), 32, split_k, 4, 2)
    out = fp8_weight_gemm(x, w, scale, block, bias, cfg)
    # The reference in float32 from x as given: a float16 output differs by its own rounding only.
    ref = fp8_weight_gemm_ref(x.float(), w, scale, block, None if bias is None else bias.float())
    return _matches(f"gemm seed {seed}", x, w, scale, block, bias, out, ref, f"split {split_k} {cfg[:2]}")


def _matches(what: str, x, w, scale, block, bias, out: torch.Tensor, ref: torch.Tensor, detail: str) -> bool:
    """`out` against the float32 `ref`, the error measured against sum(|x| |w|) + |bias| (what bounds
    a sum's rounding error): float32 to 1e-6, a float16 output to its own rounding."""
    bound = x.float().abs() @ dequantize(w, scale, block, torch.float32).abs().T
    bound = (bound + (0 if bias is None else bias.abs())).clamp(min=1e-6)
    tol = 1e-6 if x.dtype == torch.float32 else 2**-10
    err = ((out.float() - ref).abs() / bound).max().item()
    ok = out.dtype == x.dtype and out.shape == ref.shape and err < tol
    print(
        f"{what} {tuple(x.shape)}x{tuple(w.shape)} block {block} {detail} {x.dtype} "
        f"bias {bias is not None}: rel err {err:.1e} {'ok' if ok else 'FAIL'}"
    )
    return ok


def _on_e4m3_grid(gen: torch.Generator, m: int, k: int) -> torch.Tensor:
    """`[m, k]` activations that per-token E4M3 quantization represents exactly: E4M3 values with a
    448 in each row (so the row's scale is its power of two), times a power of two per row."""
    q = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn).float()
    q[:, int(torch.randint(0, k, (), generator=gen))] = 448.0
    return q * torch.exp2(torch.randint(-12, -6, (m, 1), generator=gen).float())


def _check_w8a8(seed: int, block, split_k: int, dtype: torch.dtype) -> bool:
    from loraplex.kernels.fp8_weight_gemm import fp8_w8a8_gemm, fp8_w8a8_gemm_ref

    gen = torch.Generator().manual_seed(1000 + seed)
    x, w, scale, bias = _random_case(gen, block)
    x = _on_e4m3_grid(gen, *x.shape).to(dtype)
    cfg = Fp8GemmConfig(16, 16 * int(torch.randint(1, 3, (), generator=gen)), 32, split_k, 4, 2)
    out = fp8_w8a8_gemm(x, w, scale, block, bias, cfg)
    ref = fp8_w8a8_gemm_ref(x.float(), w, scale, block, None if bias is None else bias.float())
    return _matches(f"w8a8 seed {seed}", x, w, scale, block, bias, out, ref, f"split {split_k} {cfg[:2]}")


def _check_split_counters() -> bool:
    """Split-K's arrival counters are zero again after a launch (a replayed graph finds them so), and
    a second launch gives the same bits."""
    from loraplex.kernels import fp8_weight_gemm as gemm

    gen = torch.Generator().manual_seed(11)
    x, w, scale, bias = _random_case(gen, None)
    cfg = Fp8GemmConfig(16, 16, 32, 3, 4, 2)
    first = gemm.fp8_weight_gemm(x, w, scale, None, bias, cfg)
    counters = gemm._COUNTERS[x.device]
    again = gemm.fp8_weight_gemm(x, w, scale, None, bias, cfg)
    ok = bool((counters == 0).all()) and torch.equal(first, again)
    print(f"split-K counters reset, launches repeat bit for bit: {'ok' if ok else 'FAIL'}")
    return ok


def _check_w8a8_static_scale() -> bool:
    """A static per-tensor input scale (compressed-tensors' static activations) quantizes every row
    by that scale, not its own amax: the output differs from per-token quantization, as the
    reference's does."""
    from loraplex.kernels.fp8_weight_gemm import fp8_w8a8_gemm, fp8_w8a8_gemm_ref

    gen = torch.Generator().manual_seed(5)
    x, w, scale, _ = _random_case(gen, None)
    x = _on_e4m3_grid(gen, *x.shape)
    static = torch.tensor([2.0**-7])  # x / static stays on the E4M3 grid (powers of two), clipped at 448
    out = fp8_w8a8_gemm(x, w, scale, None, None, Fp8GemmConfig(16, 16, 32, 2, 4, 2), static)
    ref = fp8_w8a8_gemm_ref(x, w, scale, None, None, static)
    dynamic = fp8_w8a8_gemm_ref(x, w, scale, None)
    ok = torch.allclose(out, ref, rtol=1e-5, atol=1e-5) and not torch.allclose(ref, dynamic, rtol=1e-3)
    print(f"w8a8 static input scale: {'ok' if ok else 'FAIL'}")
    return ok


def _check_linear_dispatch() -> int:
    """Fp8Linear through the Triton GEMMs (run_triton_on_cpu) equals the reference path, and `auto`
    takes the W8A8 GEMM up to 64 rows where torch._scaled_mm operands exist (torch._scaled_mm above),
    the weight-only GEMM where they don't, and a measured choice where the tables have one."""
    from loraplex.kernels import fp8_gemm_choice, fp8_gemm_configs
    from loraplex.kernels import fp8_weight_gemm as gemm
    from loraplex.kernels.placement import run_triton_on_cpu

    failures = 0
    calls = []

    def counting(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return call

    import loraplex.services.inference.models.quantization.fp8_linear as fp8_linear

    fp8_linear.fp8_weight_gemm = counting("weight_only", gemm.fp8_weight_gemm)
    fp8_linear.fp8_w8a8_gemm = counting("w8a8", gemm.fp8_w8a8_gemm)
    x = _on_e4m3_grid(torch.Generator().manual_seed(7), 5, 64)  # W8A8 quantizes it exactly
    for mode, expect in (
        ("scaled_mm", []),
        ("weight_only", ["weight_only"]),
        ("w8a8", ["w8a8"]),
        ("auto", ["weight_only"]),
    ):
        reload_kernel_settings({"TRITON_INTERPRET": "1", "LORAPLEX_FP8_GEMM": mode})
        lin = _block_linear()
        ref = lin(x)  # CPU tensors without run_triton_on_cpu: the reference path
        run_triton_on_cpu(True)
        try:
            calls.clear()
            out = lin(x)
        finally:
            run_triton_on_cpu(False)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        ok = calls == expect and err < 1e-5
        failures += not ok
        print(f"Fp8Linear {mode}: Triton calls {calls}, rel err {err:.1e} {'ok' if ok else 'FAIL'}")
    run_triton_on_cpu(True)
    choose = fp8_gemm_choice.fp8_gemm_kernel
    try:
        reload_kernel_settings({"TRITON_INTERPRET": "1", "LORAPLEX_FP8_GEMM": "auto"})
        picks = [
            choose(torch.zeros(rows, 8), None, ready, shape)
            for rows, ready, shape in (
                (64, 1, None),  # decode rows: the W8A8 GEMM
                (256, 1, None),  # its tiles go up to 256 rows
                (257, 1, None),  # above: torch._scaled_mm
                (65, 0, None),  # no torch._scaled_mm operands: weight-only
                (64, 1, (8, 8)),
                (1, 1, (24, 8)),
            )
        ]
        fp8_gemm_configs.OVERRIDES[Fp8GemmKey("64", 24, 8, "auto")] = "weight_only"  # measured choices
        fp8_gemm_configs.OVERRIDES[Fp8GemmKey("64", 8, 8, "auto")] = "scaled_mm"
        picks += [
            choose(torch.zeros(40, 8), None, True, (24, 8)),
            choose(torch.zeros(40, 8), None, True, (8, 8)),
        ]
        picks.append(choose(torch.zeros(40, 8), None, False, (8, 8)))  # no scaled_mm operands
        picks.append(choose(torch.zeros(16, 8), None, True, (8, 8)))  # another bucket: the rule
        reload_kernel_settings({"TRITON_INTERPRET": "1", "LORAPLEX_FP8_GEMM": "scaled_mm"})
        picks.append(choose(torch.zeros(4, 8), None, False))
        picks.append(choose(torch.zeros(4, 8), None, True))
    finally:
        fp8_gemm_configs.OVERRIDES.clear()
        run_triton_on_cpu(False)
    want = ["w8a8", "w8a8", "scaled_mm", "weight_only", "w8a8", "w8a8"]
    want += ["weight_only", "scaled_mm", "weight_only", "w8a8", "ref", "scaled_mm"]
    ok = picks == want
    failures += not ok
    cases = "rows 64, 256, 257, 65 without scaled_mm, two shapes, measured x3, another bucket, scaled_mm x2"
    print(f"auto picks ({cases}) {picks} {'ok' if ok else 'FAIL'}")
    return failures


def _interpreter_checks() -> int:
    failures = 0
    seed = 0
    for block in (None, (16, 32), (32, 64)):
        for split_k in (1, 3):
            for dtype in (torch.float32, torch.float16):
                failures += not _check_gemm(seed, block, split_k, dtype)
                failures += not _check_w8a8(seed, block, split_k, dtype)
                seed += 1
    failures += not _check_w8a8_static_scale()
    failures += not _check_split_counters()
    # Block scales narrower than the config's K step (narrowed to 16), and the check discriminates:
    # the same scales read upside down are caught.
    from loraplex.kernels.fp8_weight_gemm import fp8_weight_gemm, fp8_weight_gemm_ref

    gen = torch.Generator().manual_seed(99)
    x, w, scale, _ = _random_case(gen, (16, 16))
    out = fp8_weight_gemm(x, w, scale, (16, 16), None, Fp8GemmConfig(16, 16, 64, 2, 4, 2))
    right = fp8_weight_gemm_ref(x, w, scale, (16, 16))
    wrong = fp8_weight_gemm_ref(x, w, scale.flip(0), (16, 16))
    ok = torch.allclose(out, right, rtol=1e-5, atol=1e-5) and not torch.allclose(
        out, wrong, rtol=1e-3, atol=1e-3
    )
    failures += not ok
    print(f"block 16x16 under a 64-wide K step; flipped scales caught: {'ok' if ok else 'FAIL'}")
    failures += _check_linear_dispatch()
    print("checked")
    return failures


if __name__ == "__main__":
    if "--compile" in sys.argv:
        sys.exit(_compile_checks())
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        sys.exit("set TRITON_INTERPRET=1 to run the kernels on the CPU")
    sys.exit(1 if _interpreter_checks() else 0)
