"""`amsp-jax train`: train the LLaMA model from a config, with checkpoints, resume and several hosts.

Device set-up comes first and must precede any JAX computation: without an accelerator XLA is asked
for simulated CPU devices (`cpu_devices`, 8 by default, unless `XLA_FLAGS` already sets a count), and
with `--coordinator` (or under a SLURM / Open MPI launch with several tasks) the process joins the
others through `jax.distributed`. Then `amsp_jax.run.train.train` runs the config; each flag sets one
key of it (`--steps` sets `run.steps`, see `OVERRIDES`).

    amsp-jax train --config demo          # the shipped demo config; or the path of a train config YAML
    amsp-jax train --config demo --run-dir runs/demo-... --resume
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

from amsp_jax.errors import is_input_error, one_line
from amsp_jax.run import distributed

# Settings that the command line may override: flag name, the train config key it sets, type, help.
OVERRIDES: dict[str, tuple[str, type, str]] = {
    "model": ("model.name", str, "model config YAML, or a shipped model's name (tiny, small, llama-7b, ...)"),
    "strategy": (
        "plan.strategy",
        str,
        "auto, a preset (ddp, zero1, zero2, zero3, mics, hsdp) or p=AxB,g=CxD,os=ExF",
    ),
    "cluster": (
        "plan.cluster",
        str,
        "NODESxDEVICES (e.g. 2x4), a cluster YAML, a shipped cluster's name, or host (this host's profile); "
        "default: one node per process, on simulated CPUs 2 nodes priced with this host's profile",
    ),
    "steps": ("run.steps", int, "train until this many optimizer steps are done"),
    "global_batch": ("data.global_batch", int, "sequences per step over all devices"),
    "seq_len": ("data.seq_len", int, "tokens per sequence"),
    "micro_batches": ("plan.micro_batches", int, "micro-batches per step (gradient accumulation)"),
    "precision": ("plan.precision", str, "mixed (bf16 P and gradient reduction) or fp32"),
    "remat": ("plan.remat", str, "none, dots or full"),
    "learning_rate": ("optimizer.learning_rate", float, "peak learning rate"),
    "eval_every": ("run.eval_every", int, "held-out evaluation every N steps"),
    "checkpoint_every": ("run.checkpoint_every", int, "save a checkpoint every N steps"),
    "keep_checkpoints": ("run.keep_checkpoints", int, "keep the newest N checkpoints"),
    "run_dir": ("run.dir", str, "directory of checkpoints and metrics.jsonl; {time} becomes the start time"),
    "seed": ("run.seed", int, "initialisation and data seed"),
    "data_dtype": ("data.dtype", str, "token dtype of raw .bin token files (uint16 or int32)"),
    "cpu_devices": ("plan.cpu_devices", int, "simulated devices when there is no accelerator"),
    "init_from": (
        "run.init_from",
        str,
        "start from the parameters in this file (amsp-jax export's .safetensors, or .msgpack)",
    ),
    "stop_after_bad_steps": (
        "run.stop_after_bad_steps",
        int,
        "stop after this many steps in a row with a non-finite loss (skipped)",
    ),
}
# The flags that are not a typed value, and the keys they set.
SWITCHES = {
    "data": "data.paths",
    "resume": "run.resume",
    "progress": "run.progress",
    "keep_first_layer": "plan.keep_first_layer",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `train` command's flags: a config file, overrides of its settings, and multi-process flags."""
    parser.add_argument("--config", type=Path, help="train config YAML, or a shipped config's name (demo)")
    parser.add_argument(
        "--data", nargs="+", help="text files or directories, JSON lines (.jsonl) or token files (.npy/.bin)"
    )
    for name, (key, kind, help_text) in OVERRIDES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, help=f"{help_text} ({key})")
    parser.add_argument(
        "--resume", action="store_true", default=None, help="continue from the latest checkpoint"
    )
    parser.add_argument(
        "--keep-first-layer", action="store_true", default=None,
        help="with micro-batches: gather the first layer once per step and reduce its gradient once",
    )  # fmt: skip
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", default=None, help="no progress bar"
    )
    hosts = parser.add_argument_group(
        "several processes (hosts); SLURM and Open MPI are detected without these"
    )
    hosts.add_argument("--coordinator", help="host:port of process 0")
    hosts.add_argument("--num-processes", type=int, help="number of processes")
    hosts.add_argument("--process-id", type=int, help="this process's index, 0 .. N-1")


def run(args: argparse.Namespace) -> int:
    """Set up devices and processes, then train; exit code 2 and one line on bad input, 1 on divergence."""
    # Imported here, not above: Orbax is slow to import, which `amsp-jax plan` need not pay.
    from amsp_jax.run.train import ConfigError, DivergedError, load_config, train

    keys = {**{name: key for name, (key, _, _) in OVERRIDES.items()}, **SWITCHES}
    quiet_abandoned_reads()
    try:
        config = load_config(args.config, {key: getattr(args, name) for name, key in keys.items()})
        distributed.simulate_cpu_devices(config.plan.cpu_devices)
        try:
            distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        train(config)
    except DivergedError as error:
        print(f"amsp-jax train: stopped: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        if not is_input_error(error):
            raise
        print(f"amsp-jax train: error: {one_line(error)}", file=sys.stderr)
        return 2
    return 0


def quiet_abandoned_reads() -> None:
    """Keep the reads that a failed restore abandons from printing tracebacks (the error itself is reported).

    When one array of a damaged checkpoint cannot be read, Orbax's `asyncio.gather` raises that error,
    closes its event loop and leaves the other reads running in TensorStore: asyncio reports their
    errors as never retrieved, and their completions, calling into the closed loop, raise "Event loop
    is closed" in TensorStore's threads, during the restore or at exit. Dropped here: those asyncio
    reports about Orbax's reads (`abandoned_orbax_read`), and that RuntimeError where nothing can catch
    it (unraisable); in a command, a closed event loop has no one left to serve.
    """
    if getattr(sys.unraisablehook, "quiets_closed_loops", False):
        return  # installed by an earlier command in this process
    logging.getLogger("asyncio").addFilter(lambda record: not abandoned_orbax_read(record))
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous(unraisable)

    hook.quiets_closed_loops = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def abandoned_orbax_read(record: logging.LogRecord) -> bool:
    """Whether an asyncio log record reports an exception never retrieved from one of Orbax's reads.

    A task names Orbax's coroutine in its message; a future (the `gather` of Orbax's reads, which
    failed under load) names only the error, so the traceback's frames are read too.
    """
    message = record.getMessage()
    if "was never retrieved" not in message:
        return False
    trace = record.exc_info[2] if record.exc_info else None
    return "orbax" in message or any("orbax" in frame.filename for frame in traceback.extract_tb(trace))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="amsp-jax train", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
