"""Attention benchmark harness: ejkernel's GPU platforms and the anchors, in one run.

For each shape, causal and not: forward and forward+backward time and TFLOP/s (forward
4·B·H·Sq·Sk·D, halved for causal; forward+backward 3.5× that) of every implementation, each
checked in the same run against a float32 reference on one (batch, head) slice, so a fast wrong
result never counts. Anchors (BENCHMARKS.md): cuDNN and XLA through ``jax.nn.dot_product_attention``,
JAX's Pallas GPU ``mha``, tokamax (when importable), upstream ejkernel 0.0.80.3 (in a child
process, from ``--upstream-path``: its package name is ours). Also a sequence sweep at B·S = 16384
for the plot, and the cold/warm start of one new shape. Each ejkernel row also records the config
its forward and forward+backward ran with and where it came from (``ejkernel.explain``: heuristic,
cache or autotune), printed after the table.

Writes ``<out>.json`` and ``<out>.png`` (TFLOP/s against sequence length per implementation) and
prints a table.

Other modes (``--mode``), each printing its table:

- ``rounds``: the forward of one ejkernel platform against a reference (cuDNN) at one shape,
  causal and not, in rotating rounds (which function runs first changes every round): the
  spread of one harness row's ratio.
- ``configs``: the forward with every config of a platform's config space (its heuristic
  first) and the default call (the config chain's choice, a shipped table's where one applies),
  against the reference, in rotating rounds: does another config beat the chosen one?

Both take ``--grad`` (forward+backward instead) and ``--causal no|yes`` (one of the two).
- ``startup``: the cold and warm start of a new shape, ``--repeat`` times, fresh caches each.

Run (GPU): ``python benchmarks/bench_attention.py [--quick] [--out benchmarks/results/attention]``,
``python benchmarks/bench_attention.py --mode rounds --rounds 6 --shape 8,2048,16,64``
(``benchmarks/gpu_attention.sh`` installs ours and the anchors and passes its arguments on).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata as md
import itertools
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))  # also when loaded from its file (its tests)
import _common

SHAPES = [(4, 4096, 16, 128), (8, 2048, 16, 64), (1, 16384, 16, 128)]
SWEEP = [(8, 2048), (4, 4096), (2, 8192), (1, 16384)]  # (B, S) at H 16, D 128


#: Seconds each function runs before it is timed. An H100 under attention's load sits at its
#: 700 W limit with its clock lowered; a function timed right after an idle moment or a lighter
#: function runs up to 8 % faster for a few tens of milliseconds, which favours whoever is
#: timed first. After this warm-up each is timed at the steady clock of its own load, as in a
#: training loop. ``BENCH_WARM_S=0``: no warm-up.
WARM_S = float(os.environ.get("BENCH_WARM_S", "0.3"))


def timed(fn: Callable[..., Any], *args: Any, iters: int = 10, repeats: int = 5) -> float:
    """Median milliseconds per call (compiled first, then run for ``WARM_S`` seconds)."""
    return _common.timed(fn, *args, iters=iters, repeats=repeats, warm_s=WARM_S)


def flops(b: int, s: int, h: int, d: int, causal: bool) -> float:
    return 4.0 * b * h * s * s * d / (2 if causal else 1)


# -- implementations: attn(q, k, v, causal) -> out, layout [B, S, H, D] -------------------------


def ours(platform: str) -> Callable[..., Any]:
    """ejkernel's flash attention on one platform; ``.platform`` names it for :func:`chosen`."""

    def attn(q: Any, k: Any, v: Any, causal: bool) -> Any:
        import ejkernel

        return ejkernel.flash_attention(q, k, v, causal=causal, platform=platform)

    attn.platform = platform  # type: ignore[attr-defined]
    return attn


