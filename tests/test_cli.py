import json

import numpy as np
import pytest
from click.testing import CliRunner

from ddtree_rtc.backend import Backend
from ddtree_rtc.cli import BENCHMARKS, main
from ddtree_rtc.kernels.registry import SPECS


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_help_on_every_command():
    for args in ([], ["info"], ["kernels"], ["kernels", "list"], ["kernels", "build"], ["kernels", "dump"],
                 ["kernels", "clear-cache"], ["bench"]):
        res = run(*args, "--help")
        assert res.exit_code == 0, (args, res.output)
        assert "Usage:" in res.output and len(res.output.splitlines()) > 3


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_help_reaches_the_benchmark(name):
    res = run("bench", name, "--help")
    assert res.exit_code == 0, res.output
    assert f"usage: ddtree-rtc bench {name}" in res.output and "--json" in res.output
    if name in ("attention", "moe", "topk", "tree"):  # a kernel's variants side by side: one command
        assert "--variants" in res.output


def test_bench_unknown_name_is_refused():
    res = run("bench", "nope")
    assert res.exit_code == 2 and "'nope' is not one of" in res.output


def test_info_json():
    res = run("info", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["backend"] in ("cuda", "numpy")
    assert data["nvrtc"][0].isdigit()
    if data["backend"] == "numpy":
        assert data["note"] == "no GPU: numpy backend"


def test_kernels_list_names_every_family():
    res = run("kernels", "list")
    assert res.exit_code == 0
    for name in SPECS:
        assert name in res.output


def test_kernels_build_table(tmp_path):
    out = tmp_path / "build.json"
    res = run("kernels", "build", "--arch", "sm_120a", "--only", "rmsnorm", "--json", str(out))
    assert res.exit_code == 0, res.output
    assert "rmsnorm_kernel" in res.output and "spill" in res.output
    rows = json.loads(out.read_text())
    assert rows[0]["arch"] == "sm_120a" and rows[0]["registers"] > 0


def test_dump_sass_and_ptx(tmp_path):
    res = run("kernels", "dump", "rmsnorm", "--arch", "sm_103a", "--sass")
    assert res.exit_code == 0, res.output
    assert "rmsnorm_kernel" in res.output and ("FFMA" in res.output or "FMUL" in res.output)
    out = tmp_path / "r.ptx"
    res = run("kernels", "dump", "rmsnorm", "--arch", "sm_90a", "--ptx", "-o", str(out))
    assert res.exit_code == 0, res.output
    assert ".entry rmsnorm_kernel" in out.read_text()


def test_bad_names_give_clear_errors():
    res = run("kernels", "dump", "no_such_kernel", "--arch", "sm_90a")
    assert res.exit_code != 0 and "unknown kernel 'no_such_kernel'" in res.output
    res = run("kernels", "build", "--arch", "sm_80")
    assert res.exit_code != 0 and "sm_80" in res.output
    res = run("kernels", "build", "--only", "nope", "--arch", "sm_90a")
    assert res.exit_code == 2 and "unknown kernel 'nope'" in res.output


def test_numpy_backend_dispatches_to_reference():
    from ml_dtypes import bfloat16

    from ddtree_rtc.reference.rmsnorm import rmsnorm as ref

    be = Backend("numpy")
    assert be.rmsnorm is ref
    x = np.ones((2, 8), dtype=bfloat16)
    assert be.asarray(x).dtype == bfloat16
    assert be.empty((3,), "bf16").dtype == bfloat16
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        be.nope  # noqa: B018
    with pytest.raises(ValueError, match="backend must be"):
        Backend("tpu")
