"""multi_head_latent_attention in Triton: MLA (DeepSeek-V2, Sec. 2.1) in two exact forms.

- **absorbed** (decode and short queries): ``W_kc`` is folded into the query
  (``q_lat = q_nope · W_kcᵀ``), every head attends to the shared latent in
  :mod:`ejkernel_triton.kernels.mla_absorbed` (each cached token read once, as ``R + Dr``
  features, for all heads: the bytes of a latent cache, not ``Hq · (Dn + Dv)`` per token),
  and ``W_vc`` is applied to the latent output.
- **expanded** (prefill, training): per-head keys ``c · W_kc ∥ k_rope`` and values
  ``c · W_vc`` are formed by two matmuls, then Triton flash attention
  (``ejkernel.flash_attention(..., platform="triton")``, its forward and backward kernels).

Which form (:class:`MultiHeadLatentAttentionConfig` ``form``; ``None`` and the heuristic apply
this rule): the one with fewer multiply-adds, absorbed ``Sq·Sk·Hq·(2R + Dr) + Sq·Hq·R·(Dn + Dv)``
against expanded ``Sq·Sk·Hq·(Dn + Dr + Dv) + Sk·Hq·R·(Dn + Dv)`` (absorbed for ``Sq ≲ R / 3``
at DeepSeek's sizes).

Gradients: the expanded form is differentiated through its matmuls and the flash attention
op's own backward; a differentiated absorbed call takes its gradients from the expanded form
(recomputed in the backward). Non-finite latent and rotary-key entries read as 0
(:func:`ejkernel.attention_semantics.finite_or_zero`), as the spec has it.

:func:`supports` declines dtypes other than bf16/f16/f32; the expanded form needs
``Dn + Dr`` and ``Dv`` ≤ 256 (flash attention's head dims), the absorbed one ``R`` ≤ 512.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

import ejkernel
from ejkernel.attention_semantics import finite_or_zero
from ejkernel.plugins import defvjp
from ejkernel_triton import _launch, _smem
from ejkernel_triton._launch import pow2

__all__ = [
    "FORMS",
    "MultiHeadLatentAttentionConfig",
    "config_space",
    "heuristic",
    "absorbed_shared_memory",
    "multi_head_latent_attention_triton",
    "splits_for",
    "supports",
]

FORMS = ("absorbed", "expanded")
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_HEAD_DIM = 256
_MAX_LATENT = 512
_ARRAYS = ("query", "key_value", "w_kc", "w_vc", "k_rope")


def _power_of_two(config: Any, attribute: Any, value: int) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(
            f"MultiHeadLatentAttentionConfig.{attribute.name} must be a power of two ≥ 16; "
            f"got {value}"
        )


@attrs.frozen(kw_only=True)
class MultiHeadLatentAttentionConfig:
    """Tunables of the Triton MLA.

    Attributes:
        form: ``"absorbed"``, ``"expanded"`` or ``None`` (the form with fewer multiply-adds).
        block_m: (query, head) rows per program of the absorbed kernel.
        block_n: latent tokens per step of the absorbed kernel.
        num_splits: programs the keys of a block of rows are split over (absorbed; their
            partial outputs are merged by log-sum-exp); ``None``: enough to give the GPU two
            programs per SM, at least four key blocks each.
        num_warps: warps per program (absorbed).
        num_stages: software-pipelining stages (absorbed).
    """

    form: str | None = attrs.field(default=None, validator=attrs.validators.in_((None, *FORMS)))
    block_m: int = attrs.field(default=16, validator=_power_of_two)
    block_n: int = attrs.field(default=32, validator=_power_of_two)
    num_splits: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    num_warps: int = 4
    num_stages: int = 2


def _sizes(a: Any) -> tuple[int, int, int, int, int, int, int]:
    """``(Sq, Sk, Hq, R, Dn, Dr, Dv)`` of a call's keyword arguments."""
    q, c, w_kc, w_vc = a["query"], a["key_value"], a["w_kc"], a["w_vc"]
    dn = int(w_kc.shape[2])
    return (
        int(q.shape[1]),
        int(c.shape[1]),
        int(q.shape[2]),
        int(c.shape[2]),
        dn,
        int(q.shape[3]) - dn,
        int(w_vc.shape[2]),
    )


