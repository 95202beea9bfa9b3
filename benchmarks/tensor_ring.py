"""The ring form of tensor-parallel matmuls audited: the cost model's collective-permutes beside the
compiled program's, and how many of the ring's bytes have a matmul between their transfer's start and
done, on the 8 simulated CPU devices (2 x 4) and compiled for 2 nodes of 8 H100s.

    python -m benchmarks.tensor_ring [--out benchmarks/results]

writes a dated benchmarks/results/tensor_ring_<hardware>_<date>.md: per plan, predicted and compiled bytes
per device and step of every collective kind and level, and (compiled for H100s, on a LLaMA 2,048 wide)
the ring's bytes hidden behind a gemm in XLA's schedule, beside the gather form's tensor collectives.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit, gpu_target
from amsp_jax.core.config_files import find
from amsp_jax.models.llama import Llama, LlamaConfig, ModelConfigError, make_loss_fn
from benchmarks import results_file

# 2,048 wide, four layers: the width the overlap claim is made at.
WIDE = LlamaConfig(
    vocab_size=1024, dim=2048, n_layers=4, n_heads=16, n_kv_heads=16, ffn_dim=5632, max_seq_len=2048
)

# (target or None for the CPU mesh, model, strategy, micro-batches, remat, precision, matmul form)
CASES = [
    (None, "tiny", "t=2,zero3", 2, "full", "fp32", "ring"),
    (None, "tiny", "t=2,p=1x1,g=2x1,os=2x2", 1, "dots", "fp32", "ring"),
    (None, "tiny kv4", "t=4,zero3", 3, "none", "mixed", "ring"),
    ("h100-sxm", "wide", "t=2,zero3", 1, "full", "mixed", "ring"),
    ("h100-sxm", "wide", "t=2,zero3", 1, "full", "mixed", "gather"),
    ("h100-sxm", "wide", "t=4,zero3", 1, "full", "mixed", "ring"),
    ("h100-sxm", "wide", "t=8,zero3", 1, "full", "mixed", "ring"),
]


def run_case(target, model_name, strategy, micro, remat, precision, form):  # type: ignore[no-untyped-def]
    config = WIDE
    if model_name != "wide":  # "tiny kv4": the tiny model with a key/value head per rank at t = 4
        config = LlamaConfig.from_yaml(find("models", model_name.split()[0], ModelConfigError))
        config = dataclasses.replace(config, n_kv_heads=4) if model_name.endswith("kv4") else config
    devices = gpu_target.topology(target, 2, 8) if target else None
    cluster = aj.Cluster.detect(devices) if devices else aj.Cluster(2, 4)
    plan = aj.Plan(
        cluster, aj.resolve(strategy, cluster), micro, precision=precision, remat=remat, tensor_matmul=form
    )
    model = Llama(config)
    trainer = aj.Trainer(plan, model, optax.adamw(1e-4), make_loss_fn(model), devices=devices)
    seq = config.max_seq_len
    trainer.setup(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))
    data_devices = cluster.num_devices // plan.strategy.tensor
    tokens = jax.ShapeDtypeStruct((data_devices * micro, seq), jnp.int32)
    return plan, audit.audit_trainer(trainer, {"inputs": tokens, "targets": tokens}, cost.llama_dims(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(results_file.RESULTS))
    args = parser.parse_args(argv)
    lines = [
        results_file.header("Ring-form tensor matmuls: predicted and compiled bytes, overlap"),
        "| target | model | plan | kind | level | predicted B | compiled B | equal |",
        "|---|---|---|---|---|---:|---:|---|",
    ]
    overlap = [
        "",
        "Compiled for H100s: bytes per device and step with a gemm between start and done (XLA's schedule).",
        "",
        "| plan | kind | hidden B | all B | hidden |",
        "|---|---|---:|---:|---:|",
    ]
    failures = 0
    for case in CASES:
        target, model_name = case[0], case[1]
        plan, report = run_case(*case)
        name = f"{plan.strategy}, {plan.tensor_matmul}, M={plan.micro_batches}, remat {plan.remat}, "
        name += plan.precision.name
        predicted, measured = (
            report.predicted.bytes_by_kind_and_level(),
            report.measured.bytes_by_kind_and_level(),
        )
        for kind in sorted(set(predicted) | set(measured)):
            for level in ("intra", "inter"):
                p, m = predicted.get(kind, {}).get(level, 0), measured.get(kind, {}).get(level, 0)
                if p or m:
                    cells = [target or "cpu 2x4", model_name, name, kind, level, f"{p:,}", f"{m:,}"]
                    lines.append("| " + " | ".join(cells) + f" | {'yes' if p == m else 'NO'} |")
        if target:
            for kind in sorted(measured):
                hidden, total = report.measured.hidden_bytes(kind)
                if total:
                    overlap.append(f"| {name} | {kind} | {hidden:,} | {total:,} | {hidden / total:.1%} |")
        failures += not report.bytes_match
        verdict = "bytes equal" if report.bytes_match else "bytes differ"
        print(f"{target or 'cpu'} {name}: {verdict}", flush=True)
    lines += ["", f"{len(CASES) - failures} of {len(CASES)} plans: every kind and level equal.", *overlap]
    stem = results_file.dated_stem(args.out, "tensor_ring", "cpu8-and-h100x16-compiled")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(stem.with_suffix(".md"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
