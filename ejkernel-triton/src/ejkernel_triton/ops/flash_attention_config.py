"""flash_attention (Triton): the config, the kernel variants and what each serves, the heuristic
and the config space.

A config names the kernels that run: ``fwd_variant`` for the forward, ``bwd_variant`` for the
backward (:data:`FWD_VARIANTS`, :data:`BWD_VARIANTS`), with each kernel's block sizes, warps,
stages and causal program order. The launch runs exactly what the config says; a variant that
cannot serve a call is refused with the reason (:func:`check`) before any kernel runs, and the
heuristic and the config space offer only variants that can (:func:`fwd_problem`,
:func:`bwd_problem`: the hardware and the call's features, nothing tuned).

The heuristic reads the plugin's table of tuned settings (``ejkernel_triton/tuned/
flash_attention.json``, :mod:`ejkernel_triton._tuned`): for each pass, the first entry that
matches the call (device, dtype, head dim, causal, unmasked) and whose variant can serve it;
without one, generic defaults. The figures behind the table are in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import attrs
import jax
import jax.numpy as jnp

from ejkernel.ops import BwdParams, FwdParams, prune_by_shared_memory
from ejkernel_triton import _launch, _smem, _tuned
from ejkernel_triton._launch import pow2

__all__ = [
    "BWD_VARIANTS",
    "FWD_VARIANTS",
    "FlashAttentionConfig",
    "bwd_problem",
    "check",
    "config_space",
    "fwd_problem",
    "heuristic",
    "kernel_smem",
    "smem_need",
    "supports",
]

_MAX_HEAD_DIM = 256
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

FwdVariant = Literal["usual", "warp_specialized", "pingpong"]
BwdVariant = Literal["usual", "warp_specialized", "gluon", "gluon_dkdv"]

#: The forward's kernels: ``usual`` ``flash_attention_fwd_kernel`` (every feature);
#: ``warp_specialized`` ``flash_attention_fwd_ws_kernel`` (TMA, Triton's warp specialization,
#: persistent: one program per SM walks the tiles); ``pingpong`` the Gluon kernel
#: ``flash_attention_fwd_pingpong_kernel`` (FlashAttention-3's schedule; GPU only).
FWD_VARIANTS: tuple[str, ...] = ("usual", "warp_specialized", "pingpong")
#: The backward's kernels: ``usual`` the dQ kernel (which computes delta) then the dK/dV
#: kernel; ``warp_specialized`` their TMA twins (delta from JAX); ``gluon`` the Gluon kernel
#: ``flash_attention_bwd_gluon_kernel`` for dQ, dK and dV at once (delta from JAX; dQ summed by
#: TMA reduce-adds in no fixed order); ``gluon_dkdv`` the usual dQ kernel, then the Gluon
#: kernel for dK and dV only (GPU only, as ``gluon``).
BWD_VARIANTS: tuple[str, ...] = ("usual", "warp_specialized", "gluon", "gluon_dkdv")


@attrs.frozen(kw_only=True)
class FlashAttentionConfig:
    """Tunables of the Triton flash attention; the kernels it names run as it says.

    Attributes:
        fwd_variant: the forward's kernel, one of :data:`FWD_VARIANTS`.
        bwd_variant: the backward's kernels, one of :data:`BWD_VARIANTS`.
        fwd_params: forward kernel: ``q_blocksize`` rows per program, ``kv_blocksize`` keys
            per step, ``num_warps``, ``num_stages``. Fields left ``None`` take the variant's
            defaults.
        bwd_params: dK/dV kernel (or the Gluon backward): ``kv_blocksize`` keys per program,
            ``q_blocksize`` queries per step, warps, stages.
        dq_params: dQ kernel: ``q_blocksize`` rows per program, ``kv_blocksize`` keys per step;
            ``None`` takes ``bwd_params`` with the two block sizes swapped (the
            ``warp_specialized`` dQ kernel: its own tiles). Unused by ``gluon``.
        fwd_head_group: under a causal mask the forward (``usual``, ``pingpong``) runs the
            longest query blocks first, this many heads at a time; 0 keeps grid order.
        bwd_head_group: the same for the backward's ``gluon``/``gluon_dkdv`` kernel (first key
            blocks first) and the ``warp_specialized`` dQ kernel (last query blocks first).
        scale_in_exponent: the ``usual`` forward folds the softmax scale into the exponent
            where nothing is masked or added and the scale is ≥ 0 (``PLAIN_SCALE``).

    The warp-specialized kernels run on a GPU only in their validated tiles (other block sizes
    and stage counts compiled to wrong results with triton 3.6), ``pingpong`` only in its
    tested one (128 x 128, 3 stages); the interpreter takes the warp-specialized kernels'
    block sizes from the config. The Gluon
    backward takes 128 keys per program and 4 warps (its two 64-key consumer warp groups), its
    query rows per step and ring stages from ``bwd_params``.
    """

    fwd_variant: FwdVariant = attrs.field(
        default="usual", validator=attrs.validators.in_(FWD_VARIANTS)
    )
    bwd_variant: BwdVariant = attrs.field(
        default="usual", validator=attrs.validators.in_(BWD_VARIANTS)
    )
    fwd_params: FwdParams = attrs.field(factory=FwdParams)
    bwd_params: BwdParams = attrs.field(factory=BwdParams)
    dq_params: FwdParams | None = None
    fwd_head_group: int = 16
    bwd_head_group: int = 8
    scale_in_exponent: bool = True


# -- what is served -------------------------------------------------------------------------


def supports(inv: Any) -> bool | str:
    """True, or why not: dropout, head dims over 256, dtypes other than bf16/f16/f32."""
    a = inv.kwargs
    if a.get("dropout_prob", 0.0):
        return "dropout is not implemented in the Triton kernels (the xla platform serves it)"
    return qkv_supported(a)


def qkv_supported(a: Any) -> bool | str:
    """True, or why not, for the ``query``/``key``/``value`` of the keyword arguments ``a``:
    dtypes other than bf16/f16/f32, mixed dtypes, head dims over 256 (what every attention
    kernel here takes)."""
    q, k, v = a["query"], a["key"], a["value"]
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.dtype not in _DTYPES:
            return f"{name} dtype {x.dtype} (Triton kernels take bfloat16, float16, float32)"
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        return "query, key and value dtypes differ"
    if max(q.shape[-1], v.shape[-1]) > _MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v.shape[-1])} > {_MAX_HEAD_DIM}"
    return True


@attrs.frozen
class Call:
    """The facts of a call that decide which variants can serve it and which table entries
    match it (from the op's keyword arguments: arrays or ``ShapeDtypeStruct``s)."""

    head_dim: int
    head_dim_v: int
    dtype: Any
    causal: bool
    scale: float
    plain: bool  # no bias, mask, segment ids, sinks or window: the specialized kernels' case
    unmasked: bool  # no bias, mask, segment ids or soft cap, scale >= 0: PLAIN_SCALE's case
    interpreting: bool

    @classmethod
    def of(cls, a: Any) -> Call:
        q, v = a["query"], a["value"]
        scale = a.get("softmax_scale")
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        masks = ("bias", "attention_mask", "q_segment_ids", "kv_segment_ids")
        return cls(
            head_dim=int(q.shape[-1]),
            head_dim_v=int(v.shape[-1]),
            dtype=jnp.dtype(q.dtype),
            causal=bool(a.get("causal")),
            scale=scale,
            plain=all(a.get(n) is None for n in (*masks, "softmax_aux", "sliding_window")),
            unmasked=all(a.get(n) is None for n in (*masks, "logits_soft_cap")) and scale >= 0,
            interpreting=_launch.interpreting(),
        )


def fwd_problem(variant: str, call: Call) -> str | None:
    """Why forward ``variant`` cannot serve ``call`` (``None``: it can)."""
    why = _variant_problem(variant, call)
    if why or variant != "pingpong":
        return why
    if call.head_dim != 128:
        return f"it takes D 128; got D {call.head_dim}"
    if call.scale <= 0:
        return f"it takes a softmax scale > 0 (it masks unscaled scores); got {call.scale}"
    return None


def bwd_problem(variant: str, call: Call) -> str | None:
    """Why backward ``variant`` cannot serve ``call`` (``None``: it can)."""
    return _variant_problem(variant, call)


def _variant_problem(variant: str, call: Call) -> str | None:
    """What keeps ``variant`` (of either pass) from serving ``call``: nothing for the usual
    kernels; the Hopper kernels' limits for the others, and the Gluon ones' for Gluon's."""
    if variant == "usual":
        return None
    why = _specialized_problem(call)
    if why or variant == "warp_specialized":
        return why
    if call.interpreting:
        return "Gluon kernels do not run in Triton's interpreter"
    if not _gluon_available():
        return "this Triton has no Gluon Hopper API"
    return None


def _specialized_problem(call: Call) -> str | None:
    """What keeps the Hopper kernels (TMA, warp groups) from serving ``call``."""
    if not call.plain:
        return "it serves no bias, mask, segment ids, sinks or window"
    if call.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it takes bfloat16 or float16; got {call.dtype}"
    if call.head_dim != call.head_dim_v or call.head_dim not in (64, 128):
        return f"it takes D = Dv of 64 or 128; got D {call.head_dim}, Dv {call.head_dim_v}"
    if not call.interpreting and _compute_capability()[0] != 9:
        return (
            f"it needs a Hopper GPU (sm_90); this is sm_{''.join(map(str, _compute_capability()))}"
        )
    return None


#: The tiles each specialized kernel runs in on a GPU: ``(defaults, fields that must equal
#: them)``. The warp-specialized kernels compiled to wrong results in other block sizes and
#: stage counts (triton 3.6); ``pingpong`` is tested in this tile only; the Gluon backward's
#: 128 keys and 4 warps are its two consumer warp groups of 64 keys.
_EVERY_FIELD = ("q_blocksize", "kv_blocksize", "num_warps", "num_stages")
_WS_TILE = FwdParams(q_blocksize=128, kv_blocksize=128, num_warps=4, num_stages=2)
_BWD_TILE = BwdParams(q_blocksize=64, kv_blocksize=128, num_warps=4, num_stages=2)
_FIXED: dict[tuple[str, str], tuple[Any, tuple[str, ...]]] = {
    ("fwd", "warp_specialized"): (_WS_TILE, _EVERY_FIELD),
    ("bwd", "warp_specialized"): (_BWD_TILE, _EVERY_FIELD),
    ("dq", "warp_specialized"): (_WS_TILE, _EVERY_FIELD),
    ("fwd", "pingpong"): (attrs.evolve(_WS_TILE, num_stages=3), _EVERY_FIELD),
    ("bwd", "gluon"): (_BWD_TILE, ("kv_blocksize", "num_warps")),
}
_FIXED["bwd", "gluon_dkdv"] = _FIXED["bwd", "gluon"]


def resolve(kind: str, variant: str, given: Any, interpreting: bool) -> tuple[Any, str | None]:
    """The params pass ``kind`` (``fwd``, ``bwd``, ``dq``) of ``variant`` runs with, and why
    ``given`` cannot be honoured (``None`` if it can). Fields left ``None`` take the variant's
    defaults; the interpreter takes the specialized kernels' block sizes from ``given`` (so
    that tests cross several blocks) and checks nothing."""
    fixed = _FIXED.get((kind, variant))
    if fixed is None:
        return given, None
    defaults, must = fixed
    if interpreting:
        return attrs.evolve(
            defaults,
            q_blocksize=given.q_blocksize or defaults.q_blocksize,
            kv_blocksize=given.kv_blocksize or defaults.kv_blocksize,
        ), None
    values = {
        f: getattr(given, f) if getattr(given, f) is not None else getattr(defaults, f)
        for f in ("q_blocksize", "kv_blocksize", "num_warps", "num_stages")
    }
    wrong = [
        f"{f}={values[f]} (it runs {getattr(defaults, f)})"
        for f in must
        if values[f] != getattr(defaults, f)
    ]
    why = f"{kind}_params: " + ", ".join(wrong) if wrong else None
    return attrs.evolve(defaults, **values), why


def check(cfg: FlashAttentionConfig, call: Call, passes: tuple[str, ...]) -> None:
    """Raise ``ValueError`` if ``cfg``'s variants of ``passes`` (``"fwd"``, ``"bwd"``) cannot
    serve ``call`` as configured."""
    problems = []
    if "fwd" in passes:
        why = fwd_problem(cfg.fwd_variant, call)
        why = why or resolve("fwd", cfg.fwd_variant, cfg.fwd_params, call.interpreting)[1]
        if why:
            problems.append(f"fwd_variant={cfg.fwd_variant!r}: {why}")
    if "bwd" in passes:
        why = bwd_problem(cfg.bwd_variant, call)
        why = why or resolve("bwd", cfg.bwd_variant, cfg.bwd_params, call.interpreting)[1]
        if not why and cfg.bwd_variant == "warp_specialized":
            why = resolve(
                "dq", "warp_specialized", cfg.dq_params or FwdParams(), call.interpreting
            )[1]
        if why:
            problems.append(f"bwd_variant={cfg.bwd_variant!r}: {why}")
    if problems:
        raise ValueError(
            "flash_attention (triton): the config's variant cannot serve this call: "
            + "; ".join(problems)
        )


# -- configs --------------------------------------------------------------------------------

#: Generic defaults, where no table entry matches (a missing table included).
_GENERIC = {
    "fwd": {
        "variant": "usual",
        "q_blocksize": 64,
        "kv_blocksize": 32,
        "num_warps": 4,
        "num_stages": 2,
        "head_group": 16,
    },
    "bwd": {
        "variant": "usual",
        "q_blocksize": 16,
        "kv_blocksize": 64,
        "num_warps": 4,
        "num_stages": 2,
    },
    "dq": {
        "variant": "usual",
        "q_blocksize": 64,
        "kv_blocksize": 16,
        "num_warps": 4,
        "num_stages": 2,
    },
}
_PARAM_FIELDS = ("q_blocksize", "kv_blocksize", "num_warps", "num_stages")


def heuristic(inv: Any) -> FlashAttentionConfig:
    """For each pass the first entry of the tuned table that matches the call and whose variant
    can serve it, else generic defaults; in the interpreter (whose cost is per program) the
    usual kernels with few, large blocks."""
    call = Call.of(inv.kwargs)
    if call.interpreting:
        sq, sk = inv.kwargs["query"].shape[1], inv.kwargs["key"].shape[1]
        bq, bk = clamp(64, sq), clamp(64, sk)
        return FlashAttentionConfig(
            fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=4, num_stages=1),
            bwd_params=BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=4, num_stages=1),
        )
    return _config(call, FWD_VARIANTS, BWD_VARIANTS)


