"""On the GPU (run from the repository root with ours installed, as
``benchmarks/gpu_attention.sh`` does): where the time of one causal D 128 forward+backward
goes, kernel by kernel, for the backward variants below. Each variant runs
``WARM_S`` seconds, then ``ITERS`` calls under ``jax.profiler.trace``; the device events of the
Perfetto trace give each kernel's mean duration and the span of a call."""

import collections
import glob
import gzip
import json
import sys
import tempfile
import time

sys.path.insert(0, "benchmarks")
import bench_attention as ba
import jax

from ejkernel_triton.ops import flash_attention as fa

WARM_S, ITERS = 0.5, 20
#: variants: attributes of ``ops.flash_attention`` set while the backward is traced
VARIANTS = {
    "gluon backward (one kernel)": {},
    "triton ws dk/dv + dq": {"_gluon_bwd_applies": lambda *a: False},
}


def traced(fn, overrides, *args):
    """``fn`` jitted and traced now with ``overrides`` (attribute -> value) set on
    ``ops.flash_attention``, which the backward reads at trace time."""
    saved = {name: getattr(fa, name) for name in overrides}
    try:
        for name, value in overrides.items():
            setattr(fa, name, value)
        jitted = jax.jit(lambda *a: fn(*a))  # a new function: jit's cache holds traces by function
        jax.block_until_ready(jitted(*args))
    finally:
        for name, value in saved.items():
            setattr(fa, name, value)
    return jitted


def device_events(folder):
    (path,) = glob.glob(f"{folder}/**/*perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        (e.get("pid"), e.get("tid")): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") in ("thread_name", "process_name")
    }
    pids = {
        e.get("pid"): e["args"].get("name", "") for e in events if e.get("name") == "process_name"
    }
    return [
        e
        for e in events
        if e.get("ph") == "X"
        and "/device:GPU" in pids.get(e.get("pid"), "")
        and "Memcpy" not in e.get("name", "")
    ], names


if __name__ == "__main__":
    for shape in [(4, 4096, 16, 128), (2, 8192, 16, 128)]:
        q, k, v, do = ba.normal_inputs(shape, shape[1])
        for name, variant in VARIANTS.items():
            f = traced(ba.ours_vjp(causal=True), variant, q, k, v, do)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < WARM_S:
                jax.block_until_ready([f(q, k, v, do) for _ in range(5)])
            folder = tempfile.mkdtemp()
            with jax.profiler.trace(folder, create_perfetto_trace=True):
                outs = [f(q, k, v, do) for _ in range(ITERS)]
                jax.block_until_ready(outs)
            events, names = device_events(folder)
            if not events:
                print("no device events; threads:", sorted(set(names.values()))[:40], flush=True)
                continue
            per = collections.defaultdict(list)
            for e in events:
                per[e["name"]].append(float(e["dur"]))
            start = min(float(e["ts"]) for e in events)
            end = max(float(e["ts"]) + float(e["dur"]) for e in events)
            busy = sum(sum(x) for x in per.values())
            print(
                f"== {shape} causal, {name}: {(end - start) / ITERS / 1e3:.3f} ms a call "
                f"({busy / ITERS / 1e3:.3f} ms of kernels)",
                flush=True,
            )
            for n, xs in sorted(per.items(), key=lambda kv: -sum(kv[1])):
                print(f"  {sum(xs) / ITERS / 1e3:7.3f} ms  x{len(xs) // ITERS:<2d} {n[:90]}")
