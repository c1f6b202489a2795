#!/usr/bin/env bash
# The round's kernel variants on a GPU in one device call, from the repository root: the four
# `bench NAME --variants` runs (MoE M <= 8 with the fused small-M kernel, top-k with radix, MLA with
# merge="fused", tree build with warp; each checked against its reference or the default pick), the
# variants' GPU tests, then ncu of the four kernel-gap cases (MoE layer M = 1, top-k batch 32 x depth 7 k 64,
# MLA decode 64 heads batch 8 ctx 4k, tree build + accept batch 32 budget 64) at default and
# variant (tools/ncu_cases.py). Bench output, JSON, pytest and ncu logs go to $OUT (or /tmp/out).
#   BENCHES="moe topk attn tree"  NCUS="moe moev topk32 topk32v mla mlav tree treev"  TTMO=150 (0: no tests)  TK=<pytest -k>
# All of it takes ~14 minutes, over one 10-minute device call: run NCUS=" " first, then BENCHES=" " TTMO=0.
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1 DDTREE_RTC_CACHE_DIR=/tmp/ddc DDTREE_RTC_COMMIT=${DDTREE_RTC_COMMIT:-unknown}
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 ))s; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
run() { local name=$1 t=$2; shift 2; timeout $t python -m ddtree_rtc.cli bench "$@" --json $O/$name.json > /tmp/b_$name.txt 2>&1; echo "== $name rc=$? $(el)"; cat /tmp/b_$name.txt >> $O/bench.log; tail -${TAILN:-28} /tmp/b_$name.txt | cut -c1-190; }
for b in ${BENCHES:-moe topk attn tree}; do
  case $b in
    moe) run moe 80 moe --variants --ms 1,2,8 --routing bench --iters 30;;
    topk) run topk 80 topk --variants --iters 20;;
    attn) run attn 90 attention --variants;;
    tree) run tree 80 tree --variants;;
  esac
done
if [ "${TTMO:-150}" != 0 ]; then
timeout ${TTMO:-150} python -m pytest -v -rf -m gpu -p no:cacheprovider -k "${TK:-radix or warp or fused}" \
  tests/test_moe_gemm.py tests/test_moe_layer.py tests/test_mla_attention.py tests/test_tree_build.py tests/test_topk.py > $O/pytest.txt 2>&1
echo "== pytest rc=$? $(el) passed=$(grep -c ' PASSED' $O/pytest.txt) failed=$(grep -c ' FAILED' $O/pytest.txt)"
grep -E " FAILED|^E  .*(Error|assert)|passed|failed" $O/pytest.txt | cut -c1-220 | head -40
fi
NCU="ncu --clock-control none --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section LaunchStats"
for c in ${NCUS:-moe moev topk32 topk32v mla mlav tree treev}; do
  timeout 45 $NCU python tools/ncu_cases.py $c 2 >> $O/ncu.txt 2>&1; echo "== ncu $c rc=$? $(el)"
done
