#!/usr/bin/env bash
# One session's GPU run in device calls of under 10 minutes each, from the repository root on one
# H100/H200 with the CUDA 13 stack: `PART=tests bash tools/gpu_session.sh`, then bench, then lossless.
#   tests     the whole `pytest -m gpu`, the files never run on a GPU before first (small-M, budget, dummy
#             weights, vocabulary slices, single-rank NCCL), then the rest, as far as the time allows
#   bench     the single-rank NCCL tests, then `bench node` (K2.6 at 61 layers as rank 0 of TP8, small-M path on and off) and `bench budget`
#             (auto against AR, chain and fixed budgets at concurrency 1 / 4 / 10); NODE_SM (on,off), NODE_S
#             (seconds for bench node, 300) BUDGET_TOKENS (output tokens per request, 128)
#             and TOTAL (seconds for the part, 570) shorten it
#   lossless  tools/k2_6_lossless.py (random head: DDTree / chain ids against AR at concurrency 1 and 10;
#             the oracle's tau against its expected value), then `bench decode` at the TP8 and EP8 shares
#             with the general and the small-M kernels (b1 / b33, ctx 4k)
#   core      one call when only one may come (BUDGET seconds): the GPU tests of code never run on a GPU
#             (both attention splits across 2048 keys), the round and budget GPU tests,
#             then tools/small_vs_general.py, then a short tools/k2_6_lossless.py (ids against AR)
#   ncu       tools/ncu_explain.py (BUDGET s, default 240): bench decode's stage times on the TP8 slice
#             (general / small-M at b1, small-M / general at b33, ctx 4k), then ncu on one eager step of each,
#             layer 1's kernels only; per kernel a diagnosis, per stage its kernels against the measured time
#   diag      tools/small_vs_general.py (the small-M path against the general kernels stage by stage, M 1 and
#             17, PDL on and off: the first stage that parts), then the tests it concerns with --tb=short
#   ab        one command run from each tree of tools/ab_trees.sh (AB: the tree names under ab/, default all;
#             AB_CMD: the ddtree-rtc arguments, {json} standing for $OUT/ab_<name>.json; default bench decode
#             TP8 b1/b33 ctx 4k, both paths); the device call must carry ab/. AB_TESTS: pytest arguments
#             run in each tree first (empty: none); AB_TESTS_<name> (non-alphanumerics as _) for one tree
#             only (set but empty: none there). A variant measured against main in one call.
#   verify    after changes merged without a GPU run: their GPU tests (VERIFY_TESTS), bench decode of ab/$BASE
#             (default dca2747; tools/ab_trees.sh $BASE, carry ab/) and of this tree (VERIFY_TREES: the trees
#             in order, default "ab/$BASE ."; a pending patch's tree, tools/pending/README.md, goes here too),
#             then `bench linear --invariant-plans --shard tp8`
#   budget    `bench budget` alone (BUDGET_SETTINGS, default with auto and auto-any; BUDGET_TOKENS, TOTAL)
# Logs and JSON go to $OUT (or ./gpu_out); a short table is printed last.
set -uo pipefail
O=${OUT:-gpu_out}; mkdir -p "$O"
T0=$(date +%s); el() { echo $(( $(date +%s)-T0 ))s; }
left() { echo $(( ${1:-560} - ($(date +%s)-T0) )); }
export PYTHONUNBUFFERED=1 DDTREE_RTC_CACHE_DIR=${DDTREE_RTC_CACHE_DIR:-/tmp/ddtree_rtc_cache}
export DDTREE_RTC_COMMIT=${DDTREE_RTC_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$O/install.log" 2>&1 || tail -5 "$O/install.log"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
case "${PART:-tests}" in
core)  # one call when only one may come (BUDGET s): the GPU tests of code never run on a GPU, the diagnostic, lossless
  B=${BUDGET:-570}  # seconds this part may take in all (the device call's limit, less a margin)
  timeout "$(left $(( B * 50 / 100 )))" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider --tb=short --durations=10 \
    tests/test_mla_small.py tests/test_packed_verify.py tests/test_tree_round.py tests/test_budget.py \
    tests/test_budget_engine.py tests/test_round_gpu.py tests/test_bench_round.py tests/test_small_m_gpu.py \
    tests/test_invariant_schedule.py tests/test_bench_node.py \
    >"$O/pytest_core.txt" 2>&1
  echo "== pytest core rc=$? $(el) (124: stopped at the time limit)"
  grep -E "^(FAILED|ERROR)|passed|failed" "$O/pytest_core.txt" | cut -c1-200 | tail -25
  [ "$B" -lt 250 ] && { tail -c 600 "$O/pytest_core.txt"; exit 0; }  # too short for the rest: the tests alone
  timeout "$(left $(( B * 68 / 100 )))" python3 tools/small_vs_general.py --m 1,17 --pdl on \
    --json "$O/small_vs_general.json" >"$O/small_vs_general.txt" 2>&1
  echo "== small_vs_general rc=$? $(el) (1: a difference above tolerance)"
  grep -vE "^L[0-9]+ |^head |^stage " "$O/small_vs_general.txt" | cut -c1-220 | tail -12
  timeout "$(left "$B")" python3 tools/k2_6_lossless.py --out "$O" --timeout 150 --tokens 64 --no-tau \
    --runs ar1,ar10,chain1,chain10,b8c1,b32c1 >"$O/lossless.txt" 2>&1
  echo "== lossless rc=$? $(el)"; tail -9 "$O/lossless.txt" | cut -c1-220 ;;
