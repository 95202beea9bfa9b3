"""The step's operations per leaf: the one place where the step's rules live.

A `Schedule` lists, for every parameter leaf, each collective the step issues: its kind, the mesh
axes of the group, the dimension it splits or joins, the element count and dtype of its input on one
device, how many times it runs per step and in which phase. `amsp_jax.step` executes these ops
(`amsp_jax.step.collectives.execute`), `amsp_jax.cost` counts and prices them, and
`amsp_jax.compiled.audit` checks the compiled program against them. The rules live here only:

  - `uses_prefetch`, `accumulates` / `grad_dtype`, `keeps_first_layer`, `params_from_master`: the
    step-wide choices (prefetching, the fp32 G accumulator, a kept first layer, a stored P);
  - how a collective over axes that span nodes is issued (`Implementation.hierarchical`): split into
    runs of intra- and inter-node axes (a reduce-scatter intra first, an all-gather inter first, an
    all-reduce as reduce-scatter / all-reduce / all-gather), or flat over the whole group;
  - the G→OS reduction and the P refresh, by how the groups of G, OS and P nest;
  - how often each phase runs (per layer and micro-batch, once per step, hoisted out of the
    micro-batch loop) and the bytes a device sends in each op (ring convention);
  - `launches`: how many collectives XLA issues for the ops, merging those that run together.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence

from amsp_jax.core import groups
from amsp_jax.core.backend import combine_thresholds
from amsp_jax.core.leaf import Leaf
from amsp_jax.core.mesh import AxisPlan, LeafLayout, leaf_layout
from amsp_jax.core.space import Strategy

FORWARD_GATHER = "P gather, layers (forward)"
BACKWARD_GATHER = "P re-gather, layers (backward)"
OTHER_GATHER = "P gather, other leaves (once per step)"
GRAD_REDUCE = "G reduce-scatter (per micro-batch)"
REDUCTION = "G to OS reduction (once per step)"
REFRESH = "P refresh (once per step)"
# Not issued by the step: what XLA inserts into the optimizer's update (`amsp_jax.cost.optimizer`).
UPDATE = "optimizer update (once per step)"
PHASES = (FORWARD_GATHER, BACKWARD_GATHER, OTHER_GATHER, GRAD_REDUCE, REDUCTION, REFRESH, UPDATE)

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all-gather", "reduce-scatter", "all-reduce"
COLLECTIVE_PERMUTE = "collective-permute"  # only XLA's, in the optimizer's update

# XLA unrolls one- and two-trip loops and then merges the forward and backward gathers of a peeled
# layer (keeping it gathered), so short stacks stay on the checkpointed scan.
MIN_PREFETCH_LAYERS = 4


def uses_prefetch(
    micro_batches: int, remat: str, layers: int, prefetch: bool | None = None, stack: bool = True
) -> bool:
    """Whether `layers` layers gather one layer ahead: a `LayerStack` runs the explicit-prefetch loop
    (else the checkpointed scan), a loop of blocks chains each block's gather to the previous block.

    A stack runs the checkpointed scan unless `prefetch=True` asks for the loop, since XLA's collective
    pipeliner already moves the scan's next gather ahead (with less memory than the loop); a loop of
    blocks (straight-line code, no pipeliner) chains by default. Either needs one micro-batch and full
    remat (in a micro-batch loop XLA hoists the first gathers out). `prefetch=False` turns both off.
    """
    if prefetch is False or (stack and prefetch is not True):
        return False
    return remat == "full" and micro_batches == 1 and layers >= MIN_PREFETCH_LAYERS


def accumulates(micro_batches: int) -> bool:
    """Whether the step keeps an fp32 G accumulator: with one micro-batch the gradient is the sum."""
    return micro_batches > 1


def grad_dtype(micro_batches: int, reduce_dtype: str) -> str:
    """The dtype of the G block a device holds: fp32 when micro-batches accumulate into it; with one
    micro-batch the gradient reduce-scatter's output is the gradient, kept in its own (e.g. bf16) dtype,
    which halves G's memory and loses nothing (a wider copy of a bf16 sum holds no more)."""
    return "float32" if accumulates(micro_batches) else reduce_dtype


