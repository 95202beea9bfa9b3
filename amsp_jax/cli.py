"""`amsp-jax` command line: `plan`, `audit`, `profile` and `train`, each in `amsp_jax.commands`."""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys

COMMANDS = {
    "plan": "Choose the fastest strategy that fits, beside the usual presets.",
    "audit": "Compile the real step and check its collectives and memory against the cost model.",
    "profile": "Measure collective bandwidths on the devices at hand and write a cluster config.",
    "train": "Train the LLaMA model from a config, with checkpoints and resume.",
}


def simulate_host_devices(argv: list[str]) -> None:
    """Give the CPU platform as many devices as the command's cluster (default 8), before JAX loads.

    The flag only shapes the host (CPU) platform, so it is harmless where an accelerator is used.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags or "jax" in sys.modules:
        return
    values = dict(itertools.pairwise(argv))
    try:
        count = int(values.get("--nodes", 2)) * int(values.get("--devices-per-node", 4))
    except ValueError:
        count = 8
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `amsp-jax` script."""
    argv = sys.argv[1:] if argv is None else argv
    simulate_host_devices(argv)
    parser = argparse.ArgumentParser(prog="amsp-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, help_text in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen command's module is imported: the others may pull in JAX for nothing.
        if name == chosen:
            module = importlib.import_module(f"amsp_jax.commands.{name}")
            module.add_arguments(command_parser)
    args = parser.parse_args(argv)
    assert module is not None
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
