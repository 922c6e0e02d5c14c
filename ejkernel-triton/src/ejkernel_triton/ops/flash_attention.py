"""flash_attention (and scaled_dot_product_attention) in Triton: the registered entries, their
VJP and the launch wrappers.

The config, the kernel variants, the heuristic and the config space are in
:mod:`ejkernel_triton.ops.flash_attention_config` (re-exported here, where the plugin registers
them); the launches of the specialized (Hopper) variants in
:mod:`ejkernel_triton.ops.flash_attention_specialized`; the kernels in :mod:`ejkernel_triton.kernels` (``flash_attention_fwd``,
``flash_attention_bwd``, and the Gluon ``flash_attention_hopper_fwd``/``_bwd``). The config's
variants decide what runs, exactly:

- forward (``fwd_variant``): ``usual``, ``warp_specialized`` (persistent) or ``pingpong``
  (Gluon): output ``[B, Sq, Hq, Dv]`` and the per-row log2-sum-exp ``[B, Hq, Sq]`` (float32,
  the only residual besides the inputs and the output);
- backward (``bwd_variant``): ``usual``, the dQ kernel (one program per query block and query
  head), which also computes ``delta = rowsum(dO ∘ O)`` and writes the logit gradient when
  there is a bias, then the dK/dV kernel (one program per key block and key head, looping
  over the group's query heads: no K/V repeat, no atomics); ``warp_specialized``, their TMA
  twins; ``gluon``, one Gluon kernel for dQ, dK and dV (dQ accumulates in float32 by TMA
  reduce-adds across the key blocks' programs, so its last bits depend on their order);
  ``gluon_dkdv``, the usual dQ kernel then the Gluon kernel for dK and dV. The specialized
  ones take delta from JAX. The sink gradient is ``-Σ p_sink · delta``, in JAX.

Everything of OPS.md's flash_attention is served except dropout, which :func:`supports`
declines (the XLA platform then serves the call). Both functions compose with ``jit``,
``grad`` and ``vmap`` (:func:`ejkernel_triton._launch.fold_vmap` folds vmapped axes into the
batch of the grid).
"""

from __future__ import annotations

import math
import types
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.attention_semantics import EMPTY_ROW_LSE
from ejkernel.ops import FwdParams
from ejkernel.plugins import deflse, defvjp
from ejkernel_triton import _launch
from ejkernel_triton._launch import BATCH, BROADCAST, OTHER
from ejkernel_triton.ops import flash_attention_specialized as specialized
from ejkernel_triton.ops.flash_attention_config import (
    BWD_VARIANTS,
    FWD_VARIANTS,
    Call,
    FlashAttentionConfig,
    bwd_launch_params,
    check,
    clamp,
    config_space,
    fit_stages,
    fwd_smem,
    heuristic,
    pow2,
    resolve,
    supports,
)

__all__ = [
    "BWD_VARIANTS",
    "FWD_VARIANTS",
    "FlashAttentionConfig",
    "config_space",
    "flash_attention_triton",
    "heuristic",
    "supports",
]

_LOG2E = 1.4426950408889634
#: The kernels' log2-sum-exp of a row with no visible key (``EMPTY_LSE`` of
#: :mod:`ejkernel_triton.kernels.flash_attention_common`).
_EMPTY_LSE2 = 3.0e38


# -- the op ---------------------------------------------------------------------------------


