"""Adapters past the named-series bound count under `_other`, once: the counters follow the manager's
totals by delta, so an `_other` adapter's total must not be added again at every refresh; and the
per-name totals behind those deltas go with the adapter."""

from __future__ import annotations

from loraplex.services.inference.lora.adapter_slots import AdapterInfo
from loraplex.services.inference.metrics import OTHER, Metrics


def _info(name: str, evictions: int, uploads: int) -> AdapterInfo:
    return AdapterInfo(name, 4, 8.0, ["q_proj"], "gpu", evictions=evictions, uploads=uploads)


def test_other_adapters_count_each_upload_once_and_leave_no_state():
    metrics = Metrics(max_adapter_series=1)
    value = metrics.registry.get_sample_value
    loaded = [_info("named", 0, 1), _info("overflow", 1, 2)]
    for _ in range(3):  # three refreshes with unchanged totals
        metrics.observe_adapters(loaded)
    assert metrics.label("overflow") == OTHER
    assert value("loraplex_adapter_uploads_total", {"adapter": OTHER}) == 2
    assert value("loraplex_adapter_evictions_total", {"adapter": OTHER}) == 1
    metrics.prune({"named"})  # "overflow" unloaded
    assert "overflow" not in metrics._last_uploads and "overflow" not in metrics._last_evictions


def test_metrics_port_answers_metrics_only():
    """A health check pointed at the metrics port must not read 200 (it answered every path)."""
    import urllib.error
    import urllib.request

    port = Metrics().serve("127.0.0.1", 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200 and b"loraplex_" in resp.read()
    for path in ("/health", "/", "/metricsx"):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
        else:
            raise AssertionError(f"{path} answered 200")


def test_host_tier_and_upload_bytes_follow_the_manager_totals_once():
    metrics = Metrics()
    value = metrics.registry.get_sample_value
    for _ in range(2):
        metrics.popularity_decile("hot")
    metrics.popularity_decile("cold")
    hot = AdapterInfo("hot", 4, 8.0, ["q_proj"], "gpu", uploads=3, host_hits=2, host_misses=1, nbytes=100)
    cold = AdapterInfo("cold", 4, 8.0, ["q_proj"], "host", uploads=1, host_hits=1, nbytes=50)
    for _ in range(2):  # a refresh with unchanged totals adds nothing
        metrics.observe_adapters([hot, cold])
    assert value("loraplex_lora_upload_bytes_total") == 3 * 100 + 50
    assert value("loraplex_lora_host_tier_hits_total") == 3
    assert value("loraplex_lora_host_tier_misses_total") == 1
    assert value("loraplex_lora_uploads_by_decile_total", {"popularity_decile": "0"}) == 3
    assert value("loraplex_lora_uploads_by_decile_total", {"popularity_decile": "5"}) == 1
    metrics.prune({"hot"})
    assert not any(k.endswith(":cold") for k in metrics._last_host)


def test_suspensions_follow_the_engine_total_once():
    from loraplex.services.inference.engine.types import EngineStats

    metrics = Metrics()
    value = metrics.registry.get_sample_value
    for total in (3, 3, 5):  # an unchanged total adds nothing
        metrics.observe_engine(
            EngineStats(0, 4, 10, 10, 2, 2, lora_suspensions=total, lora_requests_suspended=2)
        )
    assert value("loraplex_lora_suspensions_total") == 5
    assert value("loraplex_lora_requests_suspended") == 2
