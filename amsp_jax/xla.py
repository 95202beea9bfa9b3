"""XLA options that let the step's collectives overlap with compute on GPU (passed per compile).

On GPU the latency-hiding scheduler moves each layer's all-gather ahead of the layer's compute and
each reduce-scatter behind it; the collective pipeliner prefetches loop iteration i+1's gather into
iteration i (that is the per-layer prefetch the step needs: it is done by XLA, not by carrying gathered
weights through the scan, which would make them scan residuals and keep every layer gathered).
Combine thresholds sized to one layer keep XLA from merging several layers' collectives into one
that can no longer overlap. The names follow MaxText's H100 settings.

On CPU, runs of many steps need one flag, for correctness (`add_cpu_flags`): XLA:CPU's
concurrency-optimised scheduler lets independent collectives (one leaf's G→OS reduce-scatter,
another's P refresh all-gather) become ready together; its runtime then runs some of them on a
thread pool that every simulated device shares, and when devices take them in different orders
every pool thread can end up waiting in a rendezvous that a device without a thread must join: the
step hangs until XLA aborts the process. Seen with p=2x1,g=4x1,os=4x2 on 2 x 4 devices within a
few hundred steps; with the scheduler off, 2,000 steps ran, no slower. The flag must be in
XLA_FLAGS when the backend starts (as a per-compile option XLA ignores it). It changes the CPU
schedule and so the compiled memory of some plans (a tiny model under p=4x2,g=4x1,os=1x1: 524 KB
to 648 KB), so it is set where simulated devices are made for training and benchmarks
(`amsp_jax.distributed.simulate_cpu_devices`, the `amsp-jax` command, `benchmarks/`), not on import:
the tests compile XLA's default CPU schedule.
"""

from __future__ import annotations

import os
import sys

_MIB = 1 << 20
# A file where XLA keeps the GPU kernels it built, so that compiling many plans of one model (the audit
# tests, benchmarks/gpu_compiled.py) builds each kernel once; kernels do not change the scheduled program.
KERNEL_CACHE_ENV = "AMSP_JAX_GPU_KERNEL_CACHE"


def gpu_options(layer_bytes: int = 0) -> dict[str, object]:
    """The GPU compiler options; combine thresholds are at least one layer's bytes."""
    combine = max(layer_bytes, 64 * _MIB)
    cache = os.environ.get(KERNEL_CACHE_ENV)
    return ({"xla_gpu_kernel_cache_file": cache} if cache else {}) | {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        # XLA's analytical (GPU performance model) latencies for the scheduler instead of its fixed
        # approximations. Measured on LLaMA-7B at 1,024 A100s (benchmarks/results/gpu_compiled.md): the
        # share of per-layer collective bytes with compute between start and done rises from 66% to 85%
        # for zero3 and from 64% to 92% for mics (zero2: 87% to 79%).
        "xla_gpu_enable_analytical_latency_estimator": True,
        "xla_gpu_enable_highest_priority_async_stream": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
        "xla_gpu_all_gather_combine_threshold_bytes": combine,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": combine,
        "xla_gpu_all_reduce_combine_threshold_bytes": 2 * combine,
    }


def compiler_options(platform: str, layer_bytes: int = 0) -> dict[str, object] | None:
    """Options for `Lowered.compile` on `platform` (None: XLA's defaults)."""
    return gpu_options(layer_bytes) if platform in ("gpu", "cuda", "rocm") else None


def selects_in_place(platform: str) -> bool:
    """Whether XLA writes `where(ok, new, old)` over an element-wise optimizer update in place.

    GPU fuses the update and the select into kernels that read the old state and write the new over it
    (LLaMA-7B mics at 1,024 A100s: 5.4 GiB of temporaries; 11.6 GiB as a branch, whose update XLA does
    not run in place). XLA:CPU materialises the new moments before the select, so old and new are
    alive together (100M zero3 on 8 CPU devices: 144 MiB of temporaries; 134 MiB as a branch).
    """
    return platform != "cpu"


# XLA:CPU reads this when it creates the backend: a per-compile option leaves the schedule unchanged.
CPU_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def add_cpu_flags() -> bool:
    """Add `CPU_FLAGS` to XLA_FLAGS unless JAX has already created its backends; True if added."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and bridge.backends_are_initialized():
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [flag for flag in CPU_FLAGS if flag.partition("=")[0] not in flags]
    if missing:
        os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
    return bool(missing)
