#!/usr/bin/env bash
# compute-sanitizer memcheck + racecheck on one small case of each kernel of a round
# (top-k, tree build, tree accept, KV commit, MLA tree verify, GQA attention) and of the small-M
# path's new kernels (moe_small, mla_small, the split="shape" attention). Logs go to $OUT.
#   tools/sanitize.sh [tool...]      (default: memcheck racecheck)
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DDTREE_RTC_CACHE_DIR=${DDTREE_RTC_CACHE_DIR:-/tmp/ddtree_rtc_cache}
cases=(
  "tests/test_tree_round.py::test_cuda_round_matches_the_references[False]"  # top-k, tree build, accept
  "tests/test_kv_cache.py::test_commit_kernel[False]"
  "tests/test_mla_attention.py::test_kernel_masks_tree_rows"
  "tests/test_gqa_attention.py -k lens5"
  "tests/test_moe_small.py::test_kernel_vs_reference[3-small]"  # the small-M path's kernels
  "tests/test_mla_small.py::test_head_gemm_small_vs_reference_and_invariant[3-8]"
  "tests/test_mla_small.py::test_shape_split_attention_is_bitwise_invariant[8]"
  "tests/test_small_m_gpu.py::test_invariant_linear[True-kv_a]"
)
tools=("$@"); [ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck)
printf '%-10s %-70s %s\n' tool case result
for tool in "${tools[@]}"; do
  for c in "${cases[@]}"; do
    log="$OUT/sanitize_${tool}_$(echo "$c" | tr -c 'A-Za-z0-9_' '_' | cut -c1-60).log"
    # shellcheck disable=SC2086
    timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
      python3 -m pytest -q -m gpu -p no:cacheprovider $c >"$log" 2>&1
    rc=$?
    errs=$(grep -Eo "ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: [0-9]+ hazard[s]? displayed \([0-9]+ error" "$log" | tail -1)
    printf '%-10s %-70s rc=%s %s\n' "$tool" "$c" "$rc" "$errs"
  done
done