def implementations() -> dict[str, Callable[..., Any]]:
    impls: dict[str, Callable[..., Any]] = {}
    from ejkernel.plugins import get_registry

    for platform in ("triton", "pallas", "cuda"):
        if any(i.platform == platform for i in get_registry().implementations("flash_attention")):
            impls[f"ejkernel {platform}"] = ours(platform)
    impls["cuDNN"] = lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"
    )
    impls["XLA"] = lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla"
    )
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        impls["JAX Pallas mha"] = lambda q, k, v, causal: pallas_attention.mha(
            q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal
        )
    except Exception as err:
        print(f"JAX Pallas mha unavailable: {err}")
    try:
        tokamax = _common.import_tokamax()

        def tokamax_attention(kind: str) -> Callable[..., Any]:
            return lambda q, k, v, causal: tokamax.dot_product_attention(
                q, k, v, is_causal=causal, implementation=kind
            )

        for kind in ("mosaic", "triton"):
            impls[f"tokamax {kind}"] = tokamax_attention(kind)
    except Exception as err:
        print(f"tokamax unavailable: {type(err).__name__}: {err}")
    return impls


# -- one measurement ----------------------------------------------------------------------------


def measure(attn: Callable[..., Any], shape: tuple[int, ...], causal: bool) -> dict[str, Any]:
    b, s, h, d = shape
    ks = jax.random.split(jax.random.PRNGKey(s + d), 4)
    q, k, v, do = (jax.random.normal(x, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for x in ks)
    fwd = jax.jit(lambda q, k, v: attn(q, k, v, causal))
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: attn(*a, causal), q, k, v)[1](do))
    row: dict[str, Any] = {}
    try:
        out = fwd(q, k, v)
        dq = fwd_bwd(q, k, v, do)[0]
        row["err_out"], row["err_dq"] = _errors(q, k, v, do, out, dq, causal)
        row["fwd_ms"] = timed(fwd, q, k, v)
        row["fwd_bwd_ms"] = timed(fwd_bwd, q, k, v, do, iters=5)
        total = flops(b, s, h, d, causal)
        row["fwd_tflops"] = total / row["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = 3.5 * total / row["fwd_bwd_ms"] / 1e9
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return row


def bench_row(
    name: str, attn: Callable[..., Any], shape: tuple[int, ...], causal: bool
) -> dict[str, Any]:
    """One measured row; an ejkernel one (``attn.platform`` set) also gets ``"chosen"``."""
    row = {"shape": shape, "causal": causal, "impl": name, **measure(attn, shape, causal)}
    platform = getattr(attn, "platform", None)
    if platform is not None:
        row["chosen"] = chosen(platform, shape, causal)
    return row


def chosen(platform: str, shape: tuple[int, ...], causal: bool) -> dict[str, Any]:
    """The config the forward and the forward+backward ran with, from ``ejkernel.explain`` on the
    arguments :func:`ours` passes: ``{"fwd": {"config", "source", "origin"}, "fwd_bwd": ...}``,
    ``{"error": ...}`` for a pass that cannot be explained. Asked after :func:`measure`, so an
    autotuned choice is already cached (``source`` memory, ``origin`` autotune)."""
    out: dict[str, Any] = {}
    for name, grad in (("fwd", False), ("fwd_bwd", True)):
        try:
            import ejkernel
            from ejkernel.ops import stable_json

            # An array, not a ShapeDtypeStruct: the cache key signs arrays by shape and dtype
            # but a ShapeDtypeStruct by its repr, another key than the measured call's.
            x = jnp.zeros(shape, jnp.bfloat16)
            sel = ejkernel.explain(
                ejkernel.flash_attention, x, x, x, grad=grad, causal=causal, platform=platform
            )
            out[name] = {
                "config": json.loads(stable_json(sel.config)),
                "source": sel.source,
                "origin": sel.origin,
            }
        except Exception as err:
            out[name] = {"error": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"}
    return out


def chosen_line(row: dict[str, Any]) -> str:
    """``chosen <impl> <shape> [causal]: fwd <source> <config>; fwd+bwd <source> <config>``,
    the source as ``memory(autotune)`` where the cached entry was made by another tier."""
    parts = []
    for name, label in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
        pick = row["chosen"].get(name, {})
        if "config" not in pick:
            parts.append(f"{label} fails: {pick.get('error', 'not recorded')}")
            continue
        origin = pick.get("origin")
        source = pick["source"] + (f"({origin})" if origin and origin != pick["source"] else "")
        parts.append(f"{label} {source} {_short(pick['config'])}")
    causal = " causal" if row["causal"] else ""
    return f"chosen {row['impl']} {tuple(row['shape'])}{causal}: " + "; ".join(parts)


def _short(config: Any) -> str:
    """A config's JSON without quotes and unset (null) fields."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in sorted(x.items()) if v is not None}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return json.dumps(strip(config), separators=(",", ":")).replace('"', "")


def _errors(
    q: Any, k: Any, v: Any, do: Any, out: Any, dq: Any, causal: bool
) -> tuple[float, float]:
    """Relative error of out and dQ on batch 0, head 0 against a float32 reference."""
    sl = lambda x: x[:1, :, :1].astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref = lambda q, k, v: _dense_reference(q, k, v, causal)
        ref_out, vjp = jax.vjp(ref, sl(q), sl(k), sl(v))
        ref_dq = vjp(sl(do))[0]
    rel = lambda a, b: float(jnp.linalg.norm(sl(a) - b) / jnp.linalg.norm(b))
    return rel(out, ref_out), rel(dq, ref_dq)


def _dense_reference(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """Plain softmax attention (self-contained: the upstream child process has another
    ``ejkernel`` package under the same name)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        visible = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
        s = jnp.where(visible, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def upstream_rows(path: str, shapes: list[tuple[int, ...]]) -> dict[str, dict[str, Any]]:
    """Upstream ejkernel 0.0.80.3 timed in a child process that imports it from ``path`` (an
    ``os.pathsep``-separated list: its folder, then its dependencies' folder)."""
    code = f"""
import json, sys
sys.path[:0] = {path.split(os.pathsep)!r}
import ejkernel.modules as um
sys.path.insert(0, {str(Path(__file__).parent)!r})
import bench_attention as h
out = {{}}
for shape in {shapes!r}:
    for causal in (False, True):
        attn = lambda q, k, v, causal: um.flash_attention(q, k, v, causal=causal)
        out[repr((tuple(shape), causal))] = h.measure(attn, tuple(shape), causal)
print("UPSTREAM" + json.dumps(out))
"""
    env = {**os.environ, "PYTHONPATH": ""}
    try:
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=400, env=env
        )
        line = [x for x in res.stdout.splitlines() if x.startswith("UPSTREAM")]
        if not line:
            err = (res.stderr.strip().splitlines() or ["no output"])[-1][:160]
            return {repr((tuple(s), c)): {"error": err} for s in shapes for c in (False, True)}
        return json.loads(line[0][len("UPSTREAM") :])
    except Exception as err:
        return {repr((tuple(s), c)): {"error": str(err)} for s in shapes for c in (False, True)}


#: The phases of a start, in order: each is printed by the child as ``PHASE <seconds>``.
STARTUP_PHASES = ("imported", "backend", "input", "traced", "compiled", "result")


def startup(shape: tuple[int, ...], platform: str = "triton") -> dict[str, float]:
    """Seconds to the first fwd+bwd result of a new shape: cold (empty config cache, autotune,
    empty Triton cache) and warm (both caches filled), each in a fresh process.

    Per start: ``<name>`` the whole process to the result; ``<name>_op`` from the first call
    for the new shape (tracing, Triton, XLA compile, first execution) to the result, without
    importing jax and starting its GPU client; ``<name>_<phase>`` the time each phase ended."""
    code = f"""
import time; t0 = time.perf_counter()
def mark(phase): print(phase.upper(), time.perf_counter() - t0, flush=True)
import jax, jax.numpy as jnp, ejkernel
mark("imported")
jax.devices(); mark("backend")
q = jax.block_until_ready(
    jax.random.normal(jax.random.PRNGKey(0), {tuple(shape)!r}, jnp.bfloat16))
mark("input")
f = jax.jit(jax.grad(lambda q: ejkernel.flash_attention(q, q, q, causal=True,
    platform={platform!r}).astype(jnp.float32).sum()))
lowered = f.lower(q); mark("traced")
compiled = lowered.compile(); mark("compiled")
jax.block_until_ready(compiled(q)); mark("result")
"""
    result: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "EJKERNEL_CACHE_DIR": f"{tmp}/ejk",
            "TRITON_CACHE_DIR": f"{tmp}/tri",
            "EJKERNEL_AUTOTUNE_POLICY": "autotune",
        }
        for name in ("cold", "warm"):
            res = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
            )
            marks = {}
            for line in res.stdout.splitlines():
                word, _, value = line.partition(" ")
                if word.lower() in STARTUP_PHASES:
                    marks[word.lower()] = float(value)
            for phase in STARTUP_PHASES:
                result[f"{name}_{phase}"] = marks.get(phase, float("nan"))
            result[name] = result[f"{name}_result"]
            result[f"{name}_op"] = result[name] - result[f"{name}_input"]
            if "result" not in marks:
                print(res.stderr[-2000:])
    return result


