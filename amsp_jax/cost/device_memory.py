"""Predicted memory per device: the model states, and what the step holds at each of its peaks."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import jax.numpy as jnp

from amsp_jax.core import backend, schedule
from amsp_jax.core.mesh import AxisPlan, LeafLayout
from amsp_jax.cost.traffic import largest_gather_bytes, schedule_leaf
from amsp_jax.cost.workload import FP32, Workload
from amsp_jax.layers.tensor import matmul_form
from amsp_jax.layers.tensor_cannon import DEGREE as CANNON_BLOCKS


def _block_elements(axes: AxisPlan, leaf: LeafLayout, component: str) -> int:
    return math.prod(leaf.block_shape(axes, component))


PEAKS = ("start", "loss", "backward", "update", "refresh")


@dataclasses.dataclass(frozen=True)
class Peak:
    """What a step holds at one of its peaks beyond the model states, by the choice that sets it.

    The ILP prices each field by one decision (`amsp_jax.planner.terms`), so a field depends on P's
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

    A step peaks in one of five places that never overlap, read off the buffer assignments and live
    ranges of steps compiled for GPUs (LLaMA 7B, 13B and 30B at 1,024 A100s; 4-layer LLaMAs of width
    1024 and 2048 on 16 H100s; 1B-class LLaMAs at full depth on 16 H100s):
      - `start`, before the first layer, where the backend gathers every leaf outside the layers at
        once beside the first layers' gathered weights (`backend.layers_gathered_at_start`);
      - `loss`: the saved layer inputs, the gathered leaves outside the layers (the head; a table the
        forward only indexes, the input embedding, only where they are held), the logits and their
        gradient (one buffer where the backend writes it over them, `writes_logits_gradient_in_place`);
      - `backward`, inside the layer loop: the saved inputs, the head's operands (the logits' gradient
        and the head's input) where the backend computes the head's weight gradient after the layers
        (`keeps_logits_gradient`), the rotary tables, one layer's backward (`layer_backward`: a
        blockwise attention's tile of scores peaks apart from the rest of the layer), its full-size
        weight gradient and its gathered weights (three layers in the explicit-prefetch loop); the
        gradients of the leaves outside the layers are not computed yet;
      - `update`: the new master and moments, where XLA does not write them over the old
        (`Workload.update_in_place`);
      - `refresh`: a P that is stored and less sharded than OS is gathered leaf by leaf into a new
        buffer laid out along the gathered dimension, then copied into place; G is dead by then.
    With micro-batches, or in the explicit-prefetch loop, the leaves outside the layers stay gathered
    through the backward; with micro-batches the accumulator sits beside one micro-batch's gradient
    (at the loss only the other leaves': the layers' start with their backward), and a kept first
    layer (`schedule.keeps_first_layer`) and its fp32 gradient sums stay beside both peaks of the
    micro-batches. Where P is cast from the master and gathered along a
    dimension other than a layer's major one, XLA keeps a transposed copy of the master block through
    the forward and backward passes. The same peaks hold for steps compiled for the CPU (the shipped
    `tiny` and `small` models at 128-1,024 tokens) with the backend's own buffers: fp32 activations
    (`activation_itemsize`), the blockwise attention (`attention_kind`) and no logits' gradient in the
    layers' backward. Under a tensor axis the model states, gathered weights and weight gradients are
    the rank's tensor slices (`LeafLayout.rank_padded`), and the activations, the attention and the
    logits are what one rank holds (`TensorSplit`, `logits_bytes`). Not counted: how XLA packs buffers
    into its one temporary allocation (the compiled temporaries of the programs above are 1.0-1.3x
    the largest set of buffers live at once).
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


@dataclasses.dataclass(frozen=True)
class TensorSplit:
    """How one rank of a tensor group holds a layer's activations (Korthikanti et al., 2205.05198).

    Tensors after a column-parallel matmul and before a row-parallel one (q, k, v, the attention's
    scores and output, the ffn units) hold `1/degree` of their heads or units. The norms, residuals
    and layer inputs between a row output and the next column input are whole without sequence
    parallelism and hold `1/degree` of the sequence with it. The input a column matmul reads is whole
    either way (all-gathered under sequence parallelism), and its weight gradient needs it, so a
    layer keeps it whole (the cannon form keeps the last block it multiplied, `column_input`); a row
    matmul's output is a whole partial sum before it is reduced.
    """

    degree: int = 1
    sequence_parallel: bool = False
    column_parts: int = 1  # a column matmul keeps 1/column_parts of its whole input (`column_input`)

    def column_input(self, size: int) -> int:
        """What a layer keeps of a column matmul's whole input for the weight gradient: all of it, or
        in the cannon form the last block it multiplied (half the sequence, half the contraction)."""
        return size // self.column_parts

    def units(self, size: int) -> int:
        """One rank's part of a size split over heads, ffn units or the vocabulary."""
        return size // self.degree

    def rows(self, tokens: int) -> int:
        """One rank's tokens of a tensor between a row output and a column input."""
        return tokens // self.degree if self.sequence_parallel else tokens


