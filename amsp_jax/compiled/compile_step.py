"""Compiling a step program's `train_step` with the XLA options its plan calls for: the combine
threshold of its largest gather, the scheduler's memory budget and, on GPU, the overlap flags."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from amsp_jax.compiled import gpu_target
from amsp_jax.compiled.xla import compile_scheduled, compiler_options, scheduler_slop_factor
from amsp_jax.core.schedule import largest_gather_bytes
from amsp_jax.errors import one_line
from amsp_jax.step.batch import batch_shardings, check_batch
from amsp_jax.step.functions import train_step
from amsp_jax.step.program import StepProgram, TrainerError
from amsp_jax.step.state import state_shardings

# XLA's kernel autotuning level; 0 keeps its default tiling for each kernel.
DEVICELESS_AUTOTUNE_OPTION = "xla_gpu_autotune_level"


def lower(program: StepProgram, state: Any, batch: Any) -> jax.stages.Lowered:
    """The lowered (not yet compiled) step for this state and batch structure (shapes suffice)."""
    check_batch(program.plan, batch)
    shardings = state_shardings(program)
    replicated = NamedSharding(program.layout.mesh, P())
    step = jax.jit(
        functools.partial(train_step, program),
        in_shardings=(shardings, batch_shardings(program.layout, batch)),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
    )
    return step.lower(state, batch)


def cache_key(batch: Any) -> tuple[str, tuple[Any, ...]]:
    """What a compiled step depends on beyond its program: the batch's structure, shapes and dtypes."""
    shapes = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), batch)
    return str(jax.tree.structure(batch)), tuple(jax.tree.leaves(shapes))


def compile_step(program: StepProgram, state: Any, batch: Any) -> jax.stages.Compiled:
    """The compiled step for this state and batch structure, with the plan's XLA options."""
    layout = program.layout
    collective_matmul = layout.tensor > 1 and program.plan.fused_matmul
    slop, devices = _slop_factor(program, state, batch), layout.mesh.size
    options = compiler_options(layout.platform, gather_bytes(program), slop, devices, collective_matmul)
    try:
        lowered = lower(program, state, batch)
    except TypeError as error:
        if layout.tensor > 1 and "reshape" in str(error):
            # A model that reshapes a tensor-split activation with its global head or unit count.
            raise TrainerError(
                f"the model reshapes an activation that t={layout.tensor} splits ({one_line(error)}): each "
                f"tensor rank holds 1/{layout.tensor} of the heads or units of a column-parallel output; "
                "reshape with -1 for their count, e.g. x.reshape(*x.shape[:-1], -1, head_dim)"
            ) from None
        # jax.grad's message for a loss of any shape but (): say what the loss function must return.
        if "scalar-output" not in str(error):
            raise
        raise TrainerError(
            f"loss_fn must return a scalar, the mean loss of the micro-batch ({one_line(error)}); reduce "
            "it, e.g. with jnp.mean"
        ) from None
    if layout.mesh.devices.flat[0] in jax.devices():
        compiled = compile_scheduled(lowered, options, layout, collective_matmul)
        check_fits(compiled, layout.mesh.devices.flat[0])
        return compiled
    # Compiled for a topology this process has no client for (a GPU target on a CPU machine): JAX's
    # persistent cache would store it but cannot load it back ("PjRtCompiler must be constructed with
    # a Client"), so no compile time is long enough to store it.
    least = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    # Without the device XLA cannot time a kernel's tilings, and jaxlib >= 0.11 spends half of such a
    # compile trying them; the schedule, buffers and collectives do not depend on the tiling chosen.
    options = {**(options or {}), DEVICELESS_AUTOTUNE_OPTION: 0}
    try:
        return compile_scheduled(lowered, options, layout, collective_matmul)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", least)


def compiled_memory(compiled: jax.stages.Compiled) -> tuple[int, dict[str, int]]:
    """Peak bytes per device of a compiled program: arguments + outputs - donated aliases + temporaries."""
    stats = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    values = {f: int(getattr(stats, f)) for f in fields}
    total = values[fields[0]] + values[fields[1]] - values[fields[2]] + values[fields[3]]
    return total, values


def device_bytes_limit(device: jax.Device) -> int | None:
    """What the device's allocator can hand out (JAX's `bytes_limit`); None where it does not say (CPU)."""
    if device.platform == "cpu":
        return None
    stats = device.memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def check_fits(compiled: jax.stages.Compiled, device: jax.Device) -> None:
    """Refuse, before any step runs and donates the state, a step that needs more memory per device than
    the device's allocator has: XLA would fail the step's allocation instead."""
    limit = device_bytes_limit(device)
    if limit is None:
        return
    peak = compiled_memory(compiled)[0]
    if peak > limit:
        raise TrainerError(
            f"the compiled step needs {peak / 2**30:.2f} GiB per device, more than the {limit / 2**30:.2f} "
            f"GiB a {device.device_kind} can allocate here; plan again with the cluster config's "
            "usable_memory_fraction lowered to match, or use more micro-batches or remat full"
        )


def _slop_factor(program: StepProgram, state: Any, batch: Any) -> int | None:
    """XLA's scheduler budget for the plan's `memory_limit` (`xla.scheduler_slop_factor`); None without a
    limit, or on a device whose memory no shipped GPU target describes."""
    devices = program.layout.mesh.devices.flat
    device_memory = gpu_target.device_memory(devices[0].device_kind)
    if program.plan.memory_limit is None or device_memory is None:
        return None
    shardings = state_shardings(program)
    io_bytes = sum(
        math.prod(sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        for x, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True)
    )
    io_bytes += sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(batch)) // len(devices)
    return scheduler_slop_factor(program.plan.memory_limit, device_memory, io_bytes)


def gather_bytes(program: StepProgram) -> int:
    """Bytes of the largest single gather: one layer of a stack or block, or all the other leaves."""
    return largest_gather_bytes(
        (
            (split.leaf.unit, math.prod(split.rank_padded) // split.leaf.layers)
            for split in program.params.leaves.values()
        ),
        program.plan.precision.param_bytes,
    )