def startup_line(shape: tuple[int, ...], start: dict[str, float]) -> str:
    """One line per start: the total, the new shape's own part, and each phase's seconds."""
    parts = [f"startup of a new shape {shape} causal fwd+bwd (seconds):"]
    for name in ("cold", "warm"):
        ends = [start[f"{name}_{phase}"] for phase in STARTUP_PHASES]
        spans = [end - prev for prev, end in itertools.pairwise([0.0, *ends])]
        steps = ", ".join(f"{phase} {span:.2f}" for phase, span in zip(STARTUP_PHASES, spans))
        parts.append(
            f"{name} {start[name]:.1f} in all, {start[f'{name}_op']:.1f} from the first call "
            f"({steps})"
        )
    return "\n  ".join(parts)


# -- the other modes ----------------------------------------------------------------------------

#: The shape of ``--mode rounds`` and ``--mode configs`` unless ``--shape`` says otherwise: the
#: main shape where the forward's ratio to cuDNN moves most between runs.
ROUNDS_SHAPE = (8, 2048, 16, 64)
STARTUP_SHAPE = (2, 3072, 16, 128)


def timed_rounds(
    attns: dict[str, Callable[..., Any]],
    shape: tuple[int, ...],
    causal: bool,
    rounds: int,
    grad: bool = False,
) -> dict[str, list[float]]:
    """TFLOP/s of each ``attn(q, k, v, causal)`` per round (:func:`_common.rotating_rounds`), on one set
    of bf16 inputs: its forward, or with ``grad`` its forward+backward (a VJP of a random
    cotangent, 3.5× the forward's flops)."""
    keys = jax.random.split(jax.random.PRNGKey(sum(shape)), 4)
    q, k, v, do = (jax.random.normal(x, shape, jnp.float32).astype(jnp.bfloat16) for x in keys)
    gflop = flops(*shape, causal) / 1e9
    if not grad:
        fns = {n: jax.jit(lambda q, k, v, f=f: f(q, k, v, causal)) for n, f in attns.items()}
        return _common.rotating_rounds(fns, (q, k, v), rounds, gflop, warm_s=WARM_S)
    fns = {
        n: jax.jit(lambda q, k, v, do, f=f: jax.vjp(lambda *a: f(*a, causal), q, k, v)[1](do))
        for n, f in attns.items()
    }
    return _common.rotating_rounds(fns, (q, k, v, do), rounds, 3.5 * gflop, warm_s=WARM_S)


