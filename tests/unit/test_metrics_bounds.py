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
