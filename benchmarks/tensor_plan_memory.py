"""The planner's chosen plans for LLaMA 7B-65B on 64 A800s, compiled: the memory the cost model
predicts beside the compiled program's, per device.

For each model and sequence length, `amsp-jax plan`'s choice on the shipped `a800-8x-ib800` config (8
nodes of 8) is compiled for 8 x 8 A100-80GB GPUs (the A800's compute part; compile only, no GPU
needed) with the model's width and 4 of its layers (a layer's memory is what is priced; the full depth
does not compile on a small host), and the audit's predicted peak for that program is set beside XLA's.

    python -m benchmarks.tensor_plan_memory [--models llama-7b,llama-65b] [--seq 2048,8192] [--loops]

`--loops`: each chosen plan compiled again with XLA's two passes that run two iterations of a loop
at once (while-loop double buffering and unrolling) turned off, and with one micro-batch.

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
from amsp_jax.compiled import audit, compile_step, gpu_target
from amsp_jax.core.config_files import find
from amsp_jax.models.llama import Llama, LlamaConfig, ModelConfigError, llama_spec, make_loss_fn
from amsp_jax.planner.request import GIB, make_request
from amsp_jax.planner.search import price_alternatives
from benchmarks import results_file
from benchmarks.tensor_plan import CLUSTER, TOKENS_PER_STEP

NODES, PER_NODE, LAYERS = 8, 8, 4


LOOP_PASSES_OFF = {
    "xla_gpu_enable_while_loop_double_buffering": False,
    "xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_NO_UNROLL",
}


def row(model: str, seq_len: int, variant: str = "") -> str:
    """The chosen plan's predicted and compiled memory per device at 4 layers of the model's width;
    `variant`: "loop passes off" or "one micro-batch" (see `--loops`)."""
    request = make_request(
        llama_spec(model), CLUSTER, NODES, seq_len=seq_len,
        global_batch_tokens=max(TOKENS_PER_STEP, NODES * PER_NODE * seq_len),
    )  # fmt: skip
    chosen = price_alternatives(request).chosen
    devices = gpu_target.topology("a100-sxm-80", NODES, PER_NODE)
    cluster = aj.Cluster.detect(devices)
    plan = chosen.to_plan(cluster)
    if variant == "one micro-batch":
        plan = dataclasses.replace(plan, micro_batches=1)
    whole = LlamaConfig.from_yaml(find("models", model, ModelConfigError))
    config = dataclasses.replace(whole, n_layers=LAYERS, max_seq_len=seq_len)
    llama = Llama(config)
    trainer = aj.Trainer(plan, llama, optax.adamw(1e-4), make_loss_fn(llama), devices=devices)
    trainer.setup(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32))
    sequences = cluster.num_devices // plan.strategy.tensor * plan.micro_batches * chosen.micro_batch_size
    tokens = jax.ShapeDtypeStruct((sequences, seq_len), jnp.int32)
    start = time.perf_counter()
    original = compile_step.compiler_options
    if variant == "loop passes off":
        compile_step.compiler_options = lambda *a, **k: (original(*a, **k) or {}) | LOOP_PASSES_OFF
    try:
        report = audit.audit_trainer(trainer, {"inputs": tokens, "targets": tokens}, cost.llama_dims(config))
    finally:
        compile_step.compiler_options = original
    seconds = time.perf_counter() - start
    predicted, compiled = report.predicted.memory.total, report.measured.memory_bytes
    batching = f"{chosen.micro_batch_size} | {plan.micro_batches} | {chosen.remat}"
    name = f"`{chosen.description}`" + (f" ({variant})" if variant else "")
    return (
        f"| {model} | {seq_len:,} | {name} | {batching} | {chosen.memory_bytes / GIB:.1f} "
        f"| {predicted / GIB:.2f} | {compiled / GIB:.2f} "
        f"| {report.memory_ratio:.3f} | {'yes' if report.bytes_match else 'NO'} | {seconds:.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-7b,llama-13b,llama-30b,llama-65b")
    parser.add_argument("--seq", default="2048,8192")
    parser.add_argument("--out", default=str(results_file.RESULTS))
    parser.add_argument("--loops", action="store_true", help="each plan also with XLA's loop passes off")
    args = parser.parse_args(argv)
    lines = [
        results_file.header("The planner's chosen plans on 64 A800s, compiled at 4 layers: memory"),
        f"Cluster config `{CLUSTER}` ({NODES} x {PER_NODE}); the plans compiled for {NODES} x {PER_NODE} "
        f"A100-80GB with {LAYERS} layers of each model's width. `planned`: the planner's peak for the "
        f"whole model; `predicted` and `compiled`: the {LAYERS}-layer program's peak, the cost model's "
        "and XLA's; `bytes`: the audit's collective bytes equal to the compiled program's.",
        "",
        "| model | seq | chosen plan | b | M | remat | planned GiB | predicted GiB | compiled GiB | ratio "
        "| bytes | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in args.models.split(","):
        for seq_len in map(int, args.seq.split(",")):
            for variant in ("", *(("loop passes off", "one micro-batch") if args.loops else ())):
                lines.append(row(model, seq_len, variant))
                print(lines[-1], flush=True)
    stem = results_file.dated_stem(args.out, "tensor_plan_memory", "a100x64-compiled")
    path = stem.parent / f"{stem.name}.md"
    path.write_text("\n".join(lines) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