def _config(call: Call, fwd_variants: tuple[str, ...], bwd_variants: tuple[str, ...]) -> Any:
    """The table's config for ``call`` among the given variants."""
    fwd = _pick(call, "fwd", fwd_variants)
    bwd = _pick(call, "bwd", bwd_variants)
    dq_family = {"usual": "usual", "gluon_dkdv": "usual", "warp_specialized": "warp_specialized"}
    dq = _pick(call, "dq", (dq_family[bwd["variant"]],)) if bwd["variant"] in dq_family else None
    head_group = bwd.get("head_group", (dq or {}).get("head_group", 8))
    return FlashAttentionConfig(
        fwd_variant=fwd["variant"],
        bwd_variant=bwd["variant"],
        fwd_params=FwdParams(**{f: fwd[f] for f in _PARAM_FIELDS}),
        bwd_params=BwdParams(**{f: bwd[f] for f in _PARAM_FIELDS}),
        dq_params=None if dq is None else FwdParams(**{f: dq[f] for f in _PARAM_FIELDS}),
        fwd_head_group=fwd.get("head_group", 16),
        bwd_head_group=head_group,
    )


def _pick(call: Call, kind: str, variants: tuple[str, ...]) -> dict[str, Any]:
    """The first table block of pass ``kind`` matching ``call`` with one of ``variants`` that
    can serve it; else the generic one (or the variant's fixed tiles)."""
    problem = fwd_problem if kind == "fwd" else bwd_problem
    for entry in _tuned.entries("flash_attention", _device_kind()):
        block = entry.get(kind)
        if not isinstance(block, dict) or block.get("variant") not in variants:
            continue
        if kind != "dq" and problem(block["variant"], call):
            continue
        if _matches(entry, call) and all(isinstance(block.get(f), int) for f in _PARAM_FIELDS):
            return block
    for variant in variants:
        if kind == "dq" or not problem(variant, call):
            fixed = _FIXED.get((kind, variant))
            if fixed is None:
                return {**_GENERIC[kind], "variant": variant}
            return {"variant": variant, **attrs.asdict(fixed[0])}
    return _GENERIC[kind]


