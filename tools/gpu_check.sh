#!/usr/bin/env bash
# One GPU-machine session in one command: install in place (no network needed), report the device,
# run the GPU tests, then the named benchmarks. Logs and JSON go to $OUT (or ./gpu_out).
#   tools/gpu_check.sh [pytest-args...] -- [bench names...]
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DDTREE_RTC_CACHE_DIR=${DDTREE_RTC_CACHE_DIR:-/tmp/ddtree_rtc_cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
tests=() benches=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do tests+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
benches=("$@")
ddtree-rtc info | tee "$OUT/info.txt"
ddtree-rtc kernels build --arch auto --json "$OUT/build.json" >"$OUT/build.txt" 2>&1 || tail -20 "$OUT/build.txt"
if [ ${#tests[@]} -gt 0 ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml="$OUT/junit.xml" "${tests[@]}" 2>&1 \
    | tee "$OUT/pytest.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -60
fi
for b in "${benches[@]}"; do
  ddtree-rtc bench "$b" --json "$OUT/bench_$b.json" >"$OUT/bench_$b.txt" 2>&1
  echo "== bench $b (rc $?)"; tail -40 "$OUT/bench_$b.txt"
done
