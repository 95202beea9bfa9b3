"""The layer loop with explicit prefetch: layer i+1's gather is issued before layer i's compute.

Carrying the next layer's gathered weights through a plain `lax.scan` under autodiff would make them
scan residuals (every layer kept gathered until the backward pass). So the loop has its own backward
pass: the forward keeps only each layer's input (full rematerialisation), and the backward walks the
layers in reverse, gathering layer i-1 ahead of layer i's recompute, and reduce-scatters each layer's
weight gradient onto its G shard, which it returns as the cotangent of the G "sink".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Tree = Any


def _layer(tree: Tree, index: int | jax.Array) -> Tree:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), tree)


def prefetched_scan(
    layer_fn: Callable[[jax.Array, Tree, tuple[Any, ...]], jax.Array],
    gather: Callable[[Tree], Tree],
    reduce: Callable[[Tree], Tree],
    x: jax.Array,
    stacked: Tree,
    sinks: Tree,
    args: tuple[Any, ...],
) -> jax.Array:
    """Apply `layer_fn(x, full_layer_params, args)` over the stacked layers; grads land in `sinks`.

    `gather(layer_shards) -> full layer params`; `reduce(full layer grads) -> G-shard grads (fp32)`.
    `args` are per-step constants (rotary tables, masks): no gradient flows into them.
    """
    length = jax.tree.leaves(stacked)[0].shape[0]

    def forward(x: jax.Array, stacked: Tree, args: tuple[Any, ...]) -> tuple[jax.Array, Any]:
        """The output and the saved layer inputs: the loop's stacked ones (layers 0 .. L-2) and the last
        layer's apart (joining them would copy every saved input once more at the memory peak)."""

        def body(carry: tuple[jax.Array, Tree], index: jax.Array) -> tuple[tuple[jax.Array, Tree], jax.Array]:
            h, weights = carry
            following = gather(_layer(stacked, index + 1))
            return (layer_fn(h, weights, args), following), h

        (h, last), inputs = jax.lax.scan(body, (x, gather(_layer(stacked, 0))), jnp.arange(length - 1))
        return layer_fn(h, last, args), (inputs, h)

    @jax.custom_vjp
    def run(x: jax.Array, stacked: Tree, sinks: Tree, args: tuple[Any, ...]) -> jax.Array:
        del sinks
        return forward(x, stacked, args)[0]

    def run_forward(x: jax.Array, stacked: Tree, sinks: Tree, args: tuple[Any, ...]) -> tuple[jax.Array, Any]:
        del sinks
        y, inputs = forward(x, stacked, args)
        return y, (inputs, stacked, args)

    def run_backward(saved: Any, dy: jax.Array) -> tuple[jax.Array, None, Tree, None]:
        inputs, stacked, args = saved

        looped_inputs, last_input = inputs

        def layer_grads(h: jax.Array, weights: Tree, dy: jax.Array) -> tuple[jax.Array, Tree]:
            _, vjp = jax.vjp(lambda h, w: layer_fn(h, w, args), h, weights)
            dx, dweights = vjp(dy)
            return dx, reduce(dweights)

        last = length - 1
        dx, last_grads = layer_grads(last_input, gather(_layer(stacked, last)), dy)
        if length == 1:
            return dx, None, jax.tree.map(lambda g: g[None], last_grads), None

        def body(carry: tuple[jax.Array, Tree], index: jax.Array) -> tuple[tuple[jax.Array, Tree], Tree]:
            dy, weights = carry
            preceding = gather(_layer(stacked, index - 1))
            dx, grads = layer_grads(_layer(looped_inputs, index), weights, dy)
            return (dx, preceding), grads

        # Layers last-1 .. 1 each fetch their predecessor; layer 0 is peeled so nothing is fetched twice.
        (dx, weights), middle = jax.lax.scan(
            body, (dx, gather(_layer(stacked, last - 1))), jnp.arange(last - 1, 0, -1)
        )
        dx, first_grads = layer_grads(_layer(looped_inputs, 0), weights, dx)
        stacked_grads = jax.tree.map(
            lambda first, middle, final: jnp.concatenate([first[None], middle[::-1], final[None]], axis=0),
            first_grads,
            middle,
            last_grads,
        )
        return dx, None, stacked_grads, None

    run.defvjp(run_forward, run_backward)
    return run(x, stacked, sinks, args)
