"""The kernels each Triton flash-attention variant launches, by name."""

from __future__ import annotations

#: The forward's kernel of each ``fwd_variant``.
FWD_KERNEL = {
    "usual": "flash_attention_fwd_kernel",
    "warp_specialized": "flash_attention_fwd_ws_kernel",
    "pingpong": "flash_attention_fwd_pingpong_kernel",
}
#: The backward's kernels of each ``bwd_variant``, in launch order.
BWD_KERNELS = {
    "usual": ["flash_attention_bwd_dq_kernel", "flash_attention_bwd_dkdv_kernel"],
    "warp_specialized": ["flash_attention_bwd_dkdv_ws_kernel", "flash_attention_bwd_dq_ws_kernel"],
    "gluon": ["flash_attention_bwd_gluon_kernel"],
    "gluon_dkdv": ["flash_attention_bwd_dq_kernel", "flash_attention_bwd_gluon_kernel"],
}


def variant_kernels(fwd: str, bwd: str) -> list[str]:
    """What a forward and backward with these variants launch: the forward's kernel, then
    the backward's in order."""
    return [FWD_KERNEL[fwd], *BWD_KERNELS[bwd]]
