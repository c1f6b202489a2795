"""Every kernel family, declared once. The CLI, the build-all test and the spill check iterate
this table, so a new family is listed, built for every arch and spill-checked for free."""

from __future__ import annotations

from ..rtc.builder import KernelSpec, LoadedModule, load

SPECS: dict[str, KernelSpec] = {s.name: s for s in (
    KernelSpec("rmsnorm", ("rmsnorm_kernel", "rmsnorm_block_kernel"),
               "RMSNorm over the last dim with optional fused residual add (bf16 in/out, fp32 math)"),
    KernelSpec("rope", ("rope_kernel",),
               "RoPE in place on a slice of each head: interleaved pairs (GPT-J/MLA) or rotate-half"),
    KernelSpec("embedding", ("embedding_kernel",), "embedding row gather by token id"),
    KernelSpec("silu_mul", ("silu_mul_kernel",), "SiLU(gate) * up over a fused [gate | up] input"),
    KernelSpec("sampling", ("argmax_kernel", "sample_kernel"),
               "argmax and seeded temperature / top-p sampling over the vocabulary"),
    # -- DDTree (issue: tree build) --
    # -- INT4 MoE (issue: MoE) --
    # -- MLA attention and the paged latent KV cache (issue: MLA) --
    KernelSpec("bench_ceiling", ("read_stream_kernel", "copy_stream_kernel"),
               "streaming read and copy kernels that measure the memory ceilings for benchmarks"),
)}


def spec(name: str) -> KernelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}; known kernels: {', '.join(sorted(SPECS))}") from None


def module(name: str, **params) -> LoadedModule:
    """The family's module built for the current GPU (cached on disk and in process)."""
    return load(spec(name), **params)