def config_space(
    platform: str, shape: tuple[int, ...], causal: bool, grad: bool = False
) -> dict[str, Any]:
    """Label -> config: the heuristic of ``platform``'s flash attention, then every config of its
    config space, for a bf16 forward (``grad``: forward+backward) at ``shape`` (through the
    registry, as the autotuner asks)."""
    from ejkernel.ops import Invocation, stable_json
    from ejkernel.plugins import get_registry

    registry = get_registry()
    spec = registry.spec("flash_attention")
    impls = [i for i in registry.implementations("flash_attention") if i.platform == platform]
    if not impls:
        raise SystemExit(f"no {platform!r} implementation of flash_attention is installed")
    x = jnp.zeros(shape, jnp.bfloat16)
    args = spec.validate(spec.bind((), {"query": x, "key": x, "value": x, "causal": causal}))
    inv = Invocation(kernel=spec.name, kwargs=args, metadata={"grad": grad})
    heuristic, space = impls[0].get_heuristic(), impls[0].get_config_space()
    configs = ([heuristic(inv)] if heuristic else []) + (list(space(inv)) if space else [])
    configs = list(dict.fromkeys(configs))  # the space usually starts with the heuristic
    labels = [_short(json.loads(stable_json(c))) for c in configs]
    if labels:
        labels[0] = f"heuristic {labels[0]}"
    return dict(zip(labels, configs, strict=True))


