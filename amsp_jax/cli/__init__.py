"""`amsp-jax` command line: `plan`, `audit`, `profile` and `train`, each in `amsp_jax.cli`.

Bad input ends in one line on stderr, `amsp-jax COMMAND: error: ...`, and exit code 2; an error that
is not about the input is a bug and says so under its traceback (exit code 1).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import logging
import math
import os
import sys
import traceback
from typing import NoReturn

from amsp_jax.core import backend
from amsp_jax.errors import AmspError, is_input_error, one_line

COMMANDS = {
    "plan": "Choose the fastest strategy that fits, beside the usual presets.",
    "audit": "Compile the real step and check its collectives and memory against the cost model.",
    "profile": "Measure collective bandwidths on the devices at hand and write a cluster config.",
    "train": "Train the LLaMA model from a config, with checkpoints and resume.",
    "export": "Write a run's parameters to a safetensors file (for serving, evaluation, fine-tuning).",
}

# Integer flags of any command that count something and so must be at least 1.
POSITIVE_FLAGS = (
    "nodes",
    "devices_per_node",
    "seq_len",
    "global_batch_tokens",
    "micro_batch_size",
    "micro_batches",
    "global_batch",
    "repeats",
    "num_processes",
    "cpu_devices",
)
# Number flags of any command that measure an amount, with what they accept: above 0 and finite.
POSITIVE_AMOUNT_FLAGS = {"memory_limit": "a number of GiB above 0"}


class UsageError(AmspError):
    """A command line that argparse rejects (unknown flag, missing value, value of the wrong type)."""


class _Parser(argparse.ArgumentParser):
    """An argparse parser that raises instead of printing the usage and exiting."""

    def error(self, message: str) -> NoReturn:
        """Raise a UsageError pointing at `--help`."""
        raise UsageError(f"{message}; see {self.prog} --help")


def simulate_host_devices(argv: list[str]) -> None:
    """Give the CPU platform as many devices as the command's cluster (default 8), before JAX loads.

    The flag only shapes the host (CPU) platform, so it is harmless where an accelerator is used.
    """
    if "jax" in sys.modules:
        return
    values = dict(itertools.pairwise(argv))
    try:
        count = int(values.get("--nodes", 2)) * int(values.get("--devices-per-node", 4))
    except ValueError:
        count = 8
    if count < 1:
        count = 8  # the flags are rejected with a clear error once parsed
    os.environ["XLA_FLAGS"] = backend.cpu_flags(os.environ.get("XLA_FLAGS", ""), count)


def check_counts(args: argparse.Namespace) -> None:
    """Raise a UsageError when a counting flag (`--nodes`, `--seq-len`, ...) is below 1, or an amount
    (`--memory-limit`) is not above 0."""
    for name in POSITIVE_FLAGS:
        value = getattr(args, name, None)
        if isinstance(value, int) and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name, accepted in POSITIVE_AMOUNT_FLAGS.items():
        value = getattr(args, name, None)
        if isinstance(value, float) and not (0 < value < math.inf):
            raise UsageError(f"--{name.replace('_', '-')} must be {accepted}, got {value:g}")


def check_devices(nodes: int, devices_per_node: int) -> None:
    """Raise a UsageError unless JAX has `nodes` × `devices_per_node` devices (audit compiles on them)."""
    import jax

    count = jax.device_count()
    if count != nodes * devices_per_node:
        raise UsageError(
            f"--nodes {nodes} x --devices-per-node {devices_per_node} = {nodes * devices_per_node} devices, "
            f"but JAX has {count} ({jax.devices()[0].platform}); give a shape of {count} devices, or on the "
            f"CPU run without XLA_FLAGS fixing the device count"
        )


class _NoCudaOnThisMachine(logging.Filter):
    """Drops JAX's traceback for its CUDA plugin finding no CUDA: the `gpu-aot` extra installs the plugin
    to compile for GPUs on machines without one, where JAX then runs on the CPU (each command names the
    devices it uses), so the traceback says nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep every record but that one."""
        error = record.exc_info[1] if record.exc_info else None
        return not (
            record.getMessage().startswith("Jax plugin configuration error")
            and error is not None
            and "Unable to load CUDA" in str(error)
        )


def _chosen_command(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def _run(argv: list[str]) -> int:
    parser = _Parser(prog="amsp-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    chosen = _chosen_command(argv)
    module = None
    for name, help_text in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen command's module is imported: the others may pull in JAX for nothing.
        if name == chosen:
            module = importlib.import_module(f"amsp_jax.cli.{name}")
            module.add_arguments(command_parser)
    args = parser.parse_args(argv)
    if module is None:
        raise UsageError(f"unknown command {chosen!r}; choose one of {', '.join(COMMANDS)}")
    check_counts(args)
    if args.command == "audit":
        check_devices(args.nodes, args.devices_per_node)
    return int(module.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `amsp-jax` script."""
    argv = sys.argv[1:] if argv is None else argv
    simulate_host_devices(argv)
    logging.getLogger("jax._src.xla_bridge").addFilter(_NoCudaOnThisMachine())
    chosen = _chosen_command(argv)
    prog = f"amsp-jax {chosen}" if chosen in COMMANDS else "amsp-jax"
    try:
        return _run(argv)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # SystemExit("message"): a command's own clean stop
            print(f"{prog}: error: {exit_.code.removeprefix(prog + ': ')}", file=sys.stderr)
            return 2
        raise
    except Exception as error:
        if is_input_error(error):
            print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
            return 2
        traceback.print_exc()
        print(
            f"{prog}: internal error ({type(error).__name__}): this is a bug of amsp_jax, not of the "
            "input; please report it with the traceback above",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
