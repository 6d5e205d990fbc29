"""The tiers below the GPU pool (issue 57): the host tier bounded in bytes and its counters, on real
PEFT adapters and a real CPU pool."""

from __future__ import annotations

import pytest
import torch

from loraplex.services.inference.lora.adapter_loader import load_adapter_weights
from loraplex.services.inference.lora.manager import LoRAManager
from loraplex.services.inference.lora.pool import AdapterPool
from loraplex.services.inference.lora.settings import LoRAConfig, default_cpu_lora_bytes
from loraplex.services.inference.lora.shapes import ALL_MODULES, ModelShapes

QV = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def shapes(tiny_llama_path) -> ModelShapes:
    return ModelShapes.from_model_dir(tiny_llama_path)


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, adapter_factory):
    """Four distinct rank-4 q/v adapters (all the same size)."""
    return {
        f"t{i}": adapter_factory(tiny_llama_path, f"tier{i}", r=4, target_modules=QV, seed=20 + i)
        for i in range(4)
    }


def make_manager(shapes, slots=1, **kw) -> LoRAManager:
    pool = AdapterPool(
        shapes, slots=slots, max_rank=8, target_modules=ALL_MODULES, dtype=torch.float32, device="cpu"
    )
    return LoRAManager(pool, **kw)


def locations(m: LoRAManager) -> dict[str, str]:
    return {i.name: i.location for i in m.list_adapters()}


def test_host_tier_is_bounded_in_bytes_lru_and_counts_hits_and_misses(shapes, adapters):
    size = load_adapter_weights(adapters["t0"], shapes).nbytes
    m = make_manager(shapes, max_cpu_lora_bytes=2 * size + size // 2)  # room for two copies
    for n in ("t0", "t1", "t2"):
        m.load_adapter(n, adapters[n])
        assert m.host_bytes() <= m.max_cpu_lora_bytes
    assert locations(m) == {"t0": "store", "t1": "host", "t2": "host"}  # the least recently used went
    s = m.acquire("t1")  # a host hit: copied from memory
    m.release("t1")
    assert m.acquire("t0") == s  # a miss: re-read from its source, then t1's slot is taken
    info = {i.name: i for i in m.list_adapters()}
    assert (info["t1"].host_hits, info["t1"].host_misses) == (1, 0)
    assert (info["t0"].host_hits, info["t0"].host_misses) == (0, 1)
    # t0 is back in the host tier (it runs), t1 stays there (evicted from the GPU, recently used),
    # and t2, the least recently used, made room
    assert locations(m) == {"t0": "gpu", "t1": "host", "t2": "store"}
    assert m.host_bytes() == 2 * size and m.upload_bytes == 2 * size
    w0 = load_adapter_weights(adapters["t0"], shapes)
    assert torch.equal(m.pool.lora_a["qkv"][0, s, :4], w0.lora_a[(0, "q_proj")])
    m.release("t0")


def test_copies_a_request_holds_are_never_dropped(shapes, adapters):
    size = load_adapter_weights(adapters["t0"], shapes).nbytes
    m = make_manager(shapes, slots=2, max_cpu_lora_bytes=size)  # room for one copy
    m.load_adapter("t0", adapters["t0"])
    m.load_adapter("t1", adapters["t1"])
    assert m.acquire("t0") is not None and m.acquire("t1") is not None
    # both run: neither copy may go (each may need re-placing), so the bound is exceeded for now
    assert m.host_bytes() == 2 * size
    m.release("t0")
    m.release("t1")
    m.load_adapter("t2", adapters["t2"])  # the next trim drops the least recently used idle copies
    assert m.host_bytes() <= size and locations(m)["t2"] == "host"


def test_count_and_byte_bounds_combine(shapes, adapters):
    size = load_adapter_weights(adapters["t0"], shapes).nbytes
    m = make_manager(shapes, max_loaded_loras=1, max_cpu_lora_bytes=10 * size)
    for n in ("t0", "t1"):
        m.load_adapter(n, adapters[n])
    assert locations(m) == {"t0": "store", "t1": "host"}  # the count bound binds first
    m = make_manager(shapes, max_loaded_loras=10, max_cpu_lora_bytes=size)
    for n in ("t0", "t1"):
        m.load_adapter(n, adapters[n])
    assert locations(m) == {"t0": "store", "t1": "host"}  # the byte bound binds first


def test_default_byte_bound_is_a_fraction_of_available_memory():
    assert LoRAConfig().max_cpu_lora_bytes is None
    default = default_cpu_lora_bytes()
    assert default is not None and 0 < default < 2**50
    with pytest.raises(ValueError, match="--max-cpu-lora-bytes"):
        LoRAConfig(max_cpu_lora_bytes=0)


def test_the_flag_reaches_the_manager_and_defaults_from_memory(tiny_llama_path, adapters, one_torch_thread):
    from tests.support.lora_reference import lora_settings, server_args, sync_engine

    shapes, cpu = ModelShapes.from_model_dir(tiny_llama_path), torch.device("cpu")
    default = lora_settings(server_args(tiny_llama_path), shapes, cpu)
    assert default.max_cpu_lora_bytes == default_cpu_lora_bytes() or (
        # available memory moves between the two reads; the same fraction of it, within 5%
        abs(default.max_cpu_lora_bytes - default_cpu_lora_bytes()) < 0.05 * default.max_cpu_lora_bytes
    )
    size = load_adapter_weights(adapters["t0"], shapes).nbytes
    engine = sync_engine(server_args(tiny_llama_path, adapters, max_cpu_lora_bytes=size))
    assert engine.adapter_slots.max_cpu_lora_bytes == size
    assert engine.adapter_slots.host_bytes() == size  # four loaded, one host copy kept
