"""state_space_v1 in Triton: the Mamba-1 selective scan as a recurrent scan kernel pair.

Per channel i the state ``h[i, :] [N]`` follows ``h_t = exp(Δ_t[i] A[i]) ⊙ h_{t-1} + Δ_t[i]
x_t[i] B_t`` and ``y_t[i] = C_t · h_t[i] + D[i] x_t[i]``, gated by ``silu(z)`` (Gu and Dao,
"Mamba", 2023, Alg. 2). :mod:`ejkernel_triton.kernels.ssm_scan` runs the recurrence itself:
one program per (batch row, block of ``block_i`` channels), sequential over the tokens, the
state ``[block_i, N]`` in float32 registers; ``Δ`` (bias, softplus), the decay ``exp(Δ A)``
(floored as :func:`~ejkernel_triton.ops.state_space_gla.log_decay`: ``A = -inf`` is a reset
where ``Δ > 0``, ``Δ = 0`` passes the state), the skip ``D x`` and the gate are formed in the
kernel from the op's own arrays (``B``, ``C`` read per batch row, nothing broadcast per
channel). Every call, a decoding one included, runs it: the scan kernel is itself the
recurrent kernel.

Backward (the executor's custom VJP: :func:`_vjp_fwd`, :func:`_vjp_bwd`): the differentiated
forward keeps the state every ``chunk`` tokens (``[B, NT, I, N]`` float32); the backward kernel
walks those chunks from the last, recomputing each chunk's states from its checkpoint, then
its tokens backwards with the state gradient. It writes ``dx``, the gate's gradient, ``dΔ``,
per-channel-block shares of ``dB``/``dC`` and per-batch-row ``dA``/``dD``, and the initial
state's gradient; JAX sums the shares and takes ``dΔ`` through softplus and the bias
(autodiff of :func:`~ejkernel_triton.ops.state_space_gla.delta`) and ``dA`` through
:func:`~ejkernel.specs.state_space_v1.decay_rate`.

Config: :class:`StateSpaceV1Config` (channel block, checkpoint chunk, warps, stages).
:func:`supports` declines an ``x`` dtype other than bf16/f16/f32 and N over 256.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp
from ejkernel.specs.state_space_v1 import decay_rate
from ejkernel_triton import _launch
from ejkernel_triton._launch import BATCH, OTHER, pow2
from ejkernel_triton.ops import state_space_gla as ssm
from ejkernel_triton.ops.gla import MIN_LOG_DECAY

__all__ = [
    "StateSpaceV1Config",
    "config_space",
    "heuristic",
    "state_space_v1_triton",
    "supports",
]

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_N = 256
#: The most float32 state entries one program holds (``block_i`` x N rounded up).
_MAX_TILE = 2048
#: Programs that fill an H100/H200 (one per SM) before the channel block shrinks.
_PROGRAMS = 132


def _power_of_two(config: Any, attribute: Any, value: int) -> None:
    if not isinstance(value, int) or value < 2 or value & (value - 1):
        raise ValueError(
            f"StateSpaceV1Config.{attribute.name} must be a power of two ≥ 2; got {value}"
        )


def _positive(config: Any, attribute: Any, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"StateSpaceV1Config.{attribute.name} must be ≥ 1; got {value}")


@attrs.frozen(kw_only=True)
class StateSpaceV1Config:
    """Tunables of the Triton selective scan.

    Attributes:
        block_i: channels per program (a power of two ≥ 2; clamped to I rounded up to one,
            and to :data:`_MAX_TILE` state entries).
        chunk: tokens between the differentiated forward's state checkpoints (the backward
            recomputes a chunk's states from its checkpoint).
        num_warps: warps per program.
        num_stages: software-pipelining stages of the token loop.
    """

    block_i: int = attrs.field(default=32, validator=_power_of_two)
    chunk: int = attrs.field(default=64, validator=_positive)
    num_warps: int = 4
    num_stages: int = 2

    def block(self, i: int, n: int) -> int:
        """``block_i`` clamped to ``I`` rounded up to a power of two and to the tile limit."""
        return max(2, min(self.block_i, pow2(i), _MAX_TILE // pow2(n)))


def supports(inv: Any) -> bool | str:
    """True, or why not: an ``x`` dtype other than bf16/f16/f32, N over 256."""
    x = inv.kwargs["x"]
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} (the Triton kernels take bfloat16, float16, float32)"
    n = inv.kwargs["A"].shape[-1]
    if n > _MAX_N:
        return f"state size N {n}: the kernels hold N ≤ {_MAX_N}"
    return True


def heuristic(inv: Any) -> StateSpaceV1Config:
    """The largest channel block of 64, 32, 16 that still gives :data:`_PROGRAMS` programs
    (16 when none does), checkpoints every 64 tokens, 4 warps (2 for a tile of 256 entries or
    fewer), 2 stages."""
    b, _, i = inv.kwargs["x"].shape
    n = inv.kwargs["A"].shape[-1]
    block = next((bi for bi in (64, 32) if b * _cdiv(i, bi) >= _PROGRAMS), 16)
    cfg = StateSpaceV1Config(block_i=block, chunk=64, num_stages=2)
    warps = 4 if cfg.block(i, n) * pow2(n) > 256 else 2
    return attrs.evolve(cfg, num_warps=warps)


def config_space(inv: Any) -> list[StateSpaceV1Config]:
    """The heuristic, then channel blocks 16, 32, 64 x 2 or 4 warps x 2 or 3 stages."""
    out = [heuristic(inv)]
    for bi, warps, stages in itertools.product((16, 32, 64), (2, 4), (2, 3)):
        cfg = StateSpaceV1Config(block_i=bi, chunk=64, num_warps=warps, num_stages=stages)
        if cfg not in out:
            out.append(cfg)
    return out


def _config(cfg: StateSpaceV1Config | None, args: dict[str, Any]) -> StateSpaceV1Config:
    return heuristic(_Inv(args)) if cfg is None else cfg


@attrs.frozen
class _Inv:
    kwargs: dict[str, Any]


# -- the registered entry and its custom VJP -------------------------------------------------


def state_space_v1_triton(*, cfg: StateSpaceV1Config | None = None, **args: Any) -> Any:
    """The Mamba-1 selective scan through the Triton scan kernel.

    Args:
        **args: the arguments of :func:`ejkernel.specs.state_space_v1.state_space_v1`, by
            name, as the core spec validated them.
        cfg: the kernels' tunables; ``None`` takes the heuristic's.

    Returns:
        out [B, S, I] in the dtype of ``x``, or ``(out, final_state [B, I, N] float32)`` when
        ``return_state``.
    """
    a = {n: args.get(n) for n in ssm.ARRAYS}
    out, final, _ = _forward(a, bool(args.get("dt_softplus")), _config(cfg, args), False)
    return (out, final) if args.get("return_state") else out


def _vjp_fwd(*, cfg: StateSpaceV1Config | None = None, **args: Any) -> tuple[Any, Any]:
    """The differentiated call's forward: the scan kernel, keeping its state checkpoints."""
    a = {n: args.get(n) for n in ssm.ARRAYS}
    out, final, hs = _forward(a, bool(args.get("dt_softplus")), _config(cfg, args), True)
    return ((out, final) if args.get("return_state") else out), {"arrays": a, "h": hs}


