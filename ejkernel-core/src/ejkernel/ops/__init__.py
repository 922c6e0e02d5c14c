"""The kernel framework of the seeds: kernels, invocations, the executor, caches and tuning.

Example:
    >>> from ejkernel.ops import Executor, ConfigSelectorChain, ConfigCache
    >>> executor = Executor(ConfigSelectorChain(cache=ConfigCache()))
"""

from __future__ import annotations

from ejkernel._autotune import benchmark
from ejkernel._batch_tune import autotune_recorded
from ejkernel._cache import CacheEntry, ConfigCache, PersistentCache, file_lock
from ejkernel._chain import (
    Choice,
    ConfigSelectorChain,
    overlay_cache,
    policy_override,
    unique_configs,
)
from ejkernel._executor import Executor, Selection, default_executor
from ejkernel._hardware import prune_by_shared_memory, shared_memory_limit
from ejkernel._invocation import (
    Invocation,
    default_key_builder_with_sharding,
    device_fingerprint,
    device_kind,
    sharding_fingerprint,
)
from ejkernel._json import from_json, stable_json, to_json
from ejkernel._kernel import Cfg, Kernel, OpKernel, Out, get_device_platform
from ejkernel._labels import (
    Label,
    extract_labels_from_hlo_text,
    find_labels_in_lowered,
    label,
    labels_to_configs,
)
from ejkernel._lse import FlashLseStep, flash_attention_lse_step
from ejkernel._params import BwdParams, FwdParams
from ejkernel._policy import AutotunePolicy, forward_autotune_only
from ejkernel._recording import (
    InvocationRecorder,
    clear_invocations,
    get_invocations,
    load_invocations,
    record_invocation,
    record_invocations,
    save_invocations,
)
from ejkernel._records import ArraySpec, RecordedInvocation
from ejkernel._shipped import (
    ShippedTable,
    load_shipped_table,
    shipped_tables,
    write_shipped_table,
)
from ejkernel._tune_result import AutotuneResult, PlatformChoice, TunedConfig, TuneFailure
from ejkernel._tuning import autotune, autotune_platforms, pmap_with_config, vmap_with_config
from ejkernel.specs.ring_attention import undo_zigzag_layout, zigzag_layout

__all__ = [
    "ArraySpec",
    "AutotunePolicy",
    "AutotuneResult",
    "BwdParams",
    "CacheEntry",
    "Cfg",
    "Choice",
    "ConfigCache",
    "ConfigSelectorChain",
    "Executor",
    "FlashLseStep",
    "FwdParams",
    "Invocation",
    "InvocationRecorder",
    "Kernel",
    "Label",
    "OpKernel",
    "Out",
    "PersistentCache",
    "PlatformChoice",
    "RecordedInvocation",
    "Selection",
    "ShippedTable",
    "TuneFailure",
    "TunedConfig",
    "autotune",
    "autotune_platforms",
    "autotune_recorded",
    "benchmark",
    "clear_invocations",
    "default_executor",
    "default_key_builder_with_sharding",
    "device_fingerprint",
    "device_kind",
    "extract_labels_from_hlo_text",
    "file_lock",
    "find_labels_in_lowered",
    "flash_attention_lse_step",
    "forward_autotune_only",
    "from_json",
    "get_device_platform",
    "get_invocations",
    "label",
    "labels_to_configs",
    "load_invocations",
    "load_shipped_table",
    "overlay_cache",
    "pmap_with_config",
    "policy_override",
    "prune_by_shared_memory",
    "record_invocation",
    "record_invocations",
    "save_invocations",
    "sharding_fingerprint",
    "shared_memory_limit",
    "shipped_tables",
    "stable_json",
    "to_json",
    "undo_zigzag_layout",
    "unique_configs",
    "vmap_with_config",
    "write_shipped_table",
    "zigzag_layout",
]
