"""amsp_jax: flexible P/G/OS sharding for LLM training in JAX (AMSP, arXiv 2311.00257).

The public names load lazily, so the `amsp-jax` command can size the CPU platform before JAX starts.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LayerStack": "amsp_jax.layers",
    "Plan": "amsp_jax.plan",
    "Precision": "amsp_jax.plan",
    "Cluster": "amsp_jax.space",
    "Placement": "amsp_jax.space",
    "Strategy": "amsp_jax.space",
    "StrategyError": "amsp_jax.space",
    "ddp": "amsp_jax.space",
    "hsdp": "amsp_jax.space",
    "mics": "amsp_jax.space",
    "preset": "amsp_jax.space",
    "resolve": "amsp_jax.space",
    "zero1": "amsp_jax.space",
    "zero2": "amsp_jax.space",
    "zero3": "amsp_jax.space",
    "Trainer": "amsp_jax.step",
    "TrainState": "amsp_jax.step",
    "rng_for": "amsp_jax.step",
    "choose": "amsp_jax.planning",
    "load_params": "amsp_jax.checkpoint",
    "read_params": "amsp_jax.checkpoint",
    "write_params": "amsp_jax.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'amsp_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