WHOLE = TensorSplit()


def tensor_split(axes: AxisPlan, workload: Workload) -> TensorSplit:
    """The activations' split under `axes`' tensor degree and `workload`'s sequence parallelism."""
    # Compiled for the CPU the cannon form's steps are within the gather form's bounds counting the
    # whole inputs (`benchmarks.tensor_cannon`), so the gather form's count stands there.
    cannon = matmul_form(workload.boundaries) == "cannon" and workload.platform != "cpu"
    parts = CANNON_BLOCKS if cannon else 1
    return TensorSplit(axes.tensor, axes.tensor > 1 and workload.sequence_parallel, parts)


def layer_gradients_held(workload: Workload, split: TensorSplit) -> int:
    """How many layers' full-size weight gradients the layers' backward holds at its peak.

    One, except in a sequence-parallel step compiled for a GPU: there XLA double-buffers the loop's
    weight gradients, so one layer's gradient waits for its reduce-scatter while the next layer's is
    computed (LLaMA-7B's width on H100s: each ffn weight gradient beside its double-buffer clone at
    the peak; without sequence parallelism, no clone).
    """
    return 2 if split.sequence_parallel and workload.platform != "cpu" else 1


def activation_itemsize(workload: Workload) -> int:
    """Bytes per element of the activations the step holds on its backend.

    Where XLA runs 16-bit dots in fp32 (`backend.widens_16bit_dots`: XLA:CPU before jaxlib 0.11) its
    float normalisation converts their operands, the saved residual stacks included, to fp32 copies,
    so the step holds its activations in fp32; elsewhere it holds them in the compute dtype.
    """
    act = workload.precision.param_bytes
    return max(act, FP32) if backend.widens_16bit_dots(workload.platform) else act


def attention_kind(workload: Workload) -> str:
    """The attention the step runs: `auto` resolved as `amsp_jax.models.attention` resolves it.

    `auto` is cuDNN's flash attention where the step is lowered for a GPU in 16-bit with a head_dim
    cuDNN takes (a multiple of 8 up to 128), and the blockwise attention everywhere else (the CPU, fp32).
    """
    d = workload.dims
    if d.attention != "auto":
        return d.attention
    cudnn = workload.platform != "cpu" and workload.precision.param_bytes < FP32
    return "cudnn" if cudnn and d.head_dim % 8 == 0 and d.head_dim <= 128 else "blockwise"


def keeps_logits_gradient(workload: Workload, split: TensorSplit = WHOLE) -> bool:
    """Whether the head's weight gradient runs after the layers' backward, keeping its operands through it
    (`backend.keeps_logits_gradient`: XLA:GPU, unless it splits that gemm into its most parts)."""
    head_outputs = workload.dims.dim * split.units(workload.dims.vocab_size)
    return backend.keeps_logits_gradient(workload.platform, head_outputs=head_outputs)


def logits_bytes(workload: Workload, split: TensorSplit = WHOLE) -> tuple[int, int]:
    """(bytes the loss's peak holds for the logits, bytes the head's weight gradient keeps through the
    layers' backward) per micro-batch and device.

    Without a tensor axis the loss holds two logits-sized buffers in the activations' dtype (the logits
    and their gradient), or one where the backend writes the gradient over the logits
    (`backend.writes_logits_gradient_in_place`). With one, each rank computes its vocabulary slice and
    gathers the whole logits for the loss, which keeps only the rank's slice of their gradient: the
    gathered logits beside the gather's input slice, and XLA:GPU's gradient slice (it fuses the loss
    into the gathered logits' consumers) or XLA:CPU's second whole buffer (the loss's select over the
    vocabulary). Where the backend runs the head's weight gradient after the layers
    (`keeps_logits_gradient`), it keeps both its operands through the layers' backward: the slice and
    the head's input.
    """
    tokens = workload.micro_batch_size * workload.seq_len
    whole = tokens * workload.dims.vocab_size * activation_itemsize(workload)
    local = split.units(whole)
    # The head's input: the final norm's output, whole (gathered over the sequence under a tensor axis).
    head_input = tokens * workload.dims.dim * activation_itemsize(workload)
    kept = local + head_input if keeps_logits_gradient(workload, split) else 0
    if split.degree == 1:
        return (1 if backend.writes_logits_gradient_in_place(workload.platform) else 2) * whole, kept
    return whole + local + (local if workload.platform != "cpu" else whole), kept


