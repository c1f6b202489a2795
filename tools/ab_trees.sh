#!/usr/bin/env bash
# Trees of several git refs side by side, for one device call that runs the same bench or tests on each
# (PART=ab tools/gpu_session.sh): `bash tools/ab_trees.sh main gupipe m64occ` writes ab/<ref>/ with the
# ref's package, tests, tools and pipelines (git archive: committed files only). ab/ is ignored by git,
# so the device call must name it in `carry`; each tree is ~4 MB of the 64 MiB a call may carry.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ $# -ge 1 ] || { echo "usage: tools/ab_trees.sh REF [REF ...]"; exit 2; }
for ref in "$@"; do
  git rev-parse --verify -q "$ref^{commit}" >/dev/null || { echo "ab_trees: no such ref: $ref"; exit 2; }
  dir="ab/${ref//\//_}"
  rm -rf "$dir" && mkdir -p "$dir"
  git archive "$ref" ddtree_rtc tests tools pipelines pyproject.toml setup.cfg | tar -x -C "$dir"
  echo "$(git rev-parse --short=12 "$ref")" > "$dir/COMMIT"
  echo "$dir: $ref at $(cat "$dir/COMMIT")"
done
