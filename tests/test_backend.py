"""The backend's op table: every op has a CUDA wrapper and a numpy reference taking the same arguments,
so model code calls ``backend.<op>(...)`` the same way on either."""

import importlib
import inspect

import pytest

from ddtree_rtc.backend import OPS

# Kernel-only launch options with no meaning in numpy; only kernel code passes them (moe_gemm's own align).
KERNEL_ONLY = {"moe_align": {"pdl"}}


def _params(fn, skip=()):
    """(name, kind, default) of each parameter; annotations differ where the plan types do."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in skip]


@pytest.mark.parametrize("op", sorted(OPS))
def test_kernel_and_reference_signatures_match(op):
    kern = getattr(importlib.import_module(f"ddtree_rtc.kernels.{OPS[op]}"), op)
    refm = getattr(importlib.import_module(f"ddtree_rtc.reference.{OPS[op]}"), op)
    k, r = _params(kern, KERNEL_ONLY.get(op, ())), _params(refm)
    if r and r[-1][1] is inspect.Parameter.VAR_KEYWORD:  # the reference takes the kernel's tuning knobs
        r = r[:-1]
        k = k[:len(r)]
    assert k == r, op
