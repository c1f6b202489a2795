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


@pytest.fixture(scope="session")
def load_tool():
    """A script of tools/ (not a package) as a module: ``load_tool("node_summary")``."""
    import importlib.util
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load


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


def _yield_the_cpu():
    """A pool worker's initializer: the lowest CPU priority, in its own session and autogroup too, so
    the builds take only what the tests leave idle (a test's own processes keep their CPU)."""
    try:
        os.setsid()
        with open("/proc/self/autogroup", "w") as f:  # where the scheduler groups by session
            f.write("19")
    except OSError:
        pass
    os.nice(19)


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


@pytest.fixture(scope="session", autouse=True)
def _nvrtc_background(request, tmp_path_factory):
    """Where the session holds tests of ``nvrtc_prebuilt``: every registered kernel is built for every
    supported arch from the session's start, by low-priority workers on all cores, into the cache the
    tests read (``_isolated_cache``), while the tests before them run."""
    if not any("nvrtc_prebuilt" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    import multiprocessing as mp

    from ddtree_rtc.kernels.registry import SPECS
    from ddtree_rtc.rtc import SUPPORTED_ARCHS

    root = str(tmp_path_factory.getbasetemp() / "kcache")
    jobs = [(name, arch, root) for name in sorted(SPECS) for arch in SUPPORTED_ARCHS]
    pool = mp.get_context("spawn").Pool(max(1, os.cpu_count() or 1), initializer=_yield_the_cpu)
    try:
        yield pool.map_async(_build_quietly, jobs, chunksize=1)
    finally:
        pool.terminate()
        pool.join()


@pytest.fixture(scope="session")
def nvrtc_prebuilt(_nvrtc_background):
    """Waits for the background builds (``_nvrtc_background``). The tests still call ``build`` and
    check what it returns; only the wall time of the compiles is shared."""
    _nvrtc_background.get(timeout=3600)
