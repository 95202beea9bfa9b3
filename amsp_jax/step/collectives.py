"""The schedule's ops as JAX collectives: every `all_gather`, `psum_scatter` and `psum` of the step.

`amsp_jax.core.schedule` decides which collectives a leaf needs (and whether a group that spans nodes is
split into intra- and inter-node runs); this module only issues them, in order, inside
`jax.shard_map`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from amsp_jax.core.mesh import AxisPlan, pad, unpad
from amsp_jax.core.schedule import ALL_GATHER, REDUCE_SCATTER, LeafSchedule, Op


def execute(x: jax.Array, ops: Sequence[Op], replicated: bool = False) -> jax.Array:
    """Run `ops` on `x` in order. Ops without a dimension (the pieces of an all-reduce) work on the
    flattened buffer; `replicated` types a gathered result as equal on every device of its group
    (for values leaving shard_map), else it stays varying like the activations it meets."""
    saved_shape = None
    for op in ops:
        if op.dim is None and saved_shape is None:
            saved_shape, x = x.shape, x.reshape(-1)
        elif op.dim is not None and saved_shape is not None:
            x, saved_shape = x.reshape(saved_shape), None
        dim = 0 if op.dim is None else op.dim
        if op.kind == ALL_GATHER:
            # The gather closing an all-reduce always yields the same sum on every device.
            typing = "invarying" if replicated or op.dim is None else "varying"
            x = jax.lax.all_gather(x, op.axes, axis=dim, tiled=True, to=typing)
        elif op.kind == REDUCE_SCATTER:
            x = jax.lax.psum_scatter(x, op.axes, scatter_dimension=dim, tiled=True)
        else:
            x = jax.lax.psum(x, op.axes)
    return x.reshape(saved_shape) if saved_shape is not None else x


def local_slice(layout: AxisPlan, x: jax.Array, dims: Mapping[str, int]) -> jax.Array:
    """This device's block of `x` when each axis of `dims` (major first) splits its dimension: no
    communication."""
    by_dim: dict[int, list[str]] = {}
    for axis, dim in dims.items():
        by_dim.setdefault(dim, []).append(axis)
    for dim, axes in by_dim.items():
        index = jnp.zeros((), jnp.int32)
        for axis in axes:
            index = index * layout.axis_size(axis) + jax.lax.axis_index(axis)
        block = x.shape[dim] // layout.size(axes)
        x = jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=dim)
    return x


def mark_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """`x` typed as varying over `axes` (no communication)."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def gather_weights(layout: AxisPlan, p_block: jax.Array, leaf: LeafSchedule, dtype: jnp.dtype) -> jax.Array:
    """The full leaf (one layer of a stacked one) in `dtype` from this device's P block, its padding cut
    off, typed varying over every axis like the batch it meets.

    The block is cast before the gather: a no-op for a stored P, and where P is the fp32 master
    (`schedule.params_from_master`) one layer's block at a time, never a whole cast copy. Without the
    typing, autodiff would insert a hidden psum of the cotangent over the axes P is replicated on.
    """
    full = unpad(execute(p_block.astype(dtype), leaf.gather), leaf.gathered_shape)
    return mark_varying(full, layout.all_axes)


def reduce_gradient(
    cotangent: jax.Array, leaf: LeafSchedule, reduce_dtype: jnp.dtype, grad_dtype: jnp.dtype
) -> jax.Array:
    """This device's G block (in `grad_dtype`) of a full-leaf gradient: padded with zeros (so the
    padding's gradient, and with it every optimizer statistic, is exactly zero), then reduce-scattered
    onto G in `reduce_dtype`."""
    padded = pad(cotangent.astype(reduce_dtype), leaf.gathered_padded)
    return execute(padded, leaf.grad_reduce).astype(grad_dtype)


def make_sink(
    leaf: LeafSchedule, reduce_dtype: jnp.dtype, grad_dtype: jnp.dtype
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`attach(full_leaf, g_sink) -> full_leaf` whose gradient lands in `g_sink`, reduce-scattered over G.

    For a leaf gathered once, before the micro-batch loop: each micro-batch attaches its own sink to the
    same gathered leaf, so the gradient is reduced per micro-batch while the gather runs once.
    """

    @jax.custom_vjp
    def attach(full: jax.Array, g_sink: jax.Array) -> jax.Array:
        del g_sink
        return full

    def forward(full: jax.Array, g_sink: jax.Array) -> tuple[jax.Array, None]:
        return attach(full, g_sink), None

    def backward(_: None, cotangent: jax.Array) -> tuple[None, jax.Array]:
        return None, reduce_gradient(cotangent, leaf, reduce_dtype, grad_dtype)

    attach.defvjp(forward, backward)
    return attach


@jax.custom_vjp
def attach_full_sink(full: jax.Array, sink: jax.Array) -> jax.Array:
    """`full`, whose gradient lands in `sink` (a zero buffer of its shape) whole, in `sink`'s dtype.

    For a layer gathered once for every micro-batch (`schedule.keeps_first_layer`): its gradient is
    summed over the micro-batches before one reduce-scatter.
    """
    del sink
    return full


def _attach_full_forward(full: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array]:
    return full, jnp.zeros((), sink.dtype)


def _attach_full_backward(dtype_of: jax.Array, cotangent: jax.Array) -> tuple[None, jax.Array]:
    return None, cotangent.astype(dtype_of.dtype)


attach_full_sink.defvjp(_attach_full_forward, _attach_full_backward)


def make_gather(
    layout: AxisPlan,
    leaf: LeafSchedule,
    param_dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    grad_dtype: jnp.dtype,
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`gather(p_block, g_sink) -> full leaf` whose gradient lands in `g_sink`, reduce-scattered over G.

    The gathered leaf goes through `make_sink`, so `jax.grad` with respect to the sinks yields gradients
    already on G (and none flows back into the gather itself).
    """
    attach = make_sink(leaf, reduce_dtype, grad_dtype)

    def gather(p_block: jax.Array, g_sink: jax.Array) -> jax.Array:
        return attach(gather_weights(layout, p_block, leaf, param_dtype), g_sink)

    return gather