def _matches(entry: dict[str, Any], call: Call) -> bool:
    """Whether a table entry's shape class holds ``call``: ``dtype`` (its name), ``head_dim``
    (D = Dv), ``max_head_dim`` (D and Dv rounded up to a power of two at most), ``causal``,
    ``unmasked``; a key left out matches anything."""
    d = pow2(max(call.head_dim, call.head_dim_v))
    tests = {
        "dtype": lambda x: x == call.dtype.name,
        "head_dim": lambda x: call.head_dim == call.head_dim_v == x,
        "max_head_dim": lambda x: d <= x,
        "causal": lambda x: call.causal == x,
        "unmasked": lambda x: call.unmasked == x,
    }
    return all(test(entry[key]) for key, test in tests.items() if key in entry)


def config_space(inv: Any) -> list[FlashAttentionConfig]:
    """The heuristic; the usual forward's and backward's blocks that ranked near the top of a
    sweep (benchmarks/triton_tune.py); and every other variant that can serve the call, in the
    table's tiles; minus those whose kernels need more shared memory than the device grants
    (:func:`smem_need`; the heuristic's stays). Kept small (about a dozen candidates) so a cold
    start tunes in well under a minute."""
    base = heuristic(inv)
    call = Call.of(inv.kwargs)
    if call.interpreting or call.dtype == jnp.float32:
        return [base]

    def tiles(field: str, params: Any, blocks: Any, **fixed: Any) -> list[Any]:
        """``base`` with ``field`` set to each of ``blocks`` (and the ``fixed`` fields)."""
        return [
            attrs.evolve(
                base,
                **{field: params(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)},
                **fixed,
            )
            for bq, bk, w, s in blocks
        ]

    usual = _config(call, ("usual",), ("usual",))
    configs = [base]
    configs += tiles(
        "fwd_params",
        FwdParams,
        _FWD_BLOCKS,
        fwd_variant="usual",
        fwd_head_group=usual.fwd_head_group,
    )

    def with_pass(kind: str, other: FlashAttentionConfig) -> FlashAttentionConfig:
        return attrs.evolve(base, **{f: getattr(other, f) for f in _PASS_FIELDS[kind]})

    for variant in FWD_VARIANTS:
        if variant != base.fwd_variant and not fwd_problem(variant, call):
            configs.append(with_pass("fwd", _config(call, (variant,), (base.bwd_variant,))))
    for variant in BWD_VARIANTS:
        if variant != base.bwd_variant and not bwd_problem(variant, call):
            configs.append(with_pass("bwd", _config(call, (base.fwd_variant,), (variant,))))
    if base.bwd_variant == "usual":
        configs += tiles("bwd_params", BwdParams, _BWD_BLOCKS)
    if base.bwd_variant in ("usual", "gluon_dkdv"):  # the dQ kernel steps over keys
        configs += tiles("dq_params", FwdParams, _DQ_BLOCKS)
    return prune_by_shared_memory(
        list(dict.fromkeys(configs)),
        functools.partial(smem_need, inv.kwargs, grad=getattr(inv, "grad", True), beside=base),
        keep=(base,),
        what="flash_attention (triton)",
    )