def mla_form(sq: int, sk: int, hq: int, r: int, dn: int, dr: int, dv: int) -> str:
    """The form with fewer multiply-adds (ties: absorbed)."""
    absorbed = sq * sk * hq * (2 * r + dr) + sq * hq * r * (dn + dv)
    expanded = sq * sk * hq * (dn + dr + dv) + sk * hq * r * (dn + dv)
    return "absorbed" if absorbed <= expanded else "expanded"


def _form_problem(form: str, a: Any) -> str | None:
    _, _, _, r, dn, dr, dv = _sizes(a)
    if form == "expanded" and max(dn + dr, dv) > _MAX_HEAD_DIM:
        return f"the expanded form needs Dn + Dr and Dv ≤ {_MAX_HEAD_DIM}; got {dn + dr}, {dv}"
    if form == "absorbed" and r > _MAX_LATENT:
        return f"the absorbed form holds R ≤ {_MAX_LATENT}; got R {r}"
    return None


def supports(inv: Any) -> bool | str:
    """True, or why not: dtypes other than bf16/f16/f32, or sizes neither form holds."""
    a = inv.kwargs
    dtype = a["query"].dtype
    if dtype not in _DTYPES:
        return f"dtype {dtype} (the Triton kernels take bfloat16, float16, float32)"
    problems = [_form_problem(form, a) for form in FORMS]
    if all(problems):
        return "; ".join(p for p in problems if p)
    return True


#: Programs the absorbed kernel aims for: two per SM of an H100 (132 SMs).
_TARGET_PROGRAMS = 264
#: Fewest key blocks a split of the absorbed kernel walks.
_MIN_BLOCKS_PER_SPLIT = 4


