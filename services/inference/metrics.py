"""Recording the inference service's Prometheus metrics (defined in metric_families.py),
served on `--metrics-port` (metrics_http.py).

Request-path metrics are recorded by the servicer as events happen; engine gauges (queue,
KV, slots, per-adapter residency) are refreshed from `engine.stats()` / `list_adapters()`
once a second by the server (the `observe_*` methods), so a scrape never touches the engine
thread.

Per-adapter series are bounded: at most `max_adapter_series` adapter names (default 256,
`--metrics-max-adapters`) have series of their own, first come first served; traffic of any
other adapter is counted under the label `_other`. An adapter's series (and this module's state
for it) are removed at the first refresh after it is neither loaded in the engine nor has
requests in flight here (a store delete, an unload), which frees its place for another name.
Adapters that live only in the store get residency rows only while they have requests here;
`loraplex_store_adapters` counts them. Queue time and uploads are also counted by the adapter's
popularity decile (issue 34), eleven labels however many adapters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from loraplex.services.inference.engine.types import EngineStats
from loraplex.services.inference.lora.adapter_slots import AdapterInfo
from loraplex.services.inference.metric_families import MetricFamilies
from loraplex.services.inference.metrics_http import serve_registry

log = logging.getLogger(__name__)

LOCATIONS = ("gpu", "host", "store")


OTHER = "_other"  # adapter names start with a letter or digit, so no adapter is called this
DEFAULT_MAX_ADAPTER_SERIES = 256


class Metrics(MetricFamilies):
    """One server's metric families and what recording into them keeps: which adapters have series
    of their own, and the engine's running totals seen so far (its counters follow them)."""

    def __init__(self, replica: str = "", max_adapter_series: int = DEFAULT_MAX_ADAPTER_SERIES) -> None:
        self.replica = replica
        self.max_adapter_series = max_adapter_series
        self._named: set[str] = set()  # adapters with series of their own (at most max_adapter_series)
        # names loaded or busy on this server (set by the server): label() prunes with it when full
        self.live_names: Callable[[], set[str]] | None = None
        super().__init__()
        self._compiles_seen = 0
        self._last_location: dict[str, str] = {}
        self._fleet_names: set[str] = set()
        self._last_evictions: dict[str, int] = {}
        self._last_uploads: dict[str, int] = {}
        self._last_host: dict[str, int] = {}  # "hit:NAME" / "miss:NAME" -> the manager's total
        self._last_engine_totals: dict[str, int] = {}
        self._popularity: dict[str, int] = {}  # requests per adapter name so far

    # -- bounded adapter labels --------------------------------------------------------------
    def label(self, adapter: str | None) -> str:
        """The adapter's label: its name while fewer than `max_adapter_series` names have one, else
        `_other`; no adapter is "base"."""
        if not adapter:
            return "base"
        if adapter in self._named:
            return adapter
        if len(self._named) >= self.max_adapter_series and self.live_names is not None:
            self.prune(self.live_names())  # make room now rather than at the next refresh
        if len(self._named) < self.max_adapter_series:
            self._named.add(adapter)
            return adapter
        return OTHER

    def _per_adapter(self) -> tuple:
        return (
            self.prompt_tokens,
            self.completion_tokens,
            self.adapter_slot_wait,
            self.adapter_uploads,
            self.adapter_loads,
            self.adapter_evictions,
            self.adapter_requests,
            self.prefix_cache_prompt_tokens,
            self.prefix_cache_hit_tokens,
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
        )

    def prune(self, live: set[str]) -> list[str]:
        """Remove the series and state of every named adapter not in `live` (loaded in the engine or
        with requests in flight here); returns the names removed."""
        gone = sorted(self._named - live)
        if len(self._named) - len(gone) < self.max_adapter_series // 2:
            gone.append(OTHER)  # little pressure: the overflow bucket goes too (restarts at 0 if needed)
        for name in gone:
            for metric in self._per_adapter():
                _remove(metric, name)
            _remove(self.requests, name, "OK")
            for loc in LOCATIONS:
                _remove(self.residency, name, loc)
                _remove(self.adapter_location, self.replica, name, loc)
            _remove(self.adapter_queued, self.replica, name)
            self._named.discard(name)
            self._last_location.pop(name, None)
            self._fleet_names.discard(name)
        # per-name totals are kept for every adapter, named series or not
        for state in (self._last_evictions, self._last_uploads, self._popularity):
            for name in state.keys() - live:
                del state[name]
        for key in [k for k in self._last_host if k.split(":", 1)[1] not in live]:
            del self._last_host[key]
        return gone

    def adapter_series(self) -> int:
        """How many per-adapter series exist now (for tests and the churn check)."""
        families = (
            *self._per_adapter(),
            self.requests,
            self.residency,
            self.adapter_location,
            self.adapter_queued,
        )
        return sum(len(m._metrics) for m in families)  # prometheus_client keeps one child per label set

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP exporter on a daemon thread; returns the bound port (metrics_http.py)."""
        return serve_registry(self.registry, host, port)

    def observe_compiles(self, after_start: int) -> None:
        """Export `loraplex.kernels.compile_watch.compile_counter.after_start` (a running total)."""
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
        self.slots_draining.set(stats.lora_slots_draining)
        self.adapters_waiting.set(stats.lora_adapters_waiting)
        self.requests_suspended.set(stats.lora_requests_suspended)
        self._follow(self.suspensions, "lora_suspensions", stats.lora_suspensions)
        self.prefix_cache_enabled.set(1 if stats.prefix_cache_enabled else 0)
        self.prefix_cache_blocks.set(stats.prefix_cache_blocks)
        self._follow(self.prefix_cache_evictions, "evictions", stats.prefix_cache_evictions)
        reported = {"evictions", "lora_suspensions"}
        for kind, metric, totals in (
            ("prompt:", self.prefix_cache_prompt_tokens, stats.prefix_cache_prompt_tokens),
            ("hit:", self.prefix_cache_hit_tokens, stats.prefix_cache_hit_tokens),
            ("drafted:", self.spec_draft_tokens, stats.spec_draft_tokens),
            ("accepted:", self.spec_accepted_tokens, stats.spec_accepted_tokens),
        ):
            for name, total in totals.items():
                key = kind + name
                reported.add(key)
                delta = total - self._last_engine_totals.get(key, 0)
                self._last_engine_totals[key] = total
                if delta > 0:
                    metric.labels(self.label(name)).inc(delta)
        for key in self._last_engine_totals.keys() - reported:
            del self._last_engine_totals[key]

    def _follow(self, counter, key: str, total: int) -> None:
        """Advance `counter` to the engine's running total named `key`."""
        delta = total - self._last_engine_totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last_engine_totals[key] = total

    def observe_adapters(self, adapters: list[AdapterInfo]) -> None:
        seen: dict[str, str] = {}
        for info in adapters:
            label = self.label(info.name)
            if label == OTHER:
                continue  # a gauge of "some adapter" says nothing
            seen[info.name] = info.location
            for loc in LOCATIONS:
                self.residency.labels(label, loc).set(1 if info.location == loc else 0)
            self.adapter_slot_wait.labels(label).set(info.slot_wait_s)
        for info in adapters:  # the manager counts evictions and uploads; the counters follow its totals
            label = self.label(info.name)
            delta = info.evictions - self._last_evictions.get(info.name, 0)
            if delta > 0:
                self.adapter_evictions.labels(label).inc(delta)
                self.swaps.inc(delta)
            delta = info.uploads - self._last_uploads.get(info.name, 0)
            if delta > 0:
                self.adapter_uploads.labels(label).inc(delta)
                self.uploads.inc(delta)
                self.upload_bytes.inc(delta * info.nbytes)
                self.uploads_by_decile.labels(self._decile_of(info.name)).inc(delta)
            for counter, key, total in (
                (self.host_hits, "hit:", info.host_hits),
                (self.host_misses, "miss:", info.host_misses),
            ):
                delta = total - self._last_host.get(key + info.name, 0)
                if delta > 0:
                    counter.inc(delta)
                self._last_host[key + info.name] = total
            # kept for "_other" adapters too (else their whole total counts again every refresh);
            # prune drops it once the adapter is gone
            self._last_evictions[info.name] = info.evictions
            self._last_uploads[info.name] = info.uploads
        for name in self._last_location:
            if name not in seen and name in self._named:
                for gone in LOCATIONS:
                    self.residency.labels(name, gone).set(0)
                self.adapter_slot_wait.labels(name).set(0)
        self._last_location = seen

    def observe_residency(
        self,
        adapters: list[AdapterInfo],
        store_only: Iterable[str],
        in_flight: Mapping[str, int],
        max_lora: int,
    ) -> None:
        """Per adapter on this replica: where it lives and how many of its requests wait for a slot
        (requests the server holds minus those running on a slot), and the vLLM-shaped summary."""
        rows: dict[str, tuple[str, int]] = {}
        running, waiting = [], []
        for info in adapters:
            # the scheduler's queue, or more while the server still resolves or pulls the adapter
            queued = max(info.queued_requests, in_flight.get(info.name, 0) - info.requests_in_flight, 0)
            rows[info.name] = (info.location, queued)
            if info.requests_in_flight > 0:
                running.append(info.name)
            if queued > 0:
                waiting.append(info.name)
        idle_in_store = 0
        for name in store_only:
            if name not in rows:
                if in_flight.get(name, 0) > 0:
                    rows[name] = ("store", in_flight[name])
                    waiting.append(name)
                else:
                    idle_in_store += 1
        self.store_adapters.set(idle_in_store)
        rows = {n: row for n, row in rows.items() if self.label(n) != OTHER}
        for name in self._fleet_names - rows.keys():
            for loc in LOCATIONS:
                self.adapter_location.remove(self.replica, name, loc)
            self.adapter_queued.remove(self.replica, name)
        for name, (location, queued) in rows.items():
            for loc in LOCATIONS:
                self.adapter_location.labels(self.replica, name, loc).set(1 if loc == location else 0)
            self.adapter_queued.labels(self.replica, name).set(queued)
        self._fleet_names = set(rows)
        self.lora_info.clear()
        self.lora_info.labels(str(max_lora), ",".join(sorted(running)), ",".join(sorted(waiting))).set(
            time.time()
        )

    # -- adapter fairness (issue 34): popularity deciles --------------------------------------
    def popularity_decile(self, adapter: str | None) -> str:
        """Count one request of `adapter` and return its decile among adapters by requests so far."""
        if not adapter:  # None or "" (the base model)
            return "base"
        counts = self._popularity
        counts[adapter] = mine = counts.get(adapter, 0) + 1
        ahead = sum(1 for c in counts.values() if c > mine)
        return str(ahead * 10 // len(counts))

    def _decile_of(self, adapter: str) -> str:
        """`adapter`'s popularity decile now, without counting a request."""
        counts = self._popularity
        if adapter not in counts:
            return "9"  # no request seen yet: the coldest
        ahead = sum(1 for c in counts.values() if c > counts[adapter])
        return str(ahead * 10 // len(counts))

    def observe_queue_time(self, adapter: str | None, seconds: float) -> None:
        """One request's queue time (RequestOutput.queue_time), labelled by its adapter's decile."""
        self.queue_by_decile.labels(self.popularity_decile(adapter)).observe(seconds)


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
