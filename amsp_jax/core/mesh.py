"""One mesh for P, G and OS, and the per-leaf `PartitionSpec`s that put each on its placement.

The mesh's axes are the factors of the nested groups: inter-node axes before intra-node
axes, the replica factor outermost, and the tensor axis (a strategy's `t > 1`) innermost, so each
tensor group is consecutive devices of one node. Each component shards a leaf over a prefix of one axis order
(smaller groups first), so a device's OS block lies inside its G and P blocks and moving between
components is a slice, a reduce-scatter or an all-gather over the extra axes only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from amsp_jax.core.leaf import Leaf
from amsp_jax.core.space import COMPONENTS, Cluster, Strategy
from amsp_jax.core.tensor import TENSOR, TensorRuleError


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

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The data-parallel axes (every axis but the tensor axis), outermost first: what the batch is
        split over and what P, G and OS are placed on."""
        return tuple(name for name in self.all_axes if name != TENSOR)

    @property
    def tensor(self) -> int:
        """The tensor-parallel degree (1: no tensor axis)."""
        return self.strategy.tensor

    @property
    def data_devices(self) -> int:
        """Devices that each see their own part of the batch (the tensor ranks of a group share theirs)."""
        return self.cluster.num_devices // self.tensor

    def axes(self, component: str) -> tuple[str, ...]:
        """The axes `component` is sharded over, in `PartitionSpec` order (major first)."""
        return self.component_axes[component]

    @functools.cached_property
    def _sizes(self) -> dict[str, int]:
        return dict(self.axis_sizes)

    def axis_size(self, axis: str) -> int:
        """Number of devices along one axis."""
        return self._sizes[axis]

    def size(self, axes: Sequence[str]) -> int:
        """Number of devices spanned by `axes`."""
        return math.prod(self.axis_size(a) for a in axes)

    def __hash__(self) -> int:
        # Hashable (equal plans hash equal), so that what a leaf's layout and schedule depend on can key
        # a cache: the planner prices the same leaves under the same axes many times.
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        components = frozenset(self.component_axes.items())
        return hash((self.cluster, self.strategy, self.axis_sizes, components, self.inter_axes))

    def without_devices(self) -> AxisPlan:
        """These axes alone, as a plain `AxisPlan` (a `Layout` less its mesh)."""
        if type(self) is AxisPlan:
            return self
        return AxisPlan(self.cluster, self.strategy, self.axis_sizes, self.component_axes, self.inter_axes)

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

    @property
    def platform(self) -> str:
        """The devices' platform (`cpu`, `gpu`, `cuda`, ...)."""
        return self.mesh.devices.flat[0].platform


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
    data = strategy.data_parallel(cluster)
    intra_axes, intra_cover = _chain([p.intra for p in placements.values()], data.devices_per_node, "intra")
    inter_axes, inter_cover = _chain([p.inter for p in placements.values()], cluster.nodes, "inter")
    axis_sizes = tuple(reversed(inter_axes)) + tuple(reversed(intra_axes))
    if strategy.tensor > 1:
        axis_sizes += ((TENSOR, strategy.tensor),)
    axis_sizes = axis_sizes or (("intra0", 1),)

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
    """How one parameter leaf is split: over one dimension (`dim`), or two (`dim` and `minor_dim`), or
    none (whole everywhere); each component's spec; and the stored shape.

    The largest group's mesh axes, in order, split `dim` and then (the rest of them) `minor_dim`; a
    component with fewer axes uses a prefix of that order, so its block still contains the larger
    groups' blocks. Where no dimension or pair divides, `dim` is padded with zeros at its end up to a
    multiple of the largest group (`padded`): only where the leaf is stored and moved (P, G and OS
    blocks, their collectives); the model, the user's parameters and checkpoints see `shape`.
    """

    leaf: Leaf
    dim: int | None
    specs: dict[str, P]
    padded: tuple[int, ...]
    minor_dim: int | None = None
    axis_dims: tuple[tuple[str, int], ...] = ()  # every axis of the largest group -> the dimension it splits

    tensor: int = 1  # the tensor degree: `leaf.tensor_dim` (if any) is split this many ways first

    @property
    def shape(self) -> tuple[int, ...]:
        """The leaf's full shape."""
        return self.leaf.shape

    @property
    def tensor_dim(self) -> int | None:
        """The dimension the tensor axis splits (None: whole on every tensor rank, or t = 1)."""
        return self.leaf.tensor_dim if self.tensor > 1 else None

    @property
    def rank_padded(self) -> tuple[int, ...]:
        """The stored shape one tensor rank holds (`padded` when t = 1 or the leaf is not tensor-split):
        what the data-parallel placements split and their collectives move."""
        if self.tensor_dim is None:
            return self.padded
        shape = list(self.padded)
        shape[self.tensor_dim] //= self.tensor
        return tuple(shape)

    @property
    def is_padded(self) -> bool:
        """Whether the stored shape is larger than the leaf."""
        return self.padded != self.shape

    def dims_of(self, axes: Sequence[str], offset: int = 0) -> dict[str, int]:
        """The dimension each of `axes` splits (less `offset`: a stacked leaf's per-layer tensors)."""
        dims = dict(self.axis_dims)
        return {a: dims[a] - offset for a in axes}

    def block_shape(self, layout: AxisPlan, component: str) -> tuple[int, ...]:
        """The shape of one device's block of this leaf under `component`'s placement."""
        if self.dim is None:
            return self.rank_padded
        shape = list(self.rank_padded)
        for axis, dim in self.dims_of(layout.axes(component)).items():
            shape[dim] //= layout.axis_size(axis)
        return tuple(shape)


