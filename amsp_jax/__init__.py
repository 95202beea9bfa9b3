"""amsp_jax: flexible P/G/OS sharding for LLM training in JAX (AMSP, arXiv 2311.00257)."""

from amsp_jax.layers import LayerStack
from amsp_jax.plan import Plan, Precision
from amsp_jax.space import (
    Cluster,
    Placement,
    Strategy,
    StrategyError,
    ddp,
    hsdp,
    mics,
    preset,
    resolve,
    zero1,
    zero2,
    zero3,
)
from amsp_jax.step import Trainer, TrainState

__all__ = [
    "Cluster",
    "LayerStack",
    "Placement",
    "Plan",
    "Precision",
    "Strategy",
    "StrategyError",
    "TrainState",
    "Trainer",
    "ddp",
    "hsdp",
    "mics",
    "preset",
    "resolve",
    "zero1",
    "zero2",
    "zero3",
]
