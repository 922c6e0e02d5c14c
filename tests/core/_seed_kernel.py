"""The seeds' user kernel, as a user would type it: a config and a matmul over three configs."""

from dataclasses import dataclass

import jax.numpy as jnp

from ejkernel.ops import Invocation, Kernel


@dataclass(frozen=True)
class MyConfig:
    block_size: int = 128
    num_warps: int = 4
    algorithm: str = "default"


class MyKernel(Kernel[MyConfig, jnp.ndarray]):
    def __init__(self):
        super().__init__(name="my_kernel")

    def run(self, a, b, *, cfg: MyConfig, **kwargs) -> jnp.ndarray:
        return jnp.dot(a, b)

    def heuristic_cfg(self, inv: Invocation) -> MyConfig:
        a = inv.args[0]
        block = 128 if a.shape[0] >= 128 else 64
        return MyConfig(block_size=block)

    def config_space(self, inv: Invocation) -> list[MyConfig]:
        return [
            MyConfig(block_size=64, num_warps=2),
            MyConfig(block_size=128, num_warps=4),
            MyConfig(block_size=256, num_warps=8),
        ]
