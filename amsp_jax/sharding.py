"""One mesh for P, G and OS, and the per-leaf `PartitionSpec`s that put each on its placement.

The mesh's axes are the factors of the nested groups: inter-node axes before intra-node
axes, the replica factor outermost. Each component shards a leaf over a prefix of one axis order
(smaller groups first), so a device's OS block lies inside its G and P blocks and moving between
components is a slice, a reduce-scatter or an all-gather over the extra axes only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from amsp_jax.space import COMPONENTS, Cluster, Strategy


@dataclasses.dataclass(frozen=True)
class AxisPlan:
    """The mesh axes of a (cluster, strategy) and the axes each component is sharded over; no devices."""

    cluster: Cluster
    strategy: Strategy
    axis_sizes: tuple[tuple[str, int], ...]
    component_axes: dict[str, tuple[str, ...]]
    inter_axes: frozenset[str]

    @property
    def all_axes(self) -> tuple[str, ...]:
        """Every mesh axis, outermost first."""
        return tuple(name for name, _ in self.axis_sizes)

    def axes(self, component: str) -> tuple[str, ...]:
        """The axes `component` is sharded over, in `PartitionSpec` order (major first)."""
        return self.component_axes[component]

    def axis_size(self, axis: str) -> int:
        """Number of devices along one axis."""
        return dict(self.axis_sizes)[axis]

    def size(self, axes: Sequence[str]) -> int:
        """Number of devices spanned by `axes`."""
        return math.prod(self.axis_size(a) for a in axes)

    def is_inter(self, axis: str) -> bool:
        """Whether `axis` runs across nodes."""
        return axis in self.inter_axes

    def node_of_device(self) -> list[int]:
        """Node index of each position of the flattened mesh (the compiled program's device ids)."""
        return [i // self.cluster.devices_per_node for i in range(self.cluster.num_devices)]


@dataclasses.dataclass(frozen=True)
class Layout(AxisPlan):
    """An `AxisPlan` placed on real devices: the `Mesh`."""

    mesh: Mesh


def _chain(
    degrees: Sequence[int], total: int, prefix: str
) -> tuple[list[tuple[str, int]], dict[int, list[str]]]:
    """Axes (innermost first) factoring `total` through the sorted distinct `degrees`; degree → its axes."""
    steps = sorted({d for d in degrees if d > 1})
    axes: list[tuple[str, int]] = []
    covering: dict[int, list[str]] = {1: []}
    previous = 1
    for degree in steps:
        axes.append((f"{prefix}{len(axes)}", degree // previous))
        covering[degree] = [name for name, _ in axes]
        previous = degree
    if total // previous > 1:
        axes.append((f"{prefix}_rep", total // previous))
    return axes, covering


def ordered_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """Devices node-major: by process (host), then id, so consecutive devices share a node."""
    devices = list(devices if devices is not None else jax.devices())
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def plan_axes(cluster: Cluster, strategy: Strategy) -> AxisPlan:
    """The nested mesh axes of `strategy` on `cluster`, without touching devices."""
    strategy.validate(cluster, allow_partial_nodes=True)
    placements = strategy.placements()
    intra_axes, intra_cover = _chain(
        [p.intra for p in placements.values()], cluster.devices_per_node, "intra"
    )
    inter_axes, inter_cover = _chain([p.inter for p in placements.values()], cluster.nodes, "inter")
    axis_sizes = tuple(reversed(inter_axes)) + tuple(reversed(intra_axes)) or (("intra0", 1),)

    # Order components by group size; each adds its new intra axes, then its new inter axes, so every
    # component's axes are a prefix of one order and reduce-scatters run intra-node first.
    order: list[str] = []
    component_axes: dict[str, tuple[str, ...]] = {}
    for comp in sorted(COMPONENTS, key=lambda c: placements[c].degree):
        intra, inter = intra_cover[placements[comp].intra], inter_cover[placements[comp].inter]
        order += [a for a in intra + inter if a not in order]
        mine = set(intra) | set(inter)
        component_axes[comp] = tuple(a for a in order if a in mine)
    return AxisPlan(cluster, strategy, axis_sizes, component_axes, frozenset(n for n, _ in inter_axes))


def make_layout(cluster: Cluster, strategy: Strategy, devices: Sequence[jax.Device] | None = None) -> Layout:
    """Build the mesh for `strategy` on `cluster`, checking the devices match the cluster."""
    devices = ordered_devices(devices)
    if len(devices) != cluster.num_devices:
        raise ValueError(
            f"the cluster {cluster.nodes} nodes x {cluster.devices_per_node} devices needs "
            f"{cluster.num_devices} devices but JAX has {len(devices)}; pass a cluster that matches "
            f"(e.g. Cluster.detect()) or set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{cluster.num_devices} on the CPU"
        )
    processes = {d.process_index for d in devices}
    if len(processes) > 1 and len(processes) != cluster.nodes:
        raise ValueError(
            f"{len(processes)} processes (hosts) run but the cluster has {cluster.nodes} nodes; "
            "with several hosts each host is one node"
        )
    axes = plan_axes(cluster, strategy)
    device_grid = np.array(devices, dtype=object).reshape([size for _, size in axes.axis_sizes])
    # Auto axes: every collective of the step is explicit (shard_map) and every output sharding is
    # given, so sharding-in-types would add nothing, and an Explicit mesh makes optax under jit and
    # host-side indexing of state arrays fail unless callers enter `jax.set_mesh`.
    mesh = Mesh(device_grid, axes.all_axes, axis_types=(AxisType.Auto,) * len(axes.all_axes))
    return Layout(**{f.name: getattr(axes, f.name) for f in dataclasses.fields(AxisPlan)}, mesh=mesh)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one parameter leaf is split: the dimension (or None: whole everywhere), each component's spec,
    and the stored shape: `shape` with the split dimension padded up to a multiple of the largest group.

    Padding is zeros at the end of the split dimension, kept only where the leaf is stored and moved
    (P, G and OS blocks, their collectives); the model, the user's parameters and checkpoints see
    `shape`.
    """

    shape: tuple[int, ...]
    dim: int | None
    specs: dict[str, P]
    padded: tuple[int, ...]

    @property
    def is_padded(self) -> bool:
        """Whether the stored shape is larger than the leaf."""
        return self.padded != self.shape

    def block_shape(self, layout: AxisPlan, component: str) -> tuple[int, ...]:
        """The shape of one device's block of this leaf under `component`'s placement."""
        if self.dim is None:
            return self.shape
        shape = list(self.padded)
        shape[self.dim] //= layout.size(layout.axes(component))
        return tuple(shape)


def padded_size(size: int, degree: int) -> int:
    """`size` rounded up to a multiple of `degree`."""
    return -(-size // degree) * degree


def shard_dim(shape: Sequence[int], degree: int, stacked: bool) -> int | None:
    """The dimension to split `degree` ways (never a stacked-layer dimension), or None (nothing to split).

    The one needing the fewest padded elements; among equals (e.g. several that divide) the largest.
    """
    first = 1 if stacked else 0
    if degree == 1 or len(shape) <= first:
        return None
    size = math.prod(shape)

    def padding(dim: int) -> int:
        return (padded_size(shape[dim], degree) - shape[dim]) * (size // shape[dim] if shape[dim] else 0)

    return min(range(first, len(shape)), key=lambda dim: (padding(dim), -shape[dim], dim))


def leaf_layout(layout: AxisPlan, shape: Sequence[int], stacked: bool) -> LeafLayout:
    """Split of one leaf: every component on the same dimension, smaller groups' axes first, padded to
    the largest group."""
    degree = max(layout.size(layout.axes(c)) for c in COMPONENTS)
    dim = shard_dim(shape, degree, stacked)
    specs = {}
    for comp in COMPONENTS:
        axes = layout.axes(comp) if dim is not None else ()
        entries: list[object] = [None] * len(shape)
        if axes:
            entries[dim] = axes if len(axes) > 1 else axes[0]
        specs[comp] = P(*entries)
    padded = list(shape)
    if dim is not None:
        padded[dim] = padded_size(shape[dim], degree)
    return LeafLayout(tuple(shape), dim, specs, tuple(padded))


def pad(x: Any, padded: Sequence[int]) -> Any:
    """`x` (numpy or JAX) with zeros appended up to the stored shape `padded`."""
    widths = [(0, p - s) for s, p in zip(x.shape, padded, strict=True)]
    if not any(w for _, w in widths):
        return x
    return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)


def unpad(x: Any, shape: Sequence[int]) -> Any:
    """`x` cut back from its stored shape to the leaf's `shape` (the leading corner)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return x[tuple(slice(0, s) for s in shape)]


def batch_spec(layout: Layout, ndim: int) -> P:
    """The batch is split along its first dimension over every device (data parallelism)."""
    axes = layout.all_axes
    return P(axes if len(axes) > 1 else axes[0], *([None] * (ndim - 1)))
