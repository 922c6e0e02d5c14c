#!/usr/bin/env bash
# vLLM's Triton unified attention (`unified_attention`, the kernel of its Triton attention
# backend), the serving anchor of bench_serving.py --anchors, as a folder the lent GPU can import
# without vLLM (its wheel is 336 MB): the kernel module and its Triton helpers from the wheel,
# under empty package __init__ files, with small stand-ins for the vllm modules they import
# (envs, logger, platforms, triton_utils, kv_cache_interface). Run here, in the repo root (it
# writes .whl-vllm/, which .git/info/exclude should name); carry .whl-vllm with the call and put
# it on PYTHONPATH (gpu_serving.sh copies it into the install folder).
set -euo pipefail
spec=${VLLM_VERSION:-0.33.*}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! python3 -m pip download -q --no-deps --only-binary :all: -d "$work" "vllm==$spec" 2>/dev/null; then
  url=$(curl -fsS https://pypi.org/simple/vllm/ | grep -o "https://[^\"#]*vllm-${spec//\*/[0-9a-z.]*}-cp38-abi3-manylinux_2_28_x86_64.whl" | tail -1)
  curl -fsS -o "$work/$(basename "$url")" "$url"
fi
wheel=$(ls "$work"/vllm-*.whl | head -1)
version=$(basename "$wheel" | cut -d- -f2)
ops=vllm/v1/attention/ops
rm -rf .whl-vllm && mkdir -p .whl-vllm
unzip -q -o "$wheel" -d .whl-vllm "$ops/triton_unified_attention.py" "$ops/triton_attention_helpers.py"
unzip -q -o -j "$wheel" -d .whl-vllm/vllm "vllm-$version.dist-info/licenses/LICENSE"
for d in vllm vllm/v1 vllm/v1/attention "$ops"; do : > ".whl-vllm/$d/__init__.py"; done
mkdir -p .whl-vllm/vllm/platforms .whl-vllm/vllm/triton_utils
cat > .whl-vllm/vllm/envs.py <<'EOF'
import os

VLLM_BATCH_INVARIANT = bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))
EOF
cat > .whl-vllm/vllm/logger.py <<'EOF'
import logging


def init_logger(name):
    logger = logging.getLogger(name)
    logger.debug_once = logger.debug
    return logger
EOF
cat > .whl-vllm/vllm/platforms/__init__.py <<'EOF'
import torch


class _Cuda:
    @staticmethod
    def fp8_dtype():
        return torch.float8_e4m3fn

    @staticmethod
    def is_device_capability_family(capability, device_id=0):
        if not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability(device_id)[0] == capability // 10


current_platform = _Cuda()
EOF
cat > .whl-vllm/vllm/triton_utils/__init__.py <<'EOF'
import triton
import triton.language as tl

__all__ = ["tl", "triton"]
EOF
cat > .whl-vllm/vllm/v1/kv_cache_interface.py <<'EOF'
from enum import IntEnum


class KVQuantMode(IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
EOF
echo "$version" > .whl-vllm/vllm/VERSION
echo "vllm $version Triton unified attention in .whl-vllm ($(du -sh .whl-vllm | cut -f1))"
