"""The bytes a GPU step's memory-bound kernels touch, from the plan's blocks and the model's shape.

On one GPU a third of a ~1B LLaMA step is kernels that run at the memory's speed, not the tensor
cores': the norms, rotary embeddings, activations, casts, the loss's softmax, the gradient
accumulator and the optimizer update (`benchmarks/gpu_step.py`, traced). Their time is the bytes they
touch over one bandwidth per card (`gpu_step --traffic`: the compiled bytes over the kernels' measured
seconds). What the time model needs is those bytes for a plan it has not compiled, so they are written
as a linear form in what the plan and the shape fix, one coefficient per term:

    bytes = Σ_block k_block · B_block                          (P, G, OS: the placement's blocks)
          + k_grads_reduced · B_grads   where G is reduced across devices
          + k_weights · 4Φ · M                                  (every parameter, per micro-batch)
          + k_accumulator · 4Φ · [M > 1]                        (the micro-batch loop's accumulator)
          + k_logits · 4 · T · V                                (the logits and their gradient)
          + Σ_{x ∈ D, F, K} (k_{remat,x} + k_{loop,remat,x} · [M > 1]) · 2 · T · L · x
                                                                (a layer's activations, by remat)

with B_block the bytes per device of the stored P (0 where the gathers cast the master), the G block
counted in fp32 and the fp32 master (`timing.pass_blocks`), Φ parameters, M micro-batches, T tokens
per device and step, V the vocabulary, L layers, D the width, F the MLP's and K the key/value
projection's width. Why these terms: the optimizer update reads and writes the master and its moments
once per step (OS); the gradient is cast, accumulated and clipped on its G block, and passed again
around the collective that reduces it (G); a P stored apart from the master is cast from it (P); each
micro-batch casts and passes every full-size weight and gradient whatever the placement (weights); the
loss passes the (T, V) logits a few times; and a layer's elementwise work is linear in its tokens and
its widths, with a different count per remat policy (recomputation runs the forward's kernels again,
`dots` keeps the projections' outputs and recomputes the rest). With more than one micro-batch the step
is a loop over them, and the loop is a program of its own: it zeroes and carries an fp32 gradient
accumulator (accumulator), and XLA copies the layer loop's stacked residuals out of each trip's buffers
(loop activations: the compiled 1B-class steps copy the saved ffn and fp32 norm inputs under remat
`none`, less under `dots`, nothing under `full`), so the bytes are not linear in M from M = 1.

The coefficients are fitted by `benchmarks/gpu_traffic_fit.py` on probe steps compiled for H100s on a
machine without a GPU (no measured time enters them): LLaMA shapes whose widths, vocabularies and
tokens per parameter move each term on its own, two of them at 1B-class widths, on one device (every
remat, one, two and four micro-batches) and on four (ddp, zero1, zero2, zero3: the blocks apart). The
counted traffic is `amsp_jax.compiled.hlo.memory_traffic`, which counts an in-place update by the slot
it writes, not read: counting the slot read put the traced in-place updates of the layer loop above the
card's memory speed. They live in `amsp_jax/configs/traffic/xla-gpu.yaml` with
their source. The time model prices these bytes at the profiled memory bandwidth (`bandwidth`) for a
GPU whose compute was measured (`applies`): the shipped datasheet configs assume a compute efficiency
that already stands for the memory-bound kernels, and a profiled CPU host fits its own passes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from amsp_jax.core import backend, config_files
from amsp_jax.cost.bandwidth import ClusterConfigError
from amsp_jax.cost.hardware import ClusterConfig
from amsp_jax.cost.workload import FP32, Workload

REMATS = ("none", "dots", "full")
WIDTHS = ("dim", "ffn", "kv")
BLOCK_TERMS = ("params", "grads", "opt_state", "grads_reduced")
"""The terms that depend on the P, G and OS placements."""
TERMS = (
    *BLOCK_TERMS, "weights", "accumulator", "logits",
    *(f"{r}.{w}" for r in REMATS for w in WIDTHS),
    *(f"loop.{r}.{w}" for r in REMATS for w in WIDTHS),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TrafficForm:
    """Bytes touched per byte of each term (`TERMS`), and where they were fitted."""

    coefficients: Mapping[str, float]
    source: str = ""

    def bytes(self, terms: Mapping[str, float]) -> dict[str, float]:
        """Bytes of each term: its coefficient times its size."""
        return {name: self.coefficients[name] * size for name, size in terms.items()}


def grad_terms(grad_block: float, devices: int) -> dict[str, float]:
    """The G block's terms: its own passes, and again where it is reduced across `devices` (> 1)."""
    return {"grads": grad_block, "grads_reduced": grad_block if devices > 1 else 0.0}


