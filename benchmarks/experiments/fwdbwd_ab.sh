#!/usr/bin/env bash
# On the GPU, after benchmarks/gpu_attention.sh has installed ours into /tmp/site: ours
# fwd+bwd (fwdbwd_probe.py) from two builds in alternating fresh processes, steady clock.
#   OLD_SITE=/tmp/site-old ROUNDS=2 bash benchmarks/experiments/fwdbwd_ab.sh
# OLD_SITE holds the other build's wheels, installed as gpu_attention.sh installs ours.
set -u
for r in $(seq "${ROUNDS:-2}"); do
  for site in /tmp/site "$OLD_SITE"; do
    echo "== round $r: $site"
    PYTHONPATH="$site:/tmp/anchors" python3 benchmarks/experiments/fwdbwd_probe.py
  done
done
