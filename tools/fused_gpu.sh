#!/usr/bin/env bash
# The fused decoder layer (issue 45: cuda_src/mla_block.cu and moe_block.cu, runtime.fused_blocks) on one
# H100/H200, from the repository root, in one device call of under 8 minutes (after `pip install --no-deps
# --no-build-isolation -e .`):
#   1. build the families they and their tests load (zero spills is checked by the build);
#   2. their GPU tests (tests/test_mla_block.py, tests/test_moe_block.py): the tensor-parallel prologue
#      bitwise against to_bf16 + rmsnorm and a simulated TP8 rank's decode (fused, 4 launches per MoE layer)
#      bitwise against the unfused TP path; against the numpy twins, bitwise against the separate small-M
#      kernels, the TP8 decode's rows invariant over M = 1, 7, 33, 64 and equal to the unfused ones;
#   3. `bench decode` at one rank's TP8 share (8 heads, expert intermediate 256), b1 and b33, ctx 4k: the
#      general kernels (small_m_path off), the separate small-M kernels, the fused kernels, one run each
#      (a hang or a timeout of one cannot take the other rows with it);
#   4. a short table last. Logs and JSON under $OUT (or /tmp/fused_out); every stage under `timeout`.
set -u
O=${OUT:-/tmp/fused_out}; mkdir -p "$O"
export PYTHONPATH=. PYTHONUNBUFFERED=1 DDTREE_RTC_CACHE_DIR=${DDTREE_RTC_CACHE_DIR:-/tmp/ddc}
export DDTREE_RTC_COMMIT=${DDTREE_RTC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 ))s; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
echo "commit $DDTREE_RTC_COMMIT"
fams=""; for f in mla_block moe_block mla_small mla_attention linear rmsnorm moe_small moe_routing moe_gemm rope embedding \
  kv_cache sampling silu_mul bench_ceiling; do fams="$fams --only $f"; done
timeout 110 python -m ddtree_rtc.cli kernels build --arch auto $fams --json "$O/build.json" > "$O/build.txt" 2>&1
rc=$?; echo "== build rc=$rc $(el)"; grep -E "mla_block|moe_block" "$O/build.txt" | cut -c1-120
[ $rc != 0 ] && tail -5 "$O/build.txt"
# the bitwise comparisons first: if the time runs out, the slower twin comparisons are what is cut
timeout ${TTMO:-230} python -m pytest -v -rf -m gpu -p no:cacheprovider --durations=8 \
  tests/test_mla_block.py::test_prologue_is_bitwise_to_bf16_and_rmsnorm \
  tests/test_moe_block.py::test_fused_moe_prologue_is_bitwise_to_bf16_and_rmsnorm \
  tests/test_mla_block.py::test_simulated_tp_rank_decode_fused_is_the_unfused \
  tests/test_mla_block.py::test_fused_block_vs_twin_and_separate_kernels \
  tests/test_moe_block.py::test_fused_moe_is_bitwise_the_separate_kernels \
  tests/test_mla_block.py::test_decode_rows_invariant_with_the_fused_block \
  tests/test_moe_block.py::test_fused_moe_vs_twin > "$O/pytest_fused.txt" 2>&1
echo "== pytest rc=$? $(el) passed=$(grep -c ' PASSED' "$O/pytest_fused.txt") failed=$(grep -cE ' (FAILED|ERROR)' "$O/pytest_fused.txt")"
grep -E " FAILED|^E  .*(Error|assert|differ)|seed=|passed|failed|Timeout" "$O/pytest_fused.txt" | cut -c1-220 | head -30
for run in "off:45" "on:45" "fused:45"; do
  paths=${run%%:*}; limit=${run##*:}
  timeout "$limit" python -m ddtree_rtc.cli bench decode --shard tp8 --moe-layers 1 --batches 1,33 --contexts 4096 \
    --small-m "$paths" --iters ${ITERS:-10} --json "$O/decode_$paths.json" > "$O/bench_$paths.txt" 2>&1
  echo "== bench decode --small-m $paths rc=$? $(el)"; tail -4 "$O/bench_$paths.txt" | cut -c1-200
done
python - "$O" <<'PY'
import json, re, sys, pathlib
o = pathlib.Path(sys.argv[1])
log = o / "pytest_fused.txt"
if log.exists():
    text = log.read_text()
    print("\nfused kernel tests:")
    for name in ("test_prologue_is_bitwise_to_bf16_and_rmsnorm", "test_fused_moe_prologue_is_bitwise_to_bf16_and_rmsnorm",
                 "test_simulated_tp_rank_decode_fused_is_the_unfused",
                 "test_fused_block_vs_twin_and_separate_kernels", "test_decode_rows_invariant_with_the_fused_block",
                 "test_fused_moe_vs_twin", "test_fused_moe_is_bitwise_the_separate_kernels"):
        res = re.findall(rf"::{name}\S* (PASSED|FAILED|ERROR|SKIPPED)", text)
        print(f"  {name}: {res.count('PASSED')} passed, {res.count('FAILED') + res.count('ERROR')} failed"
              + (f", {res.count('SKIPPED')} skipped" if 'SKIPPED' in res else "") if res else f"  {name}: not run")
rows = []
for paths in ("off", "on", "fused"):
    f = o / f"decode_{paths}.json"
    if f.exists():
        rows += [r.get("extra", {}) for r in json.loads(f.read_text()).get("rows", [])]
    else:
        print(f"bench decode --small-m {paths}: no JSON")
table = {"rows": [{k: e[k] for k in ("path", "batch", "ctx", "mean_stage_us", "mean_stage_over_floor", "graph_us")}
                  for e in rows if "graph_us" in e]}
(o / "fused_summary.json").write_text(json.dumps(table, indent=1))
print("\nTP8 shard, 1 dense + 1 MoE layer | path | batch | ctx | attention block µs (x floor) | MoE µs | step graph µs")
for e in table["rows"]:
    us, fl = e["mean_stage_us"], e["mean_stage_over_floor"]
    c = lambda k: f"{us[k]:.1f} ({fl[k]:.2f}x)" if k in us else "-"
    print(f"  {e['path']} | {e['batch']} | {e['ctx']} | {c('attention')} | {c('moe')} | {e['graph_us']:.0f}")
PY
echo "== done $(el)"
