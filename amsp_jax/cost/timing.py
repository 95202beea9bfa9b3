"""The time model: step time, tokens/s and MFU from the cost model's bytes and a cluster's hardware.

Built on `amsp_jax.cost`, never beside it: the bytes of every collective come from `cost.leaf_ops`
(the step's schedule: the same numbers the audit checks against the compiled program), regrouped by
the compute they can hide behind. Each group of ops is priced by its kind, link level, group size and
nodes spanned: `launches × latency(kind, group, nodes) + bytes / busbw(bytes / launches)` (NCCL's ring
latency grows with the ring; see `amsp_jax.cost.hardware`), where `launches` counts the collectives
XLA issues once its combiners have merged the ops that run together (`schedule.launches`: on GPU one
per layer and phase, not one per leaf).

Compute: model FLOPs per token 6Φ + 12·L·H·Q·T (Φ without an untied input embedding, which is
looked up, not multiplied; forward 1/3, backward 2/3) plus what remat runs
again — `full` repeats each layer's forward (2Φ_layers + 4·L·H·Q·T per token); `dots` keeps every
projection's output (`dots_with_no_batch_dims_saveable`) and repeats only the attention matmuls,
whose dot_generals carry batch dimensions (4·L·H·Q·T per token); `none` repeats nothing — each
matmul at the rate the cluster gives the tokens it runs over and its width (`matmul_rates`: peak ×
efficiency unless `amsp-jax profile` measured how much slower a few dozen tokens, or a narrow matrix,
run; a leaf's width is the side of the square as large as one layer's slice of it). Every attention matmul
is counted over the part of the (seq, seq) square the kernel runs (`Workload.attention_square_fraction`:
a flash-style kernel skips the tiles above the diagonal, about half at long sequences), while MFU's
model FLOPs count the whole square.

Overlap, per window (exposed = max(0, communication − compute it hides behind)):
  - forward: each layer's P gather is prefetched behind the previous layer's forward;
  - backward: each layer's P re-gather and gradient reduce-scatter run behind the layer's backward
    (they share the links, so their times add);
  - other leaves: the per-micro-batch reduce-scatter of the embedding/head/norm gradients runs behind
    those leaves' own forward and backward;
  - step start: the P refresh of the last step and the once-per-step gather of the other leaves run
    behind the first micro-batch's forward (contention with that forward's layer gathers ignored);
  - reduction: the once-per-step G→OS reduction overlaps a fraction (the cluster's
    `overlap.reduction_fraction`) of the last micro-batch's backward: its buckets become ready one
    layer at a time while the per-layer traffic of that backward shares the links;
  - optimizer update: what XLA inserts into the update (`amsp_jax.cost.optimizer`, e.g. Muon's
    Newton–Schulz on split matrices) is exposed: the update needs it before it can finish.
Overlapped communication is not free: its kernels take SMs and HBM bandwidth from the compute they
run beside, so a window costs at least the cluster's `overlap.interference` × its communication.
Since every layer is alike, the per-layer max(0, comm − compute) summed over L layers and M
micro-batches equals max(0, total comm − total compute) of the window. The pipeline fill (the
first layer's gather, the last layer's reduce-scatter) is not counted, per micro-batch or, with
`keep_first_layer`, once per step.

Memory-bound work on a profiled GPU (`memory_traffic.applies`): every kernel's bytes by the fitted GPU
traffic form (`amsp_jax.cost.memory_traffic`: per P, G and OS block, per micro-batch, the logits and
the layers' work under the step's remat) at the fastest elementwise pass the profile measured.
Memory-bound work elsewhere: where the cluster config carries measured `memory_passes` (`amsp-jax
profile` writes them), every state block is priced by the bytes the compiled step's memory-bound kernels
touch per byte of it — the stored P block (casts, the refresh), the G block (sinks, the casts around the
reduce-scatter), the fp32 master (the optimizer update), every parameter (the gathered weights and
full-size gradients all plans handle), the activations and, with micro-batches, the fp32 accumulator
each micro-batch's gradient is added into (a G-sized block passed once per micro-batch, so a replicated
G costs M times its size: zero1 at two micro-batches is slower than zero2 by more than its single pass
over G) — at the bandwidth those kernels reach in a running step, plus a fixed cost per step. On the CPU
mesh these passes are most of a step (zero1's replicated fp32 gradient is what makes it slower than
zero2 at equal bytes on the wire), and their speed depends on the block's size: a fresh buffer comes
from pages the kernel maps on first touch, a small one from the allocator's reused memory and the cache.
The profile measures that curve (`memory_bandwidths`) and each block runs at its size's speed relative
to the largest. A P stored apart from the master costs more than its block's bytes say where XLA:CPU
computes a bf16 matmul in fp32 (before jaxlib 0.11, `backend.widens_16bit_dots`): a stored 16-bit
weight is converted from memory at each of its uses, where the master gathered for zero3 is cast in
cache; the probe steps' times give it as `stored_params` bytes per fp32 parameter byte
(`stored_params_time`), and a profile on a later jaxlib measures none. A collective split into stages
on a backend that runs it wider than its dtype (XLA:CPU, bf16) rounds each stage's result in a kernel
of its own before the next stage reads it (`cost.rounded_bytes`: exactly the compiled bytes a split step
adds over its flat form);
those passes belong to the collective (`rounding_time`), priced at `split_results` bytes per byte, which
the probe steps time zero3 split against flat for.
Without measured passes or a profiled GPU only the optimizer update is priced: it reads the fp32 gradient,
reads and writes the master and the moments and writes the compute copy, all on the OS block, at
the device's HBM bandwidth.
MFU follows Megatron-LM: model FLOPs (no recompute, no causal halving) per second over peak.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping

import jax.numpy as jnp

from amsp_jax.core.mesh import AxisPlan, plan_axes
from amsp_jax.core.schedule import COLLECTIVE_PERMUTE, PHASES, Op, accumulates, grad_dtype
from amsp_jax.core.space import Placement, Strategy
from amsp_jax.cost import memory_traffic
from amsp_jax.cost.device_memory import Memory
from amsp_jax.cost.hardware import (
    PASS_BLOCKS,
    PASS_DEFAULTS,
    PER_MICRO_BATCH_BLOCKS,
    SPLIT_RESULTS,
    STORED_PARAMS,
    ClusterConfig,
)
from amsp_jax.cost.prediction import Prediction, predict
from amsp_jax.cost.tensor_traffic import shift_phases, tensor_transfers
from amsp_jax.cost.traffic import Transfer, issued, largest_gather_bytes, leaf_ops
from amsp_jax.cost.workload import FP32, Leaf, Workload

FORWARD_GATHER = "P gather, layers (forward)"
BACKWARD_GATHER = "P re-gather, layers (backward)"
LAYER_GRADS = "G reduce-scatter, layers (per micro-batch)"
OTHER_GRADS = "G reduce-scatter, other leaves (per micro-batch)"
OTHER_GATHER = "P gather, other leaves (once per step)"
REFRESH = "P refresh (once per step)"
REDUCTION = "G to OS reduction (once per step)"
UPDATE = "optimizer update (once per step)"
GROUPS = (
    FORWARD_GATHER, BACKWARD_GATHER, LAYER_GRADS, OTHER_GRADS, OTHER_GATHER, REFRESH, REDUCTION, UPDATE
)  # fmt: skip
WINDOWS = ("forward", "backward", "other leaves", "step start", "reduction", "optimizer update")


def group_of(phase: str, stacked: bool) -> str:
    """The overlap group of one cost-model phase for a layer-stack leaf or another leaf."""
    if phase == PHASES[3]:
        return LAYER_GRADS if stacked else OTHER_GRADS
    return {
        PHASES[0]: FORWARD_GATHER,
        PHASES[1]: BACKWARD_GATHER,
        PHASES[2]: OTHER_GATHER,
        PHASES[4]: REDUCTION,
        PHASES[5]: REFRESH,
        PHASES[6]: UPDATE,
    }[phase]


Traffic = Mapping[str, tuple[Transfer, ...]]
"""Per-device transfers of one step by overlap group, merged by (kind, level)."""


def distinct_leaves(workload: Workload) -> list[tuple[Leaf, int]]:
    """One leaf per kind of leaf and its count: identical leaves of one layer group (wq/wk/wv, w1/w3)
    run identical ops."""

    def key(leaf: Leaf) -> tuple[object, ...]:
        # A per-layer leaf without a named stack or block is a group of its own: its path stays.
        alone = leaf.layer_group == leaf.path
        return dataclasses.astuple(dataclasses.replace(leaf, path=leaf.path if alone else ()))

    counts = Counter(key(leaf) for leaf in workload.leaves)
    first = {key(leaf): leaf for leaf in reversed(workload.leaves)}
    return [(first[k], count) for k, count in counts.items()]


def issue(
    ops: list[tuple[int, Op]], group: str, workload: Workload, layer_bytes: int
) -> tuple[Transfer, ...]:
    """`(count, op)` pairs of one overlap group as the collectives XLA issues (`cost.issued`), by (kind,
    level, group size, nodes)."""
    found = issued(ops, workload, layer_bytes, group)
    return tuple(sorted(found, key=lambda t: (t.kind, t.level, t.group, t.nodes)))


def traffic(axes: AxisPlan, workload: Workload) -> Traffic:
    """Every collective of one step from `cost.leaf_ops`, grouped by overlap window."""
    by_group: dict[str, list[tuple[int, Op]]] = {g: [] for g in GROUPS}
    for leaf, count in distinct_leaves(workload):
        for op in leaf_ops(axes, workload, leaf):
            by_group[group_of(op.phase, leaf.stacked)].append((count, op))
    layer_bytes = largest_gather_bytes(axes, workload)
    return {g: issue(items, g, workload, layer_bytes) for g, items in by_group.items()}


def transfer_time(t: Transfer, cluster: ClusterConfig) -> float:
    """Seconds of one (merged) transfer on `cluster`: a collective-permute (a ring's step, a pair's
    exchange) as its sends to one neighbour each (`ClusterConfig.permute_time`). A chain's intermediate
    results that the backend rounds in passes of their own (`rounding_time`) belong to it."""
    if t.kind == COLLECTIVE_PERMUTE:
        return cluster.permute_time(t.bytes, t.level, t.executions)
    return cluster.collective_time(t.kind, t.level, t.bytes, t.executions, t.group, t.nodes) + rounding_time(
        t, cluster
    )


def rounding_time(t: Transfer, cluster: ClusterConfig) -> float:
    """Seconds of the passes that round a chain's intermediate results (`cost.rounded_bytes`): with
    measured passes, `split_results` bytes per byte at their speed for buffers of that size; else
    read and written once at the device's bandwidth."""
    if not t.rounded:
        return 0.0
    if cluster.memory_passes is None:
        return 2 * t.rounded / cluster.hbm_bandwidth
    count = cluster.memory_passes.get(SPLIT_RESULTS, PASS_DEFAULTS[SPLIT_RESULTS])
    return count * rounded_at_scale(t, cluster) / cluster.pass_bandwidth


