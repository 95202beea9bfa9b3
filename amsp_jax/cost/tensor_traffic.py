"""The bytes of tensor parallelism: the collectives of each boundary a forward pass crosses
(`amsp_jax.layers.tensor.Boundary`), in the forward pass, again where remat recomputes a layer, and in
the backward pass.

Per boundary, with t devices in the tensor group and `whole` the elements of the activation at it:

| boundary | sequence parallel: forward, backward | without: forward, backward |
|---|---|---|
| column input | all-gather of whole/t, reduce-scatter of whole | -, all-reduce of whole |
| row output | reduce-scatter of whole, all-gather of whole/t | all-reduce of whole, - |
| vocabulary gather | all-gather of whole/t, - (each rank keeps its slice) | the same |
| column matmul (ring) | t - 1 collective-permutes of whole/t, the same | (needs sequence parallelism) |
| row matmul (ring) | t - 1 collective-permutes of whole/t, the same | (needs sequence parallelism) |
| matmul (cannon) | collective-permutes of blocks (`tensor_cannon.shifts`) | (needs sequence parallelism) |

The ring form (`layers.tensor_ring`, `Plan(..., tensor_matmul="ring")`) passes one sequence block per
step: forward the input's blocks (column) or the running sums (row), backward the input gradient's
running sums (column) or the output gradient's blocks (row); the column form keeps the blocks it
received, so its weight gradient needs no third ring. Projections of one input share its ring.
A layer's last ring, recomputed under remat for a sum nothing reads, is dropped on every backend.
The cannon form (t = 4, `layers.tensor_cannon`) moves each matmul's input, kernel and output between
pairs of ranks, into and out of the 2 x 2 square (boundary phases) and on it (`SQUARE_FORWARD`,
`SQUARE_BACKWARD`); a layer's last row matmul, recomputed under remat, drops only its exchange out.
Outside the layers a kernel's own moves are hoisted out of the micro-batch loop on XLA:CPU
(`backend.hoists_loop_invariant_permutes`).

A layer's forward collectives run once more in its backward pass under remat (`dots` or `full`: a
gathered or summed activation is not a matmul output, so it is recomputed, not saved); where the
backend drops collectives whose result nothing reads (`backend.drops_unused_collective`), all but the
layer's last row output, whose sum only becomes the layer's output, which no backward step reads. Each
layer of a stack crosses the boundaries its code crosses; every micro-batch crosses them all.

Besides the boundaries, a weight whole on every tensor rank (a norm's scale, a row-parallel bias) has
its OS-placed gradient summed over the tensor group once per step (`step.gradients`).

These bytes are in the audit's prediction; the time model prices them on the critical path
(`timing.tensor_seconds`), which is how the planner weighs a tensor degree.
"""

from __future__ import annotations

import math

from amsp_jax.core.backend import drops_unused_collective, hoists_loop_invariant_permutes
from amsp_jax.core.mesh import AxisPlan, leaf_layout
from amsp_jax.core.schedule import (
    ALL_REDUCE,
    COLLECTIVE_PERMUTE,
    REDUCE_SCATTER,
    REDUCTION,
    Implementation,
    Op,
    _Builder,
)
from amsp_jax.core.tensor import TENSOR
from amsp_jax.cost.traffic import Transfer, issued, largest_gather_bytes
from amsp_jax.cost.workload import Workload
from amsp_jax.layers.tensor import (
    COLUMN,
    COLUMN_CANNON,
    COLUMN_RING,
    ROW,
    ROW_CANNON,
    ROW_RING,
    VOCAB,
    matmul_form,
)
from amsp_jax.layers.tensor_cannon import SIDE, shifts

TENSOR_FORWARD = "tensor boundaries (forward, remat)"
TENSOR_BACKWARD = "tensor boundaries (backward)"
# The cannon form's shifts on the square, each beside a block product (its exchanges into and out of
# the square are boundaries).
SQUARE_FORWARD = "tensor square shifts (forward, remat)"
SQUARE_BACKWARD = "tensor square shifts (backward)"


