"""Recording op invocations: the environment variable, the context manager, dedupe, grad, jit,
forced platforms, records by hand, JSON files, and records made by a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest
from tests.core._flash_calls import SHAPE, causal_attention

import ejkernel
from ejkernel import _recording
from ejkernel.ops import (
    Invocation,
    Kernel,
    RecordedInvocation,
    get_invocations,
    load_invocations,
    record_invocation,
    record_invocations,
    save_invocations,
)
from ejkernel.testing import attention_inputs


def _loss(q, k, v):
    return causal_attention(q, k, v).sum()


def _jit(f):
    """``jax.jit`` of a new function: JAX traces a function it traced before only once."""
    return jax.jit(lambda *a: f(*a))


def test_nothing_is_recorded_while_recording_is_off(toy):
    q, k, v = attention_inputs(SHAPE)
    causal_attention(q, k, v)
    _jit(causal_attention)(q, k, v)
    assert get_invocations() == []


def test_the_environment_variable_is_read_at_call_time(toy, monkeypatch):
    q, k, v = attention_inputs(SHAPE)
    causal_attention(q, k, v)
    monkeypatch.setenv("EJKERNEL_OPS_RECORD", "1")
    causal_attention(q, k, v)  # the eager memo's hit is recorded too
    (rec,) = get_invocations()
    assert rec.op == "flash_attention" and not rec.grad and rec.platform is None
    assert rec.arrays["query"].shape == q.shape and rec.arrays["key"].dtype == "float32"
    assert rec.static["causal"] is True
    monkeypatch.setenv("EJKERNEL_OPS_RECORD", "0")
    causal_attention(q[:, :20], k[:, :20], v[:, :20])
    assert len(get_invocations()) == 1


def test_a_block_records_its_calls_and_the_process_keeps_them(toy):
    q, k, v = attention_inputs(SHAPE)
    with record_invocations() as rec:
        causal_attention(q, k, v)
        with record_invocations() as inner:
            causal_attention(q[:, :20], k[:, :20], v[:, :20])
    causal_attention(q[:, :10], k[:, :10], v[:, :10])  # outside: not recorded
    assert [r.arrays["query"].shape[1] for r in rec] == [37, 20]
    assert [r.arrays["query"].shape[1] for r in inner.invocations] == [20]
    assert get_invocations() == rec.invocations
    assert len(rec) == 2 and "2 invocations" in repr(rec)


def test_blocks_are_per_thread(toy):
    q, k, v = attention_inputs(SHAPE)
    seen: dict[str, list[RecordedInvocation]] = {}

    def work(name, n):
        with record_invocations() as rec:
            causal_attention(q[:, :n], k[:, :n], v[:, :n])
        seen[name] = rec.invocations

    with record_invocations() as outer:
        threads = [threading.Thread(target=work, args=(f"t{n}", n)) for n in (11, 13)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [r.arrays["query"].shape[1] for r in seen["t11"]] == [11]
    assert [r.arrays["query"].shape[1] for r in seen["t13"]] == [13]
    assert outer.invocations == []  # threads do not inherit the block
    assert len(get_invocations()) == 2


def test_records_are_deduplicated_in_first_seen_order(toy):
    q, k, v = attention_inputs(SHAPE)
    with record_invocations() as rec:
        for _ in range(3):
            causal_attention(q, k, v)
            causal_attention(q[:, :20], k[:, :20], v[:, :20])
        causal_attention(q, k, v, softmax_scale=0.5)
    assert [(r.arrays["query"].shape[1], r.static["softmax_scale"]) for r in rec] == [
        (37, 0.25),
        (20, 0.25),
        (37, 0.5),
    ]


def test_jit_records_when_traced_and_grad_records_the_differentiated_call(toy):
    q, k, v = attention_inputs(SHAPE)
    with record_invocations() as rec:
        _jit(causal_attention)(q, k, v)
        jax.grad(_loss, argnums=(0, 1, 2))(q, k, v)
        _jit(jax.grad(_loss))(q, k, v)  # the same differentiated call: deduplicated
    assert [r.grad for r in rec] == [False, True]
    fwd, grad = rec.invocations
    assert fwd.arrays == grad.arrays and fwd.static == grad.static
    assert fwd.arrays["query"].sharding is None


def test_a_differentiated_call_alone_is_one_record(toy):
    q, k, v = attention_inputs(SHAPE)
    with record_invocations() as rec:
        jax.grad(_loss)(q, k, v)
    assert [r.grad for r in rec] == [True]


def test_forced_platforms_are_recorded(toy, monkeypatch):
    @dataclass(frozen=True)
    class WithPlatform:
        platform: str = "toy"

    q, k, v = attention_inputs(SHAPE)
    with record_invocations() as rec:
        causal_attention(q, k, v)
        causal_attention(q, k, v, platform="toy")
        jax.jit(lambda q: causal_attention(q, k, v, cfg=WithPlatform()))(q)
        monkeypatch.setenv("EJKERNEL_PLATFORM", "toy")
        causal_attention(q[:, :20], k[:, :20], v[:, :20])
    assert [(r.platform, r.arrays["query"].shape[1]) for r in rec] == [
        (None, 37),
        ("toy", 37),
        ("toy", 20),
    ]


def test_a_bad_platform_is_refused_before_it_is_recorded(toy, monkeypatch):
    monkeypatch.setenv("EJKERNEL_OPS_RECORD", "1")
    q, k, v = attention_inputs(SHAPE)
    with pytest.raises(TypeError, match="platform"):
        causal_attention(q, k, v, platform=123)
    assert get_invocations() == []


def test_records_go_through_a_json_file(toy, tmp_path):
    q, k, v = attention_inputs(SHAPE)
    with record_invocations() as rec:
        _jit(causal_attention)(q, k, v)
        jax.grad(_loss)(q, k, v)
        causal_attention(q, k, v, platform="toy")
    path = rec.save(tmp_path / "sub" / "calls.json")
    assert load_invocations(path) == rec.invocations
    save_invocations(tmp_path / "all.json")  # default: the process-wide records
    assert load_invocations(tmp_path / "all.json") == get_invocations()
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["calls.json"]
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_invocations(tmp_path / "bad.json")


def test_a_record_rebuilds_its_call(toy):
    q, k, v = attention_inputs(SHAPE)
    with record_invocations() as rec:
        causal_attention(q, k, v)
    args, kwargs = _recording.call_arguments(rec.invocations[0])
    assert args == ()
    sel = ejkernel.explain("flash_attention", **kwargs)
    assert sel.config == ejkernel.explain("flash_attention", q, k, v, causal=True).config


def test_a_child_process_records_and_this_one_loads(tmp_path):
    path = tmp_path / "calls.json"
    script = textwrap.dedent(
        f"""
        import jax, ejkernel
        from ejkernel.ops import save_invocations
        from ejkernel.testing import AttentionShape, attention_inputs
        q, k, v = attention_inputs(AttentionShape(b=1, sq=37, sk=37, hq=4, hkv=2, d=16))
        f = lambda q, k, v: ejkernel.flash_attention(q, k, v, causal=True).sum()
        jax.jit(f).lower(q, k, v)
        jax.jit(jax.grad(f)).lower(q, k, v)
        ejkernel.flash_attention(q, k, v, causal=True, platform="xla")
        save_invocations({str(path)!r})
        """
    )
    env = {**os.environ, "EJKERNEL_OPS_RECORD": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    records = load_invocations(path)
    assert [(r.op, r.grad, r.platform) for r in records] == [
        ("flash_attention", False, None),
        ("flash_attention", True, None),
        ("flash_attention", False, "xla"),
    ]
    q, k, v = attention_inputs(SHAPE)
    with record_invocations() as rec:
        _jit(causal_attention).lower(q, k, v)
    assert records[0] == rec.invocations[0]


# -- by hand ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MyConfig:
    block_size: int = 128


class MyKernel(Kernel[MyConfig, jnp.ndarray]):
    def __init__(self):
        super().__init__(name="my_kernel")

    def run(self, a, b, *, cfg: MyConfig, **kwargs) -> jnp.ndarray:
        return jnp.dot(a, b) * kwargs.get("scale", 1.0)

    def heuristic_cfg(self, inv: Invocation) -> MyConfig:
        return MyConfig(block_size=64)


def test_record_invocation_by_hand_for_ops(toy):
    from ejkernel.modules import FlashAttention

    q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in attention_inputs(SHAPE))
    kernel = FlashAttention()
    a = record_invocation(
        kernel, Invocation(kernel=kernel, args=(q, k, v), kwargs={"causal": True})
    )
    assert a.op == "flash_attention" and a.static["causal"] is True and not a.grad
    b = record_invocation(
        "flash_attention",
        Invocation(
            kernel="flash_attention",
            kwargs={"query": q, "key": k, "value": v, "platform": "toy"},
            metadata={"grad": True},
        ),
    )
    assert (b.platform, b.grad) == ("toy", True)
    c = record_invocation(ejkernel.flash_attention, a)  # a record again: deduplicated
    assert c == a
    assert get_invocations() == [a, b]


def test_record_invocation_refuses_what_it_cannot_record(toy):
    q = attention_inputs(SHAPE)[0]
    with pytest.raises(TypeError, match="kernel"):
        record_invocation(42, Invocation(kernel="x"))
    with pytest.raises(ValueError, match="not a known op"):
        record_invocation("no_such_op", Invocation(kernel="x"))
    with pytest.raises(TypeError, match="inv"):
        record_invocation("flash_attention", {"query": q})
    rec = RecordedInvocation(op="mean_pooling")
    with pytest.raises(ValueError, match="mean_pooling"):
        record_invocation("flash_attention", rec)
    with pytest.raises((TypeError, ValueError)):
        record_invocation("flash_attention", Invocation(kernel="flash_attention", args=(q,)))
    assert get_invocations() == []


def test_user_kernels_are_recorded_with_the_kernel_object(tmp_path):
    kernel = MyKernel()
    a = jnp.ones((8, 4))
    b = jnp.ones((4, 3))
    with record_invocations() as rec:
        kernel(a, b, scale=2.0)
        jax.jit(lambda a: kernel(a, b, scale=2.0))(a)  # the same call, traced
        small = jax.ShapeDtypeStruct((2, 4), a.dtype)
        record_invocation(kernel, Invocation(kernel=kernel, args=(small, b)))
    first, second = rec.invocations
    assert first.kernel is kernel and first.op == "my_kernel"
    assert first.arrays["0"].shape == (8, 4) and first.static["scale"] == 2.0
    assert second.arrays["0"].shape == (2, 4)
    args, kwargs = _recording.call_arguments(first)
    assert [x.shape for x in args] == [(8, 4), (4, 3)] and kwargs == {"scale": 2.0}
    save_invocations(tmp_path / "k.json", rec.invocations)
    loaded = load_invocations(tmp_path / "k.json")
    assert loaded == rec.invocations
    assert loaded[0].kernel == f"{__name__}:MyKernel"


# -- the seed's example ("Batch Autotuning") -----------------------------------------------------


def test_seed_batch_autotuning_records_and_gets_invocations():
    from ejkernel.modules import FlashAttention
    from ejkernel.ops import get_invocations, record_invocation

    q = k = v = jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.float32)
    kernel = FlashAttention()
    inv = Invocation(kernel=kernel, args=(q, k, v), kwargs={"causal": True})
    # Enable recording
    record_invocation(kernel, inv)
    # ... run your model with various inputs ...
    with record_invocations():
        x = jnp.ones((2, 48, 4, 32))
        jax.jit(lambda x: ejkernel.flash_attention(x, x, x))(x)
    # Get all recorded invocations
    invocations = get_invocations()
    assert [r.arrays["query"].shape for r in invocations] == [(2, 64, 4, 32), (2, 48, 4, 32)]


def test_seed_batch_autotuning_autotune_recorded_is_importable():
    import ejkernel.ops

    if not hasattr(ejkernel.ops, "autotune_recorded"):
        pytest.skip("autotune_recorded is not in this tree yet")
    from ejkernel.ops import autotune_recorded  # noqa: F401
