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


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny preset's random checkpoint (seed 5), written once per session; tests only read it."""
    from ddtree_rtc.model.config import preset_config
    from ddtree_rtc.model.make_model import make_model

    d = tmp_path_factory.mktemp("tiny_seed5")
    make_model(preset_config("tiny"), d, seed=5)
    return d


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """The tiny preset's model on the numpy backend (one per test module)."""
    from ddtree_rtc.backend import Backend
    from ddtree_rtc.model.target import TargetModel

    return TargetModel.load(tiny_dir, Backend("numpy"))


@pytest.fixture(scope="module")
def cont(tiny):
    """The tiny model's greedy continuation of every prompt (the oracle drafter's input)."""
    from ddtree_rtc.pipeline.runner import greedy_continuation

    return greedy_continuation(tiny, 40, 16)