def rounds_mode(
    platform: str,
    ref: str,
    shape: tuple[int, ...],
    rounds: int,
    causals: tuple[bool, ...],
    grad: bool,
    every_config: bool = False,
) -> None:
    """``--mode rounds``: ejkernel's default call on ``platform`` against ``ref``;
    ``every_config`` (``--mode configs``): also each config of the config space, and the
    default call is the config chain's choice (a shipped table's, where one applies)."""
    import ejkernel

    anchor = implementations()[ref]
    what = "forward+backward" if grad else "forward"
    for causal in causals:
        attns: dict[str, Callable[..., Any]] = {}
        if every_config:
            attns = {
                label: lambda q, k, v, causal, c=cfg: ejkernel.flash_attention(
                    q, k, v, causal=causal, platform=platform, cfg=c
                )
                for label, cfg in config_space(platform, shape, causal, grad).items()
            }
        default = "default call" if every_config else f"ejkernel {platform}"
        attns[default] = ours(platform)
        attns[ref] = anchor
        res = timed_rounds(attns, shape, causal, rounds, grad)
        _common.print_rounds(f"{shape} causal={causal} {what}, {rounds} rounds", res, ref)
        if every_config:
            row = {"impl": default, "shape": shape, "causal": causal}
            print(chosen_line({**row, "chosen": chosen(platform, shape, causal)}), flush=True)


def startup_mode(shape: tuple[int, ...], repeat: int, platform: str) -> None:
    """``--mode startup``: :func:`startup` ``repeat`` times (fresh caches each): its spread."""
    for i in range(repeat):
        print(f"repeat {i}: " + startup_line(shape, startup(shape, platform)), flush=True)


# -- output -------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind}
    for dist in ("jaxlib", "triton", "jax-triton", "tokamax", "ejkernel-core", "ejkernel-triton"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| B, S, H, D | causal | implementation | fwd TFLOP/s | fwd+bwd TFLOP/s | "
        "x cuDNN fwd / fwd+bwd | err out / dQ |",
        "|---|---|---|---|---|---|---|",
    ]
    cudnn = {(tuple(r["shape"]), r["causal"]): r for r in rows if r["impl"] == "cuDNN"}
    for r in rows:
        c = cudnn.get((tuple(r["shape"]), r["causal"]), {})
        if "error" in r:
            lines.append(
                f"| {r['shape']} | {r['causal']} | {r['impl']} | fails: {r['error']} | | | |"
            )
            continue
        ratio = (
            (
                f"{r['fwd_tflops'] / c['fwd_tflops']:.2f} / "
                f"{r['fwd_bwd_tflops'] / c['fwd_bwd_tflops']:.2f}"
            )
            if "fwd_tflops" in c
            else ""
        )
        lines.append(
            f"| {r['shape']} | {r['causal']} | {r['impl']} | {r['fwd_tflops']:.0f} | "
            f"{r['fwd_bwd_tflops']:.0f} | {ratio} | "
            f"{r['err_out']:.1e} / {r['err_dq']:.1e} |"
        )
    return "\n".join(lines)