def _vjp_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: StateSpaceV1Config | None = None,
    **statics: Any,
) -> dict[str, jax.Array | None]:
    """The gradient of every given array, in its dtype (``None`` for absent ones)."""
    a = residuals["arrays"]
    d_o, d_final = d_out if statics.get("return_state") else (d_out, None)
    cfg = _config(cfg, {**statics, **a})
    return _backward(a, residuals["h"], d_o, d_final, bool(statics.get("dt_softplus")), cfg)


defvjp(state_space_v1_triton, _vjp_fwd, _vjp_bwd)


# -- forward and backward on the scan kernels ------------------------------------------------


def _kernel_arrays(a: dict[str, Any]) -> tuple[jax.Array, ...]:
    """``(x, z, B, C, dt, A, D, dt_bias)`` as the kernels read them: ``x`` standing in for an
    absent gate and ``D`` for an absent bias (neither read then), ``A`` through
    :func:`decay_rate`, ``A``, ``D`` and ``dt_bias`` float32."""
    x = a["x"]
    skip = a["D"].astype(jnp.float32)
    bias = skip if a["dt_bias"] is None else a["dt_bias"].astype(jnp.float32)
    z = x if a["gate"] is None else a["gate"]
    return x, z, a["B"], a["C"], a["dt"], decay_rate(a["A"]), skip, bias


