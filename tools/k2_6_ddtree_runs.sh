#!/usr/bin/env bash
# pipelines/k2_6_slice_ddtree_h200.yaml at the oracle's tau ~ 3 / 5 / 7 (acceptance p 0.42 / 0.77 /
# 0.93) and autoregressive, at each concurrency given (default 1 and 10); one JSON per run in $OUT,
# then a table of tau, total tok/s and tok/s per user. About a minute per run once the checkpoint
# exists (the first run makes it: ~2 minutes more).
#   [RUNS="ar 0.77"] tools/k2_6_ddtree_runs.sh [concurrency...]    (RUNS: which of ar 0.42 0.77 0.93)
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DDTREE_RTC_CACHE_DIR=${DDTREE_RTC_CACHE_DIR:-/tmp/ddtree_rtc_cache}
pipe=pipelines/k2_6_slice_ddtree_h200.yaml
concs=("$@"); [ ${#concs[@]} -eq 0 ] && concs=(1 10)
for c in "${concs[@]}"; do
  for p in ${RUNS:-ar 0.42 0.77 0.93}; do
    json="$OUT/k2_6_ddtree_c${c}_${p}.json"
    if [ "$p" = ar ]; then mode=(--set decode.mode=autoregressive); else mode=(--set "decode.drafter.acceptance.p=$p"); fi
    ddtree-rtc run "$pipe" --quiet "${mode[@]}" --set "workload.concurrency=$c" --set "output.json=$json" \
      >"$json.log" 2>&1 || { echo "run c=$c p=$p failed:"; tail -20 "$json.log"; }
  done
done
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
print(f"{'run':<28} {'tau':>5} {'tok/s':>8} {'tok/s per user':>15}")
for f in sorted(pathlib.Path(sys.argv[1]).glob("k2_6_ddtree_c*.json")):
    m = json.loads(f.read_text())["metrics"]
    tau = (m.get("speculative") or {}).get("tau")
    print(f"{f.stem:<28} {'-' if tau is None else f'{tau:.2f}':>5} {m['tok_per_s']:>8.1f} "
          f"{m['tok_per_s_per_user']:>15.1f}")
EOF
