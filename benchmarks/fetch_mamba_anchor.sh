#!/usr/bin/env bash
# mamba-ssm's Triton SSD (`mamba_chunk_scan_combined`), the state_space_v2 anchor of
# bench_linear_gpu.py, as a folder the lent GPU can import without mamba-ssm's CUDA extension:
# the sdist's Triton SSD modules and the two utility modules they import, under package
# __init__ files of their own (the sdist's import the CUDA extension). Run here, in the repo
# root (it writes .whl-mamba/, which .git/info/exclude should name); carry .whl-mamba with
# the call (gpu_linear.sh copies it into the install folder).
set -euo pipefail
version=${MAMBA_SSM_VERSION:-2.3.2.post1}
work=$(mktemp -d)
url=$(curl -fsS https://pypi.org/simple/mamba-ssm/ | grep -o "https://[^\"#]*mamba_ssm-$version.tar.gz" | head -1)
curl -fsS -o "$work/sdist.tar.gz" "$url"
tar xzf "$work/sdist.tar.gz" -C "$work"
src="$work/mamba_ssm-$version/mamba_ssm"
rm -rf .whl-mamba && mkdir -p .whl-mamba/mamba_ssm/ops/triton .whl-mamba/mamba_ssm/utils
for f in ssd_bmm ssd_chunk_state ssd_state_passing ssd_chunk_scan ssd_combined layernorm_gated k_activations softplus; do
  cp "$src/ops/triton/$f.py" .whl-mamba/mamba_ssm/ops/triton/
done
cp "$src/utils/torch.py" "$src/utils/determinism.py" .whl-mamba/mamba_ssm/utils/
cp "$work/mamba_ssm-$version/LICENSE" .whl-mamba/mamba_ssm/ 2>/dev/null || true
for d in mamba_ssm mamba_ssm/ops mamba_ssm/ops/triton mamba_ssm/utils; do : > ".whl-mamba/$d/__init__.py"; done
echo "mamba-ssm $version Triton SSD in .whl-mamba ($(du -sh .whl-mamba | cut -f1))"
