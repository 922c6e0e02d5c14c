"""Stamps and labels: named scopes that survive lowering and compiling, found in program text
and mapped back to the configs that ran."""

from __future__ import annotations

import sys

import jax
import pytest
from tests.core._flash_calls import SHAPE, causal_attention

import ejkernel
from ejkernel import _executor, _labels
from ejkernel.ops import (
    Label,
    PersistentCache,
    extract_labels_from_hlo_text,
    find_labels_in_lowered,
    label,
    labels_to_configs,
)
from ejkernel.testing import assert_close, attention_inputs


def _lower(f, *args):
    """Lower a new function each time (JAX traces a function it traced before only once)."""
    return jax.jit(lambda *a: f(*a)).lower(*args)


def test_nothing_is_stamped_by_default(toy, monkeypatch):
    q, k, v = attention_inputs(SHAPE)
    assert find_labels_in_lowered(_lower(causal_attention, q, k, v)) == []
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "none")
    assert find_labels_in_lowered(_lower(causal_attention, q, k, v)) == []


def test_hash_stamps_survive_lowering_and_compiling(toy, monkeypatch):
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "hash")
    q, k, v = attention_inputs(SHAPE)
    lowered = _lower(causal_attention, q, k, v)
    labels = find_labels_in_lowered(lowered)
    sel = ejkernel.explain("flash_attention", q, k, v, causal=True)
    assert labels == [
        Label(
            kind="op",
            name="flash_attention",
            op="flash_attention",
            platform="toy",
            key=sel.key[:16],
            digest=labels[0].digest,
        )
    ]
    compiled = lowered.compile()
    assert find_labels_in_lowered(compiled) == labels
    assert extract_labels_from_hlo_text(compiled.as_text()) == labels
    assert labels_to_configs(labels) == {labels[0]: sel.config}


def test_json_stamps_carry_their_config(toy, monkeypatch):
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "json")
    q, k, v = attention_inputs(SHAPE)
    (found,) = find_labels_in_lowered(_lower(causal_attention, q, k, v))
    assert found.config_type == f"{toy.__name__}:ToyConfig"
    assert found.config_json == '{"block":32}'
    # as in another process: no stamp, no memory cache, no persistent entry
    _labels.forget_stamps()
    _executor._default = None
    assert labels_to_configs([found]) == {found: {"block": 32}}  # the class is not importable
    monkeypatch.setitem(sys.modules, toy.__name__, toy)
    assert labels_to_configs([found]) == {found: toy.ToyConfig(block=32)}


def test_stamps_tell_configs_of_one_invocation_apart(toy, monkeypatch):
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "hash")
    q, k, v = attention_inputs(SHAPE)

    def two(q, k, v):
        return causal_attention(q, k, v) + causal_attention(q, k, v, cfg=toy.ToyConfig(block=16))

    labels = find_labels_in_lowered(_lower(two, q, k, v))
    assert len(labels) == 2 and labels[0].key == labels[1].key
    assert labels[0].digest != labels[1].digest
    assert list(labels_to_configs(labels).values()) == [
        toy.ToyConfig(block=32),
        toy.ToyConfig(block=16),
    ]


def test_a_differentiated_call_is_stamped_with_its_own_config(toy, monkeypatch):
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "hash")
    q, k, v = attention_inputs(SHAPE)
    grad_cfg = toy.ToyConfig(block=16)
    sel = ejkernel.explain("flash_attention", q, k, v, causal=True, grad=True)
    ejkernel.ops.default_executor().selector.cache.put(sel.key, grad_cfg)
    lowered = _lower(jax.grad(lambda q: causal_attention(q, k, v).sum()), q)
    (found,) = find_labels_in_lowered(lowered)
    assert found.key == sel.key[:16]
    assert labels_to_configs([found]) == {found: grad_cfg}
    # the backward runs in the same scope as the forward
    text = lowered.as_text(debug_info=True)
    assert "transpose(jvp(" in text and "ejkernel:op=flash_attention" in text


def test_hash_stamps_are_found_in_the_caches(toy, monkeypatch):
    monkeypatch.setitem(sys.modules, toy.__name__, toy)  # persistent entries name their class
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "hash")
    q, k, v = attention_inputs(SHAPE)
    (found,) = find_labels_in_lowered(_lower(causal_attention, q, k, v))
    key = ejkernel.explain("flash_attention", q, k, v, causal=True).key
    _labels.forget_stamps()
    assert labels_to_configs([found]) == {found: toy.ToyConfig(block=32)}  # memory cache
    _executor._default = None
    assert labels_to_configs([found]) == {}
    PersistentCache().put(key, toy.ToyConfig(block=48))  # another config: not this stamp's
    assert labels_to_configs([found]) == {}
    PersistentCache().put(key, toy.ToyConfig(block=32))
    assert labels_to_configs([found]) == {found: toy.ToyConfig(block=32)}


def test_a_config_without_a_json_form_is_stamped_by_its_repr(toy, monkeypatch):
    class Opaque:
        def __repr__(self):
            return "Opaque()"

    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "json")
    q, k, v = attention_inputs(SHAPE)
    cfg = toy.ToyConfig(block=Opaque())
    lowered = _lower(lambda q, k, v: causal_attention(q, k, v, cfg=cfg), q, k, v)
    (found,) = find_labels_in_lowered(lowered)
    assert found.config_json == '"ToyConfig(block=Opaque())"'
    assert labels_to_configs([found]) == {found: cfg}  # the stamp made in this process
    _labels.forget_stamps()
    assert labels_to_configs([found]) == {found: "ToyConfig(block=Opaque())"}


