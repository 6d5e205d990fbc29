"""Every Prometheus metric the inference service exports: its name, help text, labels, buckets.

The one place to read what a scrape of `--metrics-port` shows (docs/operations.md, "Metrics",
explains each); metrics.py records into them and keeps their per-adapter series bounded.
Registration order here is the exposition's order.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class MetricFamilies:
    """One registry per server and every metric family in it, as attributes; names are prefixed
    `loraplex_`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "loraplex_requests",
            "Generation requests (one per input) by adapter and outcome",
            ["adapter", "code"],
            registry=r,
        )
        self.rpcs = Counter(
            "loraplex_rpcs", "RPCs handled, by method and status code", ["method", "code"], registry=r
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens", "Prompt tokens admitted", ["adapter"], registry=r
        )
        self.completion_tokens = Counter(
            "loraplex_completion_tokens", "Tokens generated", ["adapter"], registry=r
        )
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "loraplex_inter_token_latency_seconds",
            "Time between output tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.aborted = Counter(
            "loraplex_aborted_requests",
            "Engine requests aborted (client cancel, deadline, error)",
            ["reason"],
            registry=r,
        )
        self.queue_waiting = Gauge("loraplex_queue_waiting", "Requests waiting in the scheduler", registry=r)
        self.running = Gauge("loraplex_requests_running", "Requests running in the engine", registry=r)
        self.kv_blocks_total = Gauge("loraplex_kv_blocks_total", "KV cache blocks", registry=r)
        self.kv_blocks_free = Gauge("loraplex_kv_blocks_free", "Free KV cache blocks", registry=r)
        self.kv_usage = Gauge("loraplex_kv_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.slots_total = Gauge("loraplex_lora_slots_total", "GPU adapter slots", registry=r)
        self.slots_used = Gauge("loraplex_lora_slots_used", "GPU adapter slots in use", registry=r)
        self.slots_draining = Gauge(
            "loraplex_lora_slots_draining",
            "Busy slots taking no new requests until they empty for a waiting adapter",
            registry=r,
        )
        self.adapters_waiting = Gauge(
            "loraplex_lora_adapters_waiting", "Adapters waiting for a GPU slot", registry=r
        )
        self.requests_suspended = Gauge(
            "loraplex_lora_requests_suspended",
            "Running requests that gave their GPU slot up for a waiting adapter (KV kept) and wait to resume",
            registry=r,
        )
        self.suspensions = Counter(
            "loraplex_lora_suspensions",
            "Running requests that gave their GPU slot up for a waiting adapter",
            registry=r,
        )
        self.adapter_slot_wait = Gauge(
            "loraplex_adapter_slot_wait_seconds",
            "How long the adapter has been waiting for a GPU slot (0: not waiting)",
            ["adapter"],
            registry=r,
        )
        self.adapter_uploads = Counter(
            "loraplex_adapter_uploads",
            "Times the adapter was copied into a GPU slot",
            ["adapter"],
            registry=r,
        )
        self.residency = Gauge(
            "loraplex_adapter_resident",
            "1 where the adapter lives (gpu/host/store)",
            ["adapter", "location"],
            registry=r,
        )
        self.adapter_loads = Counter(
            "loraplex_adapter_loads", "Adapter loads into the engine", ["adapter"], registry=r
        )
        self.adapter_evictions = Counter(
            "loraplex_adapter_evictions",
            "Times the adapter's GPU slot was given to another adapter",
            ["adapter"],
            registry=r,
        )
        self.adapter_requests = Counter(
            "loraplex_adapter_requests", "Requests naming the adapter", ["adapter"], registry=r
        )
        # For routers that score replicas by adapter residency (docs/operations.md, "Residency").
        self.adapter_location = Gauge(
            "loraplex_adapter_location",
            "1 for where the adapter lives on this replica: gpu (a slot), host (memory) or store "
            "(only there)",
            ["replica", "adapter", "location"],
            registry=r,
        )
        self.adapter_queued = Gauge(
            "loraplex_adapter_queued_requests",
            "Requests for the adapter on this replica waiting for a GPU slot",
            ["replica", "adapter"],
            registry=r,
        )
        self.lora_info = Gauge(
            "loraplex_lora_requests_info",
            "vllm:lora_requests_info's shape: adapters with running / waiting requests (comma-separated) and "
            "the GPU slots; the value is the refresh time (unix seconds)",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
        self.prefix_cache_enabled = Gauge(
            "loraplex_prefix_cache_enabled",
            "1 when the prefix cache is on (off: --disable-prefix-cache)",
            registry=r,
        )
        self.prefix_cache_blocks = Gauge(
            "loraplex_prefix_cache_blocks",
            "KV blocks indexed by the prefix cache (held or evictable)",
            registry=r,
        )
        self.prefix_cache_evictions = Counter(
            "loraplex_prefix_cache_evictions", "Cached KV blocks evicted to make room", registry=r
        )
        self.prefix_cache_prompt_tokens = Counter(
            "loraplex_prefix_cache_prompt_tokens",
            "Prompt tokens of admitted requests",
            ["adapter"],
            registry=r,
        )
        self.prefix_cache_hit_tokens = Counter(
            "loraplex_prefix_cache_hit_tokens",
            "Prompt tokens whose KV was reused from the prefix cache (computed by the same content)",
            ["adapter"],
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "loraplex_spec_draft_tokens",
            "Speculative draft tokens verified (--speculative-algorithm)",
            ["adapter"],
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "loraplex_spec_accepted_tokens",
            "Speculative draft tokens accepted by verification",
            ["adapter"],
            registry=r,
        )
        self.store_adapters = Gauge(
            "loraplex_store_adapters",
            "Adapters the store has that are neither loaded here nor have requests here",
            registry=r,
        )
        self.store_pulls = Counter(
            "loraplex_store_pulls", "Adapters pulled from the adapter store", registry=r
        )
        self.store_pull_bytes = Counter(
            "loraplex_store_pull_bytes", "Bytes pulled from the adapter store", registry=r
        )
        self.triton_compiles = Counter(
            "loraplex_triton_compiles_after_start",
            "Triton kernel compilations after start-up (each stalls the engine thread; 0 in steady state)",
            registry=r,
        )
        # Adapter fairness (issue 34): queue time by popularity decile, swaps. Bounded series:
        # eleven decile labels ("0" hottest .. "9", "base"), however many adapters.
        self.queue_by_decile = Histogram(
            "loraplex_adapter_queue_seconds",
            "Arrival to first scheduled, by the adapter's popularity decile on this replica "
            "(0: the most requested tenth of adapters so far; base: no adapter)",
            ["popularity_decile"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.swaps = Counter(
            "loraplex_lora_swaps",
            "Resident adapters replaced in a GPU slot (each costs an upload; rate() is swaps per second)",
            registry=r,
        )
        self.uploads = Counter("loraplex_lora_uploads", "Adapters copied into a GPU slot", registry=r)
        self.uploads_by_decile = Counter(
            "loraplex_lora_uploads_by_decile",
            "Adapters copied into a GPU slot, by the adapter's popularity decile (as queue_seconds)",
            ["popularity_decile"],
            registry=r,
        )
        self.upload_bytes = Counter(
            "loraplex_lora_upload_bytes",
            "Bytes of adapter weights copied host-to-GPU (rate() is bytes moved per second)",
            registry=r,
        )
        self.host_hits = Counter(
            "loraplex_lora_host_tier_hits",
            "Uploads served from the adapter's host copy (the host tier)",
            registry=r,
        )
        self.host_misses = Counter(
            "loraplex_lora_host_tier_misses",
            "Uploads that re-read the adapter from its source first (not in the host tier)",
            registry=r,
        )
