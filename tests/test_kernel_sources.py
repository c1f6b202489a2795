"""Every CUDA entry in the package's sources is declared and has a launch site (CPU, static).

What this proves: each ``extern "C" __global__`` in ``ddtree_rtc/cuda_src/*.cu`` is listed by its
family's KernelSpec (and every listed entry exists in the source), and each one's name matches a
string literal or f-string (``{...}`` read as a name part) in the package's Python code outside the
registry: there is code that asks the module for it. What it cannot prove: that this code runs on a
default path; a launch site behind an option nobody passes would pass here. The wrappers keep no
such options (variants no default path reaches leave the package; benchmarks/README.md holds their
story), and the GPU tests run every launch site against its reference.
"""

import ast
import functools
import re
from pathlib import Path

import pytest

from ddtree_rtc.kernels.registry import SPECS
from ddtree_rtc.rtc.builder import source_dir

PACKAGE = Path(__file__).resolve().parents[1] / "ddtree_rtc"
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(')
_MACRO_ENTRY = re.compile(r"^(\w+_ENTRY)\((\w+)", re.M)  # NAME_ENTRY(entry_name, ...) instantiations


def source_entries(text: str) -> set[str]:
    """The entry names a .cu defines: direct definitions plus ``*_ENTRY(name, ...)`` macro uses
    (a macro whose body defines ``NAME(``)."""
    names = {m.group(1) for m in _ENTRY.finditer(text)}
    names.discard("NAME")  # the macro body itself
    return names | {m.group(2) for m in _MACRO_ENTRY.finditer(text)}


@functools.cache
def launch_patterns() -> tuple[re.Pattern, ...]:
    """Every name-like string literal of the package outside the registry, and every f-string that
    starts with a literal part, as a full-match regex (an f-string such as f"{name}" would match
    anything, so it proves nothing and is left out)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "registry.py" and path.parent.name == "kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.JoinedStr):
                if not (node.values and isinstance(node.values[0], ast.Constant) and node.values[0].value):
                    continue
                parts = [re.escape(v.value) if isinstance(v, ast.Constant) else r"\w+" for v in node.values]
                out.append(re.compile("".join(parts)))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                out.append(re.compile(re.escape(node.value)))
    return tuple(out)


def test_source_entries_match_the_registry():
    for name, spec in SPECS.items():
        text = (source_dir() / f"{spec.name}.cu").read_text()
        found = source_entries(text)
        assert set(spec.entries) == found, (
            f"{name}.cu: entries not in its KernelSpec {sorted(found - set(spec.entries))}, "
            f"KernelSpec entries not in the source {sorted(set(spec.entries) - found)}")


def test_every_cu_file_is_a_registered_family():
    families = {spec.name for spec in SPECS.values()}
    files = {p.stem for p in source_dir().glob("*.cu")}
    assert files == families, f"unregistered sources {sorted(files - families)}, missing {sorted(families - files)}"


@pytest.mark.parametrize("family", sorted(SPECS))
def test_every_entry_has_a_launch_site(family):
    patterns = launch_patterns()
    missing = [e for e in SPECS[family].entries if not any(p.fullmatch(e) for p in patterns)]
    assert not missing, f"{family}: no code in ddtree_rtc/ names {missing}"


def test_the_check_catches_an_unlaunched_entry():
    """The pattern check is not vacuous: a name nobody launches matches no literal."""
    patterns = launch_patterns()
    assert not any(p.fullmatch("tree_build_warp_j2") for p in patterns)
    assert any(p.fullmatch("tree_build_prune_j9") for p in patterns)
    assert source_entries('extern "C" __global__ void __launch_bounds__(256, 1) a_kernel(int x) {}\n'
                          "TREE_BUILD_ENTRY(b_kernel, 3)\n") == {"a_kernel", "b_kernel"}
