#!/usr/bin/env bash
# The GPU run of issue 43 in three device calls of under 10 minutes each, from the repository root on
# one H100/H200 with the CUDA 13 stack: `STAGE=1 bash tools/gpu_run.sh`, then 2, then 3.
#   1  correctness of what has not run on a GPU yet: the small-M kernels and row invariance
#      (tools/small_m_gpu.sh), the cost-aware budget, dummy weights made on the device, sampling and
#      top-k over vocabulary slices, the single-rank NCCL path that `run --nproc` and `serve --nproc` use
#   2  speed: `bench node` (K2.6 at 61 layers as rank 0 of TP8, small-M path on and off) and the
#      small-M stage rows of `bench decode` (TP8 / EP8 shards, b1 / b33, ctx 4k)
#   3  speed: `bench budget` (auto against AR, chain and fixed budgets at concurrency 1 / 4 / 10), then
#      the whole `pytest -m gpu` with what time is left
# Logs and JSON go to $OUT (or ./gpu_out); a short table is printed last.
set -uo pipefail
O=${OUT:-gpu_out}; mkdir -p "$O"
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 ))s; }
left() { echo $(( ${1:-560} - ($(date +%s)-T0) )); }
export PYTHONUNBUFFERED=1 DDTREE_RTC_CACHE_DIR=${DDTREE_RTC_CACHE_DIR:-/tmp/ddtree_rtc_cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$O/install.log" 2>&1 || tail -5 "$O/install.log"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
case "${STAGE:-1}" in
1)
  TTMO=300 BENCH=0 OUT="$O" bash tools/small_m_gpu.sh >"$O/small_m.txt" 2>&1
  echo "== small-M tests $(el)"; tail -25 "$O/small_m.txt" | cut -c1-200
  timeout "$(left)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_budget.py \
    tests/test_budget_engine.py tests/test_dummy_load.py tests/test_dist_vocab.py \
    tests/test_dist.py -k "not two_gpus and not two_ranks" >"$O/pytest_stage1.txt" 2>&1
  echo "== budget / dummy / vocabulary-slice / NCCL single-rank tests rc=$? $(el)"
  grep -E "FAILED|ERROR|passed|failed" "$O/pytest_stage1.txt" | cut -c1-200 | tail -12 ;;
2)
  timeout "$(left 380)" ddtree-rtc bench node --quick --layouts tp --small-m on,off \
    --json "$O/node.json" >"$O/node.txt" 2>&1
  echo "== bench node rc=$? $(el)"; tail -30 "$O/node.txt" | cut -c1-220
  [ -s "$O/node.json" ] && python3 tools/node_summary.py "$O/node.json" | tee -a "$O/node.txt"
  TTMO=0 BENCH_START_MAX="$(left 480)" OUT="$O" bash tools/small_m_gpu.sh >"$O/small_m_bench.txt" 2>&1
  echo "== small-M bench decode $(el)"; tail -12 "$O/small_m_bench.txt" | cut -c1-200 ;;
3)
  timeout "$(left 330)" ddtree-rtc bench budget --pipeline pipelines/k2_6_slice_ddtree_h200.yaml \
    --set model.load=dummy --concurrency 1,4,10 --settings autoregressive,chain,8,16,32,64,auto \
    --json "$O/budget.json" >"$O/budget.txt" 2>&1
  echo "== bench budget rc=$? $(el)"; tail -20 "$O/budget.txt" | cut -c1-220
  timeout "$(left)" python3 -m pytest -q -m gpu -p no:cacheprovider -x >"$O/pytest_gpu.txt" 2>&1
  echo "== pytest -m gpu rc=$? $(el) (stopped at the time limit if 124)"
  grep -E "FAILED|ERROR|passed|failed" "$O/pytest_gpu.txt" | cut -c1-200 | tail -12 ;;
*) echo "STAGE must be 1, 2 or 3"; exit 2 ;;
esac
