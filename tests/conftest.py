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


def _build_quietly(job):
    """One NVRTC build into the session's kernel cache (a pool worker); a failure is left for the
    test of that kernel to raise and name."""
    name, arch, root = job
    from ddtree_rtc.kernels.registry import SPECS
    from ddtree_rtc.rtc import build
    from ddtree_rtc.rtc.cache import ModuleCache

    try:
        build(SPECS[name], arch, cache=ModuleCache(root))
    except Exception:  # noqa: BLE001 - the test that builds this kernel reports it
        pass


@pytest.fixture(scope="session")
def nvrtc_prebuilt(tmp_path_factory):
    """Every registered kernel built for every supported arch once per session, on all cores at
    once, into the cache the tests read (``_isolated_cache``). The tests still call ``build`` and
    check what it returns; only the wall time of the compiles is shared."""
    import multiprocessing as mp

    from ddtree_rtc.kernels.registry import SPECS
    from ddtree_rtc.rtc import SUPPORTED_ARCHS

    root = str(tmp_path_factory.getbasetemp() / "kcache")
    jobs = [(name, arch, root) for name in sorted(SPECS) for arch in SUPPORTED_ARCHS]
    with mp.get_context("spawn").Pool(max(1, os.cpu_count() or 1)) as pool:
        pool.map(_build_quietly, jobs, chunksize=1)
