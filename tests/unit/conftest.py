"""The unit tier's own fixtures (tests/conftest.py holds the shared ones)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="package")
def _unit_tier_on_one_torch_thread():
    """Every unit test runs with torch on one thread, as each pytest-xdist worker of `make test`
    already does (tests/conftest.py). The models here are tiny, so a second thread buys little on an
    idle machine, and on a shared 2-core machine under load two threads wait on each other: eight
    files of this tier that used torch's default took 22-45 s on two threads and 9-10 s on one
    (load ~3.5). Restored after the tier (a run of both tiers goes on with the default)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