def padded_size(size: int, degree: int) -> int:
    """`size` rounded up to a multiple of `degree`."""
    return -(-size // degree) * degree


def shard_dims(
    shape: Sequence[int], degree: int, stacked: bool, intra: int = 1, major_first: bool = True
) -> tuple[int | None, int | None]:
    """Where to split a leaf `degree` ways (never on a stacked-layer dimension): (dim, minor dim or None);
    dim None when there is nothing to split. `intra` is the part of `degree` inside a node.

    One dimension that divides: the most major one (`major_first`), else the largest; else two, the
    node's devices splitting one and the nodes the other (so the collectives of each level stay on one
    dimension); else the one dimension that needs the fewest padded elements. Major first because a
    gather along a layer's major dimension lands the pieces contiguously: along another one XLA:GPU
    transposes the whole stacked block once, before the layer loops, and keeps the copy (LLaMA-30B with
    P over two devices at 1,024 A100s: two 6.7 GiB copies of the ffn up-projections, 86.6 GiB compiled
    against 76.3 split the major way). The largest where the optimizer's update communicates on the
    leaf (Muon, factored Adafactor): its collectives depend on the split, and on LLaMA-7B's matrices
    split the largest way Muon moves 125 GB per device and step under AMSP's placement, 166 GB split
    the major way (`benchmarks/optimizer_update.py`).
    """
    first = 1 if stacked else 0
    dims = range(first, len(shape))
    if degree == 1 or not dims:
        return None, None
    divisible = [d for d in dims if shape[d] % degree == 0]
    if divisible:
        return (divisible[0] if major_first else max(divisible, key=lambda d: (shape[d], -d))), None
    inter = degree // intra
    pairs = [(d, e) for d in dims for e in dims if d != e and shape[d] % intra == 0 and shape[e] % inter == 0]
    if intra > 1 and inter > 1 and pairs:
        return max(pairs, key=lambda pair: (shape[pair[0]], shape[pair[1]], -pair[0], -pair[1]))
    size = math.prod(shape)

    def padding(dim: int) -> int:
        return (padded_size(shape[dim], degree) - shape[dim]) * (size // shape[dim] if shape[dim] else 0)

    return min(dims, key=lambda dim: (padding(dim), -shape[dim], dim)), None


def leaf_layout(layout: AxisPlan, leaf: Leaf, major_first: bool = True) -> LeafLayout:
    """Split of one leaf: every component on the same dimension(s), smaller groups' axes first (a prefix
    of the largest group's), padded to the largest group where nothing divides (`shard_dims`)."""
    return _leaf_layout(layout.without_devices(), leaf, major_first)


@functools.lru_cache(maxsize=1 << 14)
def _leaf_layout(layout: AxisPlan, leaf: Leaf, major_first: bool) -> LeafLayout:
    # Every component's axes are a prefix of the largest group's, whose intra-node axes come first.
    order = max((layout.axes(c) for c in COMPONENTS), key=len)
    tensor_dim = leaf.tensor_dim if layout.tensor > 1 else None
    shape = leaf.local_shape(layout.tensor)  # one tensor rank's part, which the data axes split
    if tensor_dim is not None and leaf.shape[tensor_dim] % layout.tensor:
        raise TensorRuleError(
            f"parameter {leaf.name} has {leaf.shape[tensor_dim]} elements on dimension {tensor_dim}, "
            f"which the tensor axis splits, and t={layout.tensor} does not divide them; pick a t that "
            "does, or map that dimension's logical name to None in the tensor rules"
        )
    intra_axes = [a for a in order if not layout.is_inter(a)]
    dim, minor_dim = shard_dims(shape, layout.size(order), leaf.stacked, layout.size(intra_axes), major_first)
    axis_dims = (
        tuple((a, minor_dim if minor_dim is not None and layout.is_inter(a) else dim) for a in order)
        if dim is not None
        else ()
    )
    specs = {}
    for comp in COMPONENTS:
        entries: list[object] = [None] * len(shape)
        by_dim: dict[int, list[str]] = {}
        for axis, d in dict(axis_dims).items():
            if axis in layout.axes(comp):
                by_dim.setdefault(d, []).append(axis)
        if tensor_dim is not None:  # the tensor axis is the major split of its dimension
            by_dim[tensor_dim] = [TENSOR, *by_dim.get(tensor_dim, [])]
        for d, axes in by_dim.items():
            entries[d] = tuple(axes) if len(axes) > 1 else axes[0]
        specs[comp] = P(*entries)
    padded = list(shape)
    if dim is not None and minor_dim is None:
        padded[dim] = padded_size(shape[dim], layout.size(order))
        if dim == tensor_dim and padded[dim] != shape[dim]:
            # Padding a tensor rank's part would interleave zeros into the stored leaf.
            raise TensorRuleError(
                f"parameter {leaf.name}: no dimension of one tensor rank's part {shape} divides by the "
                f"{layout.size(order)} devices of the largest data-parallel group, and the one to pad is "
                "the tensor-split one; choose placements whose group divides one of its dimensions"
            )
    if tensor_dim is not None:
        padded[tensor_dim] *= layout.tensor
    return LeafLayout(leaf, dim, specs, tuple(padded), minor_dim, axis_dims, layout.tensor)


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
    """The batch is split along its first dimension over the data-parallel axes (every device of a
    tensor group sees the same examples)."""
    axes = layout.data_axes
    return P(axes if len(axes) > 1 else axes[0], *([None] * (ndim - 1)))
