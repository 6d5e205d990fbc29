"""Prometheus metrics of the inference service, served on `--metrics-port`.

Request-path metrics are recorded by the servicer as events happen; engine gauges (queue,
KV, slots, per-adapter residency) are refreshed from `engine.stats()` / `list_adapters()`
once a second by `Metrics.refresh`, so a scrape never touches the engine thread.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from services.inference.engine.types import AdapterInfo, EngineStats

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LOCATIONS = ("gpu", "host", "store")


def adapter_label(adapter: str | None) -> str:
    return adapter or "base"


class Metrics:
    """One registry per server; names are prefixed `loraplex_`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "loraplex_requests", "Generation requests (one per input) by adapter and outcome", ["adapter", "code"], registry=r
        )
        self.rpcs = Counter("loraplex_rpcs", "RPCs handled, by method and status code", ["method", "code"], registry=r)
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens admitted", ["adapter"], registry=r)
        self.completion_tokens = Counter("loraplex_completion_tokens", "Tokens generated", ["adapter"], registry=r)
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "loraplex_inter_token_latency_seconds", "Time between output tokens", buckets=LATENCY_BUCKETS, registry=r
        )
        self.aborted = Counter(
            "loraplex_aborted_requests", "Engine requests aborted (client cancel, deadline, error)", ["reason"], registry=r
        )
        self.queue_waiting = Gauge("loraplex_queue_waiting", "Requests waiting in the scheduler", registry=r)
        self.running = Gauge("loraplex_requests_running", "Requests running in the engine", registry=r)
        self.kv_blocks_total = Gauge("loraplex_kv_blocks_total", "KV cache blocks", registry=r)
        self.kv_blocks_free = Gauge("loraplex_kv_blocks_free", "Free KV cache blocks", registry=r)
        self.kv_usage = Gauge("loraplex_kv_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.slots_total = Gauge("loraplex_lora_slots_total", "GPU adapter slots", registry=r)
        self.slots_used = Gauge("loraplex_lora_slots_used", "GPU adapter slots in use", registry=r)
        self.residency = Gauge(
            "loraplex_adapter_resident", "1 where the adapter lives (gpu/host/store)", ["adapter", "location"], registry=r
        )
        self.adapter_loads = Counter("loraplex_adapter_loads", "Adapter loads into the engine", ["adapter"], registry=r)
        self.adapter_evictions = Counter(
            "loraplex_adapter_evictions",
            "Times the adapter's GPU slot was given to another adapter",
            ["adapter"],
            registry=r,
        )
        self.adapter_requests = Counter(
            "loraplex_adapter_requests", "Requests naming the adapter", ["adapter"], registry=r
        )
        self.prefix_cache_enabled = Gauge(
            "loraplex_prefix_cache_enabled", "1 when the prefix cache is on (off: --disable-prefix-cache)", registry=r
        )
        self.prefix_cache_blocks = Gauge(
            "loraplex_prefix_cache_blocks", "KV blocks indexed by the prefix cache (held or evictable)", registry=r
        )
        self.prefix_cache_evictions = Counter(
            "loraplex_prefix_cache_evictions", "Cached KV blocks evicted to make room", registry=r
        )
        self.prefix_cache_prompt_tokens = Counter(
            "loraplex_prefix_cache_prompt_tokens", "Prompt tokens of admitted requests", ["adapter"], registry=r
        )
        self.prefix_cache_hit_tokens = Counter(
            "loraplex_prefix_cache_hit_tokens",
            "Prompt tokens whose KV was reused from the prefix cache (computed by the same content)",
            ["adapter"],
            registry=r,
        )
        self.store_pulls = Counter("loraplex_store_pulls", "Adapters pulled from the adapter store", registry=r)
        self.store_pull_bytes = Counter("loraplex_store_pull_bytes", "Bytes pulled from the adapter store", registry=r)
        self.triton_compiles = Counter(
            "loraplex_triton_compiles_after_start",
            "Triton kernel compilations after start-up (each stalls the engine thread; 0 in steady state)",
            registry=r,
        )
        self._compiles_seen = 0
        self._last_location: dict[str, str] = {}
        self._last_evictions: dict[str, int] = {}
        self._last_engine_totals: dict[str, int] = {}

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP exporter on a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def observe_compiles(self, after_start: int) -> None:
        """Export `kernels.compile_watch.compile_counter.after_start` (a running total)."""
        if after_start > self._compiles_seen:
            self.triton_compiles.inc(after_start - self._compiles_seen)
            self._compiles_seen = after_start

    def observe_engine(self, stats: EngineStats) -> None:
        self.queue_waiting.set(stats.waiting)
        self.running.set(stats.running)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_blocks_free.set(stats.kv_blocks_free)
        used = stats.kv_blocks_total - stats.kv_blocks_free
        self.kv_usage.set(used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        self.slots_total.set(stats.lora_slots_total)
        self.slots_used.set(stats.lora_slots_used)
        self.prefix_cache_enabled.set(1 if stats.prefix_cache_enabled else 0)
        self.prefix_cache_blocks.set(stats.prefix_cache_blocks)
        self._follow(self.prefix_cache_evictions, "evictions", stats.prefix_cache_evictions)
        for name, total in stats.prefix_cache_prompt_tokens.items():
            self._follow(self.prefix_cache_prompt_tokens.labels(adapter_label(name)), "prompt:" + name, total)
        for name, total in stats.prefix_cache_hit_tokens.items():
            self._follow(self.prefix_cache_hit_tokens.labels(adapter_label(name)), "hit:" + name, total)

    def _follow(self, counter, key: str, total: int) -> None:
        """Advance `counter` to the engine's running total named `key`."""
        delta = total - self._last_engine_totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last_engine_totals[key] = total

    def observe_adapters(self, adapters: list[AdapterInfo]) -> None:
        seen: dict[str, str] = {}
        for info in adapters:
            seen[info.name] = info.location
            for loc in LOCATIONS:
                self.residency.labels(info.name, loc).set(1 if info.location == loc else 0)
        for info in adapters:  # the manager counts evictions; the counter follows its total
            delta = info.evictions - self._last_evictions.get(info.name, 0)
            if delta > 0:
                self.adapter_evictions.labels(info.name).inc(delta)
            self._last_evictions[info.name] = info.evictions
        for name in self._last_location:
            if name not in seen:
                for gone in LOCATIONS:
                    self.residency.labels(name, gone).set(0)
        self._last_location = seen
