#!/usr/bin/env bash
# The small-M path (issue 45) on one GPU, from the repository root, in one device call (< 8 minutes):
#   1. its kernels' GPU tests (moe_small, the row-invariant linear) and the row-invariance tests
#      (linears, MoE layer, whole-model decode eager + CUDA graph, chain verify vs AR);
#   2. `bench decode` at one rank's TP8 share (8 heads, expert intermediate 256, vocab / 8) and EP8
#      share (48 whole experts), b1 and b33, ctx 4k, with the small-M path off and on;
#   3. a short table last. JSON and logs under $OUT (or /tmp/out).
# Knobs: TTMO=<pytest seconds, 0: no tests> BENCH=0 (no benches) ITERS=<bench iters> BTMO=<seconds per bench>
# BENCH_START_MAX=<no bench starts after this many seconds>. Worst case ~8 minutes.
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
export PYTHONPATH=. PYTHONUNBUFFERED=1 DDTREE_RTC_CACHE_DIR=${DDTREE_RTC_CACHE_DIR:-/tmp/ddc}
export DDTREE_RTC_COMMIT=${DDTREE_RTC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 ))s; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
echo "commit $DDTREE_RTC_COMMIT"
# every family the tests and benches load, compiled up front (outside the pytest budget)
fams=""; for f in moe_small linear mla_small mla_attention moe_routing moe_gemm rmsnorm rope embedding kv_cache \
  sampling silu_mul bench_ceiling; do fams="$fams --only $f"; done
timeout 200 python -m ddtree_rtc.cli kernels build --arch auto $fams > "$O/build.txt" 2>&1
rc=$?; echo "== build rc=$rc $(el)"; grep -E "moe_small|mla_small|linear_m64_s1 |linear_m8_s1 " "$O/build.txt" | cut -c1-120 | head -16
[ $rc != 0 ] && tail -5 "$O/build.txt"
if [ "${TTMO:-270}" != 0 ]; then
  # the invariance tests first: if the time runs out, the slow reference comparisons are what is cut
  timeout ${TTMO:-270} python -m pytest -v -rf -m gpu -p no:cacheprovider --durations=12 \
    tests/test_small_m_gpu.py tests/test_mla_small.py tests/test_moe_small.py > "$O/pytest_small_m.txt" 2>&1
  echo "== pytest rc=$? $(el) passed=$(grep -c ' PASSED' "$O/pytest_small_m.txt") failed=$(grep -c ' FAILED' "$O/pytest_small_m.txt")"
  grep -E " FAILED|^E  .*(Error|assert|differ)|seed=|passed|failed" "$O/pytest_small_m.txt" | cut -c1-220 | head -40
fi
if [ "${BENCH:-1}" != 0 ]; then
  for shard in tp8 ep8; do
    if [ $(( $(date +%s)-T0 )) -gt ${BENCH_START_MAX:-390} ]; then echo "== bench decode $shard skipped (time)"; continue; fi
    timeout ${BTMO:-85} python -m ddtree_rtc.cli bench decode --shard $shard --moe-layers 2 --batches 1,33 --contexts 4096 \
      --small-m both --iters ${ITERS:-10} --json "$O/small_m_decode_$shard.json" > "$O/bench_$shard.txt" 2>&1
    echo "== bench decode $shard rc=$? $(el)"; tail -8 "$O/bench_$shard.txt" | cut -c1-200
  done
fi
python - "$O" <<'PY'
import json, re, sys, pathlib
o = pathlib.Path(sys.argv[1])
log = o / "pytest_small_m.txt"
if log.exists():
    text = log.read_text()
    print("\nrow invariance / small vs general (bitwise unless said):")
    for name in ("test_invariant_linear", "test_rows_are_bitwise_invariant_to_the_batch", "test_dense_vs_reference",
                 "test_moe_layer_rows_invariant", "test_shape_split_attention_is_bitwise_invariant",
                 "test_decode_rows_invariant_eager_and_graph", "test_chain_verify_rows_equal_their_autoregressive_twins",
                 "test_engine_chain_verify_equals_ar_through_graphs", "test_small_path_logits_match_the_general_path",
                 "test_kernel_vs_reference", "test_query_and_cache_rows_vs_twins", "test_qkv_a_vs_twin"):
        res = re.findall(rf"::{name}\S* (PASSED|FAILED|ERROR|SKIPPED)", text)
        print(f"  {name}: {res.count('PASSED')} passed, {res.count('FAILED') + res.count('ERROR')} failed"
              + (f", {res.count('SKIPPED')} skipped" if 'SKIPPED' in res else "") if res else f"  {name}: not run")
print("\nshard | path | batch | ctx | attention µs (x floor) | MoE µs (x floor) | dense µs | head µs | step graph µs")
for shard in ("tp8", "ep8"):
    f = o / f"small_m_decode_{shard}.json"
    if not f.exists():
        print(f"{shard}: no bench JSON"); continue
    for r in json.loads(f.read_text()).get("rows", []):
        e = r.get("extra", {})
        if "graph_us" not in e:
            continue
        us, fl = e["mean_stage_us"], e["mean_stage_over_floor"]
        c = lambda k: f"{us[k]:.1f} ({fl[k]:.2f}x)" if k in us else "-"
        print(f"{shard} | {e.get('path')} | {e['batch']} | {e['ctx']} | {c('attention')} | {c('moe')} | "
              f"{us.get('dense', 0):.1f} | {us.get('head', 0):.1f} | {e['graph_us']:.0f}")
PY
echo "== done $(el)"
