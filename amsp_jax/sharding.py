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

import jax
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
    """How one parameter leaf is split: the dimension (or None: replicated) and each component's spec."""

    shape: tuple[int, ...]
    dim: int | None
    specs: dict[str, P]

    def block_shape(self, layout: AxisPlan, component: str) -> tuple[int, ...]:
        """The shape of one device's block of this leaf under `component`'s placement."""
        if self.dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.dim] //= layout.size(layout.axes(component))
        return tuple(shape)


def shard_dim(shape: Sequence[int], degree: int, stacked: bool) -> int | None:
    """The largest dimension divisible by `degree` (never a stacked-layer dimension), or None."""
    if degree == 1:
        return None
    first = 1 if stacked else 0
    best = None
    for dim in range(first, len(shape)):
        if shape[dim] % degree == 0 and (best is None or shape[dim] > shape[best]):
            best = dim
    return best


def leaf_layout(layout: AxisPlan, shape: Sequence[int], stacked: bool) -> LeafLayout:
    """Split of one leaf: every component on the same dimension, smaller groups' axes first."""
    degree = max(layout.size(layout.axes(c)) for c in COMPONENTS)
    dim = shard_dim(shape, degree, stacked)
    specs = {}
    for comp in COMPONENTS:
        axes = layout.axes(comp) if dim is not None else ()
        entries: list[object] = [None] * len(shape)
        if axes:
            entries[dim] = axes if len(axes) > 1 else axes[0]
        specs[comp] = P(*entries)
    return LeafLayout(tuple(shape), dim, specs)


def batch_spec(layout: Layout, ndim: int) -> P:
    """The batch is split along its first dimension over every device (data parallelism)."""
    axes = layout.all_axes
    return P(axes if len(axes) > 1 else axes[0], *([None] * (ndim - 1)))
