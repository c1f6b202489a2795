#!/usr/bin/env bash
# Trees of several git refs side by side, for one device call that runs the same bench or tests on each
# (PART=ab tools/gpu_session.sh): `bash tools/ab_trees.sh main gupipe m64occ` writes ab/<ref>/ with the
# ref's package, tests, tools and pipelines (git archive: committed files only). ab/ is ignored by git,
# so the device call must name it in `carry`; each tree is ~4 MB of the 64 MiB a call may carry.
# REF+PATCH (e.g. `main+tools/pending/skinpipe.patch`): the ref with a committed patch applied, in
# ab/<ref>+<patch stem>/: a variant measured before it may land (a branch does not outlive the session
# that made it; a patch on main does). tools/pending/README.md lists the patches and what measures them.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ $# -ge 1 ] || { echo "usage: tools/ab_trees.sh REF[+PATCH] [REF[+PATCH] ...]"; exit 2; }
for arg in "$@"; do
  ref=${arg%%+*}
  patch=""; [ "$arg" != "$ref" ] && patch=${arg#*+}
  git rev-parse --verify -q "$ref^{commit}" >/dev/null || { echo "ab_trees: no such ref: $ref"; exit 2; }
  [ -z "$patch" ] || [ -f "$patch" ] || { echo "ab_trees: no such patch: $patch"; exit 2; }
  name=${ref//\//_}; [ -n "$patch" ] && name="$name+$(basename "$patch" .patch)"
  dir="ab/$name"
  rm -rf "$dir" && mkdir -p "$dir"
  git archive "$ref" ddtree_rtc tests tools pipelines docs pyproject.toml setup.cfg | tar -x -C "$dir"
  commit=$(git rev-parse --short=12 "$ref")
  if [ -n "$patch" ]; then
    git apply --directory="$dir" "$patch" || { echo "ab_trees: $patch does not apply to $ref"; rm -rf "$dir"; exit 2; }
    commit="$commit+$(basename "$patch" .patch)"
  fi
  echo "$commit" > "$dir/COMMIT"
  echo "$dir: $arg at $commit"
done