@functools.partial(jax.jit, static_argnames=("softplus", "cfg", "checkpoints"))
def _forward(
    a: dict[str, Any], softplus: bool, cfg: StateSpaceV1Config, checkpoints: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(out [B, S, I] in x's dtype, final_state [B, I, N] float32, checkpoints)``: the
    states before every ``cfg.chunk``-th token ``[B, NT, I, N]`` float32 when
    ``checkpoints``, else a ``[B, 1]`` placeholder."""
    b, _, i = a["x"].shape
    n = a["A"].shape[-1]
    init = a["initial_state"]
    init = jnp.zeros((b, i, n), jnp.float32) if init is None else init.astype(jnp.float32)
    flags = _flags(a, softplus)
    launch = functools.partial(_forward_launch, cfg=cfg, flags=flags, checkpoints=checkpoints)
    run = _launch.fold_vmap(launch, (BATCH,) * 5 + (OTHER,) * 3 + (BATCH,))
    return tuple(run(*_kernel_arrays(a), init))


@functools.partial(jax.jit, static_argnames=("softplus", "cfg"))
def _backward(
    a: dict[str, Any],
    hs: jax.Array,
    d_o: jax.Array,
    d_final: jax.Array | None,
    softplus: bool,
    cfg: StateSpaceV1Config,
) -> dict[str, jax.Array | None]:
    """Every gradient: the backward scan kernel, then in JAX the sums of its shares (``dB``,
    ``dC`` over channel blocks, ``dA``, ``dD`` over batch rows), ``dt``'s and ``dt_bias``'s
    through :func:`~ejkernel_triton.ops.state_space_gla.delta` and ``A``'s through
    :func:`decay_rate` (autodiff)."""
    x = a["x"]
    b, _, i = x.shape
    n = a["A"].shape[-1]
    if d_final is None:
        d_final = jnp.zeros((b, i, n), jnp.float32)
    launch = functools.partial(_backward_launch, cfg=cfg, flags=_flags(a, softplus))
    run = _launch.fold_vmap(launch, (BATCH,) * 5 + (OTHER,) * 3 + (BATCH,) * 3)
    dx, dz, d_delta, db, dc, da, dd, d_init, _ = run(
        *_kernel_arrays(a), hs, d_o, d_final.astype(jnp.float32)
    )
    timed = {k: a[k] for k in ("dt", "dt_bias")}
    _, pull_delta = jax.vjp(lambda t: ssm.delta(t, softplus), timed)
    (d_timed,) = pull_delta(d_delta)
    _, pull_rate = jax.vjp(decay_rate, a["A"])
    (d_a,) = pull_rate(jnp.sum(da, axis=0))
    grads = {
        **d_timed,
        "x": dx,
        "A": d_a,
        "B": jnp.sum(db, axis=2),
        "C": jnp.sum(dc, axis=2),
        "D": jnp.sum(dd, axis=0),
        "gate": dz,
        "initial_state": d_init,
    }
    return {k: None if a[k] is None else grads[k].astype(a[k].dtype) for k in ssm.ARRAYS}


def _flags(a: dict[str, Any], softplus: bool) -> dict[str, Any]:
    return {
        "HAS_GATE": a["gate"] is not None,
        "HAS_BIAS": a["dt_bias"] is not None,
        "SOFTPLUS": softplus,
        "MIN_LOG_DECAY": MIN_LOG_DECAY,
    }


def _forward_launch(
    x: jax.Array,
    z: jax.Array,
    b_: jax.Array,
    c_: jax.Array,
    dt: jax.Array,
    a_: jax.Array,
    skip: jax.Array,
    bias: jax.Array,
    init: jax.Array,
    *,
    cfg: StateSpaceV1Config,
    flags: dict[str, Any],
    checkpoints: bool,
) -> list[jax.Array]:
    """``(out, final_state, checkpoints)`` of :func:`ssm_scan_fwd_kernel`."""
    from ejkernel_triton.kernels.ssm_scan import ssm_scan_fwd_kernel

    b, s, i = x.shape
    n = a_.shape[-1]
    bi = cfg.block(i, n)
    nt = _cdiv(s, cfg.chunk)
    states = (b, nt, i, n) if checkpoints else (b, 1)
    return _launch.launch(
        ssm_scan_fwd_kernel,
        x,
        z,
        b_,
        c_,
        dt,
        a_,
        skip,
        bias,
        init,
        s,
        i,
        nt,
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((b, i, n), jnp.float32),
            jax.ShapeDtypeStruct(states, jnp.float32),
        ],
        grid=(_cdiv(i, bi), b),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        N=n,
        BN=pow2(n),
        BI=bi,
        CT=cfg.chunk,
        STORE_STATES=checkpoints,
        **flags,
    )


def _backward_launch(
    x: jax.Array,
    z: jax.Array,
    b_: jax.Array,
    c_: jax.Array,
    dt: jax.Array,
    a_: jax.Array,
    skip: jax.Array,
    bias: jax.Array,
    hs: jax.Array,
    d_o: jax.Array,
    d_final: jax.Array,
    *,
    cfg: StateSpaceV1Config,
    flags: dict[str, Any],
) -> list[jax.Array]:
    """``(dx, dz, dΔ, dB shares, dC shares, dA per row, dD per row, d_init, scratch)`` of
    :func:`ssm_scan_bwd_kernel`."""
    from ejkernel_triton.kernels.ssm_scan import ssm_scan_bwd_kernel

    b, s, i = x.shape
    n = a_.shape[-1]
    bi = cfg.block(i, n)
    nb = _cdiv(i, bi)
    nt = _cdiv(s, cfg.chunk)
    assert hs.shape == (b, nt, i, n), "the backward runs with the forward's chunk"
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return _launch.launch(
        ssm_scan_bwd_kernel,
        x,
        z,
        b_,
        c_,
        dt,
        a_,
        skip,
        bias,
        hs,
        d_o,
        d_final,
        s,
        i,
        nt,
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(z.shape, z.dtype),
            f32(b, s, i),
            f32(b, s, nb, n),
            f32(b, s, nb, n),
            f32(b, i, n),
            f32(b, i),
            f32(b, i, n),
            f32(b, nb, cfg.chunk + 1, bi, pow2(n)),
        ],
        grid=(nb, b),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        N=n,
        BN=pow2(n),
        BI=bi,
        CT=cfg.chunk,
        **flags,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