def flash_attention_triton(*, cfg: FlashAttentionConfig | None = None, **args: Any) -> jax.Array:
    """Exact attention through the Triton kernels.

    Args:
        **args: the arguments of :func:`ejkernel.specs.flash_attention.flash_attention`, by
            name, as the core spec validated them (absent ones take the spec's defaults);
            ``dropout_prob`` must be 0 (:func:`supports` declines dropout).
        cfg: the kernel variants with their block sizes, warps and stages; ``None`` takes the
            heuristic's. A variant that cannot serve the call raises ``ValueError``.

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    out, _ = _flash_attention_fwd(cfg=cfg, **args)
    return out


def _flash_attention_fwd(
    *, cfg: FlashAttentionConfig | None = None, **args: Any
) -> tuple[jax.Array, dict[str, Any]]:
    """Forward: ``(out, residuals)``; residuals are the inputs, the output and the lse."""
    if args.get("dropout_prob"):
        raise ValueError("flash_attention (triton): dropout is not supported; use the xla platform")
    arrays = _Arrays.of(args)
    st = _Statics.of(arrays, cfg, "fwd", **_static_args(args))
    out, lse = _forward_call(st, arrays.modes())(*arrays.launch_args())
    return out, {"arrays": arrays, "out": out, "lse": lse}


def _static_args(args: dict[str, Any]) -> dict[str, Any]:
    """The call's options the kernels take as scalars and constexprs (spec defaults filled)."""
    return {
        "softmax_scale": args.get("softmax_scale"),
        "causal": args.get("causal", False),
        "sliding_window": args.get("sliding_window"),
        "logits_soft_cap": args.get("logits_soft_cap"),
    }


def _flash_attention_bwd(
    residuals: dict[str, Any],
    d_out: jax.Array,
    *,
    cfg: FlashAttentionConfig | None = None,
    **statics: Any,
) -> dict[str, jax.Array | None]:
    """Backward: gradients of query, key, value, bias (its own shape) and softmax_aux;
    ``statics``: the call's static arguments, by name."""
    arrays, out, lse = _grad_inputs(residuals)
    st = _Statics.of(arrays, cfg, "bwd", **_static_args(statics))
    call = _backward_call(st, arrays.modes())
    dq, dk, dv, dbias, delta = call(*arrays.launch_args(), d_out, lse, out)
    grads: dict[str, jax.Array | None] = {"query": dq, "key": dk, "value": dv}
    grads["bias"] = arrays.bias_gradient(dbias)
    grads["softmax_aux"] = arrays.aux_gradient(lse, delta)
    return grads


defvjp(flash_attention_triton, _flash_attention_fwd, _flash_attention_bwd)


def _grad_inputs(residuals: dict[str, Any]) -> tuple[_Arrays, jax.Array, jax.Array]:
    """The forward's ``(arrays, out, lse)`` from its residuals, a NaN lse read as +inf.

    A row that sees a NaN or Inf key has a NaN lse (the forward cleans only V): as +inf its
    probabilities are all 0, never NaN at its hidden entries, whose keys other rows may own.
    """
    lse = residuals["lse"]
    return residuals["arrays"], residuals["out"], jnp.where(jnp.isnan(lse), jnp.inf, lse)


def _flash_attention_lse_fwd(
    *, cfg: FlashAttentionConfig | None = None, **args: Any
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse [B, Sq, Hq])``, the lse in natural log (the kernels keep log2 ``[B, Hq, Sq]``);
    an empty row's is ``EMPTY_ROW_LSE``."""
    out, residuals = _flash_attention_fwd(cfg=cfg, **args)
    lse2 = residuals["lse"]
    lse = jnp.where(lse2 >= _EMPTY_LSE2, EMPTY_ROW_LSE, lse2 / _LOG2E)
    return out, lse.transpose(0, 2, 1)


def _flash_attention_lse_bwd(
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    cfg: FlashAttentionConfig | None = None,
    **args: Any,
) -> dict[str, jax.Array | None]:
    """Gradients from the softmax statistics ``out`` and ``lse`` [B, Sq, Hq] given by the caller."""
    lse = lse.astype(jnp.float32).transpose(0, 2, 1)
    lse2 = jnp.where(lse >= EMPTY_ROW_LSE, _EMPTY_LSE2, lse * _LOG2E)
    residuals = {"arrays": _Arrays.of(args), "out": out, "lse": lse2}
    return _flash_attention_bwd(residuals, d_out, cfg=cfg, **_static_args(args))


deflse(flash_attention_triton, _flash_attention_lse_fwd, _flash_attention_lse_bwd)


# -- argument layout ------------------------------------------------------------------------


