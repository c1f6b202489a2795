"""Runtime compilation: NVRTC -> cached CUBIN/PTX -> CuPy modules; SASS and resource dumps."""

from .arch import SUPPORTED_ARCHS, ArchError, arch_for_compute_capability, check_arch, detect_arch
from .builder import BuiltModule, KernelSpec, LateCompileError, LoadedModule, build, freeze, load, unfreeze
from .cache import ModuleCache, cache_dir
from .nvrtc import CompileError, nvrtc_version

__all__ = [
    "SUPPORTED_ARCHS", "ArchError", "BuiltModule", "CompileError", "KernelSpec", "LateCompileError",
    "LoadedModule", "ModuleCache", "arch_for_compute_capability", "build", "cache_dir", "check_arch",
    "detect_arch", "freeze", "load", "nvrtc_version", "unfreeze",
]
