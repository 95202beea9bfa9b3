"""Process and device set-up before JAX starts: simulated CPU devices and `jax.distributed`.

Both must happen before the first JAX computation: XLA reads `XLA_FLAGS` when it creates the CPU
backend, and `jax.distributed.initialize` must run before any backend exists. Importing `jax` is fine;
asking for devices is not.

Several processes make one JAX program: each process is a host, and `Cluster.detect()` makes one node
per process. On a GPU cluster start one process per node (`examples/slurm/train.sbatch`); SLURM and
Open MPI are detected without arguments. On one machine, test with local processes and gloo CPU
collectives (`examples/multiprocess_cpu.sh`):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        amsp-jax train --config configs/train/demo.yaml \
        --coordinator localhost:12355 --num-processes 2 --process-id 0   # and --process-id 1
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import jax
from jax._src import xla_bridge

from amsp_jax.core.backend import DEVICE_COUNT_FLAG, cpu_flags


def backends_started() -> bool:
    """Whether JAX has created its backends (after which XLA flags and distributed set-up are fixed)."""
    return bool(xla_bridge.backends_are_initialized())


def simulate_cpu_devices(count: int) -> bool:
    """Ask XLA for `count` host devices unless the flag is already set or JAX has started; True if set.
    Until JAX starts, the CPU platform's other settings (`core.backend.cpu_flags`) are added too.

    The flags only change the CPU platform: on a GPU or TPU machine `jax.devices()` still lists the
    accelerators, so it is safe to set them before knowing the platform.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if backends_started():
        return False
    os.environ["XLA_FLAGS"] = cpu_flags(flags, count)
    return DEVICE_COUNT_FLAG not in flags


def _env_int(name: str, default: int = 1) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


def launcher() -> str | None:
    """`slurm` or `openmpi` when this process is one task of several they started, else None.

    SLURM counts only inside a job step (`srun`): a batch script itself also sees the job's task
    count but is a single process, and joining a run from there would wait for the others forever.
    """
    if "SLURM_STEP_NODELIST" in os.environ and _env_int("SLURM_STEP_NUM_TASKS") > 1:
        return "slurm"
    if _env_int("OMPI_COMM_WORLD_SIZE") > 1:
        return "openmpi"
    return None


def node_devices(name: str) -> list[int] | None:
    """All of this node's accelerators when the launcher runs one process per node.

    JAX's SLURM and Open MPI detection gives each process one device (it assumes one process per
    GPU); with one process per node that would hide all but the first GPU.
    """
    if name == "slurm":
        per_node = _env_int("SLURM_STEP_NUM_TASKS") / _env_int("SLURM_STEP_NUM_NODES")
    else:
        per_node = _env_int("OMPI_COMM_WORLD_LOCAL_SIZE")
    if per_node != 1:
        return None
    visible = os.environ.get("SLURM_GPUS_ON_NODE") or ""
    if visible.isdigit():
        return list(range(int(visible)))
    cuda = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return list(range(len(cuda))) if cuda else None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
) -> bool:
    """Join a multi-process JAX run; True if one was joined, False for a single process.

    With `coordinator` ("host:port" of process 0) the three arguments are explicit; without it, a
    SLURM or Open MPI launch with several tasks is detected. On the CPU the collectives go through gloo.
    """
    explicit = coordinator is not None
    if explicit and (num_processes is None or process_id is None):
        raise ValueError("--coordinator needs --num-processes and --process-id as well")
    if explicit and not re.fullmatch(r"\[?[^\s/]+\]?:\d{1,5}", coordinator):
        raise ValueError(
            f"--coordinator {coordinator!r} is not host:port, e.g. 10.0.0.1:1234 (process 0's address)"
        )
    if explicit and not (num_processes >= 1 and 0 <= process_id < num_processes):
        raise ValueError(
            f"--process-id {process_id} is not one of 0 .. {num_processes - 1} (--num-processes "
            f"{num_processes}); number the processes from 0"
        )
    if not explicit and (num_processes is not None or process_id is not None):
        raise ValueError(
            "--num-processes and --process-id need --coordinator host:port (process 0's address)"
        )
    detected = None if explicit else launcher()
    if not explicit and detected is None:
        return False
    if backends_started():
        raise RuntimeError(
            "JAX already started its devices; call amsp_jax.run.distributed.initialize() before any JAX "
            "computation or jax.devices()"
        )
    if detected is not None and local_device_ids is None:
        local_device_ids = node_devices(detected)
    # Only the CPU backend reads this option; GPUs use NCCL whatever it says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )
    return True


def is_primary() -> bool:
    """Whether this is process 0, the one that prints and writes run files."""
    return jax.process_index() == 0