@attrs.frozen
class _Options:
    """The call's options that every kernel of this argument layout takes (:func:`_common`)."""

    sm_scale: float
    soft_cap: float | None
    causal: bool
    window: tuple[int, int] | None
    precision: str

    def scale_and_cap(self) -> tuple[np.float32, np.float32]:
        """The first two scalars of every kernel: the softmax scale and the soft cap (1 when
        there is none), as np.float32 (jax-triton would pass a Python float as fp64)."""
        return np.float32(self.sm_scale), np.float32(self.soft_cap or 1.0)

    @staticmethod
    def fields(
        query: jax.Array,
        *,
        softmax_scale: float | None,
        causal: bool,
        sliding_window: tuple[int, int] | None,
        logits_soft_cap: float | None,
    ) -> dict[str, Any]:
        """The options' fields, by name, from the query and the call's options."""
        scale = query.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        return {
            "sm_scale": scale,
            "soft_cap": None if logits_soft_cap is None else float(logits_soft_cap),
            "causal": bool(causal),
            "window": None if sliding_window is None else tuple(int(w) for w in sliding_window),
            "precision": "ieee" if query.dtype == jnp.float32 else "tf32",
        }


@attrs.frozen
class _Statics(_Options):
    """What the kernels take as scalars and constexprs, from the call and its config (the
    variants checked against the call, the params resolved by the variants)."""

    fwd: FwdParams
    bwd: Any
    dq: FwdParams
    fwd_variant: str
    bwd_variant: str
    fwd_head_group: int
    bwd_head_group: int
    scale_in_exponent: bool

    @classmethod
    def of(
        cls,
        arrays: _Arrays,
        cfg: FlashAttentionConfig | None,
        passes: str,
        *,
        softmax_scale: float | None,
        causal: bool,
        sliding_window: tuple[int, int] | None,
        logits_soft_cap: float | None,
    ) -> _Statics:
        query = arrays.query
        kwargs = {
            "query": query,
            "key": arrays.key,
            "value": arrays.value,
            "bias": arrays.bias,
            "attention_mask": arrays.mask,
            "q_segment_ids": arrays.q_segment_ids,
            "kv_segment_ids": arrays.kv_segment_ids,
            "softmax_aux": arrays.aux,
            "softmax_scale": softmax_scale,
            "causal": causal,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
        }
        if cfg is None:
            cfg = heuristic(types.SimpleNamespace(kwargs=kwargs))
        call = Call.of(kwargs)
        check(cfg, call, (passes,))
        interp = call.interpreting
        if cfg.dq_params is not None:
            dq = cfg.dq_params
        elif cfg.bwd_variant == "warp_specialized":
            dq = FwdParams()  # the kernel's own tiles
        else:
            bwd = cfg.bwd_params
            dq = FwdParams(
                q_blocksize=bwd.kv_blocksize,
                kv_blocksize=bwd.q_blocksize,
                num_warps=bwd.num_warps,
                num_stages=bwd.num_stages,
            )
        dq_variant = "warp_specialized" if cfg.bwd_variant == "warp_specialized" else "usual"
        return cls(
            **_Options.fields(query, **_static_args(kwargs)),
            fwd=resolve("fwd", cfg.fwd_variant, cfg.fwd_params, interp)[0],
            bwd=resolve("bwd", cfg.bwd_variant, cfg.bwd_params, interp)[0],
            dq=resolve("dq", dq_variant, dq, interp)[0],
            fwd_variant=cfg.fwd_variant,
            bwd_variant=cfg.bwd_variant,
            fwd_head_group=cfg.fwd_head_group,
            bwd_head_group=cfg.bwd_head_group,
            scale_in_exponent=cfg.scale_in_exponent,
        )


