"""The loss of one micro-batch inside the step's `shard_map`: P gathered (per layer in stacks and
blocks), the user's loss run on it, and gradients routed into G-shaped sinks.

Every function here runs inside `shard_map` over the program's mesh: arrays are one device's blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from amsp_jax.core.leaf import Path
from amsp_jax.core.schedule import LeafSchedule, grad_dtype
from amsp_jax.layers.stack import (
    Chain,
    LayerContext,
    StackOps,
    first_layer_scope,
    layer_context,
    linen_blocks,
)
from amsp_jax.layers.tensor import tensor_context
from amsp_jax.layers.tensor_modules import tensor_layers
from amsp_jax.step import collectives
from amsp_jax.step.program import StepProgram, flatten

# (sinks, first-layer sinks), P blocks, first layers, micro-batch, rng, collections -> (loss, aux)
MicroLoss = Callable[..., tuple[jax.Array, Any]]


def dtypes(program: StepProgram) -> tuple[jnp.dtype, jnp.dtype, jnp.dtype]:
    """P's compute dtype, the gradient reduction's dtype and G's dtype (`schedule.grad_dtype`)."""
    precision = program.plan.precision
    held = grad_dtype(program.plan.micro_batches, precision.reduce_dtype)
    return jnp.dtype(precision.param_dtype), jnp.dtype(precision.reduce_dtype), jnp.dtype(held)


def sinks(program: StepProgram, blocks: dict[Path, jax.Array]) -> dict[Path, jax.Array]:
    """Zero G blocks, typed varying over every axis like the gradients that land in them."""
    layout, dtype = program.layout, dtypes(program)[2]
    return {
        p: collectives.mark_varying(
            jnp.zeros(program.params.leaves[p].block_shape(layout, "grads"), dtype), layout.all_axes
        )
        for p in blocks
    }


def gather_other_leaves(program: StepProgram, blocks: dict[Path, jax.Array]) -> dict[Path, jax.Array]:
    """`blocks` with every leaf outside the layers gathered whole, once, for all micro-batches.

    Issued before the micro-batch loop rather than left to XLA: its GPU pipeline does not hoist these
    loop-invariant gathers out of the loop (the CPU one does), so they would run M times.
    """
    pl, schedule, dtype = program.params, program.schedule, dtypes(program)[0]

    def gathered(path: Path, block: jax.Array) -> jax.Array:
        full = collectives.gather_weights(program.layout, block, schedule.leaves[path], dtype)
        return jax.lax.stop_gradient(full) if path in pl.frozen else full

    return {p: b if pl.per_layer(p) else gathered(p, b) for p, b in blocks.items()}


def first_layers(program: StepProgram, blocks: dict[Path, jax.Array]) -> dict[Path, jax.Array]:
    """The first layer of every `LayerStack` leaf that keeps it (`schedule.keeps_first_layer`), gathered
    once for all micro-batches, as `gather_other_leaves` gathers the other leaves."""
    schedule, dtype = program.schedule, dtypes(program)[0]
    first = {}
    for p, b in blocks.items():
        if schedule.leaves[p].keeps_first_layer:
            with jax.named_scope(first_layer_scope(p)):
                gathered = collectives.gather_weights(program.layout, b[0], schedule.leaves[p], dtype)
            first[p] = jax.lax.stop_gradient(gathered)
    return first


def _per_leaf(fn: Callable[..., jax.Array], leaves: dict[Path, Any]) -> Callable[..., Any]:
    """`fn(leaves[path], *values at path)` over params-shaped trees."""

    def apply(*trees: Any) -> Any:
        flats = [flatten(t) for t in trees]
        return traverse_util.unflatten_dict({p: fn(leaves[p], *(f[p] for f in flats)) for p in flats[0]})

    return apply


def _unit_ops(program: StepProgram, unit: Path) -> tuple[StackOps, dict[Path, LeafSchedule]]:
    """How the step moves one layer of a stack or block at `unit`: gathers (with or without a gradient
    sink) and gradient reductions, per leaf of the layer."""
    layout, (param_dtype, reduce_dtype, g_dtype) = program.layout, dtypes(program)
    inner = {p[len(unit) :]: leaf for p, leaf in program.schedule.leaves.items() if p[: len(unit)] == unit}

    def gather(leaf: LeafSchedule, block: jax.Array) -> jax.Array:
        return collectives.gather_weights(layout, block, leaf, param_dtype)

    def gather_fn(leaf: LeafSchedule) -> Callable[[jax.Array, jax.Array], jax.Array]:
        if leaf.frozen:  # no gradient, so no reduce-scatter: the sink stays zero
            return lambda block, _: jax.lax.stop_gradient(gather(leaf, block))
        return collectives.make_gather(layout, leaf, param_dtype, reduce_dtype, g_dtype)

    gathers = {p: gather_fn(leaf) for p, leaf in inner.items()}

    def reduce(leaf: LeafSchedule, grad: jax.Array) -> jax.Array:
        if leaf.frozen:  # the weight gradient is dropped (and its computation with it)
            block = leaf.split.block_shape(layout, "grads")[int(leaf.stacked) :]
            return collectives.mark_varying(jnp.zeros(block, g_dtype), layout.all_axes)
        return collectives.reduce_gradient(grad, leaf, reduce_dtype, g_dtype)

    with_sink = _per_leaf(lambda g, block, sink: g(block, sink), gathers)
    ops = StackOps(with_sink, _per_leaf(gather, inner), _per_leaf(reduce, inner))
    return ops, inner


