"""XLA options that let the step's collectives overlap with compute on GPU (passed per compile).

On GPU the latency-hiding scheduler moves each layer's all-gather ahead of the layer's compute and
each reduce-scatter behind it; the collective pipeliner prefetches loop iteration i+1's gather into
iteration i (that is the per-layer prefetch the step needs: it is done by XLA, not by carrying gathered
weights through the scan, which would make them scan residuals and keep every layer gathered).
Combine thresholds keep XLA from merging collectives that become ready at different times into one
that waits for the last of them and can no longer overlap. The names follow MaxText's H100 settings.

On CPU, simulated devices share one process, and XLA:CPU's runtime meets their collectives in a
rendezvous keyed by run, devices, kind and op id. JAX gives every shard_map collective the same
channel id, hence the same op id, so two collectives over one device group that a device has in
flight at once share a key. Both of XLA:CPU's schedules let that happen for some programs (a hang, or
more participants than devices in one rendezvous), so amsp_jax keeps XLA's default, which the tests
compile.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from amsp_jax.compiled import hlo
from amsp_jax.compiled.hlo.text import parse_module, scheduling_name
from amsp_jax.core.backend import ANALYTICAL_ESTIMATOR_BEFORE, combine_thresholds
from amsp_jax.cost.hardware import ClusterConfig, for_device_kind

if TYPE_CHECKING:
    from amsp_jax.core.mesh import Layout

# A file where XLA keeps the GPU kernels it built, so that compiling many plans of one model (the audit
# tests, benchmarks/gpu_compiled.py) builds each kernel once; kernels do not change the scheduled program.
KERNEL_CACHE_ENV = "AMSP_JAX_GPU_KERNEL_CACHE"


# XLA:GPU's scheduler and rematerialisation keep a program's temporaries under
# (BASE × device memory − arguments and outputs) × slop factor / 100; the base leaves room for
# allocations outside XLA's (gpu_hlo_schedule.cc, GetSchedulerMemoryLimit).
XLA_SCHEDULER_BASE = 0.8
# XLA's scheduler counts more than buffer assignment later allocates and stops overlapping collectives
# once its count reaches its budget, so it gets this much more than the plan's budget.
SCHEDULER_HEADROOM = 1.2


def scheduler_slop_factor(memory_limit: float, device_memory: int, io_bytes: int) -> int:
    """XLA's `xla_gpu_memory_limit_slop_factor` (percent) that gives its scheduler `SCHEDULER_HEADROOM`
    times `memory_limit` bytes for a program with `io_bytes` of arguments and outputs per device.

    XLA's default (95) schedules a plan made for most of a device as if it had much less memory, which
    leaves the layers' collectives with nothing to overlap.
    """
    room = XLA_SCHEDULER_BASE * device_memory - io_bytes
    budget = SCHEDULER_HEADROOM * memory_limit
    return max(1, int(100 * (budget - io_bytes) / room)) if room > 0 else 100


# jaxlib < 0.11: the collective pipeliner has options of its own; later jaxlibs pipeline under effort O1.
PIPELINER_OPTIONS_BEFORE = (0, 11)


def scheduler_options() -> dict[str, object]:
    """The latency-hiding scheduler's and the collective pipeliner's options for this jaxlib: the
    analytical estimator where it runs without aborting (elsewhere `compile_scheduled` gives the
    scheduler a profile), the pipeliner's options where they exist."""
    version = tuple(jax.__version_info__[:2])
    options: dict[str, object] = {}
    if version < ANALYTICAL_ESTIMATOR_BEFORE:
        options[ANALYTICAL_ESTIMATOR] = True
    if version < PIPELINER_OPTIONS_BEFORE:
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            options[f"xla_gpu_enable_pipelined_{kind}"] = True
    return options


# How many collectives XLA:GPU's scheduler may keep in flight at once; only a collective matmul's options
# carry it (`gpu_options`), so it also marks a program of the `ring` or `cannon` form.
OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
ANALYTICAL_ESTIMATOR = "xla_gpu_enable_analytical_latency_estimator"


# XLA's effort level O1 (`EFFORT_O1` of its `ExecutionOptions`; JAX's `jax_optimization_level`), passed
# per compile: on jaxlib >= 0.11, without the pipeliner's options, it is what overlaps the layer loops'
# collectives.
OPTIMIZATION_LEVEL_O1 = 19


