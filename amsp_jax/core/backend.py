"""What XLA does per backend that the schedule and the cost model must know before anything compiles.

The step asks XLA for these (`compiled.xla.gpu_options`), and the schedule and the cost model read them
from here, so the three cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata

_MIB = 1 << 20
# The XLA whose programs the cost model predicts: the installed jaxlib's (a benchmark repricing programs
# another version compiled sets this to that version).
JAXLIB = metadata.version("jaxlib")
# XLA compares a reduce-scatter's combine threshold with the scattered block, so a threshold of one
# gathered layer would merge several layers' gradients into one collective that nothing can hide;
# 32 MiB keeps them per layer (benchmarks/results/xla_overlap_a100-sxm-80x1024_20261126-2229.md).
REDUCE_SCATTER_COMBINE_BYTES = 32 * _MIB
# jaxlib < 0.11: XLA's analytical latency estimator schedules a GPU step; later jaxlibs abort in it, so
# the step is scheduled with a profile of its instruction costs (`compiled.xla.compile_scheduled`).
ANALYTICAL_ESTIMATOR_BEFORE = (0, 11)


# The host platform's XLA settings the library runs its CPU meshes with (`cpu_flags`). XLA:CPU hands
# elementwise ops and reductions to YNNPACK as well as dots; jaxlib 0.12's kernels for the former ran
# the steps of simulated devices sharing a host's cores longer than XLA's own loops, so from 0.12
# YNNPACK is kept to dots (0.10.2's ran faster than its loops, so earlier jaxlibs keep their default).
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
CPU_LIBRARY_FUSIONS = "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT"
CPU_LIBRARY_FUSIONS_FROM = (0, 12)


def cpu_flags(flags: str, devices: int | None = None) -> str:
    """`flags` (an `XLA_FLAGS` value) with what the CPU platform runs with added, each only where `flags`
    does not set it already: `devices` simulated devices (None: none asked for) and, from jaxlib 0.12,
    YNNPACK for dots only. XLA reads them when JAX creates its CPU backend, so they go into `XLA_FLAGS`
    before that."""
    names = {f.split("=")[0] for f in flags.split()}
    added = []
    if devices is not None and DEVICE_COUNT_FLAG not in names:
        added.append(f"{DEVICE_COUNT_FLAG}={devices}")
    installed = _version(metadata.version("jaxlib"))
    if installed >= CPU_LIBRARY_FUSIONS_FROM and CPU_LIBRARY_FUSIONS.split("=")[0] not in names:
        added.append(CPU_LIBRARY_FUSIONS)
    return " ".join([flags.strip(), *added]).strip()


@contextmanager
def predicting_for(jaxlib: str | None) -> Iterator[None]:
    """Predict as for the XLA of `jaxlib` (None: the installed one) while inside: which per-version
    behaviours and GPU traffic form apply follows that version, for programs another jaxlib compiled."""
    global JAXLIB
    installed = JAXLIB
    JAXLIB = jaxlib or installed
    try:
        yield
    finally:
        JAXLIB = installed


def _version(jaxlib: str | None) -> tuple[int, ...]:
    """(major, minor) of `jaxlib`, the installed one (`JAXLIB`) by default."""
    return tuple(int(part) for part in (jaxlib or JAXLIB).split(".")[:2] if part.isdigit())


def combine_thresholds(platform: str, layer_bytes: int = 0) -> dict[str, float]:
    """Bytes up to which XLA merges independent collectives of one kind into one, by kind (a kind it
    never merges is absent); the size compared is the merged op's result. `layer_bytes`: the step's
    largest single gather (`schedule.largest_gather_bytes`).

    On GPU these are the options `compiled.xla.gpu_options` sets: a gathered layer at least, so that one
    layer's gathers become one collective. XLA:CPU merges all-reduces without a limit and never merges
    all-gathers or reduce-scatters.
    """
    if platform == "cpu":
        return {"all-reduce": math.inf}
    combine = max(layer_bytes, 64 * _MIB)
    return {
        "all-gather": combine,
        "reduce-scatter": REDUCE_SCATTER_COMBINE_BYTES,
        "all-reduce": 2 * combine,
    }


def selects_in_place(platform: str) -> bool:
    """Whether XLA writes `where(ok, new, old)` over an element-wise optimizer update in place.

    XLA:GPU fuses the update and the select into kernels that write the new state over the old;
    XLA:CPU materialises the new moments before the select, so old and new are alive together.
    """
    return platform != "cpu"


def widens_16bit_dots(platform: str, jaxlib: str | None = None) -> bool:
    """Whether XLA runs 16-bit dots in fp32 on `platform`, and so holds fp32 copies of their operands.

    XLA:CPU before jaxlib 0.11 has no 16-bit dot: its float normalisation converts the operands (the
    saved residuals and stored 16-bit P blocks among them) to fp32 copies. From 0.11 XLA:CPU runs them
    in bf16 (the same mixed-precision steps compile to 0.53-0.87x the memory of 0.10.2's, fp32 steps
    unchanged: benchmarks/results/memory_matrix_cpu8_*); a GPU always runs them in 16 bit.
    """
    return platform == "cpu" and _version(jaxlib) < (0, 11)


# XLA:GPU (jaxlib 0.10.2 and 0.12.0.1 alike) splits the contraction of a gemm whose output is too small
# to fill the GPU into fp32 partial sums: 1,048,576 outputs or fewer (a 1,024-wide attention output
# projection's weight gradient in 2 parts, a 256-token vocabulary slice of a 2,048-wide head in 4, every
# gemm of the 64-wide `tiny` in 16), never 2,097,152 or more (benchmarks/results/
# memory_backward_terms_h100-sxmx16-compiled_20261201-2333.md).
SPLIT_CONTRACTION_MAX = 1 << 20
# The parts hold this many fp32 partial sums between them, in at most `MAX_SPLIT` parts.
SPLIT_PARTIAL_SUMS = 1 << 21
MAX_SPLIT = 16


def contraction_parts(platform: str, outputs: int) -> int:
    """In how many fp32 partial sums over its contraction XLA computes a gemm of `outputs` output
    elements (1: whole; `SPLIT_CONTRACTION_MAX`)."""
    if platform == "cpu" or outputs > SPLIT_CONTRACTION_MAX:
        return 1
    return min(MAX_SPLIT, SPLIT_PARTIAL_SUMS // outputs)


def keeps_logits_gradient(platform: str, jaxlib: str | None = None, head_outputs: int | None = None) -> bool:
    """Whether the head's weight gradient runs after the layers' backward, keeping its two operands (the
    logits' gradient and the head's input) through it; `head_outputs`: the elements of the head's weight
    gradient (one tensor rank's), None for a wide one.

    XLA:GPU computes the head's weight gradient after the layers (jaxlib 0.10.2 and 0.12.0.1:
    Llama-3.2-1B's shape, LLaMA-1B's and 7B's widths and 1,024 and 2,048 wide on 2 × 8 H100s,
    benchmarks/results/memory_gpu_start_and_logits_h100-sxmx16-compiled_20261201-1929.md), split in 4
    parts too (`contraction_parts`: 2,048 wide at t = 4). Where jaxlib 0.11 and later split that gemm
    into its most parts (the 64-wide `tiny`), the split gemm runs at the loss and frees the logits'
    gradient there, as XLA:CPU's schedule does on every version
    (benchmarks/results/memory_logits_gradient_h100-sxmx16-compiled_20261128-0157.md).
    """
    if platform == "cpu":
        return False
    most = head_outputs is not None and contraction_parts(platform, head_outputs) == MAX_SPLIT
    return not (most and _version(jaxlib) >= ANALYTICAL_ESTIMATOR_BEFORE)


def ffn_tensors_in_backward(platform: str) -> int:
    """How many ffn-sized tensors a layer's backward holds at its peak.

    XLA:GPU fuses the gate's sigmoid and silu into the kernels that read the up-projections, so a
    layer's backward holds both recomputed up-projections and the gradients of the gated product and
    of the silu, four (jaxlib 0.10.2 and 0.12.0.1: LLaMA-1B's, 2,048 and LLaMA-7B's widths at 2,048-8,192
    tokens, t = 1 and 4; benchmarks/results/memory_backward_terms_h100-sxmx16-compiled_20261201-2333.md).
    XLA:CPU's count is the six of the saved residuals (both projections, the sigmoid, the silu and
    their product), within the CPU-compiled matrix's bounds.
    """
    return 6 if platform == "cpu" else 4


def writes_logits_gradient_in_place(platform: str, jaxlib: str | None = None) -> bool:
    """Whether the loss's backward writes the logits' gradient over the logits, so that the loss holds
    one logits-sized buffer where XLA:CPU holds two.

    XLA:GPU fuses the softmax's gradient into the kernel that reads the logits and gives its output the
    logits' buffer (jaxlib 0.10.2 and 0.12.0.1: the two at one offset in the buffer assignment,
    benchmarks/results/memory_gpu_start_and_logits_h100-sxmx16-compiled_20261201-1929.md).
    """
    return platform != "cpu"


def layers_gathered_at_start(platform: str, jaxlib: str | None = None) -> int:
    """How many layers' gathered weights the step holds at the forward's start beside every leaf outside
    the layers, all gathered at once (0: the backend has no such peak).

    XLA:GPU gathers the leaves outside the layers (the embedding and the head) in one all-gather before
    the first layer, and merges into it the gathers that loop peeling and double buffering move out of
    the layer loops, the forward's first layer and the backward's first two, up to its all-gather
    combine threshold (`combine_thresholds`; jaxlib 0.10.2 and 0.12.0.1, Llama-3.2-1B's shape and
    LLaMA-7B's width on 2 × 8 H100s,
    benchmarks/results/memory_gpu_start_and_logits_h100-sxmx16-compiled_20261201-1929.md).
    XLA:CPU gathers them where they are used.
    """
    return 0 if platform == "cpu" else 3


def shares_zero_fills(platform: str) -> bool:
    """Whether XLA gives two zero-filled buffers of one shape a single fill (common-subexpression
    elimination), which then lives from the first buffer's use to the last's.

    The ring form assembles the head's output, the rank's vocabulary slice of the logits, block by
    block in zeros (`tensor_ring.gather_matmul`), and the input embedding's gradient is summed into
    zeros of the rank's vocabulary slice by the lookup's transposed scatter; where a micro-batch's
    tokens equal the width the two have one shape, and XLA:GPU emits the fill once, in the head's
    forward, and holds it through the loss and the layers' backward to the embedding's gradient
    (jaxlib 0.10.2 and 0.12.0.1: LLaMA-1B's width at 2,048 tokens, t = 4; at 8,192 tokens the two fills
    are apart; benchmarks/results/memory_fused_loss_h100-sxmx16-compiled_20261202-0154.md).
    XLA:CPU's steps in the fused forms are priced as the gather form's, so it is not counted there.
    """
    return platform != "cpu"


def drops_unused_collective(platform: str, kind: str) -> bool:
    """Whether XLA removes a collective of `kind` whose result nothing reads (a layer's last
    row-parallel sum, recomputed under remat for nothing): XLA:CPU removes any; XLA:GPU an all-reduce,
    not a reduce-scatter."""
    return platform == "cpu" or kind == "all-reduce"


def hoists_loop_invariant_permutes(platform: str) -> bool:
    """Whether XLA moves a collective-permute whose operand is the same in every micro-batch (a
    kernel's block, outside the layers) out of the micro-batch loop: XLA:CPU does; XLA:GPU keeps it
    in the loop."""
    return platform == "cpu"


# The shipped GPU traffic forms (`amsp_jax.cost.memory_traffic`), by the oldest jaxlib each stands for:
# XLA's fusions, and so the bytes its memory-bound kernels touch, change between releases.
TRAFFIC_FORMS = (((0, 0), "xla-gpu"), ((0, 12), "xla-gpu-jaxlib0.12"))


def traffic_form(jaxlib: str | None = None) -> str:
    """The name of the shipped GPU traffic form fitted on programs of this jaxlib's XLA (`TRAFFIC_FORMS`):
    the form fitted on jaxlib 0.10.2 predicts 0.83 of what a 0.12.0.1 program's kernels touch
    (benchmarks/results/test_suite_versions_cpu2_20261128-1214.md)."""
    version = _version(jaxlib)
    return [name for since, name in TRAFFIC_FORMS if version >= since][-1]
