"""NVRTC build of every registered kernel for every arch (no GPU needed), the spill check,
resource parsing and the on-disk cache."""

import json
import multiprocessing as mp

import pytest

from ddtree_rtc.kernels.registry import SPECS
from ddtree_rtc.rtc import SUPPORTED_ARCHS, ArchError, CompileError, KernelSpec, build, check_arch
from ddtree_rtc.rtc import builder as build_mod
from ddtree_rtc.rtc.arch import arch_for_compute_capability, compile_target
from ddtree_rtc.rtc.cache import ModuleCache


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_kernel_builds_without_spills(name, arch, nvrtc_prebuilt):
    spec = SPECS[name]
    built = build(spec, arch)
    assert built.target == compile_target(arch, spec.arch_specific)
    assert built.cubin[:4] == b"\x7fELF" and ".target" in built.ptx
    for entry in spec.entries:
        res = built.resources[entry]
        assert res["registers"] and res["registers"] > 0, (entry, res)
        spilled = (res["spill_stores"] or 0) + (res["spill_loads"] or 0)
        if spec.allow_spills is None:
            assert spilled == 0, f"{name}:{entry} spills {spilled} bytes on {arch}: {res}"


def test_arch_names():
    assert arch_for_compute_capability(9, 0) == "sm_90a"
    assert arch_for_compute_capability(10, 3) == "sm_103a"
    assert arch_for_compute_capability(12, 0) == "sm_120a"
    with pytest.raises(ArchError, match="compute capability 8.6"):
        arch_for_compute_capability(8, 6)
    with pytest.raises(ArchError, match="unsupported arch 'sm_80'"):
        check_arch("sm_80")
    assert compile_target("sm_90a", arch_specific=False) == "sm_90"


def _spec(tmp_path, body="out[0] = 1.0f;", name="probe"):
    src = tmp_path / "src"
    (src / "include").mkdir(parents=True, exist_ok=True)
    (src / "include" / "probe.cuh").write_text("#define PROBE_SCALE 2.0f\n")
    (src / f"{name}.cu").write_text(
        '#include "probe.cuh"\nextern "C" __global__ void probe_kernel(float* out) { ' + body + " }\n")
    return src, KernelSpec(name, ("probe_kernel",), "test probe")


def test_cache_hit_and_header_invalidation(tmp_path, monkeypatch):
    src, spec = _spec(tmp_path)
    monkeypatch.setenv("DDTREE_RTC_CUDA_SRC", str(src))
    cache = ModuleCache(tmp_path / "cache")
    first = build(spec, "sm_90a", cache=cache)
    again = build(spec, "sm_90a", cache=cache)
    assert not first.cached and again.cached and again.cubin == first.cubin
    (src / "include" / "probe.cuh").write_text("#define PROBE_SCALE 3.0f\n")
    assert not build(spec, "sm_90a", cache=cache).cached, "a header change must invalidate the entry"


def test_corrupt_entry_is_rebuilt(tmp_path, monkeypatch):
    src, spec = _spec(tmp_path)
    monkeypatch.setenv("DDTREE_RTC_CUDA_SRC", str(src))
    cache = ModuleCache(tmp_path / "cache")
    first = build(spec, "sm_100a", cache=cache)
    cubin = next(cache.root.glob("*.cubin"))
    cubin.write_bytes(b"garbage")
    rebuilt = build(spec, "sm_100a", cache=cache)
    assert not rebuilt.cached and rebuilt.cubin == first.cubin
    meta = next(cache.root.glob("*.json"))
    meta.write_text("{not json")
    assert not build(spec, "sm_100a", cache=cache).cached
    assert build(spec, "sm_100a", cache=cache).cached
    json.loads(meta.read_text())


def _build_in_child(src, cache_root, q):
    import os

    os.environ["DDTREE_RTC_CUDA_SRC"] = src
    spec = KernelSpec("probe", ("probe_kernel",), "test probe")
    b = build(spec, "sm_120a", cache=ModuleCache(cache_root))
    q.put((b.cached, b.cubin))


def test_concurrent_builds_make_one_valid_entry(tmp_path, monkeypatch):
    src, _ = _spec(tmp_path)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = (str(src), str(tmp_path / "cache"), q)
    procs = [ctx.Process(target=_build_in_child, args=args) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(c for c, _ in results) == [False, True], "exactly one process compiles, the other reads"
    assert results[0][1] == results[1][1]
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 1


def test_compile_error_shows_file_and_line(tmp_path, monkeypatch):
    src, spec = _spec(tmp_path, body="out[0] = undefined_name;")
    monkeypatch.setenv("DDTREE_RTC_CUDA_SRC", str(src))
    with pytest.raises(CompileError, match=r"probe\.cu\(2\).*undefined_name"):
        build(spec, "sm_90a", cache=ModuleCache(tmp_path / "cache"))


def test_unknown_param_and_missing_entry(tmp_path, monkeypatch):
    src, spec = _spec(tmp_path)
    monkeypatch.setenv("DDTREE_RTC_CUDA_SRC", str(src))
    with pytest.raises(KeyError, match="no compile-time parameter"):
        build(spec, "sm_90a", cache=ModuleCache(tmp_path / "cache"), BLOCK=4)
    bad = KernelSpec("probe", ("probe_kernel", "not_there"), "x")
    with pytest.raises(RuntimeError, match="not_there"):
        build(bad, "sm_90a", cache=ModuleCache(tmp_path / "cache2"))


def test_late_compile_is_an_error_when_asked(tmp_path, monkeypatch):
    src, spec = _spec(tmp_path)
    monkeypatch.setenv("DDTREE_RTC_CUDA_SRC", str(src))
    monkeypatch.setenv("DDTREE_RTC_NO_LATE_COMPILE", "1")
    build_mod.freeze()
    try:
        with pytest.raises(build_mod.LateCompileError):
            build(spec, "sm_90a", cache=ModuleCache(tmp_path / "cache"))
    finally:
        build_mod.unfreeze()


def test_resources_from_cubin_match_ptxas_log():
    from ddtree_rtc.rtc.cubin import resource_usage
    from ddtree_rtc.rtc.nvrtc import parse_ptxas_log

    for name, arch in (("rmsnorm", "sm_90a"), ("sampling", "sm_100a"), ("bench_ceiling", "sm_120a")):
        built = build(SPECS[name], arch)
        log = parse_ptxas_log(built.log)
        if not log:
            pytest.skip("this NVRTC leaves the -Xptxas=-v log empty")
        elf = resource_usage(built.cubin)
        for entry, r in log.items():
            assert (elf[entry]["registers"], elf[entry]["stack"], elf[entry]["shared"]) == \
                (r["registers"], r["stack"], r["shared"]), (name, arch, entry)


def test_empty_log_leaves_shared_bytes_alone():
    """A warning-free compile has a one-byte log (its NUL). NVRTC writes the log into the buffer it
    is given; that buffer once was `b" " * 1`, CPython's shared b" ", so every later b" " in the
    process read b"\\x00" (it corrupted the padding of safetensors headers written after a build)."""
    from ddtree_rtc.rtc.nvrtc import compile_cuda

    res = compile_cuda('extern "C" __global__ void k() {}', "empty_log.cu", {}, ["-std=c++17"], "sm_90")
    assert res.log.strip() == "" and res.cubin
    assert (b" " * 1)[0] == 0x20 and b"a b".split(b" ") == [b"a", b"b"]
