"""The inference adapter cache's bookings (issue 59 M5): a pull books its bytes before writing, and
what other pulls booked counts against the bound as if it were on disk already."""

from __future__ import annotations

import pytest

from loraplex.services.inference.adapter_cache import AdapterCache
from loraplex.services.inference.errors import CapacityExceeded
from tests.unit.test_adapter_cache_race import _content_dir


def test_a_booking_counts_until_released_and_evicts_for_the_next(tmp_path):
    cache = AdapterCache(tmp_path, max_bytes=1000)
    old = _content_dir(tmp_path, "a", 300)
    first = cache.reserve(600, "first", "b" * 64 + "-" + "0" * 64, in_use=set())
    assert first is not None and old.exists()  # 300 + 600 fit
    # 300 more fit only without the old directory: it is evicted for the booking.
    second = cache.reserve(300, "second", in_use=set())
    assert second is not None and not old.exists() and cache.reserved_bytes() == 900
    # 200 more fit only once a pull in progress ends: wait (None), never overshoot.
    assert cache.reserve(200, "third", in_use=set()) is None
    cache.release(second)
    assert cache.reserve(200, "third", in_use=set()) is not None


def test_with_nothing_booked_a_pull_that_cannot_fit_is_refused(tmp_path):
    cache = AdapterCache(tmp_path, max_bytes=1000)
    kept = _content_dir(tmp_path, "a", 600)
    with pytest.raises(CapacityExceeded, match="needs 500 bytes"):
        cache.reserve(500, "adapter 'x'", in_use={kept.name})
    with pytest.raises(CapacityExceeded, match="needs 1001 bytes"):
        cache.reserve(1001, "adapter 'y'", in_use=set())
    assert cache.reserved_bytes() == 0


def test_a_held_directory_is_kept_and_waited_for(tmp_path):
    """A directory handed to a loading caller (`hold`) is never evicted: a pull that fits only
    without it waits (None) until the hold ends, and a deleted adapter's discard leaves it too."""
    cache = AdapterCache(tmp_path, max_bytes=1000)
    loading = _content_dir(tmp_path, "a", 600)
    cache.hold(loading.name)
    assert cache.reserve(500, "next", in_use=set()) is None and loading.exists()
    assert not cache.discard(loading.name, in_use=set()) and loading.exists()
    cache.unhold(loading.name)
    assert cache.reserve(500, "next", in_use=set()) is not None and not loading.exists()