def gpu_options(
    layer_bytes: int = 0, slop_factor: int | None = None, collective_matmul: bool = False
) -> dict[str, object]:
    """The GPU compiler options; the gather and all-reduce combine thresholds are at least one layer
    (`combine_thresholds`); `slop_factor` sets the scheduler's memory budget (`scheduler_slop_factor`).
    `collective_matmul` (a `ring` or `cannon` plan): two collectives may be in flight at once, so that
    a ring's (or a square's) transfers run beside the layer's weight gathers instead of waiting for them."""
    thresholds = combine_thresholds("gpu", layer_bytes)
    cache = os.environ.get(KERNEL_CACHE_ENV)
    budget = _memory_budget(slop_factor)
    return ({"xla_gpu_kernel_cache_file": cache} if cache else {}) | budget | {
        "optimization_level": OPTIMIZATION_LEVEL_O1,
        "xla_gpu_enable_latency_hiding_scheduler": True,
        **scheduler_options(),
        "xla_gpu_enable_highest_priority_async_stream": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_all_gather_combine_threshold_bytes": int(thresholds["all-gather"]),
        "xla_gpu_reduce_scatter_combine_threshold_bytes": int(thresholds["reduce-scatter"]),
        "xla_gpu_all_reduce_combine_threshold_bytes": int(thresholds["all-reduce"]),
        # A collective matmul's transfers are each hidden behind their own block product (`tensor_ring`).
        "xla_gpu_collective_permute_combine_threshold_bytes": 0,
    } | ({OVERLAP_LIMIT: 2} if collective_matmul else {})


def compiler_options(
    platform: str, layer_bytes: int = 0, slop_factor: int | None = None, devices: int = 2,
    collective_matmul: bool = False,
) -> dict[str, object] | None:  # fmt: skip
    """Options for `Lowered.compile` on `platform` over `devices` devices (None: XLA's defaults). One
    device has no collective to overlap: it gets only the memory budget, which XLA's rematerialization
    reads as well."""
    if platform not in ("gpu", "cuda", "rocm"):
        return None
    if devices < 2:
        return _memory_budget(slop_factor) or None
    return gpu_options(layer_bytes, slop_factor, collective_matmul)


def _memory_budget(slop_factor: int | None) -> dict[str, object]:
    """The option that sets XLA's scheduler memory budget (`scheduler_slop_factor`), if one is given."""
    return {} if slop_factor is None else {"xla_gpu_memory_limit_slop_factor": slop_factor}


# XLA renames and removes its options between releases and rejects a compile that names one it does not
# know, so such an option is left out rather than failing every GPU compile.
_UNKNOWN_OPTION = re.compile(r"No such compile option: '([^']+)'")
# Compile failures our options cause inside XLA, by a phrase of the error, and the options behind it, left
# out one at a time in this order while the error stays.
_FAILS_WITH = {
    # jaxlib < 0.11: while-loop double buffering clones a Triton gemm fusion after its tiling was chosen,
    # and the clone has none; effort level O1 double-buffers loops by itself.
    "Block level fusion config is required for Triton fusions": (
        "xla_gpu_enable_while_loop_double_buffering", "optimization_level",
    ),
}


def compile_lowered(lowered: Any, options: dict[str, object] | None) -> Any:
    """`lowered.compile(options)`, leaving out (with a warning naming them) the options this XLA does not
    know or fails to compile this program with."""
    return _compile(lowered, options)[0]


def _compile(lowered: Any, options: dict[str, object] | None) -> tuple[Any, dict[str, object]]:
    """`compile_lowered`'s program and the options it was compiled with."""
    options = dict(options or {})
    dropped = []
    while True:
        try:
            compiled = lowered.compile(options or None)
        except jax.errors.JaxRuntimeError as error:
            unknown = _UNKNOWN_OPTION.search(str(error))
            culprit = unknown.group(1) if unknown else _culprit(str(error), options)
            if culprit is None or culprit not in options:
                raise
            dropped.append(culprit)
            del options[culprit]
            continue
        if dropped:
            warnings.warn(
                f"this XLA (jax {jax.__version__}) does not know, or fails to compile this step with, the "
                f"compiler options {dropped}; compiled without them (the overlap they ask for may be on "
                "by default, or less)",
                stacklevel=3,
            )
        return compiled, options


def _culprit(error: str, options: dict[str, object]) -> str | None:
    """The next option of ours to leave out for an XLA compile failure we know (`_FAILS_WITH`), else None."""
    for phrase, culprits in _FAILS_WITH.items():
        if phrase in error:
            return next((option for option in culprits if option in options), None)
    return None


