import os

import numpy as np
import pytest

from ddtree_rtc.backend import cuda_available

HAS_GPU = cuda_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU here (gpu tests run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh seed every run (printed on failure), so kernels meet new inputs each time."""
    seed = int(os.environ.get("DDTREE_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """One kernel cache per test session, never the user's."""
    monkeypatch.setenv("DDTREE_RTC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kcache"))
