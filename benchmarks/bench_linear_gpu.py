"""Linear attention and state-space ops on the GPU: the Triton kernels against the XLA path and
flash-linear-attention.

For each op (``--op``, repeatable; default all): ``ejkernel.<op>`` with ``platform="triton"`` and
``platform="xla"`` (heuristic configs, jitted), forward and forward+backward (``jax.vjp`` with a
fixed cotangent, gradients of every floating input), and flash-linear-attention's kernel for the
same recurrence on torch where it has one and ``fla`` imports (its refusal, if it raises, is
printed instead of a time). Each ejkernel row shows its relative error against the XLA path run
in float32 (output, and the largest of the gradients'), so a fast wrong kernel never counts.

Ops and default shapes (bfloat16; gates ``log_sigmoid(x) / 16`` as GLA's):
- ``gla`` B 2, T 8192, H 16, K = V = 128, per-channel gate; anchor ``fla.ops.gla.chunk_gla``.
- ``kda`` ``kernel_delta_attention`` with a per-channel gate and ``use_qk_l2norm``, same shape;
  anchor ``fla.ops.kda.chunk_kda``.
- ``gdn`` ``kernel_delta_attention`` with a per-head gate (Gated DeltaNet); anchor
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.
- ``lightning`` ``lightning_attention`` (layer 0 of 24); anchor
  ``fla.ops.lightning_attn.chunk_lightning_attn``.
- ``recurrent`` with a per-head ``g`` and a per-channel ``gk``; no anchor.
- ``ssd`` ``state_space_v2`` (Mamba-2: B 2, T 8192, H 32, P 64, G 1, N 128) against mamba-ssm's
  Triton ``mamba_chunk_scan_combined`` (chunks of 256; ``benchmarks/fetch_mamba_anchor.sh``
  makes the importable folder the GPU call carries).
- ``ssm`` ``state_space_v1`` (Mamba-1: B 2, T 4096, I 2048, N 16); no anchor.

Timing: median of ``--repeats`` batches of ``--iters`` calls after a warm-up
(:func:`benchmarks._common.timed`; torch the same with ``torch.cuda.synchronize``). Configs come
from the heuristics (``EJKERNEL_AUTOTUNE_POLICY=heuristics`` unless set).

``--decode``: instead, decoding with ``gla`` and ``kernel_delta_attention`` (B 64, H 16,
K = V = 128, bf16, a carried float32 state, ``return_state``) for T = 1, 4, 8 and 16 tokens a
call (``--tokens``): the fused recurrent kernel (16/32/64-wide value blocks) against the
chunked kernels (the heuristic's chunked config) and the XLA platform, forward only, and the
fused kernel per step of a ``lax.scan`` beside an XLA copy of the state in the same kind of
scan.

``--configs``: instead, every config of the Triton op's config space (gla, kda, gdn), forward
and forward+backward, against the heuristic's; ``--config-match TEXT`` keeps the first config
and those whose repr holds TEXT (e.g. ``narrow_products=True``; ``A|B``: either); ``--differentiated`` takes a
differentiated call's space (its heuristic first).

``--once``: one forward+backward (``--forward``: one forward) of each ``--op``'s Triton kernels
after a warm-up, nothing timed: what ``benchmarks/gpu_kernels.sh`` runs under ncu for the per-kernel table.

``--anchors no`` then ``--anchors only`` times ejkernel and the anchors in separate processes (torch's
Triton autotuning and jax-triton in one process can stall). flash-linear-attention tunes each
kernel on its first call, for minutes: ``BENCH_TORCH_TRITON_CACHE=DIR`` keeps torch's Triton cache
and the tuning results in DIR; ``benchmarks/torch_tuning.sh`` packs the results into one file a
call brings back and unpacks them before a later call, which then skips the tuning.
``--platforms triton`` times the Triton rows alone (A/B runs). ``--set MODULE.NAME=VALUE``
(repeatable) sets a module constant first, e.g. a kernel's tile or warps, so that one build
times its variants, a process each. ``--anchor-kernels`` prints,
after an anchor's times, each of its kernels' device time a call (``torch.profiler``): the
anchor's side of ``benchmarks/gpu_kernels.sh``'s per-kernel table.

Run: ``python benchmarks/bench_linear_gpu.py [--op gla ...] [--seq 8192] [--iters 10]
[--repeats 5] [--anchors yes|no|only]``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from _common import timed

import ejkernel

os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")

BF16 = jnp.bfloat16


@dataclass(frozen=True)
class Case:
    """One op: its inputs, its ejkernel call and, where one exists, its torch anchor."""

    shape: str
    inputs: Callable[[int], dict[str, jax.Array]]
    call: Callable[..., Any]
    anchor: str | None = None
    anchor_call: Callable[..., Any] | None = None


def _normal(i: int, shape: tuple[int, ...], dtype: Any = BF16) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(i), shape, dtype)


def _gate(i: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.nn.log_sigmoid(_normal(i, shape, jnp.float32)) / 16


def _qkv(t: int, b: int = 2, h: int = 16, d: int = 128) -> dict[str, jax.Array]:
    return {n: _normal(i, (b, t, h, d)) for i, n in enumerate(("query", "key", "value"))}


def _gla_inputs(t: int) -> dict[str, jax.Array]:
    return {**_qkv(t), "g": _gate(3, (2, t, 16, 128))}


def _kda_inputs(t: int, per_channel: bool = True) -> dict[str, jax.Array]:
    beta = jax.nn.sigmoid(_normal(4, (2, t, 16), jnp.float32))
    return {**_qkv(t), "beta": beta, "g": _gate(3, (2, t, 16) + ((128,) if per_channel else ()))}


def _recurrent_inputs(t: int) -> dict[str, jax.Array]:
    return {**_qkv(t), "g": _gate(5, (2, t, 16)), "gk": _gate(3, (2, t, 16, 128))}


def _ssd_inputs(t: int) -> dict[str, jax.Array]:
    b, h, p, g, n = 2, 32, 64, 1, 128
    return {
        "x": _normal(0, (b, t, h, p)),
        "A": -jnp.exp(_normal(1, (h,), jnp.float32)),
        "B": _normal(2, (b, t, g, n)),
        "C": _normal(3, (b, t, g, n)),
        "D": _normal(4, (h,), jnp.float32),
        "dt": jax.nn.softplus(_normal(5, (b, t, h), jnp.float32) - 3),
    }


def _ssm_inputs(t: int) -> dict[str, jax.Array]:
    b, i, n = 2, 2048, 16
    return {
        "x": _normal(0, (b, t // 2, i)),
        "A": -jnp.exp(_normal(1, (i, n), jnp.float32)),
        "B": _normal(2, (b, t // 2, n)),
        "C": _normal(3, (b, t // 2, n)),
        "D": _normal(4, (i,), jnp.float32),
        "dt": jax.nn.softplus(_normal(5, (b, t // 2, i), jnp.float32) - 3),
    }


def _kda(per_channel: bool) -> Callable[..., Any]:
    def call(query, key, value, beta, g, platform, **kw):
        return ejkernel.kernel_delta_attention(
            query, key, value, beta, g, use_qk_l2norm=True, platform=platform, **kw
        )

    return call


def _fla_kda(q, k, v, beta, g):
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def _fla_gdn(q, k, v, beta, g):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def _fla_gla(q, k, v, g):
    from fla.ops.gla import chunk_gla

    return chunk_gla(q, k, v, g)[0]


def _mamba_ssd(x, a, b, c, d, dt):
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined(x, dt, a, b, c, chunk_size=256, D=d)


def _fla_lightning(q, k, v):
    from fla.ops.lightning_attn import chunk_lightning_attn

    return chunk_lightning_attn(q, k, v, layer_idx=0, num_layers=24)[0]


CASES: dict[str, Case] = {
    "gla": Case(
        "B 2, T {t}, H 16, K = V = 128",
        _gla_inputs,
        lambda query, key, value, g, platform, **kw: ejkernel.gla(
            query, key, value, g, platform=platform, **kw
        ),
        "fla chunk_gla",
        _fla_gla,
    ),
    "kda": Case(
        "B 2, T {t}, H 16, K = V = 128, per-channel gate",
        _kda_inputs,
        _kda(True),
        "fla chunk_kda",
        _fla_kda,
    ),
    "gdn": Case(
        "B 2, T {t}, H 16, K = V = 128, per-head gate",
        lambda t: _kda_inputs(t, per_channel=False),
        _kda(False),
        "fla chunk_gated_delta_rule",
        _fla_gdn,
    ),
    "lightning": Case(
        "B 2, T {t}, H 16, K = V = 128, layer 0 of 24",
        _qkv,
        lambda query, key, value, platform: ejkernel.lightning_attention(
            query, key, value, layer_idx=0, num_layers=24, platform=platform
        ),
        "fla chunk_lightning_attn",
        _fla_lightning,
    ),
    "recurrent": Case(
        "B 2, T {t}, H 16, K = V = 128, g and gk",
        _recurrent_inputs,
        lambda query, key, value, g, gk, platform: ejkernel.recurrent(
            query, key, value, g=g, gk=gk, platform=platform
        ),
    ),
    "ssd": Case(
        "B 2, T {t}, H 32, P 64, G 1, N 128",
        _ssd_inputs,
        lambda x, A, B, C, D, dt, platform: ejkernel.state_space_v2(
            x, A, B, C, D, dt, platform=platform
        ),
        "mamba-ssm mamba_chunk_scan_combined",
        _mamba_ssd,
    ),
    "ssm": Case(
        "B 2, T {t}/2, I 2048, N 16",
        _ssm_inputs,
        lambda x, A, B, C, D, dt, platform: ejkernel.state_space_v1(
            x, A, B, C, D, dt, platform=platform
        ),
    ),
}


def ejkernel_fns(
    case: Case, names: tuple[str, ...], platform: str, cfg: Any = None
) -> tuple[Any, Any]:
    extra = {} if cfg is None else {"cfg": cfg}

    def fwd(*args: Any) -> Any:
        return case.call(**dict(zip(names, args, strict=True)), platform=platform, **extra)

    def fwd_bwd(*args: Any) -> Any:
        *xs, d_out = args
        out, vjp = jax.vjp(fwd, *xs)
        return out, vjp(d_out.astype(out.dtype))

    return jax.jit(fwd), jax.jit(fwd_bwd)


def rel(a: Any, b: Any) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def anchor_times(
    case: Case, x: dict[str, jax.Array], iters: int, repeats: int, kernels: bool = False
) -> tuple[str, str]:
    """The torch anchor's forward and forward+backward (ms), or why not; ``kernels``: then each
    call's kernels under torch's profiler (:func:`anchor_kernels`)."""
    try:
        import numpy as np
        import torch
    except Exception as err:  # not installed on this machine
        return (f"n/a ({type(err).__name__})",) * 2
    # jax-triton empties TRITON_CACHE_DIR in this process; torch's Triton kernels need one.
    # BENCH_TORCH_TRITON_CACHE names a kept one, with the anchors' autotuning results in it.
    kept = os.environ.get("BENCH_TORCH_TRITON_CACHE")
    if kept:
        os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
    os.environ["TRITON_CACHE_DIR"] = kept or tempfile.mkdtemp(prefix="bench-torch-triton-")

    def tensor(a: Any, grad: bool = False) -> Any:
        t = torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda()
        return t.to(torch.bfloat16 if a.dtype == BF16 else torch.float32).requires_grad_(grad)

    names = [n for n in x if n != "d_out"]
    args = [tensor(x[n], True) for n in names]
    d_out = tensor(x["d_out"])

    def fwd() -> Any:
        with torch.no_grad():
            return case.anchor_call(*args)

    def fwd_bwd() -> Any:
        out = case.anchor_call(*args)
        out.backward(d_out.to(out.dtype))
        return out

    def median_ms(fn: Any) -> str:
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as err:  # e.g. fla refusing a gated backward on this Triton
            return f"raises {type(err).__name__}: {str(err)[:80]}"
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - t0) * 1e3 / iters)
        return f"{statistics.median(runs):.3f}"

    times = median_ms(fwd), median_ms(fwd_bwd)
    if kernels:
        for name, fn, t in (("fwd", fwd, times[0]), ("fwd+bwd", fwd_bwd, times[1])):
            if not t.startswith("raises"):
                try:
                    anchor_kernels(f"{case.anchor} {name}", fn)
                except Exception as err:  # the times stand without the table
                    print(f"{case.anchor} {name}: no kernel table ({type(err).__name__}: {err})")
    return times


def anchor_kernels(title: str, fn: Callable[[], Any], calls: int = 5) -> None:
    """Each GPU kernel of ``fn`` (warm: after the timed runs) under ``torch.profiler``: its
    launches and device time a call, largest first; what ncu gives for ours
    (``benchmarks/gpu_kernels.sh``), for the anchor's side of a kernel-by-kernel comparison."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append((us / calls, e.count / calls, e.key))
    rows.sort(reverse=True)
    print(f"\n#### {title}: kernels a call (torch.profiler, {calls} calls)")
    print("| kernel | launches | ms |")
    print("|---|---|---|")
    for us, count, key in rows:
        print(f"| {key[:90]} | {count:g} | {us / 1e3:.3f} |")
    print(f"| total | {sum(r[1] for r in rows):g} | {sum(r[0] for r in rows) / 1e3:.3f} |")