def terms(blocks: Mapping[str, float], workload: Workload, devices: int) -> dict[str, float]:
    """Each term's size for one step on one of `devices` devices: the placement's blocks
    (`timing.pass_blocks`) and the shape's products (module docstring)."""
    d = workload.dims
    tokens = workload.tokens_per_device()
    looped = workload.micro_batches > 1
    per_layer = 2.0 * tokens * d.n_layers
    widths = {"dim": d.dim, "ffn": d.ffn_dim, "kv": d.n_kv_heads * d.head_dim}
    found = {
        "params": blocks["params"],
        **grad_terms(blocks["grads"], devices),
        "opt_state": blocks["opt_state"],
        "weights": float(FP32 * workload.num_params * workload.micro_batches),
        "accumulator": float(FP32 * workload.num_params) if looped else 0.0,
        "logits": float(FP32 * tokens * d.vocab_size),
    }
    for remat in REMATS:
        for name, width in widths.items():
            size = per_layer * width if remat == workload.remat else 0.0
            found[f"{remat}.{name}"] = size
            found[f"loop.{remat}.{name}"] = size if looped else 0.0
    return found


def applies(cluster: ClusterConfig) -> bool:
    """Whether `cluster` prices its memory-bound kernels by the GPU traffic form: a GPU whose matmul
    rates were measured (`amsp-jax profile`). A datasheet config's assumed compute efficiency already
    stands for those kernels (`h100-dgx.yaml` says so), and a CPU host measures its own passes."""
    return cluster.platform == "gpu" and cluster.memory_passes is None and cluster.matmul_rates is not None


def bandwidth(cluster: ClusterConfig) -> float:
    """Bytes/s the form's bytes are priced at: the fastest elementwise pass the profile measured.

    A pass over a larger buffer spreads its launch over more bytes, so at steady state it runs no slower
    than one over a smaller buffer; a lower reading at the largest size is a disturbed sample, not the
    memory's speed. One recorded H100 profile read 2.51 TB/s at 16 MiB and 1.46 at 64 MiB where two
    others of that card read 2.32 and 2.37 at 64 MiB (`benchmarks/results/gpu_step-llama3-1b_h100_
    20261126-0743.json`); its step's memory-bound kernels ran at 2.8-3.7 TB/s of compiled traffic.
    """
    table = cluster.memory_bandwidths
    return max(cluster.hbm_bandwidth, *(table.busbw if table is not None else ()))


def seconds(form: TrafficForm, sizes: Mapping[str, float], cluster: ClusterConfig) -> float:
    """Seconds of the traffic of `sizes` (a subset of `terms`) on `cluster`."""
    return sum(form.bytes(sizes).values()) / bandwidth(cluster)


def from_dict(values: Mapping[str, object], where: str) -> TrafficForm:
    """A `TrafficForm` from its parsed YAML: `coefficients` by term, `activations` and
    `loop_activations` by remat and width."""
    coefficients = dict(values.get("coefficients") or {})  # type: ignore[call-overload]
    for group, prefix in (("activations", ""), ("loop_activations", "loop.")):
        for remat, widths in (coefficients.pop(group, None) or {}).items():
            for width, value in (widths or {}).items():
                coefficients[f"{prefix}{remat}.{width}"] = value
    missing, unknown = set(TERMS) - set(coefficients), set(coefficients) - set(TERMS)
    if missing or unknown:
        raise ClusterConfigError(
            f"{where}: the traffic form needs exactly the terms {', '.join(TERMS)} "
            f"(missing {sorted(missing)}, unknown {sorted(unknown)})"
        )
    numbers = {}
    for name, value in coefficients.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ClusterConfigError(f"{where}: coefficient {name} = {value!r} is not a number")
        numbers[name] = float(value)
    return TrafficForm(numbers, str(values.get("source", "")))


def load(path: str | Path | None = None) -> TrafficForm:
    """The traffic form of a YAML file, by default the shipped one fitted on the installed jaxlib's XLA
    (`backend.traffic_form`: `configs/traffic/xla-gpu.yaml` before jaxlib 0.12)."""
    if path is None:
        return shipped()
    values = config_files.read_mapping(Path(path), ClusterConfigError, "traffic coefficients")
    return from_dict(values, str(path))


def shipped() -> TrafficForm:
    """The shipped form for the jaxlib the cost model predicts (`backend.JAXLIB`), each read once."""
    return _shipped(backend.traffic_form())


@functools.cache
def _shipped(name: str) -> TrafficForm:
    with resources.as_file(resources.files("amsp_jax") / "configs" / "traffic" / f"{name}.yaml") as p:
        return load(p)