def plot(sweep: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, title in (
        (axes[0], "fwd_tflops", "forward"),
        (axes[1], "fwd_bwd_tflops", "forward+backward"),
    ):
        for impl in sorted({r["impl"] for r in sweep}):
            for causal, style in ((False, "-"), (True, "--")):
                pts = [
                    (r["shape"][1], r[key])
                    for r in sweep
                    if r["impl"] == impl and r["causal"] == causal and key in r
                ]
                if pts:
                    ax.plot(
                        *zip(*sorted(pts)),
                        style,
                        marker="o",
                        label=f"{impl}{' causal' if causal else ''}",
                    )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (B·S = 16384, H 16, D 128, bf16)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


MODES = ("harness", "rounds", "configs", "startup")


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="main shapes only, no sweep")
    parser.add_argument("--out", default="benchmarks/results/attention")
    parser.add_argument("--impls", nargs="*", default=None, help="subset of implementations")
    parser.add_argument("--upstream-path", default=os.environ.get("EJKERNEL_UPSTREAM_PATH"))
    parser.add_argument("--no-startup", action="store_true")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="first N main shapes")
    parser.add_argument("--sweep-impls", nargs="*", default=None, help="subset for the sweep")
    parser.add_argument("--mode", choices=MODES, default="harness", help="what to measure")
    parser.add_argument("--platform", default="triton", help="ejkernel platform (other modes)")
    parser.add_argument("--ref", default="cuDNN", help="reference implementation (rounds, configs)")
    parser.add_argument("--shape", type=_shape, default=None, help="B,S,H,D (other modes)")
    parser.add_argument("--rounds", type=int, default=6, help="rotating rounds (rounds, configs)")
    parser.add_argument("--repeat", type=int, default=1, help="starts of each kind (startup)")
    parser.add_argument(
        "--grad", action="store_true", help="forward+backward instead of forward (rounds, configs)"
    )
    parser.add_argument(
        "--causal", choices=("both", "no", "yes"), default="both", help="(rounds, configs)"
    )
    args = parser.parse_args()
    os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    print(json.dumps(versions()), flush=True)
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    if args.mode in ("rounds", "configs"):
        shape = args.shape or ROUNDS_SHAPE
        every = args.mode == "configs"
        return rounds_mode(args.platform, args.ref, shape, args.rounds, causals, args.grad, every)
    if args.mode == "startup":
        return startup_mode(args.shape or STARTUP_SHAPE, args.repeat, args.platform)

    impls = implementations()
    if args.impls:
        impls = {n: f for n, f in impls.items() if n in args.impls}
    rows: list[dict[str, Any]] = []
    for shape in SHAPES[: args.shapes]:
        for causal in (False, True):
            for name, attn in impls.items():
                if name == "XLA" and shape[1] > 8192:
                    rows.append(
                        {
                            "shape": shape,
                            "causal": causal,
                            "impl": name,
                            "error": "skipped: O(S^2) memory",
                        }
                    )
                    continue
                row = bench_row(name, attn, shape, causal)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.upstream_path:
        for key, row in upstream_rows(args.upstream_path, SHAPES[: min(args.shapes, 2)]).items():
            shape, causal = eval(key)
            rows.append({"shape": shape, "causal": causal, "impl": "upstream ejkernel", **row})
    sweep: list[dict[str, Any]] = []
    if not args.quick:
        for b, s in SWEEP:
            for causal in (False, True):
                names = args.sweep_impls or [
                    n for n in impls if n.startswith(("ejkernel", "cuDNN", "tokamax"))
                ]
                for name in [n for n in names if n in impls]:
                    sweep.append(bench_row(name, impls[name], (b, s, 16, 128), causal))
    startup_shape = STARTUP_SHAPE
    start = {} if args.no_startup else startup(startup_shape, args.platform)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "command": " ".join(sys.argv),
        "rows": rows,
        "sweep": sweep,
        "startup_s": start,
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    if sweep:
        plot(sweep, out.with_suffix(".png"))
    print(json.dumps(report["versions"]))
    print(table(rows))
    for row in rows:
        if "chosen" in row:
            print(chosen_line(row))
    if start:
        print(startup_line(startup_shape, start))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
