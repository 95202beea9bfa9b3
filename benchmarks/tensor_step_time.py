"""Step time at tensor degrees 1, 2 and 4 on the CPU mesh: amsp_jax in each form beside the GSPMD peer
with the same tensor sharding, in one run, with the planner's predicted order beside the measured one.

For each t: the GSPMD peer (`benchmarks.peer_gspmd`: `jax.jit`, FSDP over the data axes and MaxText's
`tensor` axis by the model's logical names, XLA inserting every collective) and amsp_jax's `t=T,zero3`
with sequence parallelism on (the `gather` and the `ring` matmul form) and off (at t = 1: zero3
alone). Every program is compiled and read by
the audit (collective bytes per device, compiled memory); the steps are then timed interleaved, each
round starting one place later (`benchmarks.step_time.time_groups`), so that a slow spell of a shared
machine hits every configuration alike. Each amsp_jax row is priced by the time model on this host's
profile where one is cached (`amsp-jax profile`), else on the shipped `cpu-sim` config, which the
results file says.

    python -m benchmarks.tensor_step_time [--model tiny] [--tensor 1,2,4] [--steps 5]
"""

from __future__ import annotations

import os

from amsp_jax.core.backend import cpu_flags  # imports no JAX

os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""), 8)

import argparse
import dataclasses
import statistics
import time
from typing import Any

import jax

import amsp_jax as aj
from amsp_jax.compiled import audit
from amsp_jax.compiled.xla import compile_lowered, compiler_options
from amsp_jax.cost import host_profile
from amsp_jax.cost.hardware import ClusterConfig
from amsp_jax.cost.hardware import load as load_cluster
from amsp_jax.models.llama import Llama, llama_spec, make_loss_fn
from amsp_jax.planner.priced import price
from amsp_jax.planner.request import make_request, tensor_problem
from benchmarks import results_file
from benchmarks.peer_gspmd import build_gspmd_step, make_mesh, measure_peer
from benchmarks.step_time import (
    ANCHOR,
    MODELS,
    Entry,
    abstract,
    choose_cluster,
    make_batch,
    memory_budget,
    optimizer,
    plan_groups,
    time_groups,
)

MIB = 2**20


def hardware(cluster: aj.Cluster) -> tuple[ClusterConfig, str]:
    """This host's cached profile for `cluster`, else the shipped `cpu-sim` config; and which."""
    cached = host_profile.path(cluster.nodes, cluster.devices_per_node)
    if cached.exists():
        return load_cluster(cached), f"this host's profile ({cached})"
    return load_cluster("cpu-sim"), "the shipped cpu-sim config (no profile of this host is cached)"


def peer_entry(
    config: Any, cluster: aj.Cluster, devices: list, tensor: int, batch: dict, micro_batches: int
) -> Entry:
    """The GSPMD peer at tensor degree `tensor`, compiled and measured."""
    start = time.perf_counter()
    model = Llama(config)
    mesh = make_mesh(cluster, devices, tensor)
    init_fn, step_fn, shardings = build_gspmd_step(
        model, optimizer(), make_loss_fn(model), mesh, (batch["inputs"],), micro_batches=micro_batches
    )
    placed = jax.device_put(batch, shardings.batch)
    state = abstract(jax.eval_shape(init_fn, jax.random.key(0)), shardings.state)
    options = compiler_options(devices[0].platform, devices=len(devices))
    compiled = compile_lowered(step_fn.lower(state, abstract(placed)), options)
    name = ANCHOR if tensor == 1 else f"gspmd-fsdp-t{tensor}"
    return Entry(
        name, f"GSPMD FSDP, tensor {tensor}", compiled, measure_peer(compiled, cluster),
        time.perf_counter() - start, lambda: init_fn(jax.random.key(0)), placed,
    )  # fmt: skip


def amsp_entry(config: Any, plan: aj.Plan, devices: list, batch: dict) -> Entry:
    """amsp_jax's step of `plan`, compiled and measured."""
    start = time.perf_counter()
    model = Llama(config)
    trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model), devices)
    trainer.setup(jax.random.key(0), batch["inputs"])
    placed = trainer.shard_batch(batch)
    compiled = trainer.compile(trainer.abstract_state(), abstract(placed))
    sp = "" if plan.strategy.tensor == 1 else ("-sp" if plan.sequence_parallel else "-no-sp")
    sp += "-ring" if plan.strategy.tensor > 1 and plan.tensor_matmul == "ring" else ""
    measured = audit.measure(compiled, trainer.layout)
    return Entry(
        f"amsp-t{plan.strategy.tensor}{sp}", str(plan.strategy), compiled, measured,
        time.perf_counter() - start, lambda: trainer.init(jax.random.key(0), batch["inputs"]), placed,
    )  # fmt: skip


