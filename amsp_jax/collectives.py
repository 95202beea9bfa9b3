"""Every collective of the step, in one place: gathers, reduce-scatters and all-reduces over mesh axes.

Collectives over axes that mix intra- and inter-node axes are split into runs of one kind: a
reduce-scatter goes intra-node first and crosses nodes on the smaller piece; an all-gather crosses
nodes first on the small piece and then fans out inside the node; an all-reduce over both is
reduce-scatter (intra), all-reduce (inter), all-gather (intra). That keeps inter-node bytes at
their minimum and makes them countable. These functions run inside `jax.shard_map`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from amsp_jax.sharding import AxisPlan


def runs(layout: AxisPlan, axes: Sequence[str]) -> list[tuple[str, ...]]:
    """Split ordered `axes` into maximal runs of intra-node or inter-node axes, order kept."""
    return [tuple(group) for _, group in itertools.groupby(axes, key=layout.is_inter)]


def all_gather(
    layout: AxisPlan, x: jax.Array, axes: Sequence[str], dim: int, replicated: bool = False
) -> jax.Array:
    """Tiled all-gather of `x` along `dim` over `axes` (major first), the minor runs first.

    `replicated` types the result as equal on every device of `axes` (for values leaving shard_map).
    """
    for run in reversed(runs(layout, axes)):
        x = jax.lax.all_gather(x, run, axis=dim, tiled=True, to="invarying" if replicated else "varying")
    return x


def reduce_scatter(layout: AxisPlan, x: jax.Array, axes: Sequence[str], dim: int) -> jax.Array:
    """Tiled sum-reduce-scatter of `x` along `dim` over `axes` (major first), the major runs first."""
    for run in runs(layout, axes):
        x = jax.lax.psum_scatter(x, run, scatter_dimension=dim, tiled=True)
    return x


def hierarchical_split(
    layout: AxisPlan, x_size: int, axes: Sequence[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(intra, inter) axes of an all-reduce, with intra empty when it cannot run reduce-scatter first."""
    intra = tuple(a for a in axes if not layout.is_inter(a))
    inter = tuple(a for a in axes if layout.is_inter(a))
    if intra and inter and x_size % layout.size(intra) == 0:
        return intra, inter
    return (), tuple(axes)


def all_reduce(layout: AxisPlan, x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Sum of `x` over `axes`; across nodes as intra reduce-scatter, inter all-reduce, intra all-gather."""
    if not axes:
        return x
    intra, rest = hierarchical_split(layout, x.size, axes)
    if not intra:
        return jax.lax.psum(x, tuple(rest))
    flat = jax.lax.psum_scatter(x.reshape(-1), intra, scatter_dimension=0, tiled=True)
    flat = jax.lax.psum(flat, rest)
    return jax.lax.all_gather(flat, intra, axis=0, tiled=True, to="invarying").reshape(x.shape)


def local_slice(layout: AxisPlan, x: jax.Array, axes: Sequence[str], dim: int) -> jax.Array:
    """This device's block of `x` along `dim` when split over `axes` (major first): no communication."""
    count = layout.size(axes)
    index = jnp.zeros((), jnp.int32)
    for axis in axes:
        index = index * layout.axis_size(axis) + jax.lax.axis_index(axis)
    block = x.shape[dim] // count
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=dim)


def mark_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """`x` typed as varying over `axes` (no communication)."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def gather_weights(
    layout: AxisPlan, p_block: jax.Array, param_axes: Sequence[str], dim: int | None
) -> jax.Array:
    """The full leaf from this device's P block (typed varying over every axis, like the batch it meets).

    Without that typing, autodiff would insert a hidden psum of the cotangent over the axes P is
    replicated on.
    """
    full = all_gather(layout, p_block, param_axes, dim) if dim is not None else p_block
    return mark_varying(full, layout.all_axes)


def reduce_gradient(
    layout: AxisPlan, cotangent: jax.Array, grad_axes: Sequence[str], dim: int | None, reduce_dtype: jnp.dtype
) -> jax.Array:
    """This device's fp32 G block of a full-leaf gradient: reduce-scatter over G's axes in `reduce_dtype`."""
    reduced = cotangent.astype(reduce_dtype)
    if dim is not None:
        reduced = reduce_scatter(layout, reduced, grad_axes, dim)
    return reduced.astype(jnp.float32)


def make_gather(
    layout: AxisPlan,
    param_axes: Sequence[str],
    grad_axes: Sequence[str],
    dim: int | None,
    reduce_dtype: jnp.dtype,
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """`gather(p_block, g_sink) -> full leaf` whose gradient lands in `g_sink`, reduce-scattered over G.

    The backward pass turns the full-leaf cotangent into this device's G block and hands it to the zero
    "sink" of G's shape, so `jax.grad` with respect to the sinks yields gradients already on G.
    """

    @jax.custom_vjp
    def gather(p_block: jax.Array, g_sink: jax.Array) -> jax.Array:
        del g_sink
        return gather_weights(layout, p_block, param_axes, dim)

    def forward(p_block: jax.Array, g_sink: jax.Array) -> tuple[jax.Array, None]:
        return gather(p_block, g_sink), None

    def backward(_: None, cotangent: jax.Array) -> tuple[None, jax.Array]:
        return None, reduce_gradient(layout, cotangent, grad_axes, dim, reduce_dtype)

    gather.defvjp(forward, backward)
    return gather