def smem_need(kw: Any, cfg: FlashAttentionConfig, *, grad: bool = True, beside: Any = None) -> int:
    """Bytes of shared memory the largest of ``cfg``'s usual kernels asks for on the call
    ``kw`` (:func:`kernel_smem`), leaving out each kernel that asks for what it asks for in the
    config ``beside`` (the heuristic's: a candidate is judged by what it changes; the launch
    fits the heuristic's own stages to the device)."""
    needs = kernel_smem(kw, cfg, grad=grad)
    if beside is not None:
        theirs = kernel_smem(kw, beside, grad=grad)
        needs = {k: n for k, n in needs.items() if n != theirs.get(k)}
    return max(needs.values(), default=0)


def kernel_smem(kw: Any, cfg: FlashAttentionConfig, *, grad: bool = True) -> dict[str, int]:
    """Bytes of shared memory each usual kernel of ``cfg`` asks for on the call ``kw``: the
    forward (``"fwd"``), and with ``grad`` the ``"dq"`` and ``"dkdv"`` kernels (a
    differentiated call is tuned on both passes), at the blocks, head dims and stages the
    launch runs them (:func:`fwd_smem`, :func:`bwd_smem`). The specialized kernels run in
    fixed tiles that fit the Hopper GPUs they serve (``tests/triton/test_codegen.py``) and are
    left out. A bias or mask adds its score tile to every stage after the first, as
    :func:`fit_stages` counts it."""
    q, k, v = kw["query"], kw["key"], kw["value"]
    sq, sk = q.shape[1], k.shape[1]
    d, dv, size = pow2(q.shape[-1]), pow2(v.shape[-1]), jnp.dtype(q.dtype).itemsize
    bias, mask = kw.get("bias"), kw.get("attention_mask")
    per_score = (0 if bias is None else jnp.dtype(bias.dtype).itemsize) + (mask is not None)

    def scores(rows: int, cols: int, stages: int) -> int:
        return (stages - 1) * rows * cols * per_score

    needs: dict[str, int] = {}
    if cfg.fwd_variant == "usual":
        p = cfg.fwd_params
        bq, bk = clamp(p.q_blocksize or 128, sq), clamp(p.kv_blocksize or 64, sk)
        stages = p.num_stages or 2
        needs["fwd"] = fwd_smem(bq, bk, stages, d, dv, size) + scores(bq, bk, stages)
    if grad and cfg.bwd_variant in ("usual", "gluon_dkdv"):
        b = cfg.bwd_params
        dq = cfg.dq_params or FwdParams(
            q_blocksize=b.kv_blocksize,
            kv_blocksize=b.q_blocksize,
            num_warps=b.num_warps,
            num_stages=b.num_stages,
        )
        qb, kb = clamp(dq.q_blocksize or 128, sq), clamp(dq.kv_blocksize or 32, sk)
        stages = dq.num_stages or 2
        needs["dq"] = bwd_smem(kb, qb, stages, d, dv, size) + scores(qb, kb, stages)
    if grad and cfg.bwd_variant == "usual":
        b = cfg.bwd_params
        bq, bk = clamp(b.q_blocksize or 32, sq), clamp(b.kv_blocksize or 128, sk)
        stages = b.num_stages or 2
        tiles = bwd_smem(bq, bk, stages, d, dv, size, step_vectors=2)
        needs["dkdv"] = tiles + scores(bq, bk, stages)
    return needs


