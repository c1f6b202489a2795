"""Every kernel family, declared once. The CLI, the build-all test and the spill check iterate
this table, so a new family is listed, built for every arch and spill-checked for free."""

from __future__ import annotations

from ..rtc.builder import KernelSpec, LoadedModule, load

SPECS: dict[str, KernelSpec] = {s.name: s for s in (
    KernelSpec("rmsnorm", ("rmsnorm_kernel", "rmsnorm_block_kernel", "rmsnorm_f32_kernel", "rmsnorm_block_f32_kernel"),
               "RMSNorm over the last dim with optional fused residual add (bf16 in/out, fp32 math; the _f32 "
               "entries take a TP rank's all-reduced fp32 sum and round it to bf16 first)"),
    KernelSpec("allreduce", ("allreduce_rmsnorm_kernel",),
               "one-shot all-reduce of the tensor-parallel fp32 partials over peer memory (ranks' buffers "
               "registered by CUDA IPC; flags with device epochs, bounded waits), summed in rank order, "
               "rounded as to_bf16 and fused with the residual RMSNorm: one launch per rank and sublayer "
               "for <= 16 rows"),
    KernelSpec("rope", ("rope_kernel",),
               "RoPE in place on a slice of each head: interleaved pairs (GPT-J/MLA) or rotate-half"),
    KernelSpec("embedding", ("embedding_kernel",), "embedding row gather by token id"),
    KernelSpec("silu_mul", ("silu_mul_kernel",), "SiLU(gate) * up over a fused [gate | up] input"),
    KernelSpec("linear", tuple(f"linear{v}_m{mt}{o}_s{s}" for v, outs in (("", ("", "_f32")), ("_norm", ("",)))
                               for o in outs for mt in (8, 16, 32, 64) for s in (1, 2, 4, 8)),
               "skinny-M dense bf16 linear for decode (M <= 64; bf16 or fp32 out): weights streamed once with "
               "16-byte loads through mma.sync, K split over warps and a cluster of 1/2/4/8 CTAs, fixed-order "
               "reduction (a row's sums depend only on the split: the small-M path's row-invariant linear); "
               "linear_norm: an RMSNorm of x in front, the rmsnorm launch's bits (the small-M q_a norm + q_b)"),
    KernelSpec("sampling", ("argmax_kernel", "sample_kernel"),
               "argmax and seeded temperature / top-p sampling over the vocabulary"),
    # -- DDTree (issue: tree build) --
    KernelSpec("topk", ("topk_stream_bf16_kernel", "topk_stream_f32_kernel", "topk_radix_hist_bf16_kernel",
                        "topk_radix_hist_f32_kernel", "topk_radix_select_bf16_kernel", "topk_radix_select_f32_kernel"),
               "vocabulary top-k: fp32 log-softmax and the K best log-probs + ids per row, ties by id "
               "(stream: one read, a shared buffer of candidate vectors behind a rising threshold; radix: a "
               "streaming histogram pass, then one block per row re-reads only the groups that can hold "
               "candidates)",
               params={"TOPK_CAP": 8192, "TOPK_STREAM_BLOCKS": 2, "TOPK_PROFILE": 0}),
    KernelSpec("tree_build", ("tree_build_prune_j3", "tree_build_prune_j9", "tree_build_prune_j17"),
               "DDTree best-first tree build per request, bit-identical to the heapq reference (depth by "
               "depth in parallel, the sequential heap loop where that is not exact)",
               params={"TREE_PROFILE": 0, "TREE_THREADS": 512}),
    KernelSpec("tree_accept", ("tree_accept_table_kernel",),
               "DDTree acceptance walk: follow the children matching the target's choices"),
    # -- INT4 MoE (issue: MoE) --
    KernelSpec("moe_routing", ("moe_route_e64", "moe_route_e128", "moe_route_e256", "moe_route_e384",
                               "moe_route_e512", "moe_route_e1024", "moe_align_kernel"),
               "MoE routing: DeepSeek-V3 noaux_tc top-k (sigmoid, bias for selection, groups; one warp "
               "per token, scores in registers) and the token->expert align step (two block lists: "
               "8-pair runs for experts with few pairs, 32-pair runs for the rest)"),
    KernelSpec("moe_gemm", ("moe_gemm_nt1_h", "moe_gemm_nt1_f32", "moe_gemm_nt1_down", "moe_gemm_nt4_h",
                            "moe_gemm_nt4_f32", "moe_gate_up_reduce_kernel", "moe_combine_kernel",
                            "moe_combine_f32_kernel"),
               "fused INT4 W4A16 group-32 expert GEMMs (mma.sync, weights on the 16-row side): gate_up "
               "with SiLU*up, down, split-K reduce, weighted top-k combine",
               params={"MOE_STAGES_NT1": 3, "MOE_STAGES_NT4": 3, "MOE_MIN_CTAS_NT4": 4,
                       "MOE_NT4_WEIGHTS_NORMAL": 1}),
    KernelSpec("moe_small", ("moe_small_gate_up", "moe_small_gate_up_t2", "moe_small_down", "moe_small_down_x",
                             "moe_small_combine",
                             *(f"moe_small_dense_m{mt}_s{s}" for mt in (8, 16, 32, 64) for s in (1, 2, 4, 8)),
                             *(f"moe_small_route_shared_m{mt}{o}_s{s}" for o in ("", "_f32") for mt in (8, 16, 32, 64)
                               for s in (1, 2, 4, 8))),
               "row-invariant INT4 MoE experts for M <= 64 tokens (the small-M path): routed gate_up with "
               "SiLU*up (K over the CTA's warps, summed in warp order), then down + weighted combine + shared "
               "(whole K per warp, slots in order; from 17 tokens the down by (expert, chunk) items with the "
               "expert's h rows staged, and the combine a launch of its own) under PDL; each CTA rebuilds the "
               "routing from the ids, no align step, no atomics in sums; moe_small_dense: the router logits "
               "and the shared expert's gate_up with SiLU*up in one skinny launch; moe_small_route_shared: the "
               "routing (a warp per token) and the shared expert's down linear side by side in one launch",
               params={"MOE_SMALL_STAGES": 4}),
    # -- MLA attention and the paged latent KV cache (issue: MLA) --
    KernelSpec("kv_cache", ("kv_cache_write_kernel", "kv_cache_commit_kernel"),
               "paged KV cache: write rows at slots; DDTree commit of accepted rows, in place, all layers"),
    KernelSpec("mla_attention", ("mla_attention_m64_kernel", "mla_attention_m16_kernel",
                                 "mla_attention_small_kernel", "mla_attention_d16_kernel",
                                 "mla_attention_w64_kernel", "mla_attention_merge_kernel"),
               "absorbed MLA attention over the paged latent cache (decode / tree verify / causal "
               "prefill, mma.sync, split-K; a wgmma variant on sm_90a) and its split merge",
               arch_specific=True),
    KernelSpec("mla_small", ("mla_head_gemm_small", "mla_query_small",
                             *(f"mla_qkv_a_small_m{mt}_s{s}" for mt in (8, 16, 32, 64) for s in (1, 2, 4, 8))),
               "the small-M path's row-invariant MLA pieces for T <= 64 tokens: the head GEMMs (W_UK "
               "absorption, W_UV expansion; a CTA per head and 32 columns, K split over its threads in a "
               "fixed order), q_a and kv_a in one "
               "skinny launch, the absorbed query with its RoPE and the cache rows (norm, RoPE, write) in "
               "one launch"),
    # -- the DFlash drafter's attention --
    KernelSpec("gqa_attention", ("gqa_attention_d64_kernel", "gqa_attention_d128_kernel",
                                 "gqa_attention_merge_kernel"),
               "DFlash drafter GQA attention: a block of <= 16 query rows per request, non-causal over its "
               "paged context window plus its own K/V rows (mma.sync, query tile = block rows x the kv "
               "head's query heads, split-K over the context sized from shapes) and its split merge"),
    KernelSpec("bench_ceiling", ("read_stream_kernel", "copy_stream_kernel", "gate_wait_kernel",
                                 "latency_floor_kernel", "l2_clean_kernel", "mma_peak_kernel"),
               "streaming read and copy kernels that measure the memory ceilings for benchmarks; the "
               "L2 flush's clean read pass; a "
               "host-released gate that lets a benchmark queue a whole step before it runs; a kernel "
               "of dependent loads that gives a small kernel's latency floor; the mma.sync bf16 peak"),
)}


# Families only the benchmarks launch: built and spill-checked with the rest (kernels build, CI), not
# compiled by a pipeline run before its loop.
BENCHMARK_ONLY = frozenset({"bench_ceiling"})


def engine_specs() -> list[KernelSpec]:
    """The families an engine may launch: every registered one but the benchmark-only ones."""
    return [s for name, s in SPECS.items() if name not in BENCHMARK_ONLY]


def spec(name: str) -> KernelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}; known kernels: {', '.join(sorted(SPECS))}") from None


def module(name: str, **params) -> LoadedModule:
    """The family's module built for the current GPU (cached on disk and in process)."""
    return load(spec(name), **params)
