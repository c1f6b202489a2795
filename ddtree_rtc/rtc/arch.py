"""GPU architecture names: which ones we build for, and which one the current device is."""

from __future__ import annotations

import os

# Exact-arch targets (the "a" suffix unlocks arch-specific instructions such as wgmma on sm_90a).
SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a", "sm_120a")

_BY_CC = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a", (12, 0): "sm_120a"}

ARCH_ENV = "DDTREE_RTC_ARCH"


class ArchError(ValueError):
    pass


def check_arch(arch: str) -> str:
    """Return ``arch`` if we support it, else raise naming the supported ones."""
    if arch not in SUPPORTED_ARCHS:
        raise ArchError(f"unsupported arch {arch!r}: choose one of {', '.join(SUPPORTED_ARCHS)}")
    return arch


def arch_for_compute_capability(major: int, minor: int) -> str:
    try:
        return _BY_CC[(major, minor)]
    except KeyError:
        known = ", ".join(f"{a} (cc {m}.{n})" for (m, n), a in _BY_CC.items())
        raise ArchError(
            f"no kernels for compute capability {major}.{minor}; supported: {known}. "
            f"Set {ARCH_ENV}=<arch> to force one if you know your GPU runs it."
        ) from None


def compile_target(arch: str, arch_specific: bool) -> str:
    """The NVRTC target: the exact arch when a kernel uses arch-specific features, else the
    plain family arch (``sm_90a`` -> ``sm_90``), whose cubin runs on any GPU of that arch."""
    check_arch(arch)
    return arch if arch_specific else arch[:-1]


# The arch with wgmma (warpgroup MMA): the kernel families that use it build their wgmma variants only there.
WGMMA_ARCH = "sm_90a"


def wgmma_build(override: str | None = None) -> bool:
    """Whether the kernels are built for WGMMA_ARCH (``override``, $DDTREE_RTC_ARCH or the device)."""
    return detect_arch(override) == WGMMA_ARCH


def detect_arch(override: str | None = None) -> str:
    """The arch to build for: ``override``, else $DDTREE_RTC_ARCH, else the current device's."""
    if override:
        return check_arch(override)
    env = os.environ.get(ARCH_ENV)
    if env:
        return check_arch(env)
    import cupy  # noqa: PLC0415 - only where a GPU is asked for

    cc = cupy.cuda.Device().compute_capability  # e.g. "90", "103"
    return arch_for_compute_capability(int(cc[:-1]), int(cc[-1]))