#: The fields of a config that each pass's variant brings along.
_PASS_FIELDS = {
    "fwd": ("fwd_variant", "fwd_params", "fwd_head_group"),
    "bwd": ("bwd_variant", "bwd_params", "dq_params", "bwd_head_group"),
}
#: The usual kernels' blocks the config space tries: (q rows, keys, warps, stages).
_FWD_BLOCKS = ((128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 8, 3))
_BWD_BLOCKS = ((64, 64, 4, 2), (32, 64, 4, 2), (128, 64, 4, 1), (64, 64, 4, 3))
_DQ_BLOCKS = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3))


# -- sizes and device facts -----------------------------------------------------------------


def fwd_smem(bq: int, bk: int, stages: int, d: int, dv: int, size: int) -> int:
    """Shared memory of the usual forward (:mod:`ejkernel_triton._smem`): its ``bq`` query
    rows once, then ``stages`` buffers of ``bk`` key and value rows. What Triton allocates for
    sm_90, to the byte, at the config space's blocks."""
    return (bq * d + stages * bk * (d + dv)) * size


def bwd_smem(
    step: int, own: int, stages: int, d: int, dv: int, size: int, *, step_vectors: int = 0
) -> int:
    """Shared memory of a usual backward kernel (:mod:`ejkernel_triton._smem`): its ``own``
    rows of two operands once (dQ: Q and dO; dK/dV: K and V), ``stages`` buffers of ``step``
    rows of the other two, and of ``step_vectors`` float32 values a streamed row (dK/dV: 2,
    the logsumexp and Δ). What Triton allocates for sm_90, or at most 512 bytes more, at the
    config space's blocks."""
    return (own + stages * step) * (d + dv) * size + stages * step * 4 * step_vectors