def layer_context_of(program: StepProgram) -> Callable[[dict, dict], LayerContext]:
    """`context(stack sinks, first-layer weights)`: what the step hands the model's stacks and blocks
    while it traces one micro-batch's loss."""
    pl, schedule = program.params, program.schedule
    stack_ops: dict[Path, StackOps] = {}
    prefetching: set[Path] = set()
    for stack in pl.layer_stacks:
        stack_ops[stack], inner = _unit_ops(program, stack)
        if schedule.prefetches(next(iter(inner.values())).layers):
            prefetching.add(stack)
    block_ops = {block: _unit_ops(program, block)[0] for block in pl.blocks}
    looped = [b for b in pl.blocks if b not in pl.stacks]
    if looped and schedule.prefetches(len(looped), stack=False):
        prefetching.update(looped)
    remat, policy = program.plan.remat_policy()

    def context(stack_sinks: dict, first_weights: dict) -> LayerContext:
        return LayerContext(
            stack_ops, stack_sinks, policy, remat, frozenset(prefetching), block_ops, Chain(), first_weights
        )

    return context


def _per_stack(program: StepProgram, flat: dict[Path, Any]) -> dict[Path, Any]:
    """`flat`'s leaves of each `LayerStack` as a tree of the stack's layer (stacks without any left out)."""
    trees = {
        stack: {p[len(stack) :]: v for p, v in flat.items() if p[: len(stack)] == stack}
        for stack in program.params.layer_stacks
    }
    return {stack: traverse_util.unflatten_dict(tree) for stack, tree in trees.items() if tree}


def call_loss(program: StepProgram, params: Any, micro_batch: Any, rng: Any, variables: Any) -> tuple:
    """The user's loss on gathered-as-it-goes `params`: `(loss fp32, (metrics fp32, collections))`."""
    loss_spec = program.loss
    args = (params, micro_batch) if loss_spec.rng_seed is None else (params, micro_batch, rng)
    kwargs = {"variables": variables} if loss_spec.collections else {}
    out = loss_spec.fn(*args, **kwargs)
    loss, aux = out if loss_spec.has_aux or loss_spec.collections else (out, None)
    if loss_spec.collections:
        metrics, variables = aux if loss_spec.has_aux else ({}, aux)
    else:
        metrics = aux if loss_spec.has_aux else {}
    metrics = jax.tree.map(lambda m: jnp.asarray(m, jnp.float32), metrics)
    return loss.astype(jnp.float32), (metrics, variables)


def micro_loss_fn(program: StepProgram) -> MicroLoss:
    """`micro_loss((sinks, first-layer sinks), P blocks, first layers, micro-batch, rng, collections)
    -> (loss, (metrics, updated collections))`: gathers P (per layer in stacks and blocks), runs the
    user's loss, and routes gradients into the G-shaped sinks; a kept first layer's into its full sink."""
    pl = program.params
    _, reduce_dtype, g_dtype = dtypes(program)
    top_sinks = {
        p: collectives.make_sink(leaf, reduce_dtype, g_dtype)
        for p, leaf in program.schedule.leaves.items()
        if not pl.per_layer(p) and not leaf.frozen
    }
    context_of = layer_context_of(program)

    def with_sink(path: Path, block: jax.Array, sink: jax.Array) -> Any:
        if pl.block_of(path):
            return block, sink
        if pl.per_layer(path) or path not in top_sinks:
            return block
        return top_sinks[path](block, sink)

    def micro_loss(
        all_sinks: tuple[dict, dict], blocks: dict, first: dict, micro_batch: Any, rng: Any, variables: Any
    ) -> tuple[jax.Array, Any]:
        sinks, first_sinks = all_sinks
        # Leaves outside layers: already gathered (`gather_other_leaves`), each micro-batch attaches its
        # sink. A LayerStack's: shards (it gathers each layer). A wrapped block's: (shard, sink) pairs,
        # which its interceptor gathers call by call.
        tree = {p: with_sink(p, b, sinks[p]) for p, b in blocks.items()}
        attached = {
            p: collectives.attach_full_sink(w, first_sinks[p]) if p in first_sinks else w
            for p, w in first.items()
        }
        context = context_of(_per_stack(program, sinks), _per_stack(program, attached))
        tensor = program.tensor_context()
        layers = tensor_layers() if tensor is not None else contextlib.nullcontext()
        with layer_context(context), linen_blocks(), tensor_context(tensor), layers:
            return call_loss(program, traverse_util.unflatten_dict(tree), micro_batch, rng, variables)

    return micro_loss
