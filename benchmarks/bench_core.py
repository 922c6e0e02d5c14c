"""Core overheads: `import ejkernel` time, and the executor's per-call overhead.

Run: python benchmarks/bench_core.py   (CPU is fine; figures go to benchmarks/RESULTS.md)
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

IMPORT_PROBE = (
    "import time, jax; t = time.perf_counter(); import ejkernel; print(time.perf_counter() - t)"
)


def import_time(repeats: int = 7) -> float:
    """Median seconds of `import ejkernel` after `import jax`, each in a fresh process."""
    samples = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, check=True
        )
        samples.append(float(out.stdout.strip()))
    return statistics.median(samples)


def call_overhead(iters: int = 2000) -> tuple[float, float]:
    """Median µs per eager call: through ejkernel (config cached) vs. the implementation direct."""
    import jax
    import jax.numpy as jnp

    import ejkernel
    from ejkernel.plugins import get_registry

    q = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 2, 16))
    ejkernel.flash_attention(q, q, q)  # select, choose and cache the config
    sel = ejkernel.explain("flash_attention", q, q, q)
    impl = next(
        i for i in get_registry().implementations("flash_attention") if i.platform == sel.platform
    )
    spec = get_registry().spec("flash_attention")
    arguments = spec.validate(spec.bind((q, q, q), {}))
    direct = lambda: impl.fn(**arguments, cfg=sel.config)
    through = lambda: ejkernel.flash_attention(q, q, q)

    def per_call(fn) -> float:
        for _ in range(50):
            jax.block_until_ready(fn())
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters // 5):
                out = fn()
            jax.block_until_ready(out)
            runs.append((time.perf_counter() - t0) / (iters // 5) * 1e6)
        return statistics.median(runs)

    del jnp
    return per_call(through), per_call(direct)


def main() -> None:
    import jax

    t = import_time()
    through, direct = call_overhead()
    print(f"jax {jax.__version__}, python {sys.version.split()[0]}")
    print(f"import ejkernel after import jax: {t * 1e3:.1f} ms (target < 300 ms)")
    print(
        f"eager call, config cached: {through:.1f} us through ejkernel, {direct:.1f} us direct; overhead {through - direct:.1f} us (target < 50 us)"
    )


if __name__ == "__main__":
    main()
