"""`amsp-jax` command line: `plan`, `audit`, `profile` and `train`, each in `amsp_jax.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "plan": "Choose the fastest strategy that fits, beside the usual presets.",
    "audit": "Compile the real step and check its collectives and memory against the cost model.",
    "profile": "Measure collective bandwidths on the devices at hand and write a cluster config.",
    "train": "Train the LLaMA model from a config, with checkpoints and resume.",
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `amsp-jax` script."""
    parser = argparse.ArgumentParser(prog="amsp-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"amsp_jax.commands.{name}")
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
        modules[name] = module
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