def fit_stages(stages: int, smem_of: Any, tile: int, bias: jax.Array, mask: jax.Array) -> int:
    """``stages``, fewer while the shared memory they need exceeds the device's: ``smem_of(n)``
    for the q/k/v tiles plus, per extra stage, the bias and mask tiles of ``tile`` scores (an
    upper estimate, checked against the compiler's figure by tests/triton/test_codegen.py)."""
    extra = tile * (bias.dtype.itemsize if bias.ndim == 4 else 0) + tile * (mask.ndim == 4)
    limit = _smem.launch_limit()
    while stages > 1 and smem_of(stages) + (stages - 1) * extra > limit:
        stages -= 1
    return stages


def bwd_launch_params(
    params: Any,
    step: int,
    own: int,
    q: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    mask: jax.Array,
    *,
    dkdv: bool,
) -> dict[str, int]:
    """``num_warps`` and ``num_stages`` of a backward kernel's launch: ``step`` rows of the
    other sequence a loop step, ``own`` of the program's; the dK/dV kernel (``dkdv``) streams
    each step's logsumexp and delta too. The stages are the configured ones, fewer while they
    do not fit shared memory."""
    d_pow2, dv_pow2 = pow2(q.shape[-1]), pow2(v.shape[-1])
    vectors = 2 if dkdv else 0
    return {
        "num_warps": params.num_warps or 4,
        "num_stages": fit_stages(
            params.num_stages or 2,
            lambda n: bwd_smem(
                step, own, n, d_pow2, dv_pow2, q.dtype.itemsize, step_vectors=vectors
            ),
            step * own,
            bias,
            mask,
        ),
    }


@functools.cache
def _compute_capability() -> tuple[int, int]:
    """The default device's compute capability; ``(0, 0)`` when it is not a CUDA GPU."""
    try:
        major, minor = (int(x) for x in str(jax.devices()[0].compute_capability).split("."))
    except Exception:
        return 0, 0
    return major, minor


@functools.cache
def _device_kind() -> str:
    """The default device's kind (``"NVIDIA H100 80GB HBM3"``), which keys the tuned table."""
    return str(getattr(jax.devices()[0], "device_kind", ""))


@functools.cache
def _gluon_available() -> bool:
    """Whether this Triton has Gluon's Hopper API (triton 3.6 has)."""
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def persistent_programs() -> int:
    """Programs of a persistent launch: one per SM on a GPU; in the interpreter a few, so the
    tests' tile loops take several turns."""
    return 3 if _launch.interpreting() else _sm_count()


@functools.cache
def _sm_count() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def clamp(block: int, seq: int) -> int:
    return max(16, min(block, pow2(seq)))
