"""What a collective's group of mesh axes spans, and the runs of it one collective can take; cached by
the axes, since the planner builds the same groups for many leaves and probe strategies."""

from __future__ import annotations

import functools
import itertools

from amsp_jax.core.mesh import AxisPlan


@functools.lru_cache(maxsize=1 << 12)
def shape(axes: AxisPlan, group_axes: tuple[str, ...]) -> tuple[int, int, str]:
    """(devices, nodes spanned, level) of one group over `group_axes`: `inter` where it crosses nodes."""
    inter = tuple(a for a in group_axes if axes.is_inter(a))
    return axes.size(group_axes), axes.size(inter), "inter" if inter else "intra"


@functools.lru_cache(maxsize=1 << 12)
def runs(
    axes: AxisPlan, hierarchical: bool, group_axes: tuple[str, ...], dims: tuple[int, ...]
) -> tuple[tuple[tuple[str, ...], int], ...]:
    """`group_axes`, each splitting the dimension beside it in `dims`, in runs that one collective can
    take, with the dimension each splits: one per dimension; `hierarchical`, one per level too."""
    dim_of = dict(zip(group_axes, dims, strict=True)).__getitem__
    key = (lambda a: (axes.is_inter(a), dim_of(a))) if hierarchical else dim_of
    grouped = (tuple(run) for _, run in itertools.groupby(group_axes, key))
    return tuple((run, dim_of(run[0])) for run in grouped)
