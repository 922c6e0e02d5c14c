"""The Triton kernels' visibility (``_visible``) is :func:`ejkernel.attention_semantics.visible`:
both evaluated on grids of positions, through Triton's interpreter, for random geometries
(Sq above and below Sk, causal, windows, segment ids with padding, attention masks)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel import attention_semantics

pytest.importorskip("triton")

BLOCK_Q, BLOCK_K = 16, 32


@pytest.fixture(scope="module")
def probe():
    name = "ejkernel_tests_visibility_probe"
    path = Path(__file__).with_name("_visibility_probe.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the interpreter re-imports the kernel's module by its name
    spec.loader.exec_module(module)
    yield module.visibility_probe_kernel
    sys.modules.pop(name, None)


def _cases(n: int) -> list[dict]:
    rng = np.random.default_rng(27)
    cases = []
    for _ in range(n):
        sq, sk = int(rng.integers(1, BLOCK_Q + 1)), int(rng.integers(1, BLOCK_K + 1))
        window = None
        if rng.random() < 0.5:
            window = (int(rng.integers(0, 12)), int(rng.integers(0, 12)))
        seg = None
        if rng.random() < 0.5:
            seg = (
                np.sort(rng.integers(-1, 3, BLOCK_Q)).astype(np.int32),
                np.sort(rng.integers(0, 3, BLOCK_K)).astype(np.int32),
            )
        mask = rng.random((BLOCK_Q, BLOCK_K)) < 0.7 if rng.random() < 0.4 else None
        cases.append(
            {
                "sq": sq,
                "sk": sk,
                "causal": bool(rng.random() < 0.5),
                "window": window,
                "seg": seg,
                "mask": mask,
            }
        )
    return cases


@pytest.mark.parametrize("case", _cases(24), ids=lambda c: f"sq{c['sq']}-sk{c['sk']}")
def test_the_kernels_visibility_is_the_semantics_one(probe, case, monkeypatch):
    from ejkernel_triton import _launch
    from ejkernel_triton.kernels.flash_attention_common import MASK_VALUE

    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")
    sq, sk, window, seg, mask = case["sq"], case["sk"], case["window"], case["seg"], case["mask"]
    scores = jnp.full((BLOCK_Q * BLOCK_K,), jnp.nan, jnp.float32)  # hidden: selected away
    qseg, kseg = seg if seg is not None else (np.zeros(1, np.int32), np.zeros(1, np.int32))
    mask_arg = mask.astype(np.int8) if mask is not None else np.zeros(1, np.int8)
    left, right = window or (0, 0)
    (out,) = _launch.launch(
        probe,
        scores,
        jnp.asarray(mask_arg),
        jnp.asarray(qseg),
        jnp.asarray(kseg),
        sk - sq,
        sq,
        sk,
        left,
        right,
        out_shape=[jnp.zeros((BLOCK_Q, BLOCK_K), jnp.float32)],
        grid=(1,),
        num_warps=4,
        num_stages=1,
        BLOCK_Q=BLOCK_Q,
        BLOCK_K=BLOCK_K,
        CAUSAL=case["causal"],
        WINDOW=window is not None,
        HAS_MASK=mask is not None,
        HAS_SEG=seg is not None,
    )
    qi = np.arange(BLOCK_Q)[:, None]
    kj = np.arange(BLOCK_K)[None, :]
    want = attention_semantics.visible(
        qi + (sk - sq),
        kj,
        causal=case["causal"],
        window=window,
        q_segment_ids=None if seg is None else seg[0][:, None],
        kv_segment_ids=None if seg is None else seg[1][None, :],
        kv_valid=kj < sk,
        attention_mask=mask,
    )
    out = np.asarray(out)[:sq]  # rows past Sq are no queries
    want = np.asarray(want)[:sq]
    np.testing.assert_array_equal(np.isnan(out), want)  # visible: the score, untouched
    assert (out[~want] == MASK_VALUE.value).all()  # hidden: exactly the mask value