tests)
  first="tests/test_packed_verify.py tests/test_small_m_gpu.py tests/test_mla_small.py tests/test_moe_small.py tests/test_budget.py
    tests/test_budget_engine.py tests/test_dummy_load.py tests/test_dist_vocab.py tests/test_dist.py"
  rest=$(ls tests/test_*.py | grep -v -F -x -f <(printf '%s\n' $first))
  timeout "$(left 575)" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider --durations=15 $first $rest \
    >"$O/pytest_gpu.txt" 2>&1
  echo "== pytest -m gpu rc=$? $(el) (124: stopped at the time limit)"
  grep -E "^(FAILED|ERROR)|passed|failed" "$O/pytest_gpu.txt" | cut -c1-220 | tail -30
  tail -c 300 "$O/pytest_gpu.txt" ;;
bench)
  timeout "$(left 45)" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider --tb=short tests/test_dist.py \
    tests/test_dist_vocab.py >"$O/pytest_dist.txt" 2>&1  # the single-rank NCCL path that run/serve --nproc use
  echo "== pytest dist rc=$? $(el)"; grep -E "^(FAILED|ERROR)|passed|failed" "$O/pytest_dist.txt" | cut -c1-200 | tail -8
  timeout "$(left ${NODE_S:-300})" ddtree-rtc bench node --quick --layouts tp --small-m "${NODE_SM:-on,off}" \
    --json "$O/node.json" >"$O/node.txt" 2>&1
  echo "== bench node rc=$? $(el)"; tail -30 "$O/node.txt" | cut -c1-220
  [ -s "$O/node.json" ] && python3 tools/node_summary.py "$O/node.json" | tee -a "$O/node.txt"
  timeout "$(left ${TOTAL:-570})" ddtree-rtc bench budget --pipeline pipelines/k2_6_slice_ddtree_h200.yaml \
    --set model.load=dummy --set workload.synthetic.output_len=${BUDGET_TOKENS:-128} --concurrency 1,4,10 \
    --settings autoregressive,chain,8,16,32,64,auto \
    --json "$O/budget.json" >"$O/budget.txt" 2>&1
  echo "== bench budget rc=$? $(el)"; tail -24 "$O/budget.txt" | cut -c1-220 ;;
lossless)
  timeout "$(left 420)" python3 tools/k2_6_lossless.py --out "$O" --timeout 120 >"$O/lossless.txt" 2>&1
  echo "== lossless rc=$? $(el)"; tail -16 "$O/lossless.txt" | cut -c1-220
  for shard in tp8 ep8; do
    timeout "$(left 575)" ddtree-rtc bench decode --shard $shard --moe-layers 2 --batches 1,33 --contexts 4096 \
      --small-m both --iters 10 --json "$O/decode_$shard.json" >"$O/decode_$shard.txt" 2>&1
    echo "== bench decode $shard rc=$? $(el)"; tail -10 "$O/decode_$shard.txt" | cut -c1-200
  done ;;
diag)  # where the small-M path and the general kernels part, then the tests of this session's fixes
  timeout "$(left 300)" python3 tools/small_vs_general.py --m 1,17 --pdl on,off --json "$O/small_vs_general.json" \
    >"$O/small_vs_general.txt" 2>&1
  echo "== small_vs_general rc=$? $(el) (1: a difference above tolerance, see the table)"
  grep -vE "^L[0-9]+ |^head |^stage " "$O/small_vs_general.txt" | cut -c1-220 | tail -40
  timeout "$(left 575)" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider --tb=short \
    tests/test_small_m_gpu.py::test_small_path_matches_the_general_path tests/test_dummy_load.py \
    tests/test_moe_small.py::test_kernel_variants tests/test_moe_small.py::test_kernel_vs_reference \
    >"$O/pytest_diag.txt" 2>&1
  echo "== pytest diag rc=$? $(el)"
  grep -E "^(FAILED|ERROR|E  )|passed|failed" "$O/pytest_diag.txt" | cut -c1-220 | tail -30 ;;
ncu)  # why the attention block and the MoE layer miss their targets (issue 45): ncu per kernel, one layer
  B=${BUDGET:-240}  # seconds this part may take in all (the first call on a fresh machine compiles: 400)
  timeout "$(left "$B")" python3 tools/ncu_explain.py run --out "$O" --budget "$(left $(( B - 10 )))"
  echo "== ncu_explain rc=$? $(el) (files: ncu_explain.md / .json, ncu_raw.csv, ncu_log.txt)"
  [ -s "$O/ncu_explain.md" ] && grep -E '^(## |\*\*)' "$O/ncu_explain.md" | cut -c1-600
  [ -s "$O/ncu_explain.md" ] || tail -c 2000 "$O/ncu_log.txt" ;;
