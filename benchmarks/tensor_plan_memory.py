"""The planner's chosen plans for LLaMA 7B-65B on 64 A800s, compiled: the memory the cost model
predicts beside the compiled program's, per device.

For each model and sequence length, `amsp-jax plan`'s choice on the shipped `a800-8x-ib800` config (8
nodes of 8) is compiled for 8 x 8 A100-80GB GPUs (the A800's compute part; compile only, no GPU
needed) at the model's full depth (`--layers N`: N of its layers), and the audit's predicted peak for
that program is set beside XLA's and beside the device's memory.

    python -m benchmarks.tensor_plan_memory [--models llama-7b,llama-65b] [--seq 2048,8192] [--layers 4]

writes a dated benchmarks/results/tensor_plan_memory_a100x64-compiled_<date>.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit, gpu_target
from amsp_jax.core.config_files import find
from amsp_jax.models.llama import Llama, LlamaConfig, ModelConfigError, llama_spec, make_loss_fn
from amsp_jax.planner.request import GIB, make_request
from amsp_jax.planner.search import price_alternatives
from benchmarks import results_file
from benchmarks.tensor_plan import CLUSTER, TOKENS_PER_STEP

NODES, PER_NODE = 8, 8


def row(model: str, seq_len: int, layers: int | None = None) -> str:
    """The chosen plan's predicted and compiled memory per device at `layers` layers (None: all)."""
    request = make_request(
        llama_spec(model), CLUSTER, NODES, seq_len=seq_len,
        global_batch_tokens=max(TOKENS_PER_STEP, NODES * PER_NODE * seq_len),
    )  # fmt: skip
    chosen = price_alternatives(request).chosen
    devices = gpu_target.topology("a100-sxm-80", NODES, PER_NODE)
    cluster = aj.Cluster.detect(devices)
    plan = chosen.to_plan(cluster)
    whole = LlamaConfig.from_yaml(find("models", model, ModelConfigError))
    config = dataclasses.replace(whole, n_layers=layers or whole.n_layers, max_seq_len=seq_len)
    llama = Llama(config)
    trainer = aj.Trainer(plan, llama, optax.adamw(1e-4), make_loss_fn(llama), devices=devices)
    trainer.setup(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))
    sequences = cluster.num_devices // plan.strategy.tensor * plan.micro_batches * chosen.micro_batch_size
    tokens = jax.ShapeDtypeStruct((sequences, seq_len), jnp.int32)
    start = time.perf_counter()
    report = audit.audit_trainer(trainer, {"inputs": tokens, "targets": tokens}, cost.llama_dims(config))
    seconds = time.perf_counter() - start
    predicted, compiled = report.predicted.memory.total, report.measured.memory_bytes
    batching = f"{chosen.micro_batch_size} | {plan.micro_batches} | {chosen.remat}"
    return (
        f"| {model} | {seq_len:,} | {config.n_layers} | `{chosen.description}` | {batching} "
        f"| {chosen.memory_bytes / GIB:.1f} | {predicted / GIB:.2f} | {compiled / GIB:.2f} "
        f"| {report.memory_ratio:.3f} | {'yes' if report.bytes_match else 'NO'} | {seconds:.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-7b,llama-13b,llama-30b,llama-65b")
    parser.add_argument("--seq", default="2048,8192")
    parser.add_argument("--layers", type=int, default=None, help="compile this many layers (default: all)")
    parser.add_argument("--out", default=str(results_file.RESULTS))
    args = parser.parse_args(argv)
    lines = [
        results_file.header("The planner's chosen plans on 64 A800s, compiled: memory"),
        f"Cluster config `{CLUSTER}` ({NODES} x {PER_NODE}); each chosen plan compiled for {NODES} x "
        f"{PER_NODE} A100-80GB at the depth in `layers`. `planned`: the planner's peak for the whole "
        "model; `predicted` and `compiled`: the compiled program's peak, the cost model's and XLA's "
        "(on a device of 80 GB, 74.5 GiB); `bytes`: the audit's collective bytes equal to the compiled "
        "program's.",
        "",
        "| model | seq | layers | chosen plan | b | M | remat | planned GiB | predicted GiB | compiled GiB "
        "| ratio | bytes | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in args.models.split(","):
        for seq_len in map(int, args.seq.split(",")):
            lines.append(row(model, seq_len, args.layers))
            print(lines[-1], flush=True)
    stem = results_file.dated_stem(args.out, "tensor_plan_memory", "a100x64-compiled")
    path = stem.parent / f"{stem.name}.md"
    path.write_text("\n".join(lines) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
