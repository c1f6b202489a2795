"""The shared test helpers of ddtree_rtc/testing.py catch what they are there to catch (CPU)."""

import numpy as np
import pytest

from ddtree_rtc.testing import check_rows_invariant


def test_check_rows_invariant_passes_and_catches():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 5)).astype(np.float32)
    w = rng.standard_normal((7, 5)).astype(np.float32)
    kinds = [("fp32", "y"), ("fp32", "y2")]

    def reference(rows):
        return rows @ w.T, 2 * rows

    check_rows_invariant(lambda idx: reference(x[idx]), reference, x, rng, 9, kinds)
    with pytest.raises(AssertionError, match="y2: 9 rows differ"):  # a row that depends on the batch
        check_rows_invariant(lambda idx: (x[idx] @ w.T, 2 * x[idx] + 1e-7 * len(idx)), reference, x, rng, 9, kinds)
    with pytest.raises(AssertionError, match="y:"):  # off the reference
        check_rows_invariant(lambda idx: (x[idx] @ w.T + 1, 2 * x[idx]), reference, x, rng, 9, kinds)
