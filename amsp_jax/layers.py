"""Flax glue: `LayerStack`, the one-line way to give a model per-layer parameter gathering.

A model that builds its repeated blocks with `LayerStack(block, length)` keeps a stacked parameter
subtree (leading layer dimension) and runs the layers with `lax.scan`. Outside amsp_jax it is a plain
scan. Inside an amsp_jax step the stack finds a `LayerContext` for its path and, in the scan body,
gathers only the current layer's parameter shards (and routes their gradient into the G shard),
under the plan's remat policy. The model itself never sees a mesh or a collective.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax

from amsp_jax.layer_scan import prefetched_scan

STACK_PARAM = "layer"


@dataclasses.dataclass(frozen=True)
class StackOps:
    """How a step moves one layer of a stack: trees in, trees out (per-layer parameter structure)."""

    gather_with_sink: Callable[[Any, Any], Any]  # (P shards, G sinks) -> full weights; grads into sinks
    gather: Callable[[Any], Any]  # P shards -> full weights
    reduce: Callable[[Any], Any]  # full weight grads -> fp32 G shards


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What a step hands the stacks while it traces: per stack path, how to move one layer."""

    stacks: dict[tuple[str, ...], StackOps]
    sinks: dict[tuple[str, ...], Any]
    remat_policy: Callable[..., bool] | None
    remat: bool
    prefetch: frozenset[tuple[str, ...]] = frozenset()  # stacks that run the explicit-prefetch loop


_CONTEXT: contextvars.ContextVar[LayerContext | None] = contextvars.ContextVar("amsp_layers", default=None)
_RECORDING: contextvars.ContextVar[list[tuple[str, ...]] | None] = contextvars.ContextVar(
    "amsp_layer_paths", default=None
)


@contextlib.contextmanager
def layer_context(context: LayerContext) -> Iterator[LayerContext]:
    """Make `context` visible to every `LayerStack` traced inside the block."""
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def recording_stacks() -> Iterator[list[tuple[str, ...]]]:
    """Collect the parameter paths of the stacked subtrees of every `LayerStack` traced inside."""
    paths: list[tuple[str, ...]] = []
    token = _RECORDING.set(paths)
    try:
        yield paths
    finally:
        _RECORDING.reset(token)


class LayerStack(nn.Module):
    """Applies `block` `length` times with `lax.scan`; its parameters are stacked along axis 0.

    `block(x, *args) -> x`; `args` are the same for every layer (positions, masks).
    """

    block: nn.Module
    length: int

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any) -> jax.Array:
        block = self.block
        if self.has_variable("params", STACK_PARAM):
            # Read directly: inside a step the stored leaves are shards, which `self.param`'s shape
            # check would reject.
            stacked = self.get_variable("params", STACK_PARAM)
        else:
            stacked = self.param(
                STACK_PARAM,
                lambda rng: jax.vmap(lambda key: block.init(key, x, *args)["params"])(
                    jax.random.split(rng, self.length)
                ),
            )
        path = (*self.path, STACK_PARAM)
        recording = _RECORDING.get()
        if recording is not None and path not in recording:
            recording.append(path)
        context = _CONTEXT.get()
        if context is None or path not in context.stacks:

            def plain(carry: jax.Array, layer_params: Any) -> tuple[jax.Array, None]:
                return block.apply({"params": layer_params}, carry, *args), None

            return jax.lax.scan(plain, x, stacked)[0]

        ops = context.stacks[path]
        sinks = context.sinks[path]
        if path in context.prefetch:
            return prefetched_scan(
                lambda h, weights, args: block.apply({"params": weights}, h, *args),
                ops.gather,
                ops.reduce,
                x,
                stacked,
                sinks,
                args,
            )

        def layer(carry: jax.Array, layer_params: Any, layer_sink: Any) -> jax.Array:
            return block.apply({"params": ops.gather_with_sink(layer_params, layer_sink)}, carry, *args)

        if context.remat:
            layer = jax.checkpoint(layer, policy=context.remat_policy)

        def body(carry: jax.Array, xs: tuple[Any, Any]) -> tuple[jax.Array, None]:
            return layer(carry, *xs), None

        return jax.lax.scan(body, x, (stacked, sinks))[0]
