"""The runtime on a real GPU: arch detection, loading cubins through CuPy, and the resource counts
read from the cubin agreeing with what the driver reports for the loaded function."""

import json

import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.gpu


def test_detected_arch_matches_device():
    import cupy

    from ddtree_rtc.rtc import arch_for_compute_capability, detect_arch

    cc = cupy.cuda.Device().compute_capability
    assert detect_arch() == arch_for_compute_capability(int(cc[:-1]), int(cc[-1]))


def test_info_reports_gpu_and_arch():
    from ddtree_rtc.cli import main

    res = CliRunner().invoke(main, ["info", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["backend"] == "cuda" and data["gpu"] and data["arch"].startswith("sm_")


def test_cubin_resources_match_driver():
    from cuda.bindings import driver

    from ddtree_rtc.kernels.registry import SPECS, module

    attr = driver.CUfunction_attribute
    for name in ("rmsnorm", "bench_ceiling"):
        mod = module(name)
        for entry in SPECS[name].entries:
            fn = driver.CUfunction(mod.fn(entry).ptr)
            err, regs = driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)
            assert int(err) == 0
            err, smem = driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn)
            res = mod.built.resources[entry]
            assert regs == res["registers"], (name, entry, regs, res)
            assert smem == res["shared"], (name, entry, smem, res)


def test_backend_auto_picks_cuda():
    from ddtree_rtc.backend import Backend

    be = Backend("auto")
    assert be.is_cuda and be.arch is not None