def activation_bytes(workload: Workload, split: TensorSplit = WHOLE) -> tuple[int, int]:
    """(bytes kept per layer for the backward pass, bytes of one layer's full forward) per micro-batch
    and device, in the compute dtype, with `auto` counted as cuDNN's attention and a blockwise
    attention's block of scores in the layer (the block the time model's memory passes were fitted
    with); `split`: one tensor rank's part (`TensorSplit`)."""
    d = workload.dims
    kept, full_layer = _layer_activations(workload, workload.precision.param_bytes, d.attention, split)
    if d.attention == "blockwise":
        full_layer += _score_block(workload, split) * 2 * (FP32 + workload.precision.param_bytes)
    return (full_layer if workload.remat == "none" else kept), full_layer


def _score_block(workload: Workload, split: TensorSplit) -> int:
    """Scores in one (query block, key block) tile of the blockwise attention, every head of a rank."""
    block = min(workload.dims.attention_block, workload.seq_len)
    blocks = -(-workload.seq_len // block)
    block = -(-workload.seq_len // blocks)  # the attention's tiling: equal blocks covering the sequence
    return workload.micro_batch_size * split.units(workload.dims.n_heads) * block * block


def _layer_activations(workload: Workload, act: int, attention: str, split: TensorSplit) -> tuple[int, int]:
    """(bytes kept per layer for the backward pass, bytes of one layer's activations) per micro-batch
    and tensor rank, activations `act` bytes per element, a blockwise attention's tile of scores left
    out."""
    d, b, t = workload.dims, workload.micro_batch_size, workload.seq_len
    tokens, heads = b * t, split.units(d.n_heads)
    rows = split.rows(tokens)  # the norms' and residuals' tokens
    q, kv, ffn = split.units(d.dim), split.units(2 * d.n_kv_heads * d.head_dim), split.units(d.ffn_dim)
    dq = tokens * split.units(d.n_heads * d.head_dim) * FP32  # a flash attention's fp32 dQ accumulator
    if attention == "xla":
        # The scores of every (query, key) pair: at the backward's peak the fp32 scores, the
        # probabilities and their gradients: a lower bound for small models, where XLA also keeps
        # transposed copies of them.
        attention_bytes = b * heads * t * t * (2 * FP32 + act)
    else:
        # Flash-style: fp32 softmax statistics per row and head (kept for the backward) and the
        # backward's fp32 dQ accumulator (the forward's fp32 output accumulator is no larger); the
        # scores stay in on-chip memory (cuDNN) or one tile at a time (blockwise, `layer_backward`).
        attention_bytes = b * heads * t * FP32 + dq
    # What the backward reads of one layer (JAX's saved residuals; the same buffers in the GPU-compiled
    # scan): per RMSNorm its fp32 input and normalised output and the activation-dtype result, the
    # attention's q, k, v and output, and six ffn-sized tensors (both projections, sigmoid, silu and
    # their product). Each norm's result is the whole input of the column matmuls after it.
    columns = 2 * split.column_input(tokens * d.dim)
    full_layer = rows * 4 * FP32 * d.dim + act * (columns + tokens * (2 * q + kv + 6 * ffn)) + attention_bytes
    kept = {
        "full": act * rows * d.dim,
        # Dot outputs the backward needs (q, k, v, the output projection: a whole partial sum under
        # tensor parallelism, both ffn up-projections) and the layer input; the down projection's
        # output is only added to the residual stream.
        "dots": act * (rows * d.dim + tokens * (q + kv + 2 * ffn + d.dim)),
        # Every layer's residuals, but the blockwise attention's dQ accumulator: only its backward's.
        "none": full_layer - (attention == "blockwise") * dq,
    }[workload.remat]
    return kept, full_layer


def weight_gradient_partials(workload: Workload, split: TensorSplit = WHOLE) -> int:
    """Bytes of the fp32 partial sums of the largest of a layer's weight-gradient gemms that the backend
    splits over their contraction (`backend.contraction_parts`), one gemm's at a time, per tensor rank:
    the attention's output projection, its q, k and v projections (one gemm) and an ffn projection."""
    d = workload.dims
    q, kv = d.n_heads * d.head_dim, 2 * d.n_kv_heads * d.head_dim
    outputs = (d.dim * split.units(q), d.dim * split.units(q + kv), d.dim * split.units(d.ffn_dim))
    parts = [(backend.contraction_parts(workload.platform, n), n) for n in outputs]
    return max((k * n * FP32 for k, n in parts if k > 1), default=0)


def layer_backward(workload: Workload, split: TensorSplit = WHOLE) -> tuple[int, int]:
    """(bytes kept per layer for the backward pass, bytes one layer's backward holds at its peak) per
    micro-batch and device, on the step's backend (`activation_itemsize`, `attention_kind`); `split`:
    one tensor rank's part (`TensorSplit`).

    The layer holds the backend's ffn-sized tensors (`backend.ffn_tensors_in_backward`) and one split
    weight gradient's fp32 partial sums (`weight_gradient_partials`).
    A blockwise attention's backward peaks apart from the rest of the layer, at one tile's fp32 score
    buffers beside the attention's inputs, output and fp32 gradient accumulators. Where the sequence is
    one tile, XLA computes the tile's probabilities (and their 16-bit cast for dV's matmul) ahead of
    the rest of the layer's backward, which runs beside them; the attention's peak then holds the fp32
    probabilities and score gradients and the gradient in the compute dtype (16 bytes per score in
    fp32, where XLA also transposes it for dK's matmul; 10 in 16-bit). In a loop over tiles nothing
    is computed ahead, and in 16-bit the tile's fp32 scores are live beside the probabilities and
    their gradients (12 bytes per score; 16 in fp32 as above).
    """
    d, tokens = workload.dims, workload.micro_batch_size * workload.seq_len
    act, compute = activation_itemsize(workload), workload.precision.param_bytes
    kind = attention_kind(workload)
    kept, layer = _layer_activations(workload, act, kind, split)
    # The ffn-sized tensors the backend holds at the layer's peak beside the six the residuals count.
    layer += (backend.ffn_tensors_in_backward(workload.platform) - 6) * act * tokens * split.units(d.ffn_dim)
    layer += weight_gradient_partials(workload, split)
    if kind != "blockwise":
        return kept, layer
    scores = _score_block(workload, split)
    q, kv, rows = split.units(d.dim), split.units(2 * d.n_kv_heads * d.head_dim), split.rows(tokens)
    # The layer input, q, k, v and the attention's output, with the fp32 normalised input and the fp32
    # dQ, dK and dV accumulators.
    around = act * (rows * d.dim + tokens * (2 * q + kv)) + FP32 * (rows * d.dim + tokens * (q + kv))
    cast = compute if compute < FP32 else 0  # an fp32 step casts nothing
    one_tile = workload.seq_len <= d.attention_block
    per_score = 2 * FP32 + 2 * compute - cast  # probabilities, score gradients and their cast
    per_score = per_score if one_tile else max(per_score, 3 * FP32)  # the scores too
    ahead = scores * (FP32 + cast) if one_tile else 0
    return kept, max(layer + ahead, scores * per_score + around)


def fused_matmul_bytes(workload: Workload, split: TensorSplit) -> tuple[int, int]:
    """(bytes at the loss's peak, bytes at the layers' backward's peak) that a fused matmul form holds
    beyond the gather form's, per micro-batch and device, in a step compiled for a GPU (LLaMA-1B's and
    7B's widths at t = 4 on H100s, the buffers live at each peak beside the gather form's):
      - the loss: the head's fused matmul and the recomputed last layer's exchanges are in flight beside
        it, their blocks sent, received and joined: t whole-sequence activations of the layer's width;
        in the ring form also the zero fill its head's output shares with the input embedding's
        gradient, held from the head's forward to that gradient, through the layers' backward too;
      - the layers' backward: each ring step of the ffn's matmuls (`tensor_ring`) computes its own
        weight gradient, and XLA computes all t before it sums them, beside the up-projections' running
        sum; the cannon form's (`tensor_cannon`) up-projection backward holds four sets of their kernel
        blocks: the gradients of both products, the blocks received from across the square and the
        gradient blocks exchanged out of it.
    XLA:CPU runs without them (its compiled steps are within the gather form's bounds).
    """
    form = matmul_form(workload.boundaries)
    if form == "gather" or workload.platform == "cpu":
        return 0, 0
    d, t, itemsize = workload.dims, split.degree, workload.precision.param_bytes
    tokens, down = workload.micro_batch_size * workload.seq_len, d.dim * split.units(d.ffn_dim) * itemsize
    if form == "ring":
        # The head's output slice, zero-filled once with an embedding gradient of its shape.
        logits = (split.units(d.vocab_size), tokens)
        shared = any(leaf.looked_up and leaf.local_shape(t) == logits for leaf in workload.leaves)
        fill = math.prod(logits) * itemsize if shared and backend.shares_zero_fills(workload.platform) else 0
        return t * tokens * d.dim * itemsize + fill, (t - 1) * 3 * down + 2 * down + fill
    return t * tokens * d.dim * itemsize, 4 * 2 * down  # `down`: one rank's slice of an ffn kernel


def _leaf_sums(axes: AxisPlan, workload: Workload) -> Counter[str]:
    """Bytes per device summed over the leaves, by what `memory` prices them as."""
    p_bytes = workload.precision.param_bytes
    gathered_bytes = workload.wire_bytes(p_bytes)
    reduce_bytes = workload.wire_bytes(workload.precision.reduce_bytes)
    g_bytes = jnp.dtype(schedule.grad_dtype(workload.micro_batches, workload.precision.reduce_dtype)).itemsize
    # Where XLA widens 16-bit dots (`backend.widens_16bit_dots`) it converts a stored 16-bit P block to
    # fp32 once and holds the copy all step.
    copy_bytes = FP32 if activation_itemsize(workload) > p_bytes else 0
    sums: Counter[str] = Counter()
    stored = not schedule.params_from_master(axes.strategy)
    p_axes = set(axes.axes("params"))
    for leaf in workload.leaves:
        scheduled = schedule_leaf(axes, workload, leaf)
        split = scheduled.split
        p_block = _block_elements(axes, split, "params")
        g_block = 0 if leaf.frozen else _block_elements(axes, split, "grads") * g_bytes
        os_block = _block_elements(axes, split, "opt_state") * FP32
        sums["params"] += p_block * p_bytes
        sums["grads"] += g_block
        sums["master"] += os_block
        sums["trained_master"] += 0 if leaf.frozen else os_block
        if scheduled.refresh and stored and not leaf.frozen:
            sums["refresh"] = max(sums["refresh"], p_block * p_bytes)
        whole = math.prod(split.rank_padded)
        sums["fp32_copies"] += p_block * copy_bytes if stored else 0
        if leaf.per_layer if leaf.per_layer is not None else leaf.stacked:
            # One layer's share: a stacked leaf holds every layer; blocks gathered call by call (a
            # loop of equal blocks) are counted as the same share of all of them.
            layers = leaf.shape[0] if leaf.stacked else workload.dims.n_layers
            sums["layer_full"] += whole // layers * gathered_bytes
            sums["layer_extra"] += (whole - p_block) // layers * gathered_bytes
            sums["layer_grad"] += 0 if leaf.frozen else whole // layers * reduce_bytes
            if scheduled.keeps_first_layer:  # gathered, and its fp32 gradient sums
                sums["first_layer"] += whole // layers * (gathered_bytes + (0 if leaf.frozen else FP32))
            if not stored and leaf.stacked and any(d != 1 for a, d in split.axis_dims if a in p_axes):
                # Cast from the master and gathered along a dimension other than a layer's major one:
                # XLA transposes the whole fp32 master block once, before the layer loops, and keeps it
                # (LLaMA-7B mics at 1,024 A100s: the two ffn up-projections, 688 MiB each).
                sums["transposed"] += os_block
        else:
            sums["other_extra"] += (whole - p_block) * gathered_bytes
            sums["looked_up_extra"] += (whole - p_block) * gathered_bytes if leaf.looked_up else 0
            sums["other_grads"] += g_block
    return sums


def memory(axes: AxisPlan, workload: Workload) -> Memory:
    """Per-device memory of one step: the model states, and what each peak holds beside them (`Memory`)."""
    s = _leaf_sums(axes, workload)
    params, grads, trained_master = s["params"], s["grads"], s["trained_master"]
    opt_state = trained_master // FP32 * workload.opt_state_bytes_per_param
    split = tensor_split(axes, workload)
    kept, layer_peak = layer_backward(workload, split)
    layers = workload.dims.n_layers
    logits, kept_logits = logits_bytes(workload, split)
    saved = layers * kept
    fused_loss, fused_backward = fused_matmul_bytes(workload, split)
    if workload.remat == "none":
        # The forward's scan keeps every layer's gathered weights as residuals, a copy even where P
        # is replicated.
        saved += layers * s["layer_full"]
    accumulating = schedule.accumulates(workload.micro_batches)
    # With an accumulator one micro-batch's gradient (fp32, G's size) sits beside it; without one
    # the micro-batch's gradient is G. The leaves outside the layers get theirs after the layers in the
    # backward; at the loss only the head's has begun, the layers' gradients start with their backward.
    accumulation = grads if accumulating else 0
    accumulation_at_loss = s["other_grads"] if accumulating else 0
    prefetch = schedule.uses_prefetch(
        workload.micro_batches, workload.remat, layers, workload.implementation.prefetch,
        stack=not workload.looped_blocks,
    )  # fmt: skip
    other_extra, transposed, first_layer = s["other_extra"], s["transposed"], s["first_layer"]
    held = accumulating or prefetch
    held_other = other_extra if held else 0
    # Gathered once and not held, a table the forward only indexes is dead after the lookup.
    at_loss = other_extra if held else other_extra - s["looked_up_extra"]
    # The rotary embedding's fp32 cosine and sine tables, live from the forward to the last backward.
    rotary = workload.seq_len * workload.dims.head_dim * FP32
    # A kept first layer is held through every micro-batch: priced with the activations, which are
    # priced per batching, since it is the same whatever the placement.
    peaks = {
        "start": _start_peak(axes, workload, s),
        "loss": Peak(
            gathered=at_loss + s["fp32_copies"], grads=accumulation_at_loss, p_with_os=transposed,
            activations=saved + logits + first_layer + fused_loss + rotary,
        ),
        "backward": Peak(
            gathered=(3 if prefetch else 1) * s["layer_extra"] + held_other + s["fp32_copies"],
            grads=accumulation - s["other_grads"],
            p_with_os=transposed,
            activations=(
                saved + kept_logits + layer_peak + layer_gradients_held(workload, split) * s["layer_grad"]
                + first_layer + fused_backward + rotary
            ),
        ),
        "update": Peak(opt_state=0 if workload.update_in_place else trained_master),
        "refresh": Peak(grads=-grads, p_with_os=s["refresh"]),
    }  # fmt: skip
    from_master = params if schedule.params_from_master(axes.strategy) else 0
    # The memory passes are priced by the gather form's block (`amsp-jax profile` fitted them on it).
    passes = _passes_block(workload, dataclasses.replace(split, column_parts=1))
    return Memory(params - from_master, grads, s["master"], opt_state, passes, peaks, from_master)


def _start_peak(axes: AxisPlan, workload: Workload, s: Counter[str]) -> Peak:
    """Before the first layer: every leaf outside the layers gathered at once beside the first layers'
    gathered weights, as many as XLA's combine threshold takes in one collective
    (`backend.layers_gathered_at_start`); nothing where the backend has no such peak."""
    at_start = backend.layers_gathered_at_start(workload.platform)
    if not at_start:
        return Peak()
    threshold = backend.combine_thresholds(workload.platform, largest_gather_bytes(axes, workload))
    layers = int(min(at_start * s["layer_extra"], threshold["all-gather"]))
    return Peak(
        gathered=s["other_extra"] + layers + s["fp32_copies"], p_with_os=s["transposed"],
        activations=s["first_layer"],
    )  # fmt: skip


def _passes_block(workload: Workload, split: TensorSplit) -> int:
    """The block the memory passes are priced by (`amsp_jax.cost.timing`): the saved inputs, one layer's
    full activations and two fp32 logits-sized buffers, as `amsp-jax profile` fitted them."""
    kept, full_layer = activation_bytes(workload, split)
    logits = workload.micro_batch_size * workload.seq_len * workload.dims.vocab_size
    return workload.dims.n_layers * kept + full_layer + 2 * logits * FP32