def rounded_at_scale(t: Transfer, cluster: ClusterConfig) -> float:
    """`t`'s rounded bytes as passes at scale: one execution's buffer passes faster the smaller it is
    (`ClusterConfig.pass_speed`)."""
    return t.rounded / cluster.pass_speed(t.rounded / max(t.executions, 1)) if t.rounded else 0.0


def communication_times(traffic: Traffic, cluster: ClusterConfig) -> dict[str, float]:
    """Seconds of each group's collectives, one after another on the links."""
    return {group: sum(transfer_time(t, cluster) for t in transfers) for group, transfers in traffic.items()}


@dataclasses.dataclass(frozen=True)
class Compute:
    """Compute seconds of one step per device, split by what communication can hide behind, and the
    tensor-parallel collectives the matmuls wait for (`tensor_seconds`)."""

    forward_layers: float
    backward_layers: float
    forward_other: float
    backward_other: float
    micro_batches: int
    tensor: float = 0.0

    @property
    def total(self) -> float:
        """All compute of the step."""
        return self.forward_layers + self.backward_layers + self.forward_other + self.backward_other

    @property
    def serial(self) -> float:
        """Compute and the tensor-parallel collectives between its matmuls: the step's critical path
        before memory passes and exposed data-parallel communication."""
        return self.total + self.tensor

    @property
    def first_forward(self) -> float:
        """One micro-batch's forward."""
        return (self.forward_layers + self.forward_other) / self.micro_batches

    @property
    def last_backward(self) -> float:
        """One micro-batch's backward."""
        return (self.backward_layers + self.backward_other) / self.micro_batches