def tensor_ops(axes: AxisPlan, workload: Workload) -> list[Op]:
    """Every collective over the tensor axis in one step, with its executions."""
    if axes.tensor == 1 or not workload.boundaries:
        return []
    layers = {leaf.unit: leaf.layers for leaf in workload.leaves if leaf.unit is not None and leaf.stacked}
    build = _Builder(axes, Implementation().hierarchical)
    group, sp = (TENSOR,), workload.sequence_parallel
    last = {b.unit: i for i, b in enumerate(workload.boundaries)}  # each unit's last boundary
    hoisted = hoists_loop_invariant_permutes(workload.platform)
    ops: list[Op] = []
    sums = REDUCE_SCATTER if sp else ALL_REDUCE  # the gather form's row output
    for i, b in enumerate(workload.boundaries):
        runs = layers.get(b.unit, 1) * workload.micro_batches
        # XLA:CPU and XLA:GPU both drop a ring whose sum nothing reads (a GPU reduce-scatter stays).
        dropped = b.kind == ROW_RING or (b.kind == ROW and drops_unused_collective(workload.platform, sums))
        layer_output = last[b.unit] == i and dropped
        forward = runs * (2 if b.unit is not None and workload.remat != "none" and not layer_output else 1)
        shard = b.elements // axes.tensor
        if b.kind in (COLUMN_CANNON, ROW_CANNON):
            column = b.kind == COLUMN_CANNON
            moves = shifts(
                column, b.elements, b.kernels, b.outputs, b.itemsize, b.kernel_itemsize, b.input_moved
            )
            out_runs = runs if b.kind == ROW_CANNON and last[b.unit] == i else forward
            for phase, sizes, runs_in in (
                (TENSOR_FORWARD, moves.into, forward), (SQUARE_FORWARD, moves.square, forward),
                (TENSOR_FORWARD, moves.out, out_runs), (SQUARE_BACKWARD, moves.back_square, runs),
                (TENSOR_BACKWARD, moves.back_exchanges, runs),
            ):  # fmt: skip
                for elements, itemsize, kernel_alone in sizes:
                    # Outside the layers a kernel's own moves are the same for every micro-batch.
                    once = kernel_alone and b.unit is None and hoisted
                    executions = runs_in // workload.micro_batches if once else runs_in
                    ops.append(build.op(phase, COLLECTIVE_PERMUTE, group, 1, elements, itemsize, executions))
        if b.kind in (COLUMN_RING, ROW_RING):
            steps = axes.tensor - 1  # one block passed on per step of the ring, in each pass
            for phase, runs_in in ((TENSOR_FORWARD, forward), (TENSOR_BACKWARD, runs)):
                ops.append(build.op(phase, COLLECTIVE_PERMUTE, group, 1, shard, b.itemsize, steps * runs_in))
        if b.kind == VOCAB or (b.kind == COLUMN and sp):
            ops += build.all_gather(TENSOR_FORWARD, group, 1, shard, b.itemsize, forward)
        if b.kind == COLUMN:
            ops += (
                build.reduce_scatter(TENSOR_BACKWARD, group, 1, b.elements, b.itemsize, runs)
                if sp
                else build.all_reduce(TENSOR_BACKWARD, group, b.elements, b.itemsize, runs)
            )
        if b.kind == ROW and sp:
            ops += build.reduce_scatter(TENSOR_FORWARD, group, 1, b.elements, b.itemsize, forward)
            ops += build.all_gather(TENSOR_BACKWARD, group, 1, shard, b.itemsize, runs)
        elif b.kind == ROW:
            ops += build.all_reduce(TENSOR_FORWARD, group, b.elements, b.itemsize, forward)
    whole = [leaf for leaf in workload.leaves if leaf.tensor_dim is None and not leaf.frozen]
    os_elements = sum(math.prod(leaf_layout(axes, leaf).block_shape(axes, "opt_state")) for leaf in whole)
    ops += build.all_reduce(REDUCTION, group, os_elements, workload.precision.reduce_bytes, 1)
    return ops


def tensor_transfers(axes: AxisPlan, workload: Workload) -> list[Transfer]:
    """`tensor_ops` as per-step transfers, merged as the placements' are (`traffic.issued`)."""
    ops = [(1, op) for op in tensor_ops(axes, workload)]
    return issued(ops, workload, largest_gather_bytes(axes, workload)) if ops else []


def shift_phases(workload: Workload) -> tuple[int, str, str]:
    """(steps, forward phase, backward phase) of the permutes that run beside block products: the
    ring's t steps over the boundaries' phases, or the square's two over its shifts' phases."""
    if matmul_form(workload.boundaries) == "cannon":
        return SIDE, SQUARE_FORWARD, SQUARE_BACKWARD
    return workload.tensor, TENSOR_FORWARD, TENSOR_BACKWARD
