"""The analytic cost model: bytes of every collective phase and memory per device, without compiling.

Bytes come from the step's own `amsp_jax.core.schedule` (the ops the step executes) and from
`amsp_jax.cost.optimizer` (what XLA adds to the optimizer's update of sharded leaves: Muon's
Newton–Schulz, Adafactor's factored statistics), so `amsp_jax.compiled.audit` can require the compiled program
to move exactly the predicted bytes. Byte counts use the nccl-tests
ring convention per device: all-gather and reduce-scatter move (n-1)/n of the larger buffer,
all-reduce 2(n-1)/n. Scalar reductions (the loss, gradient norms) are not model-state traffic and
are left out.

Where bytes travel: a collective over intra-node axes stays on the node's links (NVLink). One whose
group spans nodes is counted as inter-node by the audit (it runs at its slowest link), but a
topology-aware ring (what NCCL builds) enters and leaves each node once per channel, so of the bytes
a device sends in a flat ring over n devices on N nodes only N/n cross the NICs; the rest hop between
devices of the same node. `Transfer.nic_bytes` counts that share; a hierarchical inter-node run
(one device per node in each group) sends all its bytes across the NICs.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable

from amsp_jax.core import schedule
from amsp_jax.core.mesh import AxisPlan, leaf_layout
from amsp_jax.core.schedule import PHASES, LeafSchedule, Op
from amsp_jax.cost.optimizer import update_ops
from amsp_jax.cost.workload import Leaf, Workload


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Bytes one device sends per step in one phase, by collective kind and link level.

    `executions`: collectives issued per step, one op's executions or, merged (`issued`), the
    collectives XLA issues for the ops once its combiners have merged them. `group` and `nodes`
    (devices in the collective's group, nodes they span) are set for a single op and 0 once transfers
    of different groups are merged. `rounded`: bytes of results that feed another collective and
    that a backend running the collective wider than its dtype (XLA:CPU, 16-bit) rounds to that dtype
    in a kernel of their own, reading and writing them (`rounded_bytes`).
    """

    phase: str
    kind: str
    level: str
    bytes: int
    executions: int
    group: int = 0
    nodes: int = 0
    rounded: int = 0

    @property
    def nic_bytes(self) -> int:
        """Of `bytes`, those that cross a node's network interface (topology-aware ring)."""
        if self.level != "inter" or not self.group:
            return 0
        return self.bytes * self.nodes // self.group


def rounded_bytes(op: Op, min_itemsize: int) -> int:
    """Bytes of one execution's result that a backend running collectives at `min_itemsize` or wider
    rounds to the op's narrower dtype in a pass of its own: where the result feeds the next stage of a
    chain. Split into stages, a 16-bit collective on XLA:CPU runs each in fp32 and rounds what passes
    between them to 16 bits (the compiled zero3 step of a 16M LLaMA on 2 x 4 CPU devices: 81.8 MB more
    traffic split than flat, twice the stages' fp32 results); the end result's rounding fuses into the
    kernel that uses it."""
    if not op.feeds or op.itemsize >= min_itemsize:
        return 0
    return op.result_bytes // op.itemsize * min_itemsize


def transfer(op: Op, workload: Workload) -> Transfer:
    """The per-step bytes of one scheduled op."""
    size = op.bytes_sent(workload.min_collective_itemsize) * op.executions
    rounded = rounded_bytes(op, workload.min_collective_itemsize) * op.executions
    return Transfer(op.phase, op.kind, op.level, size, op.executions, op.group, op.nodes, rounded)


def schedule_leaf(axes: AxisPlan, workload: Workload, leaf: Leaf) -> LeafSchedule:
    """The step's ops for one leaf under `workload`'s batching, remat, precision and implementation."""
    settings = schedule.StepSettings(
        workload.micro_batches, workload.remat, workload.precision.param_bytes,
        workload.precision.reduce_bytes, workload.implementation,
    )  # fmt: skip
    return schedule.leaf_schedule(axes, leaf, settings, not workload.optimizer.communicates_on(leaf.path))


