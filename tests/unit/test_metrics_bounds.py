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
