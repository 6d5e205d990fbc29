"""A request whose values turn NaN cannot reach another request's rows (issue 59, H3 (b)): the torch
path, in process. The CUDA path's kernels run the same check under the interpreter in
tests/integration/test_nan_containment_triton.py."""

from __future__ import annotations

import pytest

from tests.support.nan_containment_check import SHAPES, check


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_nan_slot_and_stale_pages_stay_in_their_rows(model, one_torch_thread):
    assert check(model, triton=False) == []
