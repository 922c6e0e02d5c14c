"""Triton's interpreter reads and writes host memory through raw pointers, so a kernel lane
that addresses past its buffers reads the heap (or crashes the process) instead of failing.
:mod:`ejkernel_triton._launch` checks every active lane of every load, store and atomic against
the buffers of the launch: an out-of-bounds lane fails the call that made it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")

import triton
import triton.language as tl

from ejkernel_triton._launch import OutOfBoundsAccess, launch


@triton.jit
def _shifted_copy(x_ptr, n, shift, y_ptr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if MASKED:
        values = tl.load(x_ptr + offs + shift, mask=offs + shift < n, other=0.0)
    else:
        values = tl.load(x_ptr + offs + shift)
    tl.store(y_ptr + offs, values, mask=offs < n)


@triton.jit
def _spill_store(x_ptr, n, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0))


@triton.jit
def _atomic_past_end(x_ptr, n, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.atomic_add(y_ptr + offs + 1, tl.load(x_ptr + offs), mask=offs < n)


def run(kernel, x, n_out, **constexprs):  # type: ignore[no-untyped-def]
    out = jax.ShapeDtypeStruct((n_out,), x.dtype)
    return launch(
        kernel,
        x,
        *constexprs.pop("scalars"),
        out_shape=[out],
        grid=(1,),
        num_warps=1,
        num_stages=1,
        zeroed_outputs=(0,),
        **constexprs,
    )[0]


def test_masked_lanes_may_point_anywhere(interpret: None) -> None:
    x = jnp.arange(1.0, 17.0)
    y = run(_shifted_copy, x, 16, scalars=(16, np.int32(5)), BLOCK=16, MASKED=True)
    np.testing.assert_array_equal(np.asarray(y), np.r_[np.arange(6.0, 17.0), np.zeros(5)])


def test_an_unmasked_load_past_the_end_fails_the_call(interpret: None) -> None:
    x = jnp.arange(1.0, 17.0)
    with pytest.raises(Exception, match=r"_shifted_copy: load of 5 active lane\(s\) outside"):
        run(_shifted_copy, x, 16, scalars=(16, np.int32(5)), BLOCK=16, MASKED=False)


def test_a_load_before_the_start_fails_the_call(interpret: None) -> None:
    x = jnp.arange(1.0, 17.0)
    with pytest.raises(Exception, match=r"load of 3 active lane\(s\) outside"):
        run(_shifted_copy, x, 16, scalars=(16, np.int32(-3)), BLOCK=16, MASKED=False)


def test_a_store_past_the_output_fails_the_call(interpret: None) -> None:
    x = jnp.arange(1.0, 17.0)
    with pytest.raises(Exception, match=r"_spill_store: store of 4 active lane\(s\) outside"):
        run(_spill_store, x, 12, scalars=(16,), BLOCK=16)


def test_an_atomic_past_the_output_fails_the_call(interpret: None) -> None:
    x = jnp.arange(1.0, 17.0)
    with pytest.raises(Exception, match=r"_atomic_past_end: atomic of 1 active lane\(s\)"):
        run(_atomic_past_end, x, 16, scalars=(16,), BLOCK=16)


def test_the_error_type_is_public_to_the_plugin() -> None:
    assert issubclass(OutOfBoundsAccess, IndexError)
