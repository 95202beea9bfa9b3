"""Flax nnx models in the Trainer: a linen-shaped `init` / `apply` pair around an nnx module.

The Trainer asks its model for `init(key, *args, **kwargs)["params"]` (a pure tree of arrays, which it
shards) and the user's loss calls `apply({"params": params}, *args, **kwargs)`. `NnxModel(make)` gives
an nnx module that pair: `init` builds the module from `make(nnx.Rngs(key))` and returns its
`nnx.Param` variables as a pure dict; `apply` merges a params tree back into the module's graph and calls it.

Variables other than `nnx.Param` (RNG streams, batch statistics) are not trained: `apply` rebuilds
them from `seed` every call, so dropout draws the same masks each step and batch statistics are not
updated.

Blocks (a list of block instances, or one block stacked with `nnx.vmap` and run by `nnx.scan`) are
gathered one call at a time, as for linen models: inside a step `apply` puts a wrapper module in
place of each block, whose call is `amsp_jax.layers.stack.gathered_call` of the block's own code, and
`find_blocks` finds them from one abstract call of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx, traverse_util

from amsp_jax.layers.discovery import BlockCall, Example, Found, find_blocks, first_shape
from amsp_jax.layers.stack import (
    StackOps,
    current_context,
    gathered_call,
    is_opaque,
    is_pair,
    opaque,
    split_pairs,
)
from amsp_jax.layers.unused import abstract_call

Path = tuple[Any, ...]


def _unsharded(make: Callable[[nnx.Rngs], nnx.Module]) -> Callable[[nnx.Rngs], nnx.Module]:
    """`make` with flax's eager sharding off: variables keep their logical names as metadata instead of
    being placed on a mesh as they are created (which needs one)."""

    def build(rngs: nnx.Rngs) -> nnx.Module:
        with nnx.use_eager_sharding(False):
            return make(rngs)

    return build


def _names_of(variable: Any) -> tuple[str | None, ...] | None:
    """A variable's logical axis names (`out_sharding` in flax 0.12, `sharding_names` / `sharding`
    before), or None."""
    metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = metadata.get(key)
        if isinstance(names, tuple | list):
            return tuple(names)
    return None


def _params_run(block: nnx.Module) -> tuple[Any, Any, Callable[[Any, Any], Any]]:
    """The block's parameters (a pure dict), its other state, and `run(weights, (args, kwargs, rest))`:
    its call with other weights."""
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)

    def run(weights: Any, inputs: Any) -> Any:
        args, kwargs, rest_state = inputs
        state = jax.tree.map(lambda x: x, params, is_leaf=is_pair)
        nnx.replace_by_pure_dict(state, weights)
        with opaque():
            return nnx.merge(graphdef, state, rest_state)(*args, **kwargs)

    return nnx.to_pure_dict(params), rest, run


class _Gathered(nnx.Module):
    """In place of a block inside a step: each call gathers the block's weights (`gathered_call`)."""

    def __init__(self, block: nnx.Module, ops: StackOps, remat: bool, prefetch: bool, path: Path) -> None:
        self.block, self.ops, self.remat, self.prefetch, self.path = block, ops, remat, prefetch, path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pairs, rest, run = _params_run(self.block)
        shards, sinks = split_pairs(pairs)
        context = current_context()
        chain = context.chain if self.prefetch and context is not None else None
        inputs = (args, kwargs, rest)
        return gathered_call(self.ops, run, shards, sinks, inputs, self.remat, chain, self.path)


def _recorder(calls: list[BlockCall]) -> type[nnx.Module]:
    class Recorded(nnx.Module):
        """In place of a candidate block while `find_blocks` traces the model: notes each call."""

        def __init__(self, block: nnx.Module, path: Path) -> None:
            self.block, self.path = block, path

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if not is_opaque():
                params, rest, run = _params_run(self.block)
                shapes = {p: tuple(x.shape) for p, x in traverse_util.flatten_dict(params).items()}
                call = abstract_call(run, params, (args, kwargs, rest))
                calls.append(BlockCall(self.path, type(self.block), shapes, call, first_shape(args)))
            return self.block(*args, **kwargs)

    return Recorded


