"""Flax nnx models in the Trainer: a linen-shaped `init` / `apply` pair around an nnx module.

The Trainer asks its model for `init(key, *inputs)["params"]` (a pure tree of arrays, which it shards)
and the user's loss calls `apply({"params": params}, *inputs)`. `NnxModel(make)` gives an nnx module
that pair: `init` builds the module from `make(nnx.Rngs(key))` and returns its `nnx.Param` variables
as a pure dict; `apply` merges a params tree back into the module's graph and calls it.

Variables other than `nnx.Param` (RNG streams, batch statistics) are not trained: `apply` rebuilds
them from `seed` every call, so dropout draws the same masks each step and batch statistics are not
updated. An nnx module has no `LayerStack`, so the step gathers its whole parameter tree at once
instead of one layer at a time (the printed plan says so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx


class NnxModel:
    """An nnx module behind linen's `init` / `apply`, for `Trainer` and plain `jax.grad` alike."""

    def __init__(self, make: Callable[[nnx.Rngs], nnx.Module], seed: int = 0) -> None:
        """`make(rngs)` builds the module; `seed` seeds its non-parameter variables in `apply`."""
        self.make = make
        self.seed = seed
        abstract = nnx.eval_shape(lambda: make(nnx.Rngs(seed)))
        self.graphdef, self._abstract_params, _ = nnx.split(abstract, nnx.Param, ...)
        # Built once and eagerly: inside a trace it would capture tracers. XLA drops the unused
        # parameter initialisers, so only the small non-parameter state is computed.
        self._other_state = jax.jit(lambda: nnx.split(make(nnx.Rngs(seed)), nnx.Param, ...)[2])()

    def init(self, key: jax.Array, *inputs: Any) -> dict[str, Any]:
        """`{"params": pure dict of arrays}` of a module built with `key` (the inputs are not needed)."""
        _, params, _ = nnx.split(self.make(nnx.Rngs(key)), nnx.Param, ...)
        return {"params": nnx.to_pure_dict(params)}

    def module(self, params: Any) -> nnx.Module:
        """The module with `params` (a pure dict as `init` returns) in place of its parameters."""
        # Fresh copies: the module writes into its variables (an RNG stream's counter, for one), and
        # the shared templates must not keep values from one trace into the next.
        param_state, other_state = jax.tree.map(lambda x: x, (self._abstract_params, self._other_state))
        nnx.replace_by_pure_dict(param_state, params)
        return nnx.merge(self.graphdef, param_state, other_state)

    def apply(self, variables: dict[str, Any], *inputs: Any, **kwargs: Any) -> Any:
        """Call the module with `variables["params"]` on `inputs`."""
        return self.module(variables["params"])(*inputs, **kwargs)
