#!/usr/bin/env bash
# The five ejkernel wheels of a git ref, for a GPU call that times builds side by side
# (benchmarks/gpu_ab.sh reads .whl-NAME for a build NAME in ORDER, .whl for "new"):
#   bash benchmarks/wheels_of.sh REF DIR     e.g. bash benchmarks/wheels_of.sh main .whl-base
# DIR's old ejkernel wheels are replaced; other wheels in it (jax-triton, cattrs) stay.
# PIP: the pip to build with (default: python3 -m pip).
set -euo pipefail
ref=${1:?REF: a branch, tag or commit}
dir=${2:?DIR: the wheel folder, e.g. .whl-e1}
tree=$(mktemp -d)
trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || rm -rf "$tree"' EXIT
git worktree add -q --detach "$tree" "$ref"
mkdir -p "$dir"
rm -f "$dir"/ejkernel_*.whl
${PIP:-python3 -m pip} wheel -q --no-deps -w "$dir" \
  "$tree"/ejkernel-core "$tree"/ejkernel-xla "$tree"/ejkernel-triton "$tree"/ejkernel-pallas \
  "$tree"/ejkernel-cuda
echo "$dir: $(git rev-parse --short "$ref") ($ref)"