# The debug option that hands XLA's latency-hiding scheduler a profile of instruction costs (its
# profile-guided latency estimator, PGLE: costs by instruction name, in µs, for kernels and for the
# time between an async collective's start and done).
PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
# What one more kernel costs beyond its work (assumption: a CUDA kernel launch, a few µs).
KERNEL_LAUNCH_SECONDS = 2e-6


def scheduling_profile(
    hlo_text: str, hardware: ClusterConfig, node_of_device: Sequence[int], permutes_only: bool = False
) -> str:
    """The text of a `ProfiledInstructionsProto` that prices every instruction of a compiled program with
    the cost model's hardware (`hlo.instruction_seconds`): collectives as the time model does
    (`collective_seconds`), kernels by a roofline at its sustained FLOP/s and HBM bandwidth;
    `permutes_only`: its collective-permutes alone (XLA prices the rest as it would without a profile).

    Without it, XLA:GPU's scheduler prices every collective alike and every kernel by its kind alone
    (on jaxlib >= 0.11, whose analytical estimator aborts on this step): a few elementwise kernels then
    look long enough to hide a layer's gather.
    """
    seconds = hlo.instruction_seconds(
        hlo_text,
        len(node_of_device),
        lambda c: collective_seconds(c, hardware, node_of_device),
        hardware.sustained_flops,
        hardware.hbm_bandwidth,
        KERNEL_LAUNCH_SECONDS,
    )
    if permutes_only:
        computations, _ = parse_module(hlo_text)
        permutes = {
            scheduling_name(ins) for body in computations.values() for ins in body.values()
            if ins.opcode in ("collective-permute-start", "collective-permute")
        }  # fmt: skip
        seconds = {name: s for name, s in seconds.items() if name in permutes}
    return "".join(f'costs {{ name: "{name}" cost_us: {1e6 * s:.3f} }}\n' for name, s in seconds.items())


def collective_seconds(c: hlo.Collective, hardware: ClusterConfig, node_of_device: Sequence[int]) -> float:
    """Seconds of compiled collective `c` (its trip count's executions) on `hardware` by the time model's
    rules: a collective-permute as sends to one neighbour each (`ClusterConfig.permute_time`: one ring
    step, which keeps XLA's scheduler from spending every block product of a ring on one transfer),
    another at the bandwidth and latency of its kind, group and nodes."""
    groups = c.replica_groups or c.source_target_pairs
    group = max((len(g) for g in groups), default=1)
    nodes = max((len({node_of_device[d] for d in g}) for g in groups), default=1)
    level = "inter" if nodes > 1 else "intra"
    if c.kind == "collective-permute":
        return hardware.permute_time(hlo.bytes_per_device(c), level, c.trip_count)
    kind = c.kind if c.kind in ("all-gather", "reduce-scatter", "all-reduce") else "all-gather"
    return hardware.collective_time(kind, level, hlo.bytes_per_device(c), c.trip_count, group, nodes)


def compile_scheduled(
    lowered: Any, options: dict[str, object] | None, layout: Layout, collective_matmul: bool = False
) -> Any:
    """`compile_lowered`, then, where the options schedule a GPU program and a shipped cluster config
    describes its GPU (`cluster_config.for_device_kind`), once more with the first program's
    `scheduling_profile` (the second compile repeats its instruction names: the same passes run on the
    same program up to the scheduler): the whole profile without XLA's analytical estimator
    (`scheduler_options`), its collective-permutes alone beside it.

    Where the analytical estimator runs (jaxlib < 0.11) it prices the rest: with the whole profile as
    well, some looped collectives of the test model lose the compute that the estimator alone puts
    beside them. It has no runtime model for a collective-permute (XLA prices one as a kernel launch),
    so a collective matmul's program (`collective_matmul`: a `ring` or `cannon` plan) is given the
    permutes' prices, else its scheduler puts no block product beside a ring's transfer but by chance.
    """
    # The second compile starts from the options the first kept: no failed compile or warning twice.
    compiled, options = _compile(lowered, options)
    analytical = bool(options.get(ANALYTICAL_ESTIMATOR))
    if not options.get("xla_gpu_enable_latency_hiding_scheduler") or (analytical and not collective_matmul):
        return compiled
    cluster = layout.cluster
    kind = layout.mesh.devices.flat[0].device_kind
    hardware = for_device_kind(kind, cluster.nodes, cluster.devices_per_node)
    if hardware is None:
        return compiled
    nodes = layout.node_of_device()
    profile = scheduling_profile(compiled.as_text(), hardware, nodes, permutes_only=analytical)
    if not profile:
        return compiled
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "profile.pbtxt")
        path.write_text(profile)
        return compile_lowered(lowered, {**options, PROFILE_OPTION: str(path)})
