"""Every CUDA entry the package compiles is declared and has a launch site (CPU, static).

What this proves: each ``extern "C"`` kernel in a family's compiled module (built for sm_90a through
the project's builder and its on-disk cache, so macro-generated entries count as the compiler sees
them) is listed by the family's KernelSpec, and every listed entry is in the module; and each
entry's name matches a string literal or f-string (``{...}`` read as a name part) in the package's
Python code outside the registry: there is code that asks the module for it. What it cannot prove:
that this code runs on a default path; a launch site behind an option nobody passes would pass here.
The wrappers keep no such options (variants no default path reaches leave the package;
benchmarks/README.md holds their story), and the GPU tests run every launch site against its
reference.
"""

import ast
import functools
import re
from pathlib import Path

import pytest

from ddtree_rtc.kernels.registry import SPECS
from ddtree_rtc.rtc.builder import build, source_dir
from ddtree_rtc.rtc.cubin import resource_usage

PACKAGE = Path(__file__).resolve().parents[1] / "ddtree_rtc"
_ARCH = "sm_90a"  # every family builds for it; entries do not depend on the arch


def kernel_symbols(cubin: bytes) -> set[str]:
    """The ``extern "C"`` functions of a CUBIN: its code sections whose names are not C++-mangled."""
    return {name for name in resource_usage(cubin) if not name.startswith("_Z")}


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


@pytest.mark.parametrize("family", sorted(SPECS))
def test_compiled_entries_match_the_registry(family, nvrtc_prebuilt):
    spec = SPECS[family]
    found = kernel_symbols(build(spec, _ARCH).cubin)
    assert set(spec.entries) == found, (
        f"{family}.cu ({_ARCH}): kernels not in its KernelSpec {sorted(found - set(spec.entries))}, "
        f"KernelSpec entries not in the module {sorted(set(spec.entries) - found)}")


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
