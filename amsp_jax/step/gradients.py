"""The step's `shard_map` bodies: the gradient of a global batch on OS's placement (micro-batches
accumulated on G, then the G→OS reduction), and the forward-only mean loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from amsp_jax.core.leaf import Path
from amsp_jax.core.mesh import batch_spec
from amsp_jax.core.tensor import TENSOR
from amsp_jax.layers.stack import first_layer_scope
from amsp_jax.step import collectives
from amsp_jax.step.batch import device_rngs, split_micro_batches
from amsp_jax.step.micro_loss import (
    MicroLoss,
    dtypes,
    first_layers,
    gather_other_leaves,
    micro_loss_fn,
    sinks,
)
from amsp_jax.step.program import StepProgram, flatten


def _accumulate(
    program: StepProgram, micro_loss: MicroLoss, inputs: tuple, split: Any, rngs: Any, variables: Any
) -> tuple[Any, Any, Any]:
    """`((G blocks, first-layer gradients), (loss sum, metric sums), collections)` over this device's
    micro-batches: one call without an accumulator, else a loop summing into fp32 G."""
    value_and_grad = jax.value_and_grad(micro_loss, has_aux=True)
    all_axes = program.layout.all_axes
    all_sinks, blocks, first = inputs
    if not program.schedule.accumulates:
        # No accumulator: one fp32 G-sized buffer less.
        only = jax.tree.map(lambda x: x[0], (split, rngs))
        (loss, (metrics, variables)), grads = value_and_grad(all_sinks, blocks, first, *only, variables)
        return grads, (loss, metrics), variables

    def micro_step(carry: tuple[Any, Any, Any], xs: Any) -> tuple[Any, Any, Any]:
        (accumulated, first_sums), sums, variables = carry
        (loss, (metrics, variables)), (grads, first_grads) = value_and_grad(
            all_sinks, blocks, first, *xs, variables
        )
        accumulated = jax.tree.map(jnp.add, accumulated, grads)
        first_sums = jax.tree.map(jnp.add, first_sums, first_grads)
        sums = jax.tree.map(jnp.add, sums, (loss, metrics))
        return (accumulated, first_sums), sums, variables

    one = jax.tree.map(lambda x: x[0], (split, rngs))
    loss_shape, (metrics_shape, _) = jax.eval_shape(micro_loss, all_sinks, blocks, first, *one, variables)
    zeros = jax.tree.map(
        lambda s: collectives.mark_varying(jnp.zeros(s.shape, s.dtype), all_axes), (loss_shape, metrics_shape)
    )
    first_sums = {p: s.astype(jnp.float32) for p, s in all_sinks[1].items()}
    carry = ((all_sinks[0], first_sums), zeros, variables)
    return _micro_batch_loop(micro_step, carry, (split, rngs))


def _micro_batch_loop(micro_step: Callable[[Any, Any], Any], carry: Any, xs: Any) -> Any:
    """`micro_step` over the leading axis of `xs` in turn, as a loop whose trip count XLA cannot read.

    XLA:GPU double-buffers every loop with a known trip count: two iterations per trip, where the
    second's zero-initialised buffers (the layer loops' saved activations) are allocated as the pair
    starts, so two micro-batches' activations would be live at once, which the plan does not budget.
    The count is still read off the compiled program (`compiled.hlo.loops`) by running the loop's
    scalars.
    """
    count = jax.lax.optimization_barrier(jnp.int32(jax.tree.leaves(xs)[0].shape[0]))

    def body(i: jax.Array, carry: Any) -> Any:
        micro_batch = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), xs)
        return micro_step(carry, micro_batch)

    return jax.lax.fori_loop(0, count, body, carry)


def _to_opt_state(program: StepProgram, accumulated: tuple[dict, dict]) -> dict[Path, jax.Array]:
    """The G blocks (a kept first layer's gradient reduce-scattered onto them once) reduced onto OS's
    placement and averaged over every device's micro-batches."""
    pl, schedule, layout = program.params, program.schedule, program.layout
    reduce_dtype = dtypes(program)[1]
    count = layout.data_devices * program.plan.micro_batches  # a tensor group shares its examples
    # A leaf whole on every tensor rank: with sequence parallelism each rank holds the part of its
    # sequence shards (summed here); without, every rank holds the same gradient (averaged, which also
    # types it equal on every rank, as its OS placement needs).
    tensor_copies = 1 if program.plan.sequence_parallel else layout.tensor
    accumulated, first_grads = accumulated
    for p, full in first_grads.items():
        # The kept first layer's gradient, summed over the micro-batches, onto G once.
        with jax.named_scope(first_layer_scope(p)):
            reduced = collectives.reduce_gradient(
                full, schedule.leaves[p], reduce_dtype, accumulated[p].dtype
            )
        accumulated[p] = accumulated[p].at[0].add(reduced)

    def to_opt_state(path: Path, g_block: jax.Array) -> jax.Array:
        if path in pl.frozen:  # the optimizer gives frozen leaves zero updates whatever they get
            return jnp.zeros(pl.leaves[path].block_shape(layout, "opt_state"), jnp.float32)
        reduced = collectives.execute(g_block.astype(reduce_dtype), schedule.leaves[path].reduction, True)
        if layout.tensor > 1 and pl.leaves[path].tensor_dim is None:
            reduced = jax.lax.psum(reduced, TENSOR)
            return reduced.astype(jnp.float32) / (count * tensor_copies)
        return reduced.astype(jnp.float32) / count

    return {p: to_opt_state(p, g) for p, g in accumulated.items()}


def gradients(
    program: StepProgram, params: Any, batch: Any, step: jax.Array, variables: Any
) -> tuple[Any, jax.Array, Any, Any]:
    """The summed-then-averaged gradient on OS's placement, mean loss, mean metrics and the updated
    collections (averaged over devices), from P blocks, a global batch and the carried collections."""
    layout, pl, plan = program.layout, program.params, program.plan
    all_axes, count = layout.all_axes, layout.cluster.num_devices * plan.micro_batches
    micro_loss = micro_loss_fn(program)

    def across_devices(x: jax.Array) -> jax.Array:
        if jnp.issubdtype(x.dtype, jnp.floating):
            return (jax.lax.psum(x, all_axes) / layout.cluster.num_devices).astype(x.dtype)
        return jax.lax.pmax(x, all_axes)

    def body(param_blocks: Any, local_batch: Any, step: jax.Array, variables: Any) -> tuple[Any, ...]:
        blocks = flatten(param_blocks)
        first = first_layers(program, blocks)
        # A micro-batch's first-layer gradient comes in the reduce dtype and is summed in fp32.
        first_sinks = {
            p: collectives.mark_varying(jnp.zeros(w.shape, dtypes(program)[1]), all_axes)
            for p, w in first.items()
            if p not in pl.frozen
        }
        inputs = ((sinks(program, blocks), first_sinks), gather_other_leaves(program, blocks), first)
        # Each device updates the collections with its own micro-batches, in turn.
        variables = jax.tree.map(lambda x: collectives.mark_varying(x, all_axes), variables)
        split = split_micro_batches(plan.micro_batches, local_batch)
        rngs = device_rngs(layout, plan.micro_batches, program.loss.rng_seed, step)
        accumulated, sums, variables = _accumulate(program, micro_loss, inputs, split, rngs, variables)
        grads = _to_opt_state(program, accumulated)
        loss, metrics = jax.tree.map(lambda x: jax.lax.psum(x, all_axes) / count, sums)
        return traverse_util.unflatten_dict(grads), loss, metrics, jax.tree.map(across_devices, variables)

    specs = lambda comp: pl.tree(lambda _, leaf: leaf.specs[comp])  # noqa: E731
    batch_specs = jax.tree.map(lambda x: batch_spec(layout, x.ndim), batch)
    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(specs("params"), batch_specs, P(), P()),
        out_specs=(specs("opt_state"), P(), P(), P()),
    )(params, batch, step, variables)