@jax.tree_util.register_pytree_node_class
@attrs.frozen
class _Arrays:
    """The array inputs as the kernels take them: bias/mask 4-D, sinks ``[Hq, n]`` float32."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    q_segment_ids: jax.Array | None
    kv_segment_ids: jax.Array | None
    aux: jax.Array | None
    bias_shape: tuple[int, ...] | None = None
    aux_shape: tuple[int, ...] | None = None
    aux_dtype: Any = None

    @classmethod
    def of(cls, args: dict[str, Any]) -> _Arrays:
        """From the call's arguments, by name."""
        query, bias, aux = args["query"], args.get("bias"), args.get("softmax_aux")
        mask, q_seg, kv_seg = (
            args.get(n) for n in ("attention_mask", "q_segment_ids", "kv_segment_ids")
        )
        return cls(
            query,
            args["key"],
            args["value"],
            None if bias is None else _as_4d(bias),
            None if mask is None else _as_4d(mask).astype(jnp.int8),
            None if q_seg is None else q_seg.astype(jnp.int32),
            None if kv_seg is None else kv_seg.astype(jnp.int32),
            None if aux is None else aux.astype(jnp.float32).reshape(query.shape[2], -1),
            None if bias is None else tuple(bias.shape),
            None if aux is None else tuple(aux.shape),
            None if aux is None else aux.dtype,
        )

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        children = (
            self.query,
            self.key,
            self.value,
            self.bias,
            self.mask,
            self.q_segment_ids,
            self.kv_segment_ids,
            self.aux,
        )
        return children, (self.bias_shape, self.aux_shape, self.aux_dtype)

    @classmethod
    def tree_unflatten(cls, aux_data: tuple[Any, ...], children: tuple[Any, ...]) -> _Arrays:
        return cls(*children, *aux_data)

    def launch_args(self) -> tuple[jax.Array, ...]:
        """The eight array inputs of the kernels; absent ones are 1-element placeholders."""
        return (
            self.query,
            self.key,
            self.value,
            _or_placeholder(self.bias, self.query.dtype),
            _or_placeholder(self.mask, jnp.int8),
            _or_placeholder(self.q_segment_ids, jnp.int32),
            _or_placeholder(self.kv_segment_ids, jnp.int32),
            _or_placeholder(self.aux, jnp.float32),
        )

    def modes(self) -> tuple[str, ...]:
        """How :func:`fold_vmap` folds each launch argument (placeholders never fold)."""
        present = (
            True,
            True,
            True,
            self.bias is not None,
            self.mask is not None,
            self.q_segment_ids is not None,
            self.kv_segment_ids is not None,
            False,
        )
        kinds = (BATCH, BATCH, BATCH, BROADCAST, BROADCAST, BATCH, BATCH, OTHER)
        return tuple(k if p else OTHER for k, p in zip(kinds, present, strict=True))

    def bias_gradient(self, dbias: jax.Array) -> jax.Array | None:
        """Sum the ``[B, Hq, Sq, Sk]`` logit gradient into the bias's own shape and dtype."""
        if self.bias is None:
            return None
        axes = tuple(i for i, n in enumerate(self.bias.shape) if n == 1 and dbias.shape[i] != 1)
        g = jnp.sum(dbias, axis=axes, keepdims=True)
        return g.reshape(self.bias_shape).astype(self.bias.dtype)

    def aux_gradient(self, lse: jax.Array, delta: jax.Array) -> jax.Array | None:
        """``d aux[h, j] = -Σ_{b, i} exp(aux[h, j] - lse[b, h, i]) · delta[b, h, i]``."""
        if self.aux is None:
            return None
        lse_nat = lse / _LOG2E
        p = jnp.exp(self.aux[None, :, None, :] - lse_nat[..., None])  # [B, Hq, Sq, n]
        g = -jnp.einsum("bhin,bhi->hn", p, delta)
        return g.reshape(self.aux_shape).astype(self.aux_dtype)


def _as_4d(x: jax.Array) -> jax.Array:
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))


def _or_placeholder(x: jax.Array | None, dtype: Any) -> jax.Array:
    return jnp.zeros((1,), dtype) if x is None else x