ab)  # the same command from several trees (tools/ab_trees.sh), each importing its own package (cd + python -m)
  [ -d ab ] || { echo "no ab/: make it with tools/ab_trees.sh and carry it"; exit 2; }
  names=${AB:-$(ls ab)}; n=$(echo $names | wc -w)
  cmd=${AB_CMD:-"bench decode --shard tp8 --moe-layers 2 --batches 1,33 --contexts 4096 --small-m both --iters 10 --json {json}"}
  for name in $names; do
    per=$(( $(left ${TOTAL:-570}) / n )); n=$(( n - 1 )); t1=$(date +%s)
    ( cd "ab/$name" && export DDTREE_RTC_COMMIT="$(cat COMMIT)" &&
      tv="AB_TESTS_${name//[^A-Za-z0-9_]/_}"; tests=${!tv-${AB_TESTS:-}}  # a tree's own, else AB_TESTS
      if [ -n "$tests" ]; then
        timeout -s INT $(( per / 2 )) python3 -m pytest -q -rfE -m gpu -p no:cacheprovider --tb=short $tests \
          > "$O/ab_${name}_pytest.txt" 2>&1
        echo "== $name pytest rc=$? $(el)"; grep -E "^(FAILED|ERROR)|passed|failed" "$O/ab_${name}_pytest.txt" | tail -8
      fi
      timeout $(( per - ($(date +%s) - t1) )) python3 -m ddtree_rtc.cli ${cmd//\{json\}/$O/ab_$name.json} \
        > "$O/ab_$name.txt" 2>&1
      rc=$?; echo "== $name ($(cat COMMIT)) rc=$rc $(el)"; tail -8 "$O/ab_$name.txt" | cut -c1-220 )
  done ;;
verify)  # after changes merged without a GPU run: their GPU tests here, then bench decode of ab/$BASE and of this tree
  # (make it with `bash tools/ab_trees.sh $BASE`, carry ab/), then the invariant linear's plans (TOTAL s, 570)
  timeout "$(left ${TEST_S:-240})" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider --tb=short --maxfail=8 \
    ${VERIFY_TESTS:-tests/test_rmsnorm.py tests/test_moe_small.py tests/test_small_m_gpu.py tests/test_linear.py \
    tests/test_allreduce.py tests/test_budget_engine.py tests/test_budget.py tests/test_backend.py tests/test_round_gpu.py} \
    >"$O/pytest_verify.txt" 2>&1
  echo "== pytest rc=$? $(el)"; grep -E "^(FAILED|ERROR)|passed|failed" "$O/pytest_verify.txt" | cut -c1-200 | tail -12
  dec="bench decode --shard tp8 --moe-layers 2 --batches 1,17,33,64 --contexts 4096 --small-m on --iters 10"
  for t in ${VERIFY_TREES:-ab/${BASE:-dca2747} .}; do
    ( cd "$t" && [ -f COMMIT ] && export DDTREE_RTC_COMMIT="$(cat COMMIT)"; name=$(basename "$(pwd)")
      timeout "$(left ${DECODE_S:-420})" env PYTHONPATH="$PWD" python3 -m ddtree_rtc.cli $dec \
        --json "$O/decode_$name.json" >"$O/decode_$name.txt" 2>&1
      echo "== decode $name rc=$? $(el)"; grep -E "^small-m \| " "$O/decode_$name.txt" | cut -c1-150 )
  done
  for t in ${LINEAR_TREES:-.}; do  # the invariant linear's plans (a tree whose linear changed: here too)
    ( cd "$t" && name=$(basename "$(pwd)")
      timeout "$(left ${TOTAL:-570})" env PYTHONPATH="$PWD" python3 -m ddtree_rtc.cli bench linear --invariant-plans \
        --shard tp8 --iters 10 --json "$O/linear_plans_$name.json" >"$O/linear_plans_$name.txt" 2>&1
      echo "== linear plans $name rc=$? $(el)"; grep -E "^  [a-z_0-9]+: default" "$O/linear_plans_$name.txt" | cut -c1-220 )
  done ;;
budget)  # issue 39's figure alone: bench budget (auto, auto-any against AR, chain and fixed budgets; TOTAL s, 570)
  timeout "$(left ${TOTAL:-570})" ddtree-rtc bench budget --pipeline pipelines/k2_6_slice_ddtree_h200.yaml \
    --set model.load=dummy --set workload.synthetic.output_len=${BUDGET_TOKENS:-128} --concurrency 1,4,10 \
    --settings ${BUDGET_SETTINGS:-autoregressive,chain,8,16,32,64,auto,auto-any} \
    --json "$O/budget.json" >"$O/budget.txt" 2>&1
  echo "== bench budget rc=$? $(el)"; tail -34 "$O/budget.txt" | cut -c1-220 ;;
*) echo "PART must be core, tests, bench, lossless, ncu, diag, ab, verify or budget"; exit 2 ;;
esac