def mean_loss(program: StepProgram, params: Any, batch: Any, step: jax.Array, variables: Any) -> jax.Array:
    """Mean loss of a batch, forward only, gathering P as the step does (per layer in stacks)."""
    layout, plan = program.layout, program.plan
    micro_loss = micro_loss_fn(program)
    count = layout.cluster.num_devices * plan.micro_batches

    def body(param_blocks: Any, local_batch: Any, step: jax.Array, variables: Any) -> jax.Array:
        blocks = flatten(param_blocks)
        all_sinks = (sinks(program, blocks), {})
        blocks = gather_other_leaves(program, blocks)
        losses = jax.lax.map(
            lambda xs: micro_loss(all_sinks, blocks, {}, *xs, variables)[0],
            (
                split_micro_batches(plan.micro_batches, local_batch),
                device_rngs(layout, plan.micro_batches, program.loss.rng_seed, step),
            ),
        )
        return jax.lax.psum(losses.sum(), layout.all_axes) / count

    specs = program.params.tree(lambda _, leaf: leaf.specs["params"])
    batch_specs = jax.tree.map(lambda x: batch_spec(layout, x.ndim), batch)
    return jax.shard_map(body, mesh=layout.mesh, in_specs=(specs, batch_specs, P(), P()), out_specs=P())(
        params, batch, step, variables
    )