def recomputed_attention_flops_per_token(workload: Workload) -> int:
    """FLOPs per token of attention matmuls that remat, or a flash-style attention's backward, runs a
    second time (remat `full` also repeats every layer's projections, priced by their width)."""
    forward = workload.attention_run_flops_per_token(4) if workload.remat in ("dots", "full") else 0
    return forward + workload.attention_recompute_flops_per_token()


def matmul_width(leaf: Leaf) -> float:
    """The side of the square matrix as large as one layer's slice of `leaf`: the width its matmuls
    are priced at (`ClusterConfig.matmul_rate`)."""
    return math.sqrt(leaf.size // leaf.shape[0] if leaf.stacked else leaf.size)


def compute_times(workload: Workload, cluster: ClusterConfig) -> Compute:
    """Seconds of the layers' and the other leaves' forward and backward, remat included; under tensor
    degree t each device multiplies with its slice of every tensor-split leaf and 1/t of the heads."""
    tokens = workload.tokens_per_device()
    # Every matmul of a micro-batch runs over its tokens at once (the attention's over its queries),
    # each leaf's at the rate of its width, the attention's at the model's.
    run, dtype = workload.micro_batch_size * workload.seq_len, workload.precision.param_dtype
    t = workload.tensor

    def forward_seconds(leaves: list[Leaf]) -> float:
        local = [dataclasses.replace(x, shape=x.local_shape(t)) for x in leaves]
        return tokens * sum(2 * x.size / cluster.matmul_rate(run, dtype, matmul_width(x)) for x in local)

    layers = forward_seconds([x for x in workload.leaves if x.stacked])
    other = forward_seconds([x for x in workload.leaves if not x.stacked and not x.looked_up])
    attention = tokens / t / cluster.matmul_rate(run, dtype, workload.dims.dim)
    forward_layers = layers + workload.attention_run_flops_per_token(12) // 3 * attention
    recompute = recomputed_attention_flops_per_token(workload) * attention
    if workload.remat == "full":
        recompute += layers
    return Compute(
        forward_layers=forward_layers,
        backward_layers=2 * forward_layers + recompute,
        forward_other=other,
        backward_other=2 * other,
        micro_batches=workload.micro_batches,
        tensor=tensor_seconds(workload, cluster, layers),
    )


def tensor_seconds(workload: Workload, cluster: ClusterConfig, projections: float = 0.0) -> float:
    """Seconds the step's tensor-parallel collectives (`cost.tensor_traffic`) add to its critical path.

    In the `gather` form every one does: a matmul waits for its input's gather and the next layer for
    its output's sum. In the `ring` form the t - 1 steps of a collective matmul each run beside one
    sequence block's product (PrimePar's Σ max(compute, transfer)): a pass's permutes are hidden
    behind (t - 1)/t of that pass's layer projections (`projections`: the forward's seconds; the
    backward runs twice as many), less the interference overlap costs (`exposed`). In the `cannon`
    form the shifts on the square are, behind 1/2 (two steps); its exchanges in and out are not. The
    sum of the tensor-replicated leaves' gradients is priced at its largest (OS unsplit), so that the term
    depends on the batching alone.
    """
    if workload.tensor == 1 or not workload.boundaries:
        return 0.0
    axes = plan_axes(cluster.cluster(), Strategy(Placement(), Placement(), Placement(), workload.tensor))
    steps, forward, backward = shift_phases(workload)
    serial, beside_products = 0.0, {forward: 0.0, backward: 0.0}
    for t in tensor_transfers(axes, workload):
        if t.kind == COLLECTIVE_PERMUTE and t.phase in beside_products:
            beside_products[t.phase] += transfer_time(t, cluster)
        else:  # collectives, and the exchanges into and out of the square
            serial += transfer_time(t, cluster)
    hidden = (steps - 1) / steps * projections
    interference = cluster.overlap_interference if cluster.overlap_enabled else 1.0
    beside = {forward: hidden, backward: 2 * hidden} if cluster.overlap_enabled else {}
    return serial + sum(exposed(s, beside.get(p, 0.0), interference) for p, s in beside_products.items())


def optimizer_time(memory: Memory, param_bytes: int, cluster: ClusterConfig) -> float:
    """Seconds of the memory-bound optimizer update on the OS block (where no passes are measured)."""
    touched = 3 * memory.master + 2 * memory.opt_state + memory.master // FP32 * param_bytes
    return touched / cluster.hbm_bandwidth


def pass_blocks(memory: Memory, workload: Workload) -> dict[str, float]:
    """Bytes per device of each block the step's memory-bound kernels pass over
    (`cluster_config.PASS_BLOCKS`), for one pass: the stored P block (none where the gathers cast the
    master), the G block counted in fp32 whatever its dtype (so a plan's G term does not hang on its
    micro-batch count), the fp32 master, every parameter in fp32, the activations, and the fp32
    accumulator (G's block where micro-batches accumulate, else none)."""
    grad_itemsize = jnp.dtype(grad_dtype(workload.micro_batches, workload.precision.reduce_dtype)).itemsize
    grads = float(memory.grads) * FP32 / grad_itemsize
    return {
        "params": float(memory.params),
        "grads": grads,
        "opt_state": float(memory.master),
        "model": float(FP32 * workload.num_params),
        "activations": float(memory.activations),
        "accumulator": grads if accumulates(workload.micro_batches) else 0.0,
    }


def pass_executions(micro_batches: int) -> dict[str, int]:
    """How many times a step passes over each block of `pass_blocks`: once per micro-batch for
    `PER_MICRO_BATCH_BLOCKS`, once per step for the others."""
    return {block: micro_batches if block in PER_MICRO_BATCH_BLOCKS else 1 for block in PASS_BLOCKS}


def pass_time(block: str, nbytes: float, cluster: ClusterConfig) -> float:
    """Seconds of the memory passes over one block of `nbytes` per device (0 where the cluster measured
    none): at the passes' bandwidth, faster over a block small enough for the cache and the
    allocator's reused memory (`ClusterConfig.pass_speed`)."""
    if cluster.memory_passes is None:
        return 0.0
    return cluster.memory_passes[block] * nbytes / (cluster.pass_bandwidth * cluster.pass_speed(nbytes))


def traffic_time(sizes: Mapping[str, float], cluster: ClusterConfig) -> float:
    """Seconds of the GPU traffic form's terms `sizes` (`memory_traffic`) at the profiled bandwidth."""
    return memory_traffic.seconds(memory_traffic.shipped(), sizes, cluster)


def params_time(param_block: float, num_params: int, cluster: ClusterConfig) -> float:
    """Seconds of the passes over the stored P block (none where the gathers cast the master)."""
    if memory_traffic.applies(cluster):
        return traffic_time({"params": param_block}, cluster)
    return pass_time("params", param_block, cluster) + stored_params_time(param_block, num_params, cluster)


def grads_time(grad_block: float, cluster: ClusterConfig) -> float:
    """Seconds of the passes over the G block, counted in fp32 (`pass_blocks`)."""
    if memory_traffic.applies(cluster):
        devices = cluster.nodes * cluster.devices_per_node
        return traffic_time(memory_traffic.grad_terms(grad_block, devices), cluster)
    return pass_time("grads", grad_block, cluster)


def accumulator_time(grad_block: float, micro_batches: int, cluster: ClusterConfig) -> float:
    """Seconds of the passes over the fp32 accumulator that `micro_batches` micro-batches' gradients are
    added into, on a G block of `grad_block` fp32 bytes: none with one micro-batch (no accumulator), and
    none on a GPU priced by the traffic form, whose `accumulator` term every plan runs."""
    if not accumulates(micro_batches) or memory_traffic.applies(cluster):
        return 0.0
    return pass_executions(micro_batches)["accumulator"] * pass_time("accumulator", grad_block, cluster)


def stored_params_time(param_block: float, num_params: int, cluster: ClusterConfig) -> float:
    """Seconds a P stored apart from the master (a nonzero `param_block`) costs beyond its own block's
    passes: `stored_params` bytes per fp32 parameter byte (0 where the cluster measured none)."""
    if cluster.memory_passes is None or param_block <= 0:
        return 0.0
    return pass_time(STORED_PARAMS, FP32 * num_params, cluster)


def fixed_pass_time(workload: Workload, activations: float, cluster: ClusterConfig) -> float:
    """Seconds of the passes every plan runs and the fixed cost of a step.

    On a GPU priced by the traffic form: every full-size weight and gradient per micro-batch, the
    logits, and the layers' elementwise work under the step's remat (`memory_traffic.terms`). With
    measured passes (a CPU host): the passes over all parameters and over one micro-batch's
    activations, once per micro-batch, since at the same tokens per step both the compiled traffic
    (XLA:CPU) and a GPU's memory-bound kernel time grow with the micro-batches. Else 0.
    """
    if memory_traffic.applies(cluster):
        sizes = memory_traffic.terms(dict.fromkeys(PASS_BLOCKS, 0.0), workload, 1)
        return traffic_time({k: v for k, v in sizes.items() if k not in memory_traffic.BLOCK_TERMS}, cluster)
    if cluster.memory_passes is None:
        return 0.0
    runs = pass_executions(workload.micro_batches)
    weights = runs["model"] * pass_time("model", FP32 * workload.num_params, cluster)
    activations_s = runs["activations"] * pass_time("activations", activations, cluster)
    return weights + activations_s + cluster.step_overhead


def opt_state_time(memory: Memory, param_bytes: int, cluster: ClusterConfig) -> float:
    """Seconds of the passes over the OS block: by the GPU traffic form, measured, or else the update's
    own bytes."""
    if memory_traffic.applies(cluster):
        return traffic_time({"opt_state": float(memory.master)}, cluster)
    if cluster.memory_passes is None:
        return optimizer_time(memory, param_bytes, cluster)
    return pass_time("opt_state", memory.master, cluster)


def memory_times(memory: Memory, workload: Workload, cluster: ClusterConfig) -> dict[str, float]:
    """Seconds of the step's memory-bound work by what it depends on: the P, G and OS placements, and
    what every plan runs.

    On a profiled GPU every kernel's bytes are priced by the fitted traffic form (`memory_traffic`) at
    the profiled memory bandwidth; with measured passes (`memory_passes` in the cluster config, from
    `amsp-jax profile` on a CPU host) every block is priced by the bytes the compiled step's kernels
    touch per byte of it; without either only the optimizer update is, by the bytes it must read and
    write (`optimizer_time`).
    """
    blocks = pass_blocks(memory, workload)
    return {
        "params": params_time(blocks["params"], workload.num_params, cluster),
        "grads": grads_time(blocks["grads"], cluster)
        + accumulator_time(blocks["accumulator"], workload.micro_batches, cluster),
        "opt_state": opt_state_time(memory, workload.precision.param_bytes, cluster),
        "every plan": fixed_pass_time(workload, blocks["activations"], cluster),
    }


def exposed(communication: float, hidden_behind: float, interference: float) -> float:
    """Seconds a window adds: what compute cannot hide, and at least the slowdown overlap itself costs."""
    return max(communication - hidden_behind, interference * communication)


def windows(comm: Mapping[str, float], compute: Compute) -> dict[str, tuple[float, float]]:
    """(communication, compute it may hide behind) seconds of each overlap window (module docstring)."""
    return {
        "forward": (comm[FORWARD_GATHER], compute.forward_layers),
        "backward": (comm[BACKWARD_GATHER] + comm[LAYER_GRADS], compute.backward_layers),
        "other leaves": (comm[OTHER_GRADS], compute.forward_other + compute.backward_other),
        "step start": (comm[OTHER_GATHER] + comm[REFRESH], compute.first_forward),
        "reduction": (comm[REDUCTION], compute.last_backward),
        # The update's own collectives sit between the reduction and the refresh: nothing to hide behind.
        "optimizer update": (comm[UPDATE], 0.0),
    }


def exposed_times(comm: Mapping[str, float], compute: Compute, cluster: ClusterConfig) -> dict[str, float]:
    """Communication seconds left visible in each overlap window (all of it where nothing overlaps)."""
    if not cluster.overlap_enabled:
        return {name: seconds for name, (seconds, _) in windows(comm, compute).items()}
    fractions = {"reduction": cluster.reduction_overlap}
    return {
        name: exposed(seconds, fractions.get(name, 1.0) * hide, cluster.overlap_interference)
        for name, (seconds, hide) in windows(comm, compute).items()
    }


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step, where they go, and the resulting throughput."""

    compute_s: float
    memory_s: Mapping[str, float]  # memory-bound passes by block (`memory_times`)
    tensor_s: float  # tensor-parallel collectives on the critical path (`tensor_seconds`)
    communication_s: Mapping[str, float]
    exposed_s: Mapping[str, float]
    model_flops_per_device: float
    peak_flops: float
    tokens_per_device: float  # a tensor group's tokens shared over its t devices

    @property
    def step_s(self) -> float:
        """Compute, the memory-bound passes (the optimizer update among them) and the communication no
        compute hides."""
        return self.compute_s + self.tensor_s + sum(self.memory_s.values()) + sum(self.exposed_s.values())

    @property
    def mfu(self) -> float:
        """Model FLOP/s per device over peak (Megatron-LM: no recompute, no causal halving)."""
        return self.model_flops_per_device / self.step_s / self.peak_flops

    def tokens_per_s(self, devices: int) -> float:
        """Tokens per second of the whole cluster."""
        return self.tokens_per_device * devices / self.step_s


def combine(
    comm: Mapping[str, float],
    compute: Compute,
    memory_s: Mapping[str, float],
    workload: Workload,
    cluster: ClusterConfig,
) -> StepTime:
    """The step time of given communication, compute and memory-pass seconds."""
    return StepTime(
        compute_s=compute.total,
        tensor_s=compute.tensor,
        memory_s=dict(memory_s),
        communication_s=dict(comm),
        exposed_s=exposed_times(comm, compute, cluster),
        model_flops_per_device=workload.flops_per_token() * workload.tokens_per_device() / workload.tensor,
        peak_flops=cluster.peak_flops,
        tokens_per_device=workload.tokens_per_device() / workload.tensor,
    )


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The cost model's prediction (bytes, memory) and the time model's step time for one plan."""

    prediction: Prediction
    time: StepTime


def step_time(traffic: Traffic, memory: Memory, workload: Workload, cluster: ClusterConfig) -> StepTime:
    """Step time of grouped transfers and memory (lets callers splice variants such as ZeRO++ hpZ)."""
    return combine(
        communication_times(traffic, cluster),
        compute_times(workload, cluster),
        memory_times(memory, workload, cluster),
        workload,
        cluster,
    )


def estimate(axes: AxisPlan, workload: Workload, cluster: ClusterConfig) -> Estimate:
    """Bytes, memory and step time of `workload` under the strategy `axes` was planned for."""
    prediction = predict(axes, workload)
    return Estimate(prediction, step_time(traffic(axes, workload), prediction.memory, workload, cluster))