def test_eager_calls_run_as_usual_while_stamping(toy, monkeypatch):
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "json")
    q, k, v = attention_inputs(SHAPE)
    assert_close(causal_attention(q, k, v), jax.jit(causal_attention)(q, k, v))


def test_a_bad_stamp_mode_is_refused(toy, monkeypatch):
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "yes")
    q, k, v = attention_inputs(SHAPE)
    with pytest.raises(ValueError, match="EJKERNEL_OPS_STAMP"):
        _lower(causal_attention, q, k, v)


@pytest.mark.parametrize("name", ["attention", "layer 3/attn (q)", "a\"b'c;d=e%f`g#h é"])
def test_label_names_read_back_exactly(name):
    # One program per name: JAX's persistent compilation cache, where it is on, keys a
    # program without its metadata, and an executable it loads keeps the labels of the program
    # first compiled. The lowered text is always the call's own.
    x = jax.numpy.ones(3)
    fn = label(name)(lambda x: jax.numpy.sin(x) * len(name))

    def ctx(x):
        with label(name + "!"):
            return jax.numpy.cos(x)

    lowered = _lower(lambda x: fn(x) + ctx(x), x)
    want = {Label(kind="label", name=name), Label(kind="label", name=name + "!")}
    for found in (find_labels_in_lowered(lowered), find_labels_in_lowered(lowered.compile())):
        assert len(found) == 2 and set(found) == want


def test_text_of_either_form_is_read():
    stamp = "ejkernel:op=flash_attention;platform=xla;key=0123456789abcdef;cfg=89abcdef"
    text = (
        f'#loc3 = loc("jit(f)/ejkernel:label=outer/{stamp}/dot_general"(#loc1))\n'
        f'  %mul.0 = f32[3]{{0}} multiply(%a, %b), metadata={{op_name="jit(f)/'
        f'transpose(jvp(ejkernel:label=outer))/{stamp};future=1/mul" stack_frame_id=2}}\n'
    )
    assert extract_labels_from_hlo_text(text) == [
        Label(kind="label", name="outer"),
        Label(
            kind="op",
            name="flash_attention",
            op="flash_attention",
            platform="xla",
            key="0123456789abcdef",
            digest="89abcdef",
        ),
    ]


def test_traced_functions_are_lowered_for_their_labels():
    fn = jax.jit(label("traced")(lambda x: x * 2))
    traced = fn.trace(jax.numpy.ones(3)) if hasattr(fn, "trace") else fn.lower(jax.numpy.ones(3))
    assert find_labels_in_lowered(traced) == [Label(kind="label", name="traced")]


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="name"):
        label(3)
    with pytest.raises(ValueError, match="name"):
        label("")
    with pytest.raises(TypeError, match="decorates"):
        label("x")(3)
    with pytest.raises(TypeError, match="Lowered"):
        find_labels_in_lowered(3)
    with pytest.raises(TypeError, match="text"):
        extract_labels_from_hlo_text(b"bytes")
    with pytest.raises(TypeError, match="Label"):
        labels_to_configs(["ejkernel:label=x"])


# -- the seed's examples ("HLO Analysis", "Labeling Operations") --------------------------------


def test_seed_hlo_analysis(monkeypatch):
    from ejkernel.ops import extract_labels_from_hlo_text, find_labels_in_lowered, labels_to_configs

    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "hash")
    q, k, v = attention_inputs(SHAPE)

    def fn(q, k, v):
        return ejkernel.flash_attention(q, k, v, causal=True)

    # Find labeled operations in lowered JAX code
    lowered = jax.jit(fn).lower(q, k, v)
    labels = find_labels_in_lowered(lowered)
    chosen = ejkernel.explain("flash_attention", q, k, v, causal=True).platform
    assert [(lab.op, lab.platform) for lab in labels] == [("flash_attention", chosen)]
    # Extract from HLO text
    hlo_text = lowered.compile().as_text()
    labels = extract_labels_from_hlo_text(hlo_text)
    # Convert labels to configs
    configs = labels_to_configs(labels)
    assert configs == {labels[0]: ejkernel.explain("flash_attention", q, k, v, causal=True).config}


def test_seed_labeling_operations(monkeypatch):
    from ejkernel.ops import label

    attention_impl = ejkernel.flash_attention

    # Add label for HLO analysis
    @label("my_attention")
    def my_attention(q, k, v):
        return attention_impl(q, k, v)

    q, k, v = attention_inputs(SHAPE)
    assert_close(my_attention(q, k, v), attention_impl(q, k, v))
    labels = find_labels_in_lowered(jax.jit(my_attention).lower(q, k, v))
    assert labels == [Label(kind="label", name="my_attention")]
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "json")
    labels = find_labels_in_lowered(_lower(my_attention, q, k, v))
    assert [(lab.kind, lab.name) for lab in labels] == [
        ("label", "my_attention"),
        ("op", "flash_attention"),
    ]
    assert my_attention.__name__ == "my_attention"