def bench(
    op: str,
    t: int,
    iters: int,
    repeats: int,
    anchors: str,
    platforms: tuple[str, ...],
    kernels: bool = False,
) -> None:
    case = CASES[op]
    x = case.inputs(t)
    names = tuple(x)
    args = tuple(x.values())
    up = tuple(a.astype(jnp.float32) for a in args)
    with jax.default_matmul_precision("highest"):
        _, ref_bwd = ejkernel_fns(case, names, "xla")
        want_out = jax.eval_shape(lambda: ejkernel_fns(case, names, "xla")[0](*up))
        d_out = _normal(9, want_out.shape)
        want, want_grads = ref_bwd(*up, d_out.astype(jnp.float32))
    x = {**x, "d_out": d_out}
    print(f"\n### {op}: {case.shape.format(t=t)}, bf16 ({jax.devices()[0].device_kind})")
    print("| contender | fwd ms | fwd+bwd ms | rel err out | max rel err grads |")
    print("|---|---|---|---|---|")
    for platform in () if anchors == "only" else platforms:
        try:
            fwd, fwd_bwd = ejkernel_fns(case, names, platform)
            t_f = timed(fwd, *args, iters=iters, repeats=repeats, warm_s=1.0)
            t_fb = timed(fwd_bwd, *args, d_out, iters=iters, repeats=repeats)
            out, grads = fwd_bwd(*args, d_out)
        except Exception as err:  # a platform that declines or fails is reported, not fatal
            print(f"| ejkernel {platform} | raises {type(err).__name__}: {str(err)[:100]} | | | |")
            continue
        err = max(rel(a, b) for a, b in zip(grads, want_grads, strict=True))
        print(
            f"| ejkernel {platform} | {t_f:.3f} | {t_fb:.3f} | {rel(out, want):.1e} | {err:.1e} |"
        )
    if case.anchor is not None and anchors != "no":
        f, fb = anchor_times(case, x, iters, repeats, kernels)
        print(f"| {case.anchor} | {f} | {fb} | | |")


