"""The kernel framework of the seeds: kernels, invocations, the executor, caches and tuning.

Example:
    >>> from ejkernel.ops import Executor, ConfigSelectorChain, ConfigCache
    >>> executor = Executor(ConfigSelectorChain(cache=ConfigCache()))
"""

from __future__ import annotations

from ejkernel._autotune import benchmark
from ejkernel._cache import CacheEntry, ConfigCache, PersistentCache
from ejkernel._chain import Choice, ConfigSelectorChain, overlay_cache, policy_override
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
from ejkernel._params import BwdParams, FwdParams
from ejkernel._tuning import autotune, autotune_platforms, pmap_with_config, vmap_with_config

__all__ = [
    "BwdParams",
    "CacheEntry",
    "Cfg",
    "Choice",
    "ConfigCache",
    "ConfigSelectorChain",
    "Executor",
    "FwdParams",
    "Invocation",
    "Kernel",
    "OpKernel",
    "Out",
    "PersistentCache",
    "Selection",
    "autotune",
    "autotune_platforms",
    "benchmark",
    "default_executor",
    "default_key_builder_with_sharding",
    "device_fingerprint",
    "device_kind",
    "from_json",
    "get_device_platform",
    "overlay_cache",
    "pmap_with_config",
    "policy_override",
    "prune_by_shared_memory",
    "sharding_fingerprint",
    "shared_memory_limit",
    "stable_json",
    "to_json",
    "vmap_with_config",
]