def predicted_s(config: Any, plan: aj.Plan, hw: ClusterConfig, seq_len: int, global_batch: int) -> float:
    """The time model's step time for `plan` (its batching and remat as run)."""
    request = make_request(
        llama_spec(config), hw, seq_len=seq_len, global_batch=global_batch, precision=plan.precision,
        remat=plan.remat, tensor_degrees=(plan.strategy.tensor,),
    )  # fmt: skip
    request = dataclasses.replace(
        request, tensor=plan.strategy.tensor, sequence_parallel=plan.sequence_parallel,
        tensor_matmul=plan.tensor_matmul,
    )  # fmt: skip
    micro_batch_size = request.sequences_per_device() // plan.micro_batches
    return price(request, plan.strategy, micro_batch_size, plan.remat).estimate.time.step_s


def _ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for rank, i in enumerate(order, 1):
        ranks[i] = rank
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--tensor", default="1,2,4")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    started = time.perf_counter()
    config = MODELS[args.model]
    cluster, devices = choose_cluster("auto")
    hw, hw_source = hardware(cluster)
    global_batch = cluster.num_devices * args.micro_batches
    batch = make_batch(config, global_batch, args.seq_len)
    entries, plans = [], {}
    skipped = []
    for t in map(int, args.tensor.split(",")):
        request = make_request(llama_spec(config), hw, seq_len=args.seq_len, global_batch=global_batch)
        if problem := tensor_problem(request, t):
            skipped.append(f"t={t}: {problem}")
            continue
        # The global batch is the same at every degree: a data-parallel rank runs t times the sequences.
        entries.append(peer_entry(config, cluster, devices, t, batch, args.micro_batches * t))
        forms = ((True, "gather"), (True, "ring"), (False, "gather")) if t > 1 else ((True, "gather"),)
        for sp, form in forms:
            plan = aj.Plan(
                cluster, aj.resolve(f"t={t},zero3" if t > 1 else "zero3", cluster), args.micro_batches * t,
                precision="mixed", remat="full", sequence_parallel=sp, tensor_matmul=form,
            )  # fmt: skip
            entries.append(amsp_entry(config, plan, devices, batch))
            plans[entries[-1].name] = plan
        print(f"compiled t={t} in {time.perf_counter() - started:.0f} s", flush=True)
    budget, _ = memory_budget(devices)
    time_groups(plan_groups(entries, budget), args.warmup, args.steps, lambda line: print(line, flush=True))
    amsp = [e for e in entries if e.name in plans]
    predicted = [predicted_s(config, plans[e.name], hw, args.seq_len, global_batch) for e in amsp]
    measured = [statistics.median(e.times) for e in amsp]
    rank_p, rank_m = _ranks(predicted), _ranks(measured)
    lines = [
        "| configuration | strategy | measured s (median) | predicted s | rank measured | rank predicted | "
        "bytes/device intra, inter | compiled MiB/device | first loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        levels = e.measured.bytes_by_level()
        i = amsp.index(e) if e in amsp else None
        pred = f"{predicted[i]:.3f}" if i is not None else "-"
        ranks = (str(rank_m[i]), str(rank_p[i])) if i is not None else ("-", "-")
        median = f"{statistics.median(e.times):.3f}" if e.times else e.note or "not timed"
        lines.append(
            f"| {e.name} | `{e.strategy}` | {median} | {pred} | {ranks[0]} | {ranks[1]} | "
            f"{levels['intra']:,}, {levels['inter']:,} | {e.measured.memory_bytes / MIB:,.1f} | "
            f"{e.losses[0] if e.losses else float('nan'):.4f} |"
        )
    load = os.getloadavg()[0]
    stem = results_file.dated_stem(results_file.RESULTS, "tensor_step_time", results_file.hardware())
    text = results_file.header("Step time by tensor degree beside the GSPMD peer (CPU mesh)")
    text += (
        f"\nModel `{args.model}` ({config.num_params() / 1e6:.1f}M parameters), seq {args.seq_len}, global "
        f"batch {global_batch} sequences, mixed precision, full remat; {args.warmup} warm-up and "
        f"{args.steps} timed steps per configuration, interleaved; the same initial parameters and "
        f"batch everywhere (first losses agree to bf16 rounding). Predicted on {hw_source}. Load "
        f"average at the end {load:.1f}. {time.perf_counter() - started:.0f} s in all.\n\n"
        + "\n".join(lines) + "\n"
        + "".join(f"\nNot run: {line}.\n" for line in skipped)
    )  # fmt: skip
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(stem.with_suffix(".md"))


if __name__ == "__main__":
    main()