def keeps_first_layer(micro_batches: int, layers: int, implementation: Implementation) -> bool:
    """Whether a `LayerStack` of `layers` layers keeps its first layer gathered across the micro-batches.

    XLA's pipeliner peels a layer loop's first gather and last reduce-scatter to where the micro-batch
    starts and ends, with no compute beside them; kept, the first layer is gathered once per step and
    its gradient summed in fp32 and reduce-scattered once, at the cost of the gathered layer and an fp32
    copy for the whole step (`amsp_jax.cost.device_memory.memory`): a choice, off by default.
    """
    return implementation.keep_first_layer and micro_batches > 1 and layers > 1


def params_from_master(strategy: Strategy) -> bool:
    """Whether P is cast from the master where the step uses it instead of being stored: where P and OS
    have one placement (so one set of mesh axes), a device's P block is its master block in the compute
    dtype, and a stored copy would only repeat it (2 bytes per parameter and device in mixed precision,
    4 in fp32)."""
    return strategy.params == strategy.opt_state


@dataclasses.dataclass(frozen=True)
class Implementation:
    """How the step issues its collectives; the planner may choose these."""

    hierarchical: bool = True
    prefetch: bool | None = None
    keep_first_layer: bool = False  # `keeps_first_layer`


@dataclasses.dataclass(frozen=True)
class Op:
    """One collective as the step issues it, on one device.

    `elements` counts this device's input (an all-gather's block; a reduce-scatter's or all-reduce's
    full buffer). `dim`: the dimension split or joined (of one layer's tensor in a stack's per-layer
    phases); None: the flattened buffer. `unit`: the stack or block the per-layer op runs with (None:
    with every leaf of its phase; `launches` merges by it). `feeds`: a stage of a chain whose result is
    the next collective's input, not a value the step uses.
    """

    phase: str
    kind: str
    axes: tuple[str, ...]
    group: int
    nodes: int
    level: str
    dim: int | None
    elements: int
    itemsize: int
    executions: int
    unit: tuple[str, ...] | None = None
    feeds: bool = False

    def bytes_sent(self, min_itemsize: int = 1) -> int:
        """Bytes this device sends in one execution (nccl-tests ring convention)."""
        size = self.elements * max(self.itemsize, min_itemsize)
        if self.kind == COLLECTIVE_PERMUTE:  # one buffer to one other device
            return size
        if self.kind == ALL_GATHER:
            return (self.group - 1) * size
        factor = 2 if self.kind == ALL_REDUCE else 1
        return -(-factor * (self.group - 1) * size // self.group)

    @property
    def result_bytes(self) -> int:
        """Bytes of one execution's result on a device: what XLA's combiners compare with their threshold."""
        size = self.elements * self.itemsize
        if self.kind == ALL_GATHER:
            return size * self.group
        return size // self.group if self.kind == REDUCE_SCATTER else size


# The dimension a collective splits or joins: one for every axis, or each axis its own (two-dimension splits).
Dims = int | Mapping[str, int]


def chained(ops: list[Op]) -> list[Op]:
    """The stages of one collective chain, each but the last marked as feeding the next."""
    return [dataclasses.replace(op, feeds=True) for op in ops[:-1]] + ops[-1:]


@dataclasses.dataclass(frozen=True)
class _Builder:
    axes: AxisPlan
    hierarchical: bool
    unit: tuple[str, ...] | None = None

    def op(
        self, phase: str, kind: str, group_axes: Sequence[str], dim: int | None, elements: int,
        itemsize: int, executions: int,
    ) -> Op:  # fmt: skip
        group_axes = tuple(group_axes)
        group, nodes, level = groups.shape(self.axes.without_devices(), group_axes)
        return Op(
            phase, kind, group_axes, group, nodes, level, dim, elements, itemsize, executions, self.unit
        )  # fmt: skip

    def pieces(self, group_axes: Sequence[str], dims: Dims) -> tuple[tuple[tuple[str, ...], int], ...]:
        """`group_axes` in runs that one collective can take, with the dimension each splits: a leaf
        split over two dimensions needs one per dimension; hierarchical, one per level too."""
        group_axes = tuple(group_axes)
        per_axis = tuple(dims if isinstance(dims, int) else dims[a] for a in group_axes)
        return groups.runs(self.axes.without_devices(), self.hierarchical, group_axes, per_axis)

    def all_gather(
        self, phase: str, group_axes: Sequence[str], dims: Dims, block: int, itemsize: int, executions: int
    ) -> list[Op]:
        """Gather over `group_axes` (major first): the minor run first, so nodes exchange the small piece."""
        ops, elements = [], block
        for run, dim in reversed(self.pieces(group_axes, dims)):
            ops.append(self.op(phase, ALL_GATHER, run, dim, elements, itemsize, executions))
            elements *= self.axes.size(run)
        return chained(ops)

    def reduce_scatter(
        self, phase: str, group_axes: Sequence[str], dims: Dims, full: int, itemsize: int, executions: int
    ) -> list[Op]:
        """Reduce-scatter over `group_axes` (major first): the major run first, intra-node by layout."""
        ops, elements = [], full
        for run, dim in self.pieces(group_axes, dims):
            ops.append(self.op(phase, REDUCE_SCATTER, run, dim, elements, itemsize, executions))
            elements //= self.axes.size(run)
        return chained(ops)

    def all_reduce(
        self, phase: str, group_axes: Sequence[str], elements: int, itemsize: int, executions: int
    ) -> list[Op]:
        """Sum over `group_axes`; across nodes as intra reduce-scatter, inter all-reduce, intra all-gather
        when hierarchical and the buffer splits over the node's devices."""
        if not group_axes:
            return []
        intra = tuple(a for a in group_axes if not self.axes.is_inter(a))
        inter = tuple(a for a in group_axes if self.axes.is_inter(a))
        if not (self.hierarchical and intra and inter and elements % self.axes.size(intra) == 0):
            return [self.op(phase, ALL_REDUCE, group_axes, None, elements, itemsize, executions)]
        piece = elements // self.axes.size(intra)
        return chained([
            self.op(phase, REDUCE_SCATTER, intra, None, elements, itemsize, executions),
            self.op(phase, ALL_REDUCE, inter, None, piece, itemsize, executions),
            self.op(phase, ALL_GATHER, intra, None, piece, itemsize, executions),
        ])


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The step-wide choices every leaf's ops follow: micro-batches, remat, the bytes per element of P
    and of the gradient reduction, and how collectives are issued."""

    micro_batches: int
    remat: str
    param_itemsize: int
    reduce_itemsize: int
    implementation: Implementation = Implementation()


@dataclasses.dataclass(frozen=True)
class LeafSchedule:
    """Every collective one parameter leaf takes part in, by what the step does with it; `split.leaf`
    is the leaf."""

    split: LeafLayout
    gather: tuple[Op, ...] = ()
    regather: tuple[Op, ...] = ()
    grad_reduce: tuple[Op, ...] = ()
    reduction: tuple[Op, ...] = ()
    refresh: tuple[Op, ...] = ()
    refresh_slice: tuple[str, ...] = ()
    # Whether the first layer is kept (`keeps_first_layer`); then its collectives, those of `gather`
    # and `grad_reduce` once per step (the gather with the other leaves', the reduce-scatter after the
    # micro-batches), and the other ops count the loop's layers only.
    keeps_first_layer: bool = False
    first_gather: tuple[Op, ...] = ()
    first_reduce: tuple[Op, ...] = ()

    @property
    def leaf(self) -> Leaf:
        """The leaf these ops are of."""
        return self.split.leaf

    @property
    def stacked(self) -> bool:
        """Whether the leaf has a leading layer dimension."""
        return self.leaf.stacked

    @property
    def frozen(self) -> bool:
        """Whether the leaf is not trained: gathered, never reduced or refreshed."""
        return self.leaf.frozen

    @property
    def per_layer(self) -> bool:
        """Whether the leaf is gathered per layer (a stack's or a block's leaf), else once per step."""
        return self.leaf.gathered_per_layer and self.split.dim is not None

    @property
    def layers(self) -> int:
        """Layers of a stacked leaf (1 otherwise)."""
        return self.leaf.layers

    @property
    def gathered_shape(self) -> tuple[int, ...]:
        """The shape the model sees of one gather: the leaf, or one layer of a stacked leaf."""
        return self.split.leaf.local_shape(self.split.tensor)[int(self.stacked) :]

    @property
    def gathered_padded(self) -> tuple[int, ...]:
        """The stored shape of one gather (what the collectives move)."""
        return self.split.rank_padded[int(self.stacked) :]

    def ops(self) -> tuple[Op, ...]:
        """Every op of this leaf in one step, in step order. A frozen leaf's `refresh` runs only where a
        state is built (init, restore), never in the step."""
        refresh = () if self.frozen else self.refresh
        return (
            self.first_gather + self.gather + self.regather + self.grad_reduce + self.first_reduce
            + self.reduction + refresh
        )  # fmt: skip


def leaf_schedule(
    axes: AxisPlan, leaf: Leaf, settings: StepSettings, major_first: bool = True
) -> LeafSchedule:
    """The collectives the step runs for one leaf, with their executions per step.

    A leaf of a layer (`Leaf.gathered_per_layer`) is gathered per layer and micro-batch in the forward
    pass and again in the backward pass (unless remat is `none`, or the backward never reads it:
    `regathered=False`), and its gradient reduce-scattered per layer and micro-batch; another leaf's
    gather is hoisted out of the micro-batch loop (once per step), its gradient reduce-scattered per
    micro-batch. Once per step the G→OS reduction and the P refresh run. A `frozen` leaf is gathered
    but never reduced or refreshed. `major_first`: how the leaf is split (`mesh.shard_dims`).
    """
    kept_first = bool(leaf.gathered_per_layer and leaf.stacked and leaf.layer_stack) and keeps_first_layer(
        settings.micro_batches, leaf.layers, settings.implementation
    )
    # Cached by what the ops read: the axes (no devices), the settings less the prefetch choice (when
    # gathers are issued, `Schedule.prefetches`) and the kept first layer's, decided here.
    issue = dataclasses.replace(settings.implementation, prefetch=None, keep_first_layer=False)
    key = dataclasses.replace(settings, implementation=issue)
    return _leaf_schedule(axes.without_devices(), leaf, key, major_first, kept_first)


@functools.lru_cache(maxsize=1 << 14)
def _leaf_schedule(
    axes: AxisPlan, leaf: Leaf, settings: StepSettings, major_first: bool, kept_first: bool
) -> LeafSchedule:
    split = leaf_layout(axes, leaf, major_first)
    build = _Builder(axes, settings.implementation.hierarchical)
    size = math.prod(split.rank_padded)  # what moves is the stored (padded) leaf
    if split.dim is None:
        # A leaf with nothing to split (a scalar) stays whole everywhere: only its gradient is summed.
        summed = build.all_reduce(REDUCTION, axes.data_axes, size, settings.reduce_itemsize, 1)
        reduction = () if leaf.frozen else tuple(summed)
        return LeafSchedule(split, reduction=reduction, keeps_first_layer=kept_first)
    gather, regather, grad_reduce = _layer_ops(axes, split, settings, kept_first)
    reduction = () if leaf.frozen else _reduction(build, split, settings.reduce_itemsize)
    refresh, refresh_slice = _refresh(build, split, settings.param_itemsize)
    first_gather: tuple[Op, ...] = ()
    first_reduce: tuple[Op, ...] = ()
    if kept_first:
        first_gather = tuple(
            dataclasses.replace(op, phase=OTHER_GATHER, executions=1, unit=None) for op in gather
        )
        first_reduce = tuple(dataclasses.replace(op, executions=1, unit=None) for op in grad_reduce)
    return LeafSchedule(
        split, gather, regather, grad_reduce, reduction, refresh, refresh_slice, kept_first, first_gather,
        first_reduce,
    )  # fmt: skip


def _layer_ops(
    axes: AxisPlan, split: LeafLayout, settings: StepSettings, kept_first: bool
) -> tuple[tuple[Op, ...], tuple[Op, ...], tuple[Op, ...]]:
    """A leaf's gathers (forward, backward) and gradient reduce-scatters: per layer and micro-batch for
    a leaf of a layer, else the gather once per step and the reduce-scatter per micro-batch."""
    leaf = split.leaf
    build = _Builder(axes, settings.implementation.hierarchical)
    p_axes, g_axes = axes.axes("params"), axes.axes("grads")
    layer_size = math.prod(split.rank_padded) // leaf.layers
    p_block = layer_size // axes.size(p_axes)
    dim = split.dims_of(tuple(a for a, _ in split.axis_dims), int(leaf.stacked))
    per_micro_batch = (leaf.layers - kept_first) * settings.micro_batches
    itemsize = settings.param_itemsize
    if leaf.gathered_per_layer:
        layer_build = dataclasses.replace(build, unit=leaf.unit or leaf.path)
        gather = layer_build.all_gather(FORWARD_GATHER, p_axes, dim, p_block, itemsize, per_micro_batch)
        regather = (
            layer_build.all_gather(BACKWARD_GATHER, p_axes, dim, p_block, itemsize, per_micro_batch)
            if settings.remat != "none" and leaf.regathered
            else []
        )
    else:
        layer_build = build
        gather, regather = build.all_gather(OTHER_GATHER, p_axes, dim, p_block, itemsize, 1), []
    # A loop of blocks is straight-line code, so XLA merges its blocks' gradient reduce-scatters with
    # each other and the other leaves' (up to the threshold); a stack's run once per loop iteration.
    grad_build = layer_build if leaf.stacked else build
    grad_reduce = (
        []
        if leaf.frozen
        else grad_build.reduce_scatter(
            GRAD_REDUCE, g_axes, dim, layer_size, settings.reduce_itemsize, per_micro_batch
        )
    )
    return tuple(gather), tuple(regather), tuple(grad_reduce)


def _reduction(build: _Builder, split: LeafLayout, itemsize: int) -> tuple[Op, ...]:
    """The once-per-step G→OS reduction of a leaf, by how G's and OS's groups nest."""
    axes = build.axes
    g_axes, o_axes, all_axes = axes.axes("grads"), axes.axes("opt_state"), axes.data_axes
    size = math.prod(split.rank_padded)
    g_block, o_block = size // axes.size(g_axes), size // axes.size(o_axes)
    leaf_dims = split.dims_of(tuple(a for a, _ in split.axis_dims))
    if set(g_axes) <= set(o_axes):
        # OS is finer than G: scatter over the axes OS adds, then sum over its replicas (MiCS' 2 hops).
        extra = [a for a in o_axes if a not in g_axes]
        ops = build.reduce_scatter(REDUCTION, extra, leaf_dims, g_block, itemsize, 1)
        ops += build.all_reduce(REDUCTION, [a for a in all_axes if a not in o_axes], o_block, itemsize, 1)
        return tuple(ops)
    # G is finer than OS: sum over G's replicas, then gather the axes G has beyond OS.
    ops = build.all_reduce(REDUCTION, [a for a in all_axes if a not in g_axes], g_block, itemsize, 1)
    extra = [a for a in g_axes if a not in o_axes]
    ops += build.all_gather(REDUCTION, extra, leaf_dims, g_block, itemsize, 1)
    return tuple(ops)


def _refresh(build: _Builder, split: LeafLayout, itemsize: int) -> tuple[tuple[Op, ...], tuple[str, ...]]:
    """The once-per-step P refresh from OS: a gather of the axes P lacks, or a slice of those it adds."""
    axes = build.axes
    p_axes, o_axes = axes.axes("params"), axes.axes("opt_state")
    if set(p_axes) <= set(o_axes):
        extra = [a for a in o_axes if a not in p_axes]
        o_block = math.prod(split.rank_padded) // axes.size(o_axes)
        leaf_dims = split.dims_of(tuple(a for a, _ in split.axis_dims))
        return tuple(build.all_gather(REFRESH, extra, leaf_dims, o_block, itemsize, 1)), ()
    return (), tuple(a for a in p_axes if a not in o_axes)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One step's operations: every leaf's ops, and the step-wide choices they follow."""

    leaves: dict[tuple[str, ...], LeafSchedule]
    micro_batches: int
    remat: str
    implementation: Implementation
    params_from_master: bool = False  # P is not stored: the step casts the master (`params_from_master`)

    @property
    def accumulates(self) -> bool:
        """Whether the step keeps an fp32 G accumulator."""
        return accumulates(self.micro_batches)

    def prefetches(self, layers: int, stack: bool = True) -> bool:
        """Whether a stack (or a loop of blocks) of `layers` gathers one layer ahead (`uses_prefetch`)."""
        return uses_prefetch(self.micro_batches, self.remat, layers, self.implementation.prefetch, stack)

    def ops(self) -> list[Op]:
        """Every op of the step."""
        return [op for leaf in self.leaves.values() for op in leaf.ops()]


def launches(ops: Iterable[tuple[int, Op]], platform: str, layer_bytes: int) -> int:
    """Collectives XLA issues per step for `ops` (each `(copies, op)`) on `platform`.

    XLA's combiners merge independent collectives of one kind over one group of devices that become
    ready together, up to a size (`backend.combine_thresholds`): here, the ops of one phase, kind and
    group shape (devices, nodes) with the same executions and layer group (`Op.unit`): one layer's
    gathers (or gradient reduce-scatters) per layer and micro-batch, the other leaves' together, a
    once-per-step phase's together. Groups are told apart by shape, not by mesh axes, so that the
    planner's placements priced one by one (`amsp_jax.planner.terms`, on meshes of fewer axes) issue as
    many as the whole strategy; two groups of one shape over different axes of one mesh (a leaf split
    along two dimensions beside one split along one) count as one. A kind the platform does not merge
    is issued once per op.
    """
    thresholds = combine_thresholds(platform, layer_bytes)
    merged: dict[tuple[object, ...], tuple[Op, list[int]]] = {}
    total = 0
    for copies, op in ops:
        if op.kind not in thresholds:
            total += copies * op.executions
            continue
        key = (op.phase, op.kind, op.group, op.nodes, op.unit, op.executions)
        merged.setdefault(key, (op, []))[1].extend([op.result_bytes] * copies)
    return total + sum(op.executions * _packed(sizes, thresholds[op.kind]) for op, sizes in merged.values())


def _packed(sizes: list[int], threshold: float) -> int:
    """Collectives XLA's combiner makes of ops of `sizes`, in order: each joins the open one while the
    sum stays within `threshold`, else starts the next; an op above the threshold goes alone and leaves
    the open one open."""
    alone = sum(size > threshold for size in sizes)
    merged, open_bytes = 0, 0.0
    for size in sizes:
        if size > threshold:
            continue
        if merged == 0 or open_bytes + size > threshold:
            merged, open_bytes = merged + 1, 0.0
        open_bytes += size
    return alone + merged


def largest_gather_bytes(layers: Iterable[tuple[tuple[str, ...] | None, int]], itemsize: int) -> int:
    """Bytes of the step's largest single gather from `(unit, stored elements of one layer)` per leaf: one
    layer of a stack or block, or every other leaf (unit None) together; XLA's combine threshold."""
    per_unit: dict[tuple[str, ...] | None, int] = {}
    for unit, elements in layers:
        per_unit[unit] = per_unit.get(unit, 0) + elements * itemsize
    return max(per_unit.values(), default=0)


def build(
    axes: AxisPlan, leaves: Iterable[Leaf], settings: StepSettings, split_largest: frozenset = frozenset()
) -> Schedule:
    """The schedule of a step over `leaves`; those in `split_largest` (paths) are split along their
    largest dimension rather than the most major one (`mesh.shard_dims`)."""
    scheduled = {
        leaf.path: leaf_schedule(axes, leaf, settings, leaf.path not in split_largest) for leaf in leaves
    }
    return Schedule(
        scheduled, settings.micro_batches, settings.remat, settings.implementation,
        params_from_master(axes.strategy),
    )  # fmt: skip
