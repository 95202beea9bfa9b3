"""`amsp-jax audit`: compile the real step for a plan and check its collectives and memory.

Without `--target` the step is compiled for the devices at hand (simulated CPU devices by default); with
`--target h100-sxm` (or `a100-sxm-80`, or a GpuTargetConfigProto file) it is compiled for a cluster of
those GPUs, `--nodes` hosts of `--devices-per-node` each, on this machine, no GPU needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from amsp_jax.core.config_files import find, shipped
from amsp_jax.core.tensor import MATMUL_FORMS


class _GpuTarget(argparse.Action):
    """`--target`: this process only compiles, so JAX must not try to load CUDA (see `gpu_target`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:  # fmt: skip
        setattr(namespace, self.dest, values)
        if not os.environ.get("JAX_PLATFORMS"):
            import jax

            # Set before anything (the device-count check, say) starts JAX's backends.
            jax.config.update("jax_platforms", "cpu")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `amsp-jax audit`."""
    models = ", ".join(shipped("models"))
    parser.add_argument("--model", required=True, help=f"model YAML, or a shipped model: {models}")
    parser.add_argument(
        "--target",
        action=_GpuTarget,
        help="compile for a GPU cluster instead of the local devices: h100-sxm, a100-sxm-80 or a .txtpb file",
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices-per-node", type=int, default=4)
    parser.add_argument(
        "--no-sequence-parallel", action="store_true",
        help="with t > 1: whole activations on every tensor rank, row-parallel outputs all-reduced",
    )  # fmt: skip
    parser.add_argument(
        "--tensor-matmul", choices=MATMUL_FORMS, default="gather",
        help="with t > 1: the collective, then the matmul (gather), collective matmuls (ring), or "
        "PrimePar's 2 x 2 square (cannon, t=4)",
    )  # fmt: skip
    parser.add_argument(
        "--strategy", default="zero3", help="preset name or p=AxB,g=AxB,os=AxB; t=N, first: tensor degree"
    )
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per device, micro-batch")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "mixed"])
    parser.add_argument("--remat", default="full", choices=["none", "dots", "full"])
    parser.add_argument(
        "--attention",
        choices=["auto", "xla", "blockwise", "cudnn"],
        help="the model's attention instead of its config's (xla materialises the scores)",
    )
    parser.add_argument(
        "--memory-limit",
        type=float,
        metavar="GIB",
        help="GiB per device the step may use; on GPU XLA's scheduler is given the same budget "
        "(without one it plans for about 76%% of the device)",
    )
    parser.add_argument(
        "--flat-collectives",
        action="store_true",
        help="one ring over a group that spans nodes, instead of a collective per level (the default)",
    )
    parser.add_argument(
        "--prefetch",
        choices=["auto", "loop", "none"],
        default="auto",
        help="auto: the checkpointed layer scan; loop: the explicit-prefetch loop where it applies (one "
        "micro-batch, --remat full, enough layers; else the scan); none: no gathering ahead",
    )
    parser.add_argument(
        "--keep-first-layer",
        action="store_true",
        help="with micro-batches: gather the first layer once per step, sum its gradient over the "
        "micro-batches and reduce-scatter it once",
    )
    parser.add_argument("--allow-partial-nodes", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--dump-hlo", metavar="FILE", help="write the compiled program's HLO text here")


def run(args: argparse.Namespace) -> int:
    """Compile, count, compare; exit 0 when prediction and program agree, 1 otherwise."""
    import jax
    import jax.numpy as jnp
    import optax

    from amsp_jax import cost
    from amsp_jax.compiled import audit, gpu_target
    from amsp_jax.core.plan import Plan
    from amsp_jax.core.space import Cluster, resolve
    from amsp_jax.models.llama import Llama, LlamaConfig, ModelConfigError, make_loss_fn
    from amsp_jax.trainer import Trainer

    devices = None
    if args.target:
        try:
            devices = gpu_target.topology(args.target, args.nodes, args.devices_per_node)
        except gpu_target.TargetError as e:
            print(f"amsp-jax audit: {e}", file=sys.stderr)
            return 2
    config = LlamaConfig.from_yaml(find("models", args.model, ModelConfigError))
    if args.attention:
        config = dataclasses.replace(config, attention=args.attention)
    cluster = Cluster(args.nodes, args.devices_per_node, name=args.target or "audit")
    plan = Plan(
        cluster,
        resolve(args.strategy, cluster),
        args.micro_batches,
        precision=args.precision,
        remat=args.remat,
        allow_partial_nodes=args.allow_partial_nodes,
        hierarchical=not args.flat_collectives,
        prefetch={"auto": None, "loop": True, "none": False}[args.prefetch],
        keep_first_layer=args.keep_first_layer,
        sequence_parallel=not args.no_sequence_parallel,
        tensor_matmul=args.tensor_matmul,
        memory_limit=None if args.memory_limit is None else args.memory_limit * 2**30,
    )
    model = Llama(config)
    trainer = Trainer(plan, model, optax.adamw(1e-4), make_loss_fn(model), devices=devices)
    seq_len = args.seq_len or config.max_seq_len
    data_devices = plan.strategy.data_parallel(cluster).num_devices
    global_batch = data_devices * args.micro_batches * args.micro_batch_size
    tokens = jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32)
    trainer.setup(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))
    report = audit.audit_trainer(
        trainer, {"inputs": tokens, "targets": tokens}, cost.llama_dims(config), dump_hlo=args.dump_hlo
    )
    print(report.dumps() if args.json else report.table())
    if not report.match:
        print("prediction and compiled program disagree (see above)", file=sys.stderr)
    return 0 if report.match else 1