def splits_for(rows: int, batch: int, sk: int, cfg: Any) -> int:
    """The absorbed kernel's key splits: ``cfg.num_splits``, else enough to reach
    :data:`_TARGET_PROGRAMS` programs, keeping at least :data:`_MIN_BLOCKS_PER_SPLIT` key
    blocks a split (one split in the interpreter)."""
    if cfg.num_splits is not None:
        return cfg.num_splits
    if _launch.interpreting():
        return 1
    programs = -(-rows // cfg.block_m) * batch
    blocks = -(-sk // cfg.block_n)
    return max(1, min(-(-_TARGET_PROGRAMS // programs), blocks // _MIN_BLOCKS_PER_SPLIT))


def absorbed_shared_memory(
    cfg: MultiHeadLatentAttentionConfig, r: int, dr: int, itemsize: int
) -> int:
    """Bytes of shared memory the absorbed kernel takes: the block's query rows
    (``[block_m, R + Dr]``) once and ``num_stages`` buffers of latent and rotary-key rows
    (``[block_n, R + Dr]``), in the input dtype (what Triton 3.6 allocates for sm_90)."""
    width = pow2(r) + (pow2(dr) if dr else 0)
    return itemsize * width * (cfg.block_m + cfg.num_stages * cfg.block_n)


def heuristic(inv: Any) -> MultiHeadLatentAttentionConfig:
    """The cheaper form that holds the call; for the absorbed kernel, 64 (query, head) rows a
    program with 8 warps where the call has that many (the block's latent products run on
    Hopper's warpgroup matrix instructions) and 64 latent tokens a step, fewer of either (and
    at the least one pipeline stage) where the device's shared memory is smaller; 16 and 16
    in the interpreter."""
    a = inv.kwargs
    sq, _, hq, r, _, dr, _ = _sizes(a)
    form = mla_form(*_sizes(a))
    if _form_problem(form, a):
        form = next(f for f in FORMS if f != form)
    if _launch.interpreting():
        return MultiHeadLatentAttentionConfig(form=form, block_m=16, block_n=16)
    itemsize = jnp.dtype(a["query"].dtype).itemsize
    limit = _smem.launch_limit()
    rows = sq * hq
    cfg = MultiHeadLatentAttentionConfig(form=form)
    for block_m in (64, 32, 16):
        if block_m > rows and block_m > 16:
            continue
        for block_n in (64, 32, 16):
            cfg = MultiHeadLatentAttentionConfig(
                form=form, block_m=block_m, block_n=block_n, num_warps=8 if block_m == 64 else 4
            )
            if absorbed_shared_memory(cfg, r, dr, itemsize) <= limit:
                return cfg
    return attrs.evolve(cfg, num_stages=1)  # the latent rows unpipelined


def config_space(inv: Any) -> list[MultiHeadLatentAttentionConfig]:
    """The heuristic, then the absorbed kernel's blocks and warps within the device's shared
    memory (:func:`absorbed_shared_memory`), its key splits, and the expanded form."""
    base = heuristic(inv)
    if _launch.interpreting():
        return [base]
    _, _, _, r, _, dr, _ = _sizes(inv.kwargs)
    itemsize = jnp.dtype(inv.kwargs["query"].dtype).itemsize
    limit = _smem.launch_limit()
    out = [base]
    if not _form_problem("absorbed", inv.kwargs):
        for block_m in (16, 32, 64):
            for block_n in (16, 32, 64):
                for warps in (4, 8):
                    cfg = MultiHeadLatentAttentionConfig(
                        form="absorbed", block_m=block_m, block_n=block_n, num_warps=warps
                    )
                    fits = absorbed_shared_memory(cfg, r, dr, itemsize) <= limit
                    if fits and cfg not in out:
                        out.append(cfg)
        for splits in (1, 2, 4, 8, 16):
            cfg = attrs.evolve(base, form="absorbed", num_splits=splits)
            if cfg not in out:
                out.append(cfg)
    expanded = MultiHeadLatentAttentionConfig(form="expanded")
    if not _form_problem("expanded", inv.kwargs) and expanded not in out:
        out.append(expanded)
    return out


# -- the op ---------------------------------------------------------------------------------


def multi_head_latent_attention_triton(
    *, cfg: MultiHeadLatentAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """MLA through the Triton kernels.

    Args:
        **args: the arguments of
            :func:`ejkernel.specs.multi_head_latent_attention.multi_head_latent_attention`, by
            name, as the core spec validated them.
        cfg: the form and the absorbed kernel's blocks; ``None`` takes the heuristic's.

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    cfg = _resolved(cfg, args)
    if cfg.form == "expanded":
        return _expanded(args)
    return _absorbed(args, cfg)


def _mla_fwd(
    *, cfg: MultiHeadLatentAttentionConfig | None = None, **args: Any
) -> tuple[jax.Array, dict[str, Any]]:
    """Forward: ``(out, residuals)``; the expanded form keeps its VJP, the absorbed one its
    inputs."""
    cfg = _resolved(cfg, args)
    diff = {n: args[n] for n in _ARRAYS}
    if cfg.form == "expanded":
        out, pull = jax.vjp(lambda d: _expanded({**args, **d}), diff)
        return out, {"pull": pull}
    return _absorbed(args, cfg), {"inputs": diff}


def _mla_bwd(
    residuals: dict[str, Any],
    d_out: jax.Array,
    *,
    cfg: MultiHeadLatentAttentionConfig | None = None,
    **statics: Any,
) -> dict[str, jax.Array | None]:
    """Backward: gradients of query, key_value, w_kc, w_vc and k_rope."""
    del cfg
    if "pull" in residuals:
        (grads,) = residuals["pull"](d_out)
        return dict(grads)
    diff = residuals["inputs"]
    _, pull = jax.vjp(lambda d: _expanded({**statics, **d}), diff)
    (grads,) = pull(d_out)
    return dict(grads)


defvjp(multi_head_latent_attention_triton, _mla_fwd, _mla_bwd)


def _resolved(
    cfg: MultiHeadLatentAttentionConfig | None, args: dict[str, Any]
) -> MultiHeadLatentAttentionConfig:
    """``cfg`` (the heuristic's when ``None``) with its form decided; a form that cannot
    serve the call raises ``ValueError``."""
    if cfg is None:
        cfg = heuristic(_Inv(args))
    if cfg.form is None:
        cfg = attrs.evolve(cfg, form=heuristic(_Inv(args)).form)
    why = _form_problem(cfg.form, args)
    if why:
        raise ValueError(f"multi_head_latent_attention (triton): {why}")
    return cfg


@attrs.frozen
class _Inv:
    kwargs: dict[str, Any]


def _attention_statics(args: dict[str, Any]) -> dict[str, Any]:
    d = args["query"].shape[-1]
    scale = args.get("softmax_scale")
    return {
        "softmax_scale": float(d**-0.5 if scale is None else scale),
        "causal": bool(args.get("causal", False)),
        "sliding_window": args.get("sliding_window"),
        "logits_soft_cap": args.get("logits_soft_cap"),
    }


def _expanded(args: dict[str, Any]) -> jax.Array:
    """Per-head keys and values by two matmuls, then Triton flash attention."""
    q, c, w_kc, w_vc, rope = (args[n] for n in _ARRAYS)
    b, sk, _ = c.shape
    hq, dr = w_kc.shape[1], rope.shape[-1]
    c = finite_or_zero(c)
    f32 = jnp.float32
    k_nope = jnp.einsum("bsr,rhn->bshn", c, w_kc, preferred_element_type=f32).astype(q.dtype)
    k_rope = jnp.broadcast_to(finite_or_zero(rope)[:, :, None, :], (b, sk, hq, dr))
    key = jnp.concatenate([k_nope, k_rope.astype(q.dtype)], axis=-1)
    value = jnp.einsum("bsr,rhv->bshv", c, w_vc, preferred_element_type=f32).astype(q.dtype)
    return ejkernel.flash_attention(q, key, value, platform="triton", **_attention_statics(args))


def _absorbed(args: dict[str, Any], cfg: MultiHeadLatentAttentionConfig) -> jax.Array:
    """``W_kc`` into the query, the absorbed kernel over the latent, ``W_vc`` on its output."""
    q, c, w_kc, w_vc, rope = (args[n] for n in _ARRAYS)
    b, sq, hq, d = q.shape
    sk, r = c.shape[1], c.shape[2]
    dn, dr = w_kc.shape[2], d - w_kc.shape[2]
    st = _attention_statics(args)
    window = st["sliding_window"]
    if isinstance(window, int):
        window = (window, window)
    f32 = jnp.float32
    q_lat = jnp.einsum("bqhn,rhn->bqhr", q[..., :dn], w_kc, preferred_element_type=f32)
    q_lat = q_lat.astype(q.dtype)
    q_rope = q[..., dn:] if dr else jnp.zeros((b, sq, hq, 1), q.dtype)
    k_rope = rope if dr else jnp.zeros((b, sk, 1), q.dtype)
    cap = st["logits_soft_cap"]
    from ejkernel_triton.kernels.mla_absorbed import mla_absorbed_fwd_kernel

    splits = splits_for(sq * hq, b, sk, cfg)
    o_parts, lse = _launch.launch(
        mla_absorbed_fwd_kernel,
        q_lat,
        q_rope,
        c,
        k_rope,
        np.float32(st["softmax_scale"]),
        np.float32(cap if cap else 1.0),
        sq,
        sk,
        window[0] if window else 0,
        window[1] if window else 0,
        hq,
        out_shape=[
            jax.ShapeDtypeStruct((splits, b, sq, hq, r), f32),
            jax.ShapeDtypeStruct((splits, b, sq, hq), f32),
        ],
        grid=(-(-(sq * hq) // cfg.block_m), b, splits),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        R=r,
        DR=dr,
        BR=pow2(r),
        BDR=pow2(max(dr, 1)),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        CAUSAL=st["causal"],
        WINDOW=window is not None,
        SOFT_CAP=bool(cap),
        DOT_PRECISION="ieee" if jnp.dtype(q.dtype) == jnp.float32 else "tf32",
    )
    if splits == 1:
        o_lat = o_parts[0]
    else:  # merge the splits by their log2-sum-exp (an empty split weighs 0)
        weights = jnp.exp2(lse - jnp.max(lse, axis=0))
        total = jnp.sum(weights, axis=0)
        o_lat = jnp.sum(weights[..., None] * o_parts, axis=0)
        o_lat = o_lat / jnp.where(total > 0, total, 1.0)[..., None]
    out = jnp.einsum("bqhr,rhv->bqhv", o_lat, w_vc.astype(f32))
    return out.astype(q.dtype)
