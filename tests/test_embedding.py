import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_rtc.reference.embedding import embedding as ref_embedding
from ddtree_rtc.testing import random_bf16


def test_reference_gathers_and_marks_bad_ids(rng):
    table = random_bf16(rng, (50, 12))
    ids = np.array([3, 0, 49, -1, 50, 2**31 - 1, 3], dtype=np.int32)
    y = ref_embedding(ids, table)
    for r, i in enumerate(ids):
        if 0 <= i < 50:
            assert np.array_equal(y[r].view(np.uint16), table[i].view(np.uint16))
        else:
            assert np.isnan(y[r].astype(np.float32)).all()
    out = np.zeros((7, 12), dtype=bfloat16)
    assert ref_embedding(ids, table, out=out) is out
    assert ref_embedding(np.zeros(0, np.int32), table).shape == (0, 12)


CASES = [(1, 1000, 7168), (5, 163, 128), (7, 50, 7), (33, 4, 8), (3, 10, 1030)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,vocab,dim", CASES)
def test_kernel_vs_reference(rng, n, vocab, dim):
    import cupy

    from ddtree_rtc.kernels.embedding import embedding

    table = random_bf16(rng, (vocab, dim))
    ids = rng.integers(0, vocab, n).astype(np.int32)
    if n > 2:
        ids[1], ids[-1] = -3, vocab  # out of range -> NaN rows
    unused = np.setdiff1d(np.arange(vocab), ids)
    table[unused] = np.nan  # rows nobody asked for: a wrong row shows up as NaN
    want = ref_embedding(ids, table)
    buf = cupy.full(n * dim + 64, 0x1234, dtype=cupy.uint16)  # finite sentinel: unwritten shows
    out = buf[: n * dim].reshape(n, dim)
    got = embedding(cupy.asarray(ids), cupy.asarray(table.view(np.uint16)), out=out)
    assert got is out
    assert np.array_equal(got.get(), want.view(np.uint16)), "embedding rows differ bit-wise"
    assert bool((buf[n * dim:] == 0x1234).all()), "wrote past the end of out"


@pytest.mark.gpu
def test_kernel_empty_and_bad_input():
    import cupy

    from ddtree_rtc.kernels.embedding import embedding

    table = cupy.zeros((10, 16), dtype=cupy.uint16)
    assert embedding(cupy.zeros(0, dtype=cupy.int32), table).shape == (0, 16)
    with pytest.raises(TypeError, match="ids: expected dtype int32"):
        embedding(cupy.zeros(3, dtype=cupy.int64), table)
    with pytest.raises(ValueError, match="out: expected shape"):
        embedding(cupy.zeros(3, dtype=cupy.int32), table, out=cupy.zeros((3, 8), dtype=cupy.uint16))
