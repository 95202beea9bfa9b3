"""amsp_jax: flexible P/G/OS sharding for LLM training in JAX (AMSP, arXiv 2311.00257).

The public names load lazily, so the `amsp-jax` command can size the CPU platform before JAX starts.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LayerStack": "amsp_jax.layers.stack",
    "Plan": "amsp_jax.core.plan",
    "Precision": "amsp_jax.core.plan",
    "Cluster": "amsp_jax.core.space",
    "Placement": "amsp_jax.core.space",
    "Strategy": "amsp_jax.core.space",
    "StrategyError": "amsp_jax.core.space",
    "ddp": "amsp_jax.core.space",
    "hsdp": "amsp_jax.core.space",
    "mics": "amsp_jax.core.space",
    "preset": "amsp_jax.core.space",
    "resolve": "amsp_jax.core.space",
    "zero1": "amsp_jax.core.space",
    "zero2": "amsp_jax.core.space",
    "zero3": "amsp_jax.core.space",
    "DEFAULT_TENSOR_RULES": "amsp_jax.core.tensor",
    "TensorRuleError": "amsp_jax.core.tensor",
    "Trainer": "amsp_jax.trainer",
    "TrainState": "amsp_jax.trainer",
    "rng_for": "amsp_jax.trainer",
    "choose": "amsp_jax.planner.search",
    "load_params": "amsp_jax.run.checkpoint",
    "read_params": "amsp_jax.run.checkpoint",
    "write_params": "amsp_jax.run.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'amsp_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
