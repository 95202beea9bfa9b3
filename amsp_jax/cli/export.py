"""`amsp-jax export`: a run's parameters as one safetensors file, for serving, evaluation or fine-tuning.

    amsp-jax export runs/demo --out demo.safetensors
    amsp-jax export runs/demo --step 100 --out demo-100.safetensors

The checkpoint's fp32 master weights are read whole (any device count, whatever plan wrote them) and
written as safetensors: one tensor per parameter leaf, keyed by its '/'-joined path
(`layers/layer/w1`), with the step and the run's model config in the file's metadata. Safetensors
rather than Flax msgpack: it loads without Flax or JAX (PyTorch, numpy, Rust, the Hugging Face hub),
memory-maps tensors one by one instead of unpacking the whole file, and holds no executable
content. `amsp-jax train --init-from FILE` and `amsp_jax.read_params(FILE)` read it back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = __doc__.split("\n\n", 2)[2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `export` command's arguments: the run directory, the step and the output file."""
    parser.description = f"{parser.description}\n\n{HELP}"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("run_dir", type=Path, help="a run directory (or its checkpoints/ directory)")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")


def run(args: argparse.Namespace) -> int:
    """Read the checkpoint's parameters and write them; a one-line error and exit code 2 on bad input."""
    # Imported here: `amsp-jax` imports only the chosen command, and Orbax is slow to import.
    import jax

    from amsp_jax.run.checkpoint import CheckpointError, load_params, saved_meta, write_params

    try:
        if not args.run_dir.is_dir():
            raise CheckpointError(f"run directory {args.run_dir} does not exist")
        if args.out.suffix != ".safetensors":
            raise CheckpointError(
                f"--out {args.out}: the file is written as safetensors; name it *.safetensors"
            )
        meta = saved_meta(args.run_dir, args.step)
        params = load_params(args.run_dir, meta["step"])
    except CheckpointError as error:
        print(f"amsp-jax export: error: {error}", file=sys.stderr)
        return 2
    metadata = {"step": meta["step"], **{k: meta[k] for k in ("model", "strategy", "cluster") if k in meta}}
    write_params(params, args.out, metadata)
    count = sum(x.size for x in jax.tree.leaves(params))
    size = args.out.stat().st_size
    print(
        f"wrote {count:,} parameters of step {meta['step']} to {args.out} (safetensors, {size / 1e6:.1f} MB)"
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="amsp-jax export", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
