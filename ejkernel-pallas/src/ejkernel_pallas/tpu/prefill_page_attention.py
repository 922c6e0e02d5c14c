"""prefill_page_attention as a Pallas Mosaic-TPU kernel: one sequence's causal chunk, through
:mod:`.ragged_page_attention`'s kernel.

The chunk is a packed batch of one sequence (``query_start_loc = [0, C]``, the table
``page_indices[None]``, ``kv_lens = [kv_len]``): its queries are the sequence's last ``C``
tokens, which is the ragged kernel's bottom-right causal rule, and a query at a negative
position (``C > kv_len``) sees no key and returns zeros there too. Blocks, VMEM and SMEM rules,
and what ``supports()`` declines (``k_scale``/``v_scale``, other cache dtypes) are the ragged
kernel's.

Verified without a TPU: ``tests/pallas/test_tpu_prefill_page_attention.py`` and the
conformance kit run it in Pallas's TPU interpret mode against the spec's reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.ops import Invocation
from ejkernel_pallas.tpu import ragged_page_attention as ragged
from ejkernel_pallas.tpu.ragged_page_attention import RaggedPageAttentionConfig

__all__ = [
    "PrefillPageAttentionConfig",
    "config_space",
    "heuristic",
    "prefill_page_attention_pallas",
    "supports",
]

#: Arguments the ragged kernel takes unchanged.
_PASSED = (
    "key_cache",
    "value_cache",
    "softmax_scale",
    "logits_soft_cap",
    "sliding_window",
    "softmax_aux",
    "k_scale",
    "v_scale",
)


@attrs.frozen(kw_only=True)
class PrefillPageAttentionConfig(RaggedPageAttentionConfig):
    """Tunables of the ragged kernel the chunk runs through (:class:`RaggedPageAttentionConfig`)."""


def _as_ragged(kw: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill's arguments as a one-sequence ragged call (arrays, or abstract shapes)."""
    query, tables = kw["query"], kw["page_indices"]
    out = {n: kw[n] for n in _PASSED if n in kw}
    out["queries"] = query
    if isinstance(query, jax.ShapeDtypeStruct):
        out |= {
            "kv_lens": jax.ShapeDtypeStruct((1,), jnp.int32),
            "block_tables": jax.ShapeDtypeStruct((1, tables.shape[0]), jnp.int32),
            "query_start_loc": jax.ShapeDtypeStruct((2,), jnp.int32),
        }
        return out
    out |= {
        "kv_lens": jnp.asarray(kw["kv_len"], jnp.int32).reshape(1),
        "block_tables": jnp.asarray(tables, jnp.int32)[None],
        "query_start_loc": jnp.asarray([0, query.shape[0]], jnp.int32),
        "num_seqs": jnp.asarray(1, jnp.int32),
    }
    return out


def _ragged(inv: Any) -> Invocation:
    """The ragged kernel's invocation standing for a prefill's (its rules read the kwargs)."""
    return Invocation(kernel="ragged_page_attention", kwargs=_as_ragged(inv.kwargs))


def _prefill(cfg: RaggedPageAttentionConfig) -> PrefillPageAttentionConfig:
    return PrefillPageAttentionConfig(fwd_params=cfg.fwd_params)


def heuristic(inv: Any) -> PrefillPageAttentionConfig:
    """The ragged kernel's heuristic for the one-sequence batch."""
    return _prefill(ragged.heuristic(_ragged(inv)))


def config_space(inv: Any) -> list[PrefillPageAttentionConfig]:
    """The ragged kernel's config space for the one-sequence batch."""
    return [_prefill(cfg) for cfg in ragged.config_space(_ragged(inv))]


def supports(inv: Any) -> bool | str:
    """True, or why the ragged kernel cannot serve the chunk."""
    reason = ragged.supports(_ragged(inv))
    if reason is True:
        return True
    return str(reason).replace("ragged_page_attention", "prefill_page_attention")


def prefill_page_attention_pallas(
    *, cfg: PrefillPageAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """One sequence's causal chunk over its pages.

    Args:
        cfg: the ragged kernel's query and kv blocks; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.prefill_page_attention`'s arguments by name, as its spec
            validated them (``query [C, Hq, D]``, the caches, ``kv_len``, ``page_indices``).

    Returns:
        [C, Hq, D] in the query dtype.
    """
    base = None if cfg is None else RaggedPageAttentionConfig(fwd_params=cfg.fwd_params)
    return ragged.ragged_page_attention_pallas(cfg=base, **_as_ragged(args))