class NnxModel:
    """An nnx module behind linen's `init` / `apply`, for `Trainer` and plain `jax.grad` alike."""

    def __init__(self, make: Callable[[nnx.Rngs], nnx.Module], seed: int = 0) -> None:
        """`make(rngs)` builds the module; `seed` seeds its non-parameter variables in `apply`. Logical
        axis names (`nnx.with_partitioning`) stay metadata: the step places every variable itself."""
        self.make = _unsharded(make)
        make = self.make
        self.seed = seed
        abstract = nnx.eval_shape(lambda: make(nnx.Rngs(seed)))
        self.graphdef, self._abstract_params, _ = nnx.split(abstract, nnx.Param, ...)
        # Built once and eagerly: inside a trace it would capture tracers. XLA drops the unused
        # parameter initialisers, so only the small non-parameter state is computed.
        self._other_state = jax.jit(lambda: nnx.split(make(nnx.Rngs(seed)), nnx.Param, ...)[2])()

    def init(self, key: jax.Array, *inputs: Any, **kwargs: Any) -> dict[str, Any]:
        """`{"params": pure dict of arrays}` of a module built with `key` (the inputs are not needed)."""
        _, params, _ = nnx.split(self.make(nnx.Rngs(key)), nnx.Param, ...)
        return {"params": nnx.to_pure_dict(params)}

    def logical_names(self) -> dict[Path, tuple[str | None, ...]]:
        """The logical axis names of every parameter that has them, by path (as `init`'s tree)."""
        names = {}
        for path, variable in nnx.to_flat_state(self._abstract_params):
            found = _names_of(variable)
            if found is not None:
                names[tuple(path)] = found
        return names

    def module(self, params: Any) -> nnx.Module:
        """The module with `params` (a pure dict as `init` returns) in place of its parameters."""
        # Fresh copies: the module writes into its variables (an RNG stream's counter, for one), and
        # the shared templates must not keep values from one trace into the next.
        param_state, other_state = jax.tree.map(lambda x: x, (self._abstract_params, self._other_state))
        nnx.replace_by_pure_dict(param_state, params)
        return nnx.merge(self.graphdef, param_state, other_state)

    def apply(self, variables: dict[str, Any], *inputs: Any, **kwargs: Any) -> Any:
        """Call the module with `variables["params"]` on `inputs` (blocks gathered per call in a step)."""
        module = self.module(variables["params"])
        context = current_context()
        if context is not None and context.blocks:
            blocks = context.blocks
            module = nnx.recursive_map(
                lambda path, node: (
                    _Gathered(
                        node, blocks[tuple(path)], context.remat, tuple(path) in context.prefetch, tuple(path)
                    )
                    if tuple(path) in blocks
                    else node
                ),
                module,
            )
        return module(*inputs, **kwargs)

    def find_blocks(
        self, abstract_params: Any, example: Example, classes: tuple[type, ...] | None
    ) -> dict[Path, Found]:
        """The blocks to gather one call at a time (as `amsp_jax.layers.discovery.find_blocks`), from one
        abstract call of the model made as `example` says. Candidates: instances of `classes`, else of
        every module class not from Flax itself."""
        calls: list[BlockCall] = []
        recorded = _recorder(calls)

        def candidate(node: Any) -> bool:
            if not isinstance(node, nnx.Module):
                return False
            if classes is not None:
                return type(node) in classes
            return not type(node).__module__.startswith("flax.")

        def call(params: Any) -> Any:
            module = nnx.recursive_map(
                lambda path, node: recorded(node, tuple(path)) if path and candidate(node) else node,
                self.module(params),
            )
            return example.call(module)

        jax.eval_shape(call, abstract_params)
        stored = {p: tuple(x.shape) for p, x in traverse_util.flatten_dict(abstract_params).items()}
        return find_blocks(calls, stored, classes)
