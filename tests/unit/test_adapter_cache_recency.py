"""The inference adapter cache's recency: an adapter used (hit or pulled) after another counts as more
recent even when both happen within one tick of the kernel's coarse file clock, so eviction follows
use, not the directories' names. (CI saw test_cache_stays_under_its_bound_evicting_least_recently_used
keep the wrong adapter: a pull landing right after a hit tied with it and the name decided.)"""

from __future__ import annotations

from loraplex.services.inference.adapter_cache import AdapterCache
from tests.unit.test_adapter_cache_race import _content_dir


def test_the_earlier_use_is_evicted_within_one_clock_tick(tmp_path):
    for round_ in range(20):  # back to back: most rounds fall within one tick of the kernel's clock
        root = tmp_path / str(round_)
        cache = AdapterCache(root, max_bytes=250)
        # "f..." sorts after "0...": a tie would evict the later-used "0..." first.
        used_first, used_last = _content_dir(root, "f", 100), _content_dir(root, "0", 100)
        cache.touch(used_first)
        cache.touch(used_last)
        assert cache.make_room(100, "a third adapter") == [used_first.name]


def test_stamps_rise_strictly(tmp_path):
    cache = AdapterCache(tmp_path, max_bytes=10_000)
    dirs = [_content_dir(tmp_path, tag, 100) for tag in "0123456789"]
    for d in dirs:
        cache.touch(d)
    stamps = [d.stat().st_mtime_ns for d in dirs]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
