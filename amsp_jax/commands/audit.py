"""`amsp-jax audit`: compile the real step for a plan and check its collectives and memory."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `amsp-jax audit`."""
    parser.add_argument("--model", required=True, help="model config, e.g. configs/models/tiny.yaml")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices-per-node", type=int, default=4)
    parser.add_argument("--strategy", default="zero3", help="preset name or p=AxB,g=AxB,os=AxB")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per device, micro-batch")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "mixed"])
    parser.add_argument("--remat", default="full", choices=["none", "dots", "full"])
    parser.add_argument("--allow-partial-nodes", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--dump-hlo", metavar="FILE", help="write the compiled program's HLO text here")


def run(args: argparse.Namespace) -> int:
    """Compile, count, compare; exit 0 when prediction and program agree, 1 otherwise."""
    import jax
    import jax.numpy as jnp
    import optax

    from amsp_jax import audit, cost
    from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn
    from amsp_jax.plan import Plan
    from amsp_jax.space import PRESETS, Cluster, Strategy, preset
    from amsp_jax.step import Trainer

    config = LlamaConfig.from_yaml(args.model)
    cluster = Cluster(args.nodes, args.devices_per_node, name="audit")
    plan = Plan(
        cluster,
        preset(args.strategy, cluster) if args.strategy in PRESETS else Strategy.parse(args.strategy),
        args.micro_batches,
        precision=args.precision,
        remat=args.remat,
        allow_partial_nodes=args.allow_partial_nodes,
    )
    model = Llama(config)
    trainer = Trainer(plan, model, optax.adamw(1e-4), make_loss_fn(model))
    seq_len = args.seq_len or config.max_seq_len
    global_batch = cluster.num_devices * args.micro_batches * args.micro_batch_size
    tokens = jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32)
    trainer.setup(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))
    report = audit.audit_trainer(
        trainer, {"inputs": tokens, "targets": tokens}, cost.llama_dims(config), dump_hlo=args.dump_hlo
    )
    print(report.dumps() if args.json else report.table())
    if not report.match:
        print("prediction and compiled program disagree (see above)", file=sys.stderr)
    return 0 if report.match else 1
