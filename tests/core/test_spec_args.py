"""The argument lists of the in-tree specs, and `OpSpec.from_function` that derives them.

Each op's arguments are pinned as one line of tokens, in signature order: ``name``, then ``!``
when required, ``[]`` for an array argument, ``~`` when differentiable, and ``=repr(default)``
when the default is not None.
"""

from __future__ import annotations

from typing import Any

import jax
import pytest

from ejkernel.specs import Arg, OpSpec, builtin_ops, builtin_spec

_FLASH = (
    "query![]~ key![]~ value![]~ bias[]~ attention_mask[] q_segment_ids[] kv_segment_ids[] "
    "softmax_aux[]~ softmax_scale causal=False sliding_window logits_soft_cap dropout_prob=0.0 "
    "dropout_seed[]"
)
_MASKING = "attention_mask[] q_segment_ids[] kv_segment_ids[]"
_STATICS = "softmax_scale logits_soft_cap sliding_window"
_KV_SCALES = "k_scale[] v_scale[]"

PINNED: dict[str, tuple[bool, str]] = {
    "attention": (True, _FLASH),
    "blocksparse_attention": (
        True,
        "query![]~ key![]~ value![]~ block_mask![] block_size=(128, 128) bias[]~ "
        f"{_MASKING} softmax_scale causal=False sliding_window logits_soft_cap",
    ),
    "flash_attention": (True, _FLASH),
    "gla": (
        True,
        "query![]~ key![]~ value![]~ g![]~ initial_state[]~ softmax_scale cu_seqlens[] "
        "return_state=False",
    ),
    "grouped_matmul": (
        True,
        "lhs![]~ rhs![]~ group_sizes![] preferred_element_type transpose_rhs=False",
    ),
    "kernel_delta_attention": (
        True,
        "query![]~ key![]~ value![]~ beta![]~ g![]~ initial_state[]~ softmax_scale "
        "use_qk_l2norm=True cu_seqlens[] return_state=False",
    ),
    "lightning_attention": (
        True,
        "query![]~ key![]~ value![]~ slopes[]~ layer_idx num_layers initial_state[]~ "
        "softmax_scale cu_seqlens[] return_state=False",
    ),
    "mean_pooling": (True, "x![]~ cu_seqlens[]"),
    "multi_head_latent_attention": (
        True,
        "query![]~ key_value![]~ w_kc![]~ w_vc![]~ k_rope![]~ softmax_scale causal=False "
        "sliding_window logits_soft_cap",
    ),
    "native_sparse_attention": (
        True,
        "query![]~ key![]~ value![]~ g_cmp![]~ g_slc![]~ g_swa[]~ block_size=64 "
        "block_counts=16 window_size=0 block_indices[] softmax_scale cu_seqlens[]",
    ),
    "page_attention": (
        False,
        f"query![] key_cache![] value_cache![] kv_lens![] block_tables![] {_STATICS} {_KV_SCALES}",
    ),
    "prefill_page_attention": (
        False,
        f"query![] key_cache![] value_cache![] kv_len![] page_indices![] {_STATICS} {_KV_SCALES}",
    ),
    "ragged_decode_attention": (
        False,
        f"query![] key![] value![] sequence_start![] sequence_end![] {_STATICS} softmax_aux[] "
        f"{_KV_SCALES}",
    ),
    "ragged_page_attention": (
        False,
        "queries![] key_cache![] value_cache![] kv_lens![] block_tables![] query_start_loc![] "
        f"num_seqs![] {_STATICS} softmax_aux[] {_KV_SCALES}",
    ),
    "ragged_page_attention_v3": (
        False,
        "queries![] keys![] values![] key_cache![] value_cache![] kv_lens![] block_tables![] "
        f"query_start_loc![] num_seqs![] {_STATICS} softmax_aux[] {_KV_SCALES}",
    ),
    "recurrent": (
        True,
        "query![]~ key![]~ value![]~ g[]~ gk[]~ gv[]~ initial_state[]~ softmax_scale "
        "reverse=False cu_seqlens[] return_state=False",
    ),
    "ring_attention": (
        True,
        _FLASH.replace("value![]~ ", "value![]~ axis_name ") + " layout='contiguous'",
    ),
    "scaled_dot_product_attention": (
        True,
        f"query![]~ key![]~ value![]~ bias[]~ {_MASKING} softmax_scale causal=False "
        "sliding_window logits_soft_cap",
    ),
    "state_space_v1": (
        True,
        "x![]~ A![]~ B![]~ C![]~ D![]~ dt![]~ gate[]~ dt_bias[]~ dt_softplus=False "
        "initial_state[]~ return_state=False",
    ),
    "state_space_v2": (
        True,
        "x![]~ A![]~ B![]~ C![]~ D![]~ dt![]~ gate[]~ dt_bias[]~ dt_softplus=False "
        "initial_state[]~ chunk_size return_state=False",
    ),
    "unified_attention": (
        False,
        "queries![] key_cache![] value_cache![] kv_lens![] block_tables![] query_start_loc![] "
        "alibi_slopes[] softmax_aux[] softmax_scale causal=True sliding_window logits_soft_cap "
        f"{_KV_SCALES}",
    ),
}


def _token(a: Arg) -> str:
    token = a.name + ("!" if a.required else "") + ("[]" if a.array else "")
    token += "~" if a.differentiable else ""
    return token if a.default is None else f"{token}={a.default!r}"


def test_every_builtin_op_is_pinned() -> None:
    assert set(builtin_ops()) == set(PINNED)


@pytest.mark.parametrize("op", sorted(PINNED))
def test_builtin_spec_args_are_pinned(op: str) -> None:
    spec = builtin_spec(op)
    differentiable, tokens = PINNED[op]
    assert spec.name == op
    assert spec.differentiable is differentiable
    assert " ".join(_token(a) for a in spec.args) == tokens
    for a in spec.args:
        assert spec.arg(a.name) is a
    assert spec.arg_names == tuple(a.name for a in spec.args)


def _toy(
    x: jax.Array,
    scale: float,
    *,
    mask: jax.Array | None = None,
    flag: bool = True,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    return x


def test_from_function_reads_the_signature() -> None:
    spec = OpSpec.from_function(_toy, differentiable=("x",), validate=dict, reference=_toy)
    assert spec.name == "_toy" and spec.differentiable
    assert " ".join(_token(a) for a in spec.args) == "x![]~ scale! mask[] flag=True"


def test_from_function_takes_explicit_arrays_and_name() -> None:
    spec = OpSpec.from_function(
        _toy, arrays=("x", "scale"), name="toy", validate=dict, reference=_toy
    )
    assert spec.name == "toy" and not spec.differentiable
    assert " ".join(_token(a) for a in spec.args) == "x![] scale![] mask flag=True"


def test_from_function_rejects_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="no parameter named"):
        OpSpec.from_function(_toy, differentiable=("y",), validate=dict, reference=_toy)
    with pytest.raises(ValueError, match="differentiable statics"):
        OpSpec.from_function(_toy, differentiable=("scale",), validate=dict, reference=_toy)

    def bare(x, *, platform=None, cfg=None):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(TypeError, match="annotate"):
        OpSpec.from_function(bare, validate=dict, reference=bare)
