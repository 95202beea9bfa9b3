"""Batches of the step: the check that a global batch splits into devices x micro-batches, placing a
host batch on the devices, splitting a device's slice into micro-batches, and the key `loss_fn` gets
for each micro-batch."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from amsp_jax.core.mesh import Layout, batch_spec
from amsp_jax.core.plan import Plan
from amsp_jax.step.program import TrainerError


def check_batch(plan: Plan, batch: Any) -> None:
    """Raise a clear error when the global batch does not split into devices × micro-batches."""
    # The devices of a tensor group share their examples.
    devices, micro = plan.cluster.num_devices // plan.strategy.tensor, plan.micro_batches
    what = "devices" if plan.strategy.tensor == 1 else f"data-parallel devices (t={plan.strategy.tensor})"
    leaves = jax.tree.leaves(batch)
    if not leaves or not all(hasattr(x, "shape") for x in leaves):
        raise TrainerError(
            "a batch is a tree of arrays with the global batch as their first dimension, e.g. "
            f"{{'inputs': tokens, 'targets': tokens}}; got {type(batch).__name__}"
        )
    sizes = {x.shape[0] if len(x.shape) else None for x in leaves}
    if None in sizes or len(sizes) != 1:
        raise TrainerError(f"every batch leaf needs the same leading batch dimension, got {sizes}")
    size = sizes.pop()
    unit = devices * micro
    if size % unit:
        raise TrainerError(
            f"global batch {size} does not split into {devices} {what} x {micro} micro-batches; "
            f"use a multiple of {unit} (e.g. {max(1, size // unit) * unit})"
        )


def batch_shardings(layout: Layout, batch: Any) -> Any:
    """The `NamedSharding` of every leaf of a global batch: split along its first dimension."""
    return jax.tree.map(lambda x: NamedSharding(layout.mesh, batch_spec(layout, len(x.shape))), batch)


def shard_batch(layout: Layout, plan: Plan, batch: Any) -> Any:
    """Place a global host batch on the devices, split along its first dimension."""
    check_batch(plan, batch)
    if isinstance(jax.tree.leaves(batch)[0], jax.Array) and jax.process_count() == 1:
        batch = jax.tree.map(np.asarray, batch)
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(
            np.shape(x), NamedSharding(layout.mesh, batch_spec(layout, np.ndim(x))), lambda i: x[i]
        ),
        batch,
    )


def on_devices(layout: Layout, plan: Plan, batch: Any) -> Any:
    """`batch` checked and, unless every leaf is already spread over the devices, placed on them."""
    check_batch(plan, batch)
    if all(isinstance(x, jax.Array) and len(x.devices()) > 1 for x in jax.tree.leaves(batch)):
        return batch
    return shard_batch(layout, plan, batch)


def split_micro_batches(micro_batches: int, local_batch: Any) -> Any:
    """A device's slice of the batch as `micro_batches` micro-batches along a new leading dimension."""
    return jax.tree.map(
        lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), local_batch
    )


def rng_for(
    seed: int, step: jax.Array | int, micro_batch: jax.Array | int, shard: jax.Array | int
) -> jax.Array:
    """The key `loss_fn` gets for one micro-batch of one batch shard: `shard` is the index of the
    device's slice of the global batch (slices in order), `micro_batch` the index within that slice."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(jax.random.fold_in(key, micro_batch), shard)


def device_rngs(layout: Layout, micro_batches: int, seed: int | None, step: jax.Array) -> jax.Array | None:
    """Inside shard_map: this device's key for each micro-batch of `step` (see `rng_for`)."""
    if seed is None:
        return None
    axes = batch_spec(layout, 1)[0]
    shard = jnp.zeros((), jnp.int32)
    for axis in (axes,) if isinstance(axes, str) else axes:
        shard = shard * layout.axis_size(axis) + jax.lax.axis_index(axis)
    return jax.vmap(lambda m: rng_for(seed, step, m, shard))(jnp.arange(micro_batches))