def leaf_ops(axes: AxisPlan, workload: Workload, leaf: Leaf) -> list[Op]:
    """The step's ops for one leaf and the collectives XLA adds to the optimizer's update of it."""
    scheduled = schedule_leaf(axes, workload, leaf)
    return [*scheduled.ops(), *update_ops(axes, leaf.path, scheduled.split, workload.optimizer)]


def leaf_transfers(axes: AxisPlan, workload: Workload, leaf: Leaf) -> list[Transfer]:
    """Every collective the step runs for one leaf, with its executions per step."""
    return [transfer(op, workload) for op in leaf_ops(axes, workload, leaf)]


def largest_gather_bytes(axes: AxisPlan, workload: Workload) -> int:
    """The step's largest single gather under `axes`, padding included (`schedule.largest_gather_bytes`:
    what the step gives XLA as its combine threshold)."""

    def stored_layer(leaf: Leaf) -> int:
        split = leaf_layout(axes, leaf, not workload.optimizer.communicates_on(leaf.path))
        return math.prod(split.rank_padded) // (leaf.shape[0] if leaf.stacked else 1)

    return schedule.largest_gather_bytes(
        ((leaf.layer_group, stored_layer(leaf)) for leaf in workload.leaves), workload.precision.param_bytes
    )


def issued(
    ops: Iterable[tuple[int, Op]], workload: Workload, layer_bytes: int, phase: str | None = None
) -> list[Transfer]:
    """`(copies, op)` pairs as transfers by (phase, kind, level, group size, nodes): bytes summed, and
    executions the collectives XLA issues for them (`schedule.launches`, with the step's largest
    gather `layer_bytes`). `phase` names every transfer by one group instead of its ops' phases."""
    merged: dict[tuple[str, str, str, int, int], list[tuple[int, Op]]] = defaultdict(list)
    for copies, op in ops:
        merged[(phase or op.phase, op.kind, op.level, op.group, op.nodes)].append((copies, op))
    found = []
    for (name, kind, level, group, nodes), items in merged.items():
        transfers = [(copies, transfer(op, workload)) for copies, op in items]
        size = sum(copies * t.bytes for copies, t in transfers)
        if size:
            issued_ops = schedule.launches(items, workload.platform, layer_bytes)
            rounded = sum(copies * t.rounded for copies, t in transfers)
            found.append(Transfer(name, kind, level, size, issued_ops, group, nodes, rounded))
    return found


def communication(axes: AxisPlan, workload: Workload) -> list[Transfer]:
    """Per-device bytes of every phase, merged by (phase, kind, level, group size, nodes), with the
    collectives XLA issues for them."""
    order = {p: i for i, p in enumerate(PHASES)}
    ops = [(1, op) for leaf in workload.leaves for op in leaf_ops(axes, workload, leaf)]
    return sorted(
        issued(ops, workload, largest_gather_bytes(axes, workload)),
        key=lambda t: (order[t.phase], t.kind, t.level, t.group, t.nodes),
    )


def bytes_by_kind_and_level(transfers: Iterable[Transfer]) -> dict[str, dict[str, int]]:
    """{kind: {intra, inter}} byte totals."""
    totals: dict[str, dict[str, int]] = {}
    for t in transfers:
        totals.setdefault(t.kind, {"intra": 0, "inter": 0})[t.level] += t.bytes
    return totals


def bytes_by_level(transfers: Iterable[Transfer]) -> dict[str, int]:
    """{intra, inter} byte totals."""
    totals = {"intra": 0, "inter": 0}
    for t in transfers:
        totals[t.level] += t.bytes
    return totals


def link_bytes(axes: AxisPlan, workload: Workload) -> dict[str, int]:
    """Bytes per device and step by the link they travel: node-local links or the node's NICs."""
    transfers = [t for leaf in workload.leaves for t in leaf_transfers(axes, workload, leaf)]
    nic = sum(t.nic_bytes for t in transfers)
    return {"node": sum(t.bytes for t in transfers) - nic, "nic": nic}
