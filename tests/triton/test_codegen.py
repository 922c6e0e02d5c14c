"""What the GPU will run, checked on any machine: the kernels compiled for sm_90 by Triton's
own compiler (no GPU needed). Guards the property that once cost 2.5x: every tile load is a
16-byte pipelined copy (jax-triton passes integer strides without divisibility hints; the
kernels take them in units of ``ALIGN`` elements to restore it)."""

from __future__ import annotations

import types

import attrs
import jax.numpy as jnp
import pytest
from tests.triton._flash_variants import variant_kernels

from ejkernel.ops import FwdParams
from ejkernel_triton import _codegen

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_cache_in_tmp")

#: The H100's shared memory per block (227 KiB, opt-in maximum).
H100_SHARED = 232448


@pytest.fixture
def hopper(monkeypatch):
    """A GPU's choices, recorded on the CPU: an H100 (sm_90) is the default device."""
    from ejkernel_triton.ops import flash_attention_config as config

    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setattr(config, "_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(config, "_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "232448")  # the H100's
    return config


def _run(shape, kv_len=None, *, causal, cfg=None, backward=False, **kwargs):
    """The launches of the forward (and the backward) of ones of ``shape`` [B, S, H, D] (keys:
    ``kv_len`` rows of half the heads), by ``cfg`` or the heuristic's config."""
    from ejkernel_triton.ops import flash_attention as fa

    b, s, h, d = shape
    q = jnp.ones(shape, jnp.bfloat16)
    kv = jnp.ones((b, kv_len or s, max(h // 2, 1), d), jnp.bfloat16)
    with _codegen.recorded_launches() as record:
        out, res = fa._flash_attention_fwd(
            query=q, key=kv, value=kv, causal=causal, cfg=cfg, **kwargs
        )
        if backward:
            fa._flash_attention_bwd(res, out, cfg=cfg, causal=causal, **kwargs)
    return record


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_tile_loads_are_vectorised_and_pipelined(head_dim):
    launches = _codegen.flash_attention_launches((1, 256, 2, head_dim), jnp.bfloat16, causal=True)
    assert [launch.kernel.fn.__name__ for launch in launches] == [
        "flash_attention_fwd_kernel",
        "flash_attention_bwd_dq_kernel",  # first: it computes delta for dK/dV
        "flash_attention_bwd_dkdv_kernel",
    ]
    for launch in launches:
        compiled = _codegen.compile_launch(launch, capability=90)
        mix = _codegen.instruction_mix(compiled.ptx)
        name = launch.kernel.fn.__name__
        narrow = {k: n for k, n in mix.items() if k.endswith((".b16", ".u16", ".b8", ".u8"))}
        assert not narrow, f"{name}: narrow global loads {narrow}"
        if launch.num_stages > 1:  # pipelined: tiles arrive by 16-byte async copies
            assert mix.get("cp.async.cg.shared.global", 0) > 0, f"{name}: no async copies"
        else:  # one stage (the causal D 64 dK/dV kernel): 16-byte loads
            assert mix.get("ld.global.v4.b32", 0) > 0, f"{name}: no 16-byte loads"
        assert any(k.startswith("wgmma") for k in mix), f"{name}: no Hopper matrix instructions"
        assert compiled.shared <= H100_SHARED, name


def test_strides_not_divisible_by_16_keep_what_they_can():
    # D 40: strides are multiples of 8 elements (16 bytes in bf16), still one vector per copy
    (fwd, *_) = _codegen.flash_attention_launches((1, 64, 2, 40), jnp.bfloat16, causal=False)
    assert fwd.constexprs["ALIGN"] == 8
    mix = _codegen.instruction_mix(_codegen.compile_launch(fwd).ptx)
    assert not any(k.endswith(".b16") for k in mix), mix


@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
def test_bias_and_mask_tiles_fit_in_shared_memory(bias_dtype):
    # the deepest pipeline of the config space; bias and mask tiles join every stage
    from ejkernel.ops import BwdParams, FwdParams
    from ejkernel_triton.ops.flash_attention import FlashAttentionConfig

    cfg = FlashAttentionConfig(
        fwd_params=FwdParams(q_blocksize=128, kv_blocksize=128, num_warps=8, num_stages=3),
        bwd_params=BwdParams(q_blocksize=64, kv_blocksize=128, num_warps=8, num_stages=3),
    )
    s = 256
    launches = _codegen.flash_attention_launches(
        (1, s, 2, 128),
        causal=False,
        cfg=cfg,
        bias=jnp.ones((1, 2, s, s), bias_dtype),
        attention_mask=jnp.ones((1, 1, s, s), bool),
    )
    for launch in launches:
        compiled = _codegen.compile_launch(launch)
        assert compiled.shared <= H100_SHARED, (launch.kernel.fn.__name__, launch)
    assert launches[0].num_stages < 3  # the forward gave up stages to fit


def test_warp_specialized_kernels_are_a_producer_and_two_consumer_warp_groups(monkeypatch):
    from ejkernel.ops import FwdParams
    from ejkernel_triton.ops import flash_attention as fa

    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")  # a CPU: the plain case qualifies only here
    cfg = fa.FlashAttentionConfig(
        fwd_variant="warp_specialized",
        bwd_variant="warp_specialized",
        fwd_params=FwdParams(q_blocksize=128, kv_blocksize=128, num_warps=4, num_stages=2),
    )
    fwd, dkdv, dq = _codegen.flash_attention_launches((1, 300, 2, 128), causal=True, cfg=cfg)
    assert fwd.kernel.fn.__name__ == "flash_attention_fwd_ws_kernel"
    assert dkdv.kernel.fn.__name__ == "flash_attention_bwd_dkdv_ws_kernel"
    assert dq.kernel.fn.__name__ == "flash_attention_bwd_dq_ws_kernel"
    for launch in (fwd, dkdv, dq):
        compiled = _codegen.compile_launch(launch)
        assert compiled.num_warps == 12  # 4 asked for: the producer and two consumers of 4
        assert compiled.ptx.count("setmaxnreg") > 0  # registers moved to the consumers
        assert any(k.startswith("wgmma") for k in _codegen.instruction_mix(compiled.ptx))
        assert compiled.shared <= H100_SHARED


def test_warp_specialized_forward_runs_its_validated_tiles_on_a_gpu(hopper):
    from ejkernel.ops import FwdParams
    from ejkernel_triton.ops import flash_attention as fa

    cfg = fa.FlashAttentionConfig(fwd_variant="warp_specialized")
    (launch,) = _run((1, 300, 2, 64), causal=True, cfg=cfg)
    assert launch.kernel.fn.__name__ == "flash_attention_fwd_ws_kernel"
    assert launch.constexprs["BLOCK_N"] == 128 and (launch.num_warps, launch.num_stages) == (4, 2)
    assert launch.grid == (6,)  # persistent: min(tiles = 3 query blocks x 2 heads, SMs)
    # other tiles compiled to wrong results (triton 3.6): refused, not replaced
    other = attrs.evolve(cfg, fwd_params=FwdParams(kv_blocksize=64, num_warps=8, num_stages=3))
    with pytest.raises(ValueError, match=r"fwd_variant='warp_specialized'.*kv_blocksize=64"):
        _run((1, 300, 2, 64), causal=True, cfg=other)


@pytest.mark.parametrize(
    ("causal", "soft_cap", "sk"),
    [(False, None, 256), (True, 30.0, 200)],
    ids=["plain-even-keys", "causal-softcap-cut-keys"],
)
def test_hopper_forward_at_d128_is_the_gluon_pingpong_kernel(hopper, causal, soft_cap, sk):
    record = _run((2, 300, 4, 128), sk, causal=causal, logits_soft_cap=soft_cap)  # heuristic
    (launch,) = record
    assert launch.kernel.fn.__name__ == "flash_attention_fwd_pingpong_kernel"
    assert launch.grid == (3, 8)  # 128-row query tiles x batch·heads
    assert launch.constexprs == {
        "HEAD_DIM": 128,
        "CAUSAL": causal,
        "SOFT_CAP": soft_cap is not None,
        "BLOCK_N": 128,
        "STAGES": 3,
        "EVEN_K": sk % 128 == 0,
        "HEAD_GROUP": 8 if causal else 0,  # causal: longest query tiles first
    }
    compiled = _codegen.compile_launch(launch)
    assert compiled.num_warps == 12  # two consumer warp groups and the loader's
    # registers handed from the loader (24) to the consumers (240)
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in compiled.ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in compiled.ptx
    assert compiled.ptx.count("cp.async.bulk.tensor") >= 4  # Q halves, K and V by TMA
    assert any(k.startswith("wgmma") for k in _codegen.instruction_mix(compiled.ptx))
    assert compiled.shared <= H100_SHARED


@pytest.mark.parametrize("scale", [0.0, -0.1])
def test_hopper_forward_at_d128_leaves_a_scale_of_zero_or_less_to_triton(hopper, scale):
    # the Gluon kernel masks and takes row maxima of unscaled scores
    from ejkernel_triton.ops import flash_attention as fa

    record = _run((2, 300, 4, 128), causal=True, softmax_scale=scale)  # heuristic
    assert [launch.kernel.fn.__name__ for launch in record] == ["flash_attention_fwd_ws_kernel"]
    with pytest.raises(ValueError, match="softmax scale > 0"):
        _run(
            (2, 300, 4, 128),
            causal=True,
            softmax_scale=scale,
            cfg=fa.FlashAttentionConfig(fwd_variant="pingpong"),
        )


@pytest.mark.parametrize(
    ("d", "causal", "variant"),
    [
        (128, True, "gluon"),
        (128, False, "gluon_dkdv"),
        (64, False, "gluon"),
        (64, True, "gluon_dkdv"),
    ],
    ids=["d128-causal-fused", "d128-dkdv", "d64-fused", "d64-causal-dkdv"],
)
def test_hopper_backward_variants_are_the_gluon_kernel(hopper, d, causal, variant):
    from ejkernel_triton.ops import flash_attention as fa

    q = jnp.ones((2, 300, 4, d), jnp.bfloat16)
    kv = jnp.ones((2, 200, 2, d), jnp.bfloat16)
    call = {"query": q, "key": kv, "value": kv, "causal": causal}
    cfg = attrs.evolve(fa.heuristic(types.SimpleNamespace(kwargs=call)), bwd_variant=variant)
    if variant == "gluon_dkdv":
        cfg = attrs.evolve(
            cfg, dq_params=FwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4, num_stages=2)
        )
    record = _run((2, 300, 4, d), 200, causal=causal, cfg=cfg, backward=True)
    names = [launch.kernel.fn.__name__ for launch in record]
    fused = variant == "gluon"
    if fused:  # one backward kernel (delta from JAX)
        assert names[1:] == ["flash_attention_bwd_gluon_kernel"]
    else:  # the usual dQ kernel first, which computes delta; the Gluon kernel's dK/dV
        assert names[1:] == ["flash_attention_bwd_dq_kernel", "flash_attention_bwd_gluon_kernel"]
    bwd = record[-1]
    block_m = cfg.bwd_params.q_blocksize
    assert bwd.grid == (2, 4)  # 128-key blocks x batch·key heads
    assert bwd.constexprs == {
        "HEAD_DIM": d,
        "CAUSAL": causal,
        "SOFT_CAP": False,
        "BLOCK_M": block_m,
        "STAGES": 2,
        "HEAD_GROUP": 8 if causal else 0,  # causal: the first key blocks first
        "FUSE_DQ": fused,
    }
    lse, delta = bwd.args[4:6]  # padded to whole query blocks for their TMA loads
    assert lse.shape == delta.shape == (2, 4, -(-300 // block_m) * block_m)
    # outputs dK, dV and the float32 dQ accumulator, zeroed before the launch (unfused: a token)
    assert [o.dtype for o in bwd.out_shape[:3]] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
    assert bwd.out_shape[2].shape == (q.shape if fused else (1,))
    assert bwd.zeroed_outputs == ((2,) if fused else ())
    compiled = _codegen.compile_launch(bwd)
    assert compiled.num_warps == 12  # two consumer warp groups and the loader's
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in compiled.ptx
    # loads of K, V, Q, dO, lse and delta; dQ added into global memory by TMA
    assert compiled.ptx.count("cp.async.bulk.tensor") >= 6
    reduces = compiled.ptx.count("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add")
    assert reduces >= 2 if fused else reduces == 0  # at least one per consumer
    mix = _codegen.instruction_mix(compiled.ptx)
    # S, dP (N = query rows), dV, dK (N = D) and dQ (N = 64: half of D 128, all of D 64)
    assert {k for k in mix if k.startswith("wgmma.mma_async")} == {
        f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"
        for n in {block_m, d, *([64] if fused else [])}
    }
    assert compiled.shared <= H100_SHARED


@pytest.mark.parametrize(("d", "causal"), [(128, True), (64, False), (64, True)])
def test_hopper_heuristic_takes_the_tables_variants(hopper, d, causal):
    record = _run((2, 300, 4, d), causal=causal, backward=True)
    names = [launch.kernel.fn.__name__ for launch in record]
    forward = "flash_attention_fwd_pingpong_kernel" if d == 128 else "flash_attention_fwd_kernel"
    backward = ["flash_attention_bwd_gluon_kernel"]
    if d == 64 and causal:  # the usual dQ kernel, then the Gluon dK/dV
        backward = ["flash_attention_bwd_dq_kernel", *backward]
    assert names == [forward, *backward]


def test_hopper_forward_at_d64_is_no_pingpong(hopper):
    from ejkernel_triton.ops import flash_attention as fa

    cfg = fa.FlashAttentionConfig(fwd_variant="warp_specialized")
    record = _run((1, 300, 2, 64), causal=True, cfg=cfg)
    assert [launch.kernel.fn.__name__ for launch in record] == ["flash_attention_fwd_ws_kernel"]
    with pytest.raises(ValueError, match="it takes D 128; got D 64"):
        _run((1, 300, 2, 64), causal=True, cfg=fa.FlashAttentionConfig(fwd_variant="pingpong"))


@pytest.mark.parametrize("d", [64, 128])
def test_every_candidate_of_the_hopper_config_space_launches_what_it_names(hopper, d):
    from ejkernel_triton.ops import flash_attention as fa

    q = jnp.ones((2, 300, 4, d), jnp.bfloat16)
    kv = jnp.ones((2, 200, 2, d), jnp.bfloat16)
    space = fa.config_space(
        types.SimpleNamespace(kwargs={"query": q, "key": kv, "value": kv, "causal": True})
    )
    assert len(space) > 5
    for cfg in space:
        record = _run((2, 300, 4, d), 200, causal=True, cfg=cfg, backward=True)
        names = [launch.kernel.fn.__name__ for launch in record]
        assert names == variant_kernels(cfg.fwd_variant, cfg.bwd_variant), cfg
        fwd = record[0]
        if cfg.fwd_variant == "usual":  # the config's blocks, warps and head group
            assert (fwd.constexprs["BLOCK_M"], fwd.constexprs["BLOCK_N"]) == (
                min(cfg.fwd_params.q_blocksize, 512),
                min(cfg.fwd_params.kv_blocksize, 256),
            )
            assert fwd.num_warps == cfg.fwd_params.num_warps
            assert fwd.constexprs["HEAD_GROUP"] == cfg.fwd_head_group


def test_decode_step_reads_shared_memory_in_matrix_fragments():
    """The bfloat16 decode kernel (B 32 tile) feeds its products by ``ldmatrix``, never by
    narrow shared-memory loads; the float8 one compiles at half the copies."""
    bf16 = _codegen.compile_launch(_codegen.decode_launches(jnp.bfloat16))
    mix = _codegen.shared_memory_mix(bf16.ptx)
    assert any(k.startswith("ldmatrix") for k in mix), mix
    assert not any(k.startswith("ld.shared") and k.endswith((".b8", ".b16")) for k in mix), mix
    fp8 = _codegen.compile_launch(_codegen.decode_launches(jnp.float8_e4m3fn))
    copies = _codegen.instruction_mix(bf16.ptx)["cp.async.cg.shared.global"]
    fp8_mix = _codegen.instruction_mix(fp8.ptx)
    assert 0 < fp8_mix["cp.async.cg.shared.global"] < copies
    assert fp8.shared <= H100_SHARED


@pytest.mark.parametrize(
    ("op", "first", "last"),
    [
        ("kda", "kda_fwd_norm_kernel", "kda_bwd_chunk_out_kernel"),
        ("gla", "gla_fwd_cumsum_kernel", None),
    ],
)
def test_linear_launches_record_the_forward_and_backward(hopper, op, first, last):
    """``_codegen.linear_launches``: the op's launches in order, its sequential walk among
    them, each compiling for sm_90 (the first here)."""
    launches = _codegen.linear_launches(op, (1, 128, 2, 64))
    names = [launch.kernel.fn.__name__ for launch in launches]
    assert names[0] == first and (last is None or names[-1] == last)
    assert any("_h_kernel" in name for name in names)
    assert _codegen.compile_launch(launches[0]).shared <= H100_SHARED
    with pytest.raises(ValueError, match="op"):
        _codegen.linear_launches("mamba")