def _strides(shape: tuple[int, ...], align: int) -> list[int]:
    """Row-major strides of the three leading axes of a [B, S, H, D] array, in units of
    ``align`` elements (the kernels multiply them back by their constexpr ``ALIGN``)."""
    return [int(np.prod(shape[i + 1 :])) // align for i in range(3)]


def _broadcast_strides(x: jax.Array) -> list[int]:
    """Row-major strides of a 4-D bias/mask, 0 along size-1 axes (read as broadcast)."""
    if x.ndim != 4:  # placeholder
        return [0, 0, 0, 0]
    strides, step = [], 1
    for n in reversed(x.shape):
        strides.append(step if n != 1 else 0)
        step *= n
    return strides[::-1]


def _layout_strides(
    align: int, q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, mask: jax.Array
) -> list[int]:
    """The strides the usual kernels (and blocksparse attention's) take after their scalars:
    those of Q, K, V and the output (and dO, of the output's shape ``[B, Sq, Hq, Dv]``) in
    units of ``align``, then the bias's and the mask's."""
    return [
        *_strides(q.shape, align),
        *_strides(k.shape, align),
        *_strides(v.shape, align),
        *_strides((*q.shape[:3], v.shape[-1]), align),
        *_broadcast_strides(bias),
        *_broadcast_strides(mask),
    ]


def _common(
    st: _Options, q: jax.Array, v: jax.Array, bias: jax.Array, mask: jax.Array, qseg: jax.Array
) -> tuple[list[Any], dict[str, Any]]:
    """Scalars shared by the kernels (after the arrays) and their constexprs."""
    _, sq, hq, d = q.shape
    _, sk, hkv, dv = v.shape
    left, right = st.window or (0, 0)
    scalars = [
        *st.scale_and_cap(),
        sq,
        sk,
        hq,
        hkv,
        left,
        right,
    ]
    constexprs = {
        "HEAD_DIM": d,
        "HEAD_DIM_V": dv,
        "BLOCK_D": pow2(d),
        "BLOCK_DV": pow2(dv),
        "CAUSAL": st.causal,
        "WINDOW": st.window is not None,
        "SOFT_CAP": st.soft_cap is not None,
        "HAS_BIAS": bias.ndim == 4,
        "HAS_MASK": mask.ndim == 4,
        "HAS_SEG": qseg.ndim == 2,
        "DOT_PRECISION": st.precision,
        # every q/k/v/o/dO stride is a multiple of gcd(D, Dv): say so, up to 16 elements
        "ALIGN": _pow2_factor(math.gcd(d, dv), 16),
    }
    return scalars, constexprs


def _forward_call(st: _Statics, modes: tuple[str, ...]) -> Any:
    """``run(arrays...) -> (out, lse)`` by the config's forward variant."""

    def run(q, k, v, bias, mask, qseg, kseg, aux):
        from ejkernel_triton.kernels.flash_attention_fwd import flash_attention_fwd_kernel

        if st.fwd_variant == "pingpong":
            return tuple(specialized.forward_pingpong(st, q, k, v))
        if st.fwd_variant == "warp_specialized":
            return tuple(specialized.forward_ws(st, q, k, v))
        b, sq, hq, _ = q.shape
        dv = v.shape[-1]
        scalars, constexprs = _common(st, q, v, bias, mask, qseg)
        has_aux = aux.ndim == 2
        num_aux = aux.shape[1] if has_aux else 1
        head_group = st.fwd_head_group if st.causal else 0  # longest query blocks first
        plain = not any(constexprs[f] for f in ("SOFT_CAP", "HAS_BIAS", "HAS_MASK", "HAS_SEG"))
        constexprs.update(
            HAS_AUX=has_aux,
            BLOCK_AUX=pow2(num_aux),
            HEAD_GROUP=head_group,
            PLAIN_SCALE=st.scale_in_exponent and plain and st.sm_scale >= 0,
        )
        bq, bk = (
            clamp(st.fwd.q_blocksize or 128, sq),
            clamp(st.fwd.kv_blocksize or 64, k.shape[1]),
        )
        out, lse = _launch.launch(
            flash_attention_fwd_kernel,
            q,
            k,
            v,
            bias,
            mask,
            qseg,
            kseg,
            aux,
            *scalars,
            num_aux,
            *_layout_strides(constexprs["ALIGN"], q, k, v, bias, mask),
            out_shape=[
                jax.ShapeDtypeStruct((b, sq, hq, dv), q.dtype),
                jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
            ],
            grid=(_cdiv(sq, bq), b * hq),
            num_warps=st.fwd.num_warps or 4,
            num_stages=fit_stages(
                st.fwd.num_stages or 2,
                lambda n: fwd_smem(bq, bk, n, pow2(q.shape[-1]), pow2(dv), q.dtype.itemsize),
                bq * bk,
                bias,
                mask,
            ),
            BLOCK_M=bq,
            BLOCK_N=bk,
            **constexprs,
        )
        return out, lse

    return _launch.fold_vmap(run, modes)


def _backward_call(st: _Statics, modes: tuple[str, ...]) -> Any:
    """``run(arrays..., dO, lse, out) -> (dQ, dK, dV, dBias, delta)``; delta
    (``rowsum(out ∘ dO)``, ``[B, Hq, Sq]``) comes out for the sinks' gradient."""

    def run(q, k, v, bias, mask, qseg, kseg, aux, do, lse, out):
        from ejkernel_triton.kernels.flash_attention_bwd import (
            flash_attention_bwd_dkdv_kernel,
            flash_attention_bwd_dq_kernel,
        )

        do = do.astype(q.dtype)
        if st.bwd_variant in ("gluon", "warp_specialized"):  # delta from JAX
            delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
            if st.bwd_variant == "gluon":
                dq, dk, dv = specialized.bwd_gluon(st, q, k, v, do, lse, delta)
            else:
                dk, dv = specialized.dkdv_ws(st, q, k, v, do, lse, delta)
                dq = specialized.dq_ws(st, q, k, v, do, lse, delta)
            return dq, dk, dv, jnp.zeros((1,), jnp.float32), delta
        del aux
        b, sq, hq, _ = q.shape
        _, sk, hkv, _ = k.shape
        scalars, constexprs = _common(st, q, v, bias, mask, qseg)

        def args(rows):  # the arrays and scalars of both kernels; ``rows``: out or delta
            return (
                q,
                k,
                v,
                bias,
                mask,
                qseg,
                kseg,
                do,
                lse,
                rows,
                *scalars,
                *_layout_strides(constexprs["ALIGN"], q, k, v, bias, mask),
            )

        def launch(kernel, rows, params, step, own, out_shape, grid, **extra):
            """One of the two kernels: ``rows`` (out or delta) after the shared arrays;
            ``step`` rows of the other sequence a loop step, ``own`` of the program's."""
            dkdv = kernel is flash_attention_bwd_dkdv_kernel
            return _launch.launch(
                kernel,
                *args(rows),
                out_shape=out_shape,
                grid=grid,
                **bwd_launch_params(params, step, own, q, v, bias, mask, dkdv=dkdv),
                **extra,
                **constexprs,
            )

        # dQ first: it computes delta for the dK/dV kernel
        has_bias = bias.ndim == 4
        qb, kb = clamp(st.dq.q_blocksize or 128, sq), clamp(st.dq.kv_blocksize or 32, sk)
        dq, dbias, delta = launch(
            flash_attention_bwd_dq_kernel,
            out,
            st.dq,
            kb,
            qb,
            [
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, hq, sq, sk) if has_bias else (1,), jnp.float32),
                jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
            ],
            (_cdiv(sq, qb), b * hq),
            zeroed_outputs=(1,),
            BLOCK_M=qb,
            BLOCK_N=kb,
        )
        if st.bwd_variant == "gluon_dkdv":  # dQ and delta from the usual kernel above
            _, dk, dv = specialized.bwd_gluon(st, q, k, v, do, lse, delta, fuse_dq=False)
            return dq, dk, dv, dbias, delta
        bq, bk = clamp(st.bwd.q_blocksize or 32, sq), clamp(st.bwd.kv_blocksize or 128, sk)
        dk, dv = launch(
            flash_attention_bwd_dkdv_kernel,
            delta,
            st.bwd,
            bq,
            bk,
            [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
            (_cdiv(sk, bk), b * hkv),
            BLOCK_M=bq,
            BLOCK_N=bk,
        )
        return dq, dk, dv, dbias, delta

    return _launch.fold_vmap(run, (*modes, BATCH, BATCH, BATCH))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_factor(n: int, cap: int) -> int:
    """The largest power of two dividing ``n``, at most ``cap``."""
    return min(n & -n, cap)
