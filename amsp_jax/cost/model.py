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

import jax.numpy as jnp

from amsp_jax.core import schedule
from amsp_jax.core.mesh import AxisPlan, LeafLayout, leaf_layout
from amsp_jax.core.plan import Precision
from amsp_jax.core.schedule import PHASES, Implementation, LeafSchedule, Op
from amsp_jax.cost.optimizer import ELEMENT_WISE, OptimizerUpdate, update_ops

FP32 = 4


@dataclasses.dataclass(frozen=True)
class LeafShape:
    """One parameter leaf: its path, full shape, and whether it is a layer stack (leading layer axis)."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    stacked: bool
    per_layer: bool | None = None  # gathered one layer at a time; None: when stacked
    regathered: bool = True  # gathered again in the backward pass (False: the backward never reads it)
    frozen: bool = False  # not trained: no gradient, no optimizer state, never refreshed
    unit: tuple[str, ...] | None = None  # the stack or block a per-layer leaf is gathered with
    layer_stack: bool = False  # a `LayerStack`'s (its own layer loop; may keep its first layer)
    looked_up: bool = False  # only indexed (an untied input embedding): the step runs no matmul with it

    @property
    def size(self) -> int:
        """Elements of the whole leaf."""
        return math.prod(self.shape)

    @property
    def layer_group(self) -> tuple[str, ...] | None:
        """What the step gathers this leaf with, one layer at a time: its stack or block (alone where
        none is named); None for a leaf gathered once per step."""
        per_layer = self.stacked if self.per_layer is None else self.per_layer
        return (self.unit or self.path) if per_layer else None


def looped_blocks(leaves: Iterable[LeafShape]) -> bool:
    """Whether a model's layers are blocks called one by one (gathered per layer, not stacked)."""
    return any(leaf.per_layer and not leaf.stacked for leaf in leaves)


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The transformer dimensions that set FLOPs and activation memory, and the attention's kind.

    `attention` is `LlamaConfig.attention`: `xla` materialises the (seq, seq) scores; `auto`,
    `cudnn` and `blockwise` are flash-style (`amsp_jax.models.attention`). The cost model counts
    `auto` as cuDNN's (what it runs on a GPU in bf16; elsewhere it runs blockwise, whose one block of
    scores is then not counted).
    """

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    attention: str = "auto"
    attention_block: int = 512

    @property
    def materialises_scores(self) -> bool:
        """Whether the attention holds (seq, seq) scores in memory."""
        return self.attention == "xla"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model's parameter leaves and dimensions, with the step's batch, precision and remat choices."""

    leaves: tuple[LeafShape, ...]
    dims: ModelDims
    seq_len: int
    micro_batch_size: int
    micro_batches: int
    precision: Precision = dataclasses.field(default_factory=Precision)
    remat: str = "full"
    opt_state_bytes_per_param: int = 2 * FP32
    # XLA's CPU backend runs 16-bit collectives in fp32 (seen in compiled HLO); 4 models that there.
    min_collective_itemsize: int = 1
    implementation: Implementation = dataclasses.field(default_factory=Implementation)
    # What the optimizer's update communicates (`amsp_jax.cost.optimizer`); default element-wise: nothing.
    optimizer: OptimizerUpdate = ELEMENT_WISE
    # Whether XLA writes the new master and moments over the old (`core.backend.selects_in_place`):
    # a GPU does; XLA:CPU builds the new state beside the old.
    update_in_place: bool = True
    # The backend the step compiles for: which collectives XLA merges (`schedule.launches`).
    platform: str = "gpu"

    def wire_bytes(self, itemsize: int) -> int:
        """Bytes per element on the wire for a tensor of `itemsize`."""
        return max(itemsize, self.min_collective_itemsize)

    @property
    def num_params(self) -> int:
        """Parameter count."""
        return sum(leaf.size for leaf in self.leaves)

    @property
    def matmul_params(self) -> int:
        """Parameters the step multiplies with: all but the looked-up ones (an untied input embedding)."""
        return sum(leaf.size for leaf in self.leaves if not leaf.looked_up)

    @property
    def looped_blocks(self) -> bool:
        """Whether the layers are blocks called one by one, not a stack (`looped_blocks`)."""
        return looped_blocks(self.leaves)

    def tokens_per_device(self) -> int:
        """Tokens one device processes per step."""
        return self.seq_len * self.micro_batch_size * self.micro_batches

    def flops_per_token(self) -> int:
        """Model FLOPs per token, forward and backward: 6Φ + 12·L·H·Q·T (Megatron/PaLM convention), Φ
        the parameters the step multiplies with (`matmul_params`).

        An untied input embedding is looked up, not multiplied: Megatron-LM's formula counts the
        output projection once and no input embedding, and torchtitan (whose published MFU this
        repository compares with) takes the token embedding out of Φ. A tied one is the output
        projection and counts once. The same for every attention implementation: no causal halving,
        no recomputation (those are `attention_square_fraction`, `attention_recompute_flops_per_token`
        and the time model's remat terms).
        """
        d = self.dims
        return 6 * self.matmul_params + 12 * d.n_layers * d.n_heads * d.head_dim * self.seq_len

    def attention_square_fraction(self) -> float:
        """The fraction of the (seq, seq) score square whose matmuls the attention runs.

        The materialising attention runs all of it and masks the upper triangle. A flash-style kernel
        skips every tile above the diagonal (FlashAttention-2, arXiv 2307.08691 §3.1: the causal kernel
        runs 1.7–1.8× faster than the unmasked one). Counted at the blockwise attention's tiling
        (`attention_block`, padding included), which is exact for it; cuDNN's tiles are smaller, so it
        skips a little more than counted.
        """
        d = self.dims
        if d.materialises_scores:
            return 1.0
        blocks = -(-self.seq_len // d.attention_block)
        block = -(-self.seq_len // blocks)
        return blocks * (blocks + 1) // 2 * block * block / self.seq_len**2

    def attention_recompute_flops_per_token(self) -> int:
        """FLOPs per token a flash-style attention's backward adds: it recomputes the scores Q·Kᵀ.

        Its backward runs five (seq, seq)-sized matmuls (Q·Kᵀ again, dV, dP, dQ, dK) where the
        materialising one runs four, so 2·L·H·Q·T more per token over the whole square; the kernel
        runs `attention_square_fraction` of it.
        """
        return 0 if self.dims.materialises_scores else self.attention_run_flops_per_token(2)

    def attention_run_flops_per_token(self, per_square: int) -> int:
        """FLOPs per token the kernel runs of attention matmuls worth `per_square`·L·H·Q·T over the whole
        (seq, seq) square (12 for a forward and backward): `attention_square_fraction` of them."""
        d = self.dims
        square = per_square * d.n_layers * d.n_heads * d.head_dim * self.seq_len
        return round(square * self.attention_square_fraction())

    def with_(self, **changes: object) -> Workload:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def llama_workload(
    config: object,
    seq_len: int,
    micro_batch_size: int = 1,
    micro_batches: int = 1,
    precision: Precision | str = "mixed",
    remat: str = "full",
) -> Workload:
    """The workload of `amsp_jax.models.llama.Llama(config)` (same leaves as the Flax model)."""
    c = config
    leaves = [LeafShape(("embed",), (c.vocab_size, c.dim), False, looked_up=not c.tie_embeddings)]
    leaves += [
        LeafShape(("layers", "layer", name), (c.n_layers, *shape), True, unit=("layers",), layer_stack=True)
        for name, shape in c.layer_shapes().items()
    ]
    leaves.append(LeafShape(("norm",), (c.dim,), False))
    if not c.tie_embeddings:
        leaves.append(LeafShape(("lm_head",), (c.dim, c.vocab_size), False))
    precision = Precision.named(precision) if isinstance(precision, str) else precision
    return Workload(tuple(leaves), llama_dims(c), seq_len, micro_batch_size, micro_batches, precision, remat)


def llama_dims(config: object) -> ModelDims:
    """The `ModelDims` of a `LlamaConfig`."""
    c = config
    return ModelDims(
        c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size,
        c.attention, c.attention_block,
    )  # fmt: skip


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


def schedule_leaf(axes: AxisPlan, workload: Workload, leaf: LeafShape) -> LeafSchedule:
    """The step's ops for one leaf under `workload`'s batching, remat, precision and implementation."""
    return schedule.leaf_schedule(
        axes, leaf.path, leaf.shape, leaf.stacked, workload.micro_batches, workload.remat,
        workload.precision.param_bytes, workload.precision.reduce_bytes, workload.implementation,
        leaf.per_layer, leaf.regathered, leaf.frozen, not workload.optimizer.communicates_on(leaf.path),
        leaf.unit, leaf.layer_stack,
    )  # fmt: skip


def leaf_ops(axes: AxisPlan, workload: Workload, leaf: LeafShape) -> list[Op]:
    """The step's ops for one leaf and the collectives XLA adds to the optimizer's update of it."""
    scheduled = schedule_leaf(axes, workload, leaf)
    return [*scheduled.ops(), *update_ops(axes, leaf.path, scheduled.split, workload.optimizer)]


def leaf_transfers(axes: AxisPlan, workload: Workload, leaf: LeafShape) -> list[Transfer]:
    """Every collective the step runs for one leaf, with its executions per step."""
    return [transfer(op, workload) for op in leaf_ops(axes, workload, leaf)]


def largest_gather_bytes(axes: AxisPlan, workload: Workload) -> int:
    """The step's largest single gather under `axes`, padding included (`schedule.largest_gather_bytes`:
    what the step gives XLA as its combine threshold)."""

    def stored_layer(leaf: LeafShape) -> int:
        split = leaf_layout(axes, leaf.shape, leaf.stacked, not workload.optimizer.communicates_on(leaf.path))
        return math.prod(split.padded) // (leaf.shape[0] if leaf.stacked else 1)

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


def _block_elements(axes: AxisPlan, leaf: LeafLayout, component: str) -> int:
    return math.prod(leaf.block_shape(axes, component))


PEAKS = ("loss", "backward", "update", "refresh")


@dataclasses.dataclass(frozen=True)
class Peak:
    """What a step holds at one of its peaks beyond the model states, by the choice that sets it.

    The ILP prices each field by one decision (`amsp_jax.planner.partitioner`), so a field depends on P's
    placement alone (`gathered`), G's (`grads`, negative where G blocks are not yet or no longer
    live), OS's (`opt_state`), P's with OS's (`p_with_os`) or the batch and remat policy
    (`activations`).
    """

    gathered: int = 0
    grads: int = 0
    opt_state: int = 0
    p_with_os: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        """Bytes beyond the model states."""
        return self.gathered + self.grads + self.opt_state + self.p_with_os + self.activations


@dataclasses.dataclass(frozen=True)
class Memory:
    """Predicted bytes per device: the model states, and what the step holds at each of its peaks.

    A step peaks in one of four places that never overlap, read off the buffer assignments and live
    ranges of steps compiled for GPUs (LLaMA 7B, 13B and 30B at 1,024 A100s; 4-layer LLaMAs of width
    1024 and 2048 on 16 H100s):
      - `loss`: the saved layer inputs, the gathered leaves outside the layers (the head), the logits
        and their gradient;
      - `backward`, inside the layer loop: the saved inputs, the logits' gradient (kept for the head's
        weight gradient, which XLA computes after the layers), one layer's activations, its full-size
        weight gradient and its gathered weights (three layers in the explicit-prefetch loop); the
        gradients of the leaves outside the layers are not computed yet;
      - `update`: the new master and moments, where XLA does not write them over the old
        (`Workload.update_in_place`);
      - `refresh`: a P that is stored and less sharded than OS is gathered leaf by leaf into a new
        buffer laid out along the gathered dimension, then copied into place; G is dead by then.
    With micro-batches, or in the explicit-prefetch loop, the leaves outside the layers stay gathered
    through the backward; with micro-batches the accumulator sits beside one micro-batch's gradient
    throughout, and a kept first layer (`schedule.keeps_first_layer`) and its fp32 gradient sums stay
    beside both peaks of the micro-batches. Where P is cast from the master and gathered along a
    dimension other than a layer's major one, XLA keeps a transposed copy of the master block through
    the forward and backward passes. Not counted: how XLA packs buffers into its one temporary
    allocation (the compiled temporaries of the programs above are 1.0-1.3x the largest set of
    buffers live at once).
    """

    params: int
    grads: int
    master: int
    opt_state: int
    activations: int  # activation bytes one micro-batch handles (the block the memory passes are priced by)
    peaks: dict[str, Peak]
    params_from_master: int = 0  # P's bytes where it is not stored but cast from the master (in no peak)

    @property
    def model_states(self) -> int:
        """P + G + OS (master and moments)."""
        return self.params + self.grads + self.master + self.opt_state

    @property
    def param_blocks(self) -> int:
        """The bytes of a device's P blocks, stored or cast from the master as the step goes."""
        return self.params + self.params_from_master

    def peak(self, name: str) -> int:
        """Bytes at one of `PEAKS`."""
        return self.model_states + self.peaks[name].total

    @property
    def peak_name(self) -> str:
        """Where the step peaks."""
        return max(PEAKS, key=self.peak)

    @property
    def total(self) -> int:
        """The peak of one step."""
        return self.peak(self.peak_name)

    def as_dict(self) -> dict[str, object]:
        """Fields, each peak and the total, for JSON."""
        return {
            **{f: getattr(self, f) for f in ("params", "grads", "master", "opt_state", "activations")},
            "params_from_master": self.params_from_master,
            "model_states": self.model_states,
            "peaks": {name: self.peak(name) for name in PEAKS},
            "peak": self.peak_name,
            "total": self.total,
        }


def activation_bytes(workload: Workload) -> tuple[int, int]:
    """(bytes kept per layer for the backward pass, bytes of one layer's full forward) per micro-batch."""
    d, b, t = workload.dims, workload.micro_batch_size, workload.seq_len
    act = workload.precision.param_bytes
    tokens = b * t
    kv = 2 * d.n_kv_heads * d.head_dim
    if d.materialises_scores:
        # The scores of every (query, key) pair: at the backward's peak the fp32 scores, the
        # probabilities and their gradients. Measured (compiled step with this attention minus the
        # flash one, per score): 9.1-9.5 bytes for LLaMA-7B and 13B on A100s in mixed precision at seq
        # 2048-4096; 13-18 bytes on 4-head test models (XLA keeps transposed copies there), so this
        # is a lower bound for small models.
        attention = b * d.n_heads * t * t * (2 * FP32 + act)
    else:
        # Flash-style: fp32 softmax statistics per row and head (kept for the backward) and the
        # backward's fp32 dQ accumulator (the forward's fp32 output accumulator is no larger); the
        # scores stay in on-chip memory (cuDNN) or one block at a time (blockwise: a block's scores,
        # probabilities and their gradients).
        attention = b * d.n_heads * t * FP32 + tokens * d.n_heads * d.head_dim * FP32
        if d.attention == "blockwise":
            block = min(d.attention_block, t)
            attention += b * d.n_heads * block * block * 2 * (FP32 + act)
    # What the backward reads of one layer (JAX's saved residuals; the same buffers in the GPU-compiled
    # scan): per RMSNorm its fp32 input and normalised output and the activation-dtype result, the
    # attention's q, k, v and output, and six ffn-sized tensors (both projections, sigmoid, silu and
    # their product).
    full_layer = tokens * (4 * FP32 * d.dim + act * (4 * d.dim + kv + 6 * d.ffn_dim)) + attention
    kept = {
        "full": act * tokens * d.dim,
        # Dot outputs the backward needs (q, k, v, the output projection, both ffn up-projections)
        # and the layer input; the down projection's output is only added to the residual stream.
        "dots": act * tokens * (3 * d.dim + kv + 2 * d.ffn_dim),
        "none": full_layer,
    }[workload.remat]
    return kept, full_layer


def memory(axes: AxisPlan, workload: Workload) -> Memory:
    """Per-device memory of one step: the model states, and what each peak holds beside them (`Memory`)."""
    p_bytes = workload.precision.param_bytes
    gathered_bytes = workload.wire_bytes(p_bytes)
    reduce_bytes = workload.wire_bytes(workload.precision.reduce_bytes)
    g_bytes = jnp.dtype(schedule.grad_dtype(workload.micro_batches, workload.precision.reduce_dtype)).itemsize
    params = grads = master = trained_master = 0
    other_extra = other_grads = layer_full = layer_extra = layer_grad = refresh = transposed = 0
    first_layer = 0  # a kept first layer (`schedule.keeps_first_layer`): gathered, and its fp32 sums
    stored = not schedule.params_from_master(axes.strategy)
    p_axes = set(axes.axes("params"))
    for leaf in workload.leaves:
        scheduled = schedule_leaf(axes, workload, leaf)
        split = scheduled.split
        p_block = _block_elements(axes, split, "params")
        g_block = 0 if leaf.frozen else _block_elements(axes, split, "grads") * g_bytes
        params += p_block * p_bytes
        grads += g_block
        master += _block_elements(axes, split, "opt_state") * FP32
        if not leaf.frozen:
            trained_master += _block_elements(axes, split, "opt_state") * FP32
        if scheduled.refresh and stored and not leaf.frozen:
            refresh = max(refresh, p_block * p_bytes)
        whole = math.prod(split.padded)
        if leaf.per_layer if leaf.per_layer is not None else leaf.stacked:
            # One layer's share: a stacked leaf holds every layer; blocks gathered call by call (a
            # loop of equal blocks) are counted as the same share of all of them.
            layers = leaf.shape[0] if leaf.stacked else workload.dims.n_layers
            layer_full += whole // layers * gathered_bytes
            layer_extra += (whole - p_block) // layers * gathered_bytes
            layer_grad += 0 if leaf.frozen else whole // layers * reduce_bytes
            if scheduled.keeps_first_layer:
                first_layer += whole // layers * (gathered_bytes + (0 if leaf.frozen else FP32))
            if not stored and leaf.stacked and any(d != 1 for a, d in split.axis_dims if a in p_axes):
                # Cast from the master and gathered along a dimension other than a layer's major one:
                # XLA transposes the whole fp32 master block once, before the layer loops, and keeps it
                # (LLaMA-7B mics at 1,024 A100s: the two ffn up-projections, 688 MiB each).
                transposed += _block_elements(axes, split, "opt_state") * FP32
        else:
            other_extra += (whole - p_block) * gathered_bytes
            other_grads += g_block
    opt_state = trained_master // FP32 * workload.opt_state_bytes_per_param
    kept, full_layer = activation_bytes(workload)
    d, layers = workload.dims, workload.dims.n_layers
    logits = workload.micro_batch_size * workload.seq_len * d.vocab_size * p_bytes
    saved = layers * kept
    if workload.remat == "none":
        # The forward's scan keeps every layer's gathered weights as residuals, a copy even where P
        # is replicated.
        saved += layers * layer_full
    accumulating = schedule.accumulates(workload.micro_batches)
    # With an accumulator one micro-batch's gradient (fp32, G's size) sits beside it; without one
    # the micro-batch's gradient is G. The leaves outside the layers get theirs after the layers.
    accumulation = grads if accumulating else 0
    prefetch = schedule.uses_prefetch(
        workload.micro_batches, workload.remat, layers, workload.implementation.prefetch,
        stack=not workload.looped_blocks,
    )  # fmt: skip
    # A kept first layer is held through every micro-batch: priced with the activations, which are
    # priced per batching, since it is the same whatever the placement.
    peaks = {
        "loss": Peak(
            gathered=other_extra, grads=accumulation, p_with_os=transposed,
            activations=saved + 2 * logits + first_layer,
        ),
        "backward": Peak(
            gathered=(3 if prefetch else 1) * layer_extra + (other_extra if accumulating or prefetch else 0),
            grads=accumulation - other_grads,
            p_with_os=transposed,
            activations=saved + logits + full_layer + layer_grad + first_layer,
        ),
        "update": Peak(opt_state=0 if workload.update_in_place else trained_master),
        "refresh": Peak(grads=-grads, p_with_os=refresh),
    }
    # The block the memory passes are priced by (`amsp_jax.cost.timing`): the saved inputs, one layer's
    # full activations and two fp32 logits-sized buffers, as `amsp-jax profile` fitted them.
    passes_block = layers * kept + full_layer + 2 * logits // p_bytes * FP32
    from_master = params if not stored else 0
    return Memory(params - from_master, grads, master, opt_state, passes_block, peaks, from_master)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Communication and memory of one plan on one workload."""

    transfers: tuple[Transfer, ...]
    memory: Memory

    def bytes_by_level(self) -> dict[str, int]:
        """{intra, inter} totals per device per step."""
        return bytes_by_level(self.transfers)

    def bytes_by_kind_and_level(self) -> dict[str, dict[str, int]]:
        """{kind: {intra, inter}} totals per device per step."""
        return bytes_by_kind_and_level(self.transfers)


def predict(axes: AxisPlan, workload: Workload) -> Prediction:
    """Bytes and memory of `workload` under the strategy that `axes` was planned for."""
    return Prediction(tuple(communication(axes, workload)), memory(axes, workload))
