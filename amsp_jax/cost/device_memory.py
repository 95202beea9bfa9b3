"""Predicted memory per device: the model states, and what the step holds at each of its peaks."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from amsp_jax.core import schedule
from amsp_jax.core.mesh import AxisPlan, LeafLayout
from amsp_jax.cost.traffic import schedule_leaf
from amsp_jax.cost.workload import FP32, Workload


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
