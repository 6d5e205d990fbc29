"""The prefix cache's per-adapter counters follow the adapters: an unloaded adapter's entry goes, so
a server that lives on churn keeps no state per adapter name ever served."""

from __future__ import annotations

from loraplex.services.inference.engine.prefix_cache import PrefixCacheStats
from loraplex.services.inference.engine.types import SamplingParams
from tests.support.lora_reference import server_args, sync_engine


def test_forget_drops_only_that_adapter():
    stats = PrefixCacheStats()
    stats.record("a", 10, 4)
    stats.record(None, 5, 0)
    stats.forget("a")
    assert dict(stats.prompt_tokens) == {"": 5} and dict(stats.hit_tokens) == {"": 0}
    stats.forget("never-served")  # no error
    stats.record("a", 3, 0)  # served again: starts from 0
    assert stats.prompt_tokens["a"] == 3


def test_an_unloaded_adapter_leaves_no_counters(tiny_llama_path, adapter_factory):
    adapter = adapter_factory(tiny_llama_path, "churn", r=4)
    engine = sync_engine(server_args(tiny_llama_path, {"churn": adapter}))
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=2, temperature=0.0), ["churn"])
    assert "churn" in engine.stats().prefix_cache_prompt_tokens
    engine.forget_adapter("churn")
    assert "churn" not in engine.stats().prefix_cache_prompt_tokens