def decode(iters: int, repeats: int, tokens: tuple[int, ...] = (1, 4, 8, 16)) -> None:
    """The fused recurrent kernel against the chunked kernels for a few tokens a call (gla and
    KDA at B 64, H 16, K = V = 128, bf16, a carried state), and the state's read and write rate (``B·H·K·V`` float32 each way) at the fused kernel's best value block; then
    the fused kernel at that block per step of :data:`SCAN_STEPS` calls in one ``lax.scan``
    that carries the state (no dispatch between steps, as in a serving loop), and the
    state's rate at that time; beside them, the rate of an XLA copy of the state (read and
    written once) in the same process."""
    from ejkernel_triton.ops.gla import GlaConfig
    from ejkernel_triton.ops.kernel_delta_attention import KernelDeltaAttentionConfig

    h, d = 16, 128

    def gla_call(q, k, v, g, s, **kw):
        return ejkernel.gla(q, k, v, g, initial_state=s, return_state=True, **kw)

    def kda_call(q, k, v, beta, g, s, **kw):
        return ejkernel.kernel_delta_attention(
            q, k, v, beta, g, initial_state=s, return_state=True, **kw
        )

    def gla_inputs(t: int, b: int) -> dict[str, jax.Array]:
        return {**_qkv(t, b, h, d), "g": _gate(3, (b, t, h, d))}

    def kda_inputs(t: int, b: int) -> dict[str, jax.Array]:
        beta = jax.nn.sigmoid(_normal(5, (b, t, h)))
        return {**_qkv(t, b, h, d), "beta": beta, "g": _gate(3, (b, t, h, d))}

    tables = (
        ("gla", 64, gla_call, gla_inputs, GlaConfig(chunk_size=16, block_k=64, block_v=64)),
        ("kda", 64, kda_call, kda_inputs, KernelDeltaAttentionConfig(chunk_size=16, block_v=32)),
    )
    for name, b, call, make, chunked in tables:
        state = _normal(7, (b, h, d, d), jnp.float32)
        nbytes = 2 * state.size * 4
        copy_ms = timed(jax.jit(lambda s: s + 1.0), state, iters=iters, repeats=repeats)
        copies = timed(scanned_copy(), state, iters=iters, repeats=repeats) / SCAN_STEPS
        print(f"\n### {name} decoding: B {b}, H {h}, K = V = {d}, bf16 ({_device()})")
        print(
            f"XLA copy of the state (read and write): one call {copy_ms:.4f} ms "
            f"({nbytes / copy_ms / 1e6:.0f} GB/s), per scan step {copies:.4f} ms "
            f"({nbytes / copies / 1e6:.0f} GB/s)"
        )
        print(
            "| T | chunked ms | fused bv16 | fused bv32 | fused bv64 | XLA ms | state GB/s "
            "| rel err | best bv per scan step | state GB/s (scan) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for t in tokens:
            args = (*make(t, b).values(), state)

            def run(cfg: Any, platform: str = "triton", call: Any = call) -> Any:
                return jax.jit(functools.partial(call, cfg=cfg, platform=platform))

            cells = [timed(run(chunked), *args, iters=iters, repeats=repeats, warm_s=0.3)]
            for bv in (16, 32, 64):
                cfg = attrs.evolve(chunked, fused=True, block_v=bv)
                cells.append(timed(run(cfg), *args, iters=iters, repeats=repeats, warm_s=0.3))
            cells.append(timed(run(None, "xla"), *args, iters=iters, repeats=repeats, warm_s=0.3))
            rate = 2 * b * h * d * d * 4 / (min(cells[1:4]) * 1e-3) / 1e9
            got = run(attrs.evolve(chunked, fused=True, block_v=16))(*args)
            want = run(chunked)(*args)
            err = max(rel(a, e) for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            cols = " | ".join(f"{c:.4f}" for c in cells)
            best = attrs.evolve(
                chunked, fused=True, block_v=(16, 32, 64)[cells.index(min(cells[1:4])) - 1]
            )
            step = timed(scanned(call, best), *args, iters=iters, repeats=repeats) / SCAN_STEPS
            scan_rate = 2 * b * h * d * d * 4 / (step * 1e-3) / 1e9
            print(
                f"| {t} | {cols} | {rate:.0f} | {err:.1e} | {step:.4f} | {scan_rate:.0f} |",
                flush=True,
            )


#: Decoding steps one ``--decode`` scan runs.
SCAN_STEPS = 32


def scanned(call: Any, cfg: Any) -> Any:
    """``SCAN_STEPS`` calls of ``call`` (its last argument the state, returning
    ``(out, state)``) in one jitted ``lax.scan`` carrying the state: the final state."""

    def steps(*args: Any) -> Any:
        def step(state: Any, _: Any) -> tuple[Any, None]:
            _, state = call(*args[:-1], state, cfg=cfg, platform="triton")
            return state, None

        return jax.lax.scan(step, args[-1], None, length=SCAN_STEPS)[0]

    return jax.jit(steps)


def scanned_copy() -> Any:
    """``SCAN_STEPS`` XLA copies of a state (``s · a + b``: read and written once a step) in
    one jitted ``lax.scan``: the rate a decoding step's state traffic is held to."""

    def steps(state: jax.Array) -> jax.Array:
        def step(s: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return s * 0.5 + 1.0, None

        return jax.lax.scan(step, state, None, length=SCAN_STEPS)[0]

    return jax.jit(steps)


def _device() -> str:
    return str(jax.devices()[0].device_kind)


#: The Triton op module of the ops ``--configs`` sweeps.
SWEEPS = {"gla": "gla", "kda": "kernel_delta_attention", "gdn": "kernel_delta_attention"}


def sweep(op: str, t: int, iters: int, repeats: int, match: str = "", grad: bool = False) -> None:
    """Every config of the Triton op's config space (``grad``: a differentiated call's, its
    heuristic first): forward and forward+backward times, and the largest relative error
    (output, gradients) against the heuristic's config."""
    import importlib
    import types

    case = CASES[op]
    module = importlib.import_module(f"ejkernel_triton.ops.{SWEEPS[op]}")
    x = case.inputs(t)
    names, args = tuple(x), tuple(x.values())
    configs = module.config_space(types.SimpleNamespace(kwargs=x, grad=grad))
    keep = match.split("|")  # alternatives
    configs = configs[:1] + [c for c in configs[1:] if any(m in repr(c) for m in keep)]
    d_out = _normal(9, jax.eval_shape(ejkernel_fns(case, names, "triton")[0], *args).shape)
    _, base = ejkernel_fns(case, names, "triton", configs[0])
    want = jax.tree.leaves(base(*args, d_out))
    print(f"\n### {op} configs: {case.shape.format(t=t)}, bf16 ({jax.devices()[0].device_kind})")
    print("| config | fwd ms | fwd+bwd ms | rel err vs the first |")
    print("|---|---|---|---|")
    for cfg in configs:
        fwd, fwd_bwd = ejkernel_fns(case, names, "triton", cfg)
        try:
            t_f = timed(fwd, *args, iters=iters, repeats=repeats, warm_s=0.3)
            t_fb = timed(fwd_bwd, *args, d_out, iters=iters, repeats=repeats)
            got = jax.tree.leaves(fwd_bwd(*args, d_out))
        except Exception as err:  # a config that fails to compile is reported, not fatal
            print(f"| {cfg} | raises {type(err).__name__}: {str(err)[:100]} | | |", flush=True)
            continue
        err = max(rel(a, b) for a, b in zip(got, want, strict=True))
        print(f"| {cfg} | {t_f:.3f} | {t_fb:.3f} | {err:.1e} |", flush=True)


def once(op: str, t: int, forward: bool = False) -> None:
    """One forward+backward of the Triton op after one warm-up call (``forward``: one
    undifferentiated call after one warm-up, its own configs): the program a profiler
    (``benchmarks/gpu_kernels.sh``: ncu's per-kernel times) looks at."""
    case = CASES[op]
    x = case.inputs(t)
    fwd, fwd_bwd = ejkernel_fns(case, tuple(x), "triton")
    args = tuple(x.values())
    d_out = _normal(9, jax.eval_shape(fwd, *args).shape)
    for _ in range(2):
        jax.block_until_ready(fwd(*args) if forward else fwd_bwd(*args, d_out))
    what = "forward" if forward else "forward+backward"
    print(f"{op}: {case.shape.format(t=t)}, two {what} calls", flush=True)


def memory(ops: list[str], iters: int, repeats: int) -> None:
    """Forward+backward at B 1 and T 8k to 64k: time and the device's peak memory (it grows
    with T, so each row's peak is that T's), which must grow linearly in T."""
    print(f"\n### long sequences, B 1, forward+backward ({jax.devices()[0].device_kind})")
    print("| op | T | fwd+bwd ms | peak GiB |")
    print("|---|---|---|---|")
    for op in ops:
        case = CASES[op]
        for t in (8192, 16384, 32768, 65536):
            x = {
                n: a[:1] if a.ndim >= 3 and a.shape[0] == 2 else a
                for n, a in case.inputs(t).items()
            }
            fwd, fwd_bwd = ejkernel_fns(case, tuple(x), "triton")
            args = tuple(x.values())
            d_out = _normal(9, jax.eval_shape(fwd, *args).shape)
            ms = timed(fwd_bwd, *args, d_out, iters=iters, repeats=repeats, warm_s=0.3)
            stats = jax.devices()[0].memory_stats() or {}
            peak = stats.get("peak_bytes_in_use", 0) / 2**30
            print(f"| {op} | {t} | {ms:.3f} | {peak:.2f} |", flush=True)


def override(assignment: str) -> str:
    """``MODULE.NAME=VALUE``: sets an existing module constant (``VALUE`` a Python literal)
    before anything traces, so that one build runs a kernel variant; returns what it set."""
    import ast
    import importlib

    target, _, value = assignment.partition("=")
    module_name, _, name = target.rpartition(".")
    if not module_name or not hasattr(module := importlib.import_module(module_name), name):
        raise SystemExit(f"--set: {assignment!r} names no existing MODULE.NAME")
    old, new = getattr(module, name), ast.literal_eval(value)
    setattr(module, name, new)
    return f"{target} = {new!r} (was {old!r})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", choices=sorted(CASES), help="(repeatable)")
    parser.add_argument("--seq", type=int, default=8192, help="T")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--anchors",
        choices=("yes", "no", "only"),
        default="yes",
        help="time the torch anchors too, not at all, or alone (a process without jax-triton)",
    )
    parser.add_argument(
        "--platforms",
        default="triton,xla",
        help="the ejkernel platforms timed (comma-separated; the XLA float32 reference runs anyway)",
    )
    parser.add_argument(
        "--decode", action="store_true", help="fused against chunked, T ≤ 16 (gla, kda)"
    )
    parser.add_argument(
        "--tokens", default="1,4,8,16", help="--decode: the tokens a call (comma-separated)"
    )
    parser.add_argument(
        "--configs", action="store_true", help="every Triton config of the ops (gla, kda, gdn)"
    )
    parser.add_argument(
        "--config-match", default="", help="--configs: only configs with this (A|B: either)"
    )
    parser.add_argument(
        "--differentiated",
        action="store_true",
        help="--configs: the config space of a differentiated call",
    )
    parser.add_argument(
        "--memory", action="store_true", help="B 1, T 8k to 64k: time and peak memory"
    )
    parser.add_argument(
        "--once", action="store_true", help="one warm-up, then one fwd+bwd (for a profiler)"
    )
    parser.add_argument(
        "--forward", action="store_true", help="--once: the forward alone (its own configs)"
    )
    parser.add_argument(
        "--anchor-kernels",
        action="store_true",
        help="after the anchor's times, its kernels a call (torch.profiler)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="(repeatable) set a module constant before any call, e.g. "
        "ejkernel_triton.ops.kernel_delta_attention._ROW_WARPS=2 (a variant without a build)",
    )
    a = parser.parse_args()
    for assignment in a.set:
        print(f"set {override(assignment)}")
    if a.once:
        for op in a.op or ["kda"]:
            once(op, a.seq, a.forward)
        return
    if a.configs:
        for op in a.op or list(SWEEPS):
            sweep(op, a.seq, a.iters, a.repeats, a.config_match, a.differentiated)
        return
    if a.memory:
        memory(a.op or ["gla", "kda"], a.iters, a.repeats)
        return
    if a.decode:
        decode(a.iters, a.repeats, tuple(int(t) for t in a.tokens.split(",")))
        return
    for op in a.op or list(CASES):
        bench(
            op,
            a.seq,
            a.iters,
            a.repeats,
            a.anchors,
            tuple(a.platforms.split(",")),
            a.anchor_kernels,
        )


if __name__ == "__main__":
    main()
