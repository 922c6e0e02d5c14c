#!/usr/bin/env bash
# The torch anchors' Triton autotuning results kept between GPU calls: flash-linear-attention
# tunes each kernel on its first call, for minutes, and caches the winners in the Triton cache
# (`*.autotune.json`, one hashed folder each) that BENCH_TORCH_TRITON_CACHE names. A call's
# $OUT returns top-level files only, so:
#   bash benchmarks/torch_tuning.sh pack DIR $OUT/fla-tuning.tgz   (on the GPU, after the run)
#   bash benchmarks/torch_tuning.sh unpack fla-tuning.tgz DIR      (before the next call's run)
# and run the anchors with BENCH_TORCH_TRITON_CACHE=DIR: each kernel then compiles its cached
# winner only.
set -euo pipefail
case ${1:-} in
  pack)
    dir=${2:?DIR} tgz=${3:?TGZ}
    (cd "$dir" && find . -name '*.autotune.json' -print0 | tar czf "$tgz" --null -T -)
    echo "$tgz: $(tar tzf "$tgz" | grep -c autotune.json || true) tuning results"
    ;;
  unpack)
    tgz=${2:?TGZ} dir=${3:?DIR}
    mkdir -p "$dir" && tar xzf "$tgz" -C "$dir"
    echo "$dir: $(find "$dir" -name '*.autotune.json' | wc -l) tuning results"
    ;;
  *) echo "usage: $0 pack DIR TGZ | unpack TGZ DIR" >&2; exit 2 ;;
esac
