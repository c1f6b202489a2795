"""SASS from a cubin, on any machine: nvdisasm (or cuobjdump) from the NVIDIA pip wheels or PATH."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path


class DisasmError(RuntimeError):
    pass


def find_tool(name: str) -> str | None:
    try:
        import cuda.pathfinder as pf

        found = pf.find_nvidia_binary_utility(name)
        if found:
            return str(found)
    except (ImportError, AttributeError):
        pass
    return shutil.which(name)


def sass(cubin: bytes) -> str:
    """Disassemble ``cubin``; nvdisasm first (needs no GPU), cuobjdump as a fallback."""
    last = None
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "module.cubin"
        path.write_bytes(cubin)
        for tool, args in (("nvdisasm", ["-c", "-g"]), ("cuobjdump", ["--dump-sass"])):
            exe = find_tool(tool)
            if exe is None:
                continue
            run = subprocess.run([exe, *args, str(path)], capture_output=True, text=True)
            if run.returncode == 0:
                return run.stdout
            last = f"{tool} failed: {run.stderr.strip()}"
    raise DisasmError(last or "no disassembler found: pip install nvidia-cuda-nvdisasm "
                              "(part of the 'dev' extra) or put nvdisasm/cuobjdump on PATH")
