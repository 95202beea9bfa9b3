"""Tensor-parallel plans audited: the cost model's bytes beside the compiled program's, per collective
kind and link level, on the 8 simulated CPU devices (2 x 4) and compiled for 2 nodes of 8 H100s.

    python -m benchmarks.tensor_audit [--out benchmarks/results]

writes a dated benchmarks/results/tensor_audit_<hardware>_<date>.md. Each row is one plan of the
shipped `tiny` LLaMA (and `small` for the H100 rows): the strategy, sequence parallelism, micro-batches
and remat, then every (kind, level) with predicted and compiled bytes per device and step.
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

# (target or None for the CPU mesh, model, strategy, sequence parallel, micro-batches, remat, precision)
CASES = [
    (None, "tiny", "t=2,zero3", True, 2, "full", "fp32"),
    (None, "tiny", "t=2,zero3", False, 3, "full", "fp32"),
    (None, "tiny", "t=2,ddp", True, 1, "full", "fp32"),
    (None, "tiny", "t=2,p=1x1,g=2x1,os=2x2", True, 1, "dots", "fp32"),
    (None, "tiny", "t=2,zero3", True, 2, "none", "mixed"),
    ("h100-sxm", "small", "t=2,zero3", True, 2, "full", "mixed"),
    ("h100-sxm", "small", "t=2,p=4x1,g=4x2,os=4x2", False, 2, "dots", "mixed"),
]


# 2,048 wide, four layers: the width the ring form's overlap claim is made at (`benchmarks.tensor_ring`).
WIDE = LlamaConfig(
    vocab_size=1024, dim=2048, n_layers=4, n_heads=16, n_kv_heads=16, ffn_dim=5632, max_seq_len=2048
)


def model_config(name: str) -> LlamaConfig:
    """A shipped model by name, `<name> kv4` with a key/value head per rank at t = 4, or `wide`."""
    if name == "wide":
        return WIDE
    config = LlamaConfig.from_yaml(find("models", name.split()[0], ModelConfigError))
    return dataclasses.replace(config, n_kv_heads=4) if name.endswith("kv4") else config


def run_case(
    target: str | None, model_name: str, strategy: str, sp: bool, micro: int, remat: str, precision: str,
    form: str = "gather", seq: int = 0, layers: int = 0,
):  # fmt: skip
    """Set up the plan's Trainer (compiled for `target` GPUs, or on the CPU mesh) and audit its step
    (`seq`: tokens per sequence, `layers`: the depth; the model's own by default)."""
    config = model_config(model_name)
    config = dataclasses.replace(
        config, max_seq_len=seq or config.max_seq_len, n_layers=layers or config.n_layers
    )
    devices = gpu_target.topology(target, 2, 8) if target else None
    cluster = aj.Cluster.detect(devices) if devices else aj.Cluster(2, 4)
    plan = aj.Plan(
        cluster, aj.resolve(strategy, cluster), micro, precision=precision, remat=remat, sequence_parallel=sp,
        tensor_matmul=form,
    )  # fmt: skip
    model = Llama(config)
    trainer = aj.Trainer(plan, model, optax.adamw(1e-4), make_loss_fn(model), devices=devices)
    seq = config.max_seq_len
    trainer.setup(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))
    data_devices = cluster.num_devices // plan.strategy.tensor
    tokens = jax.ShapeDtypeStruct((data_devices * micro, seq), jnp.int32)
    return plan, audit.audit_trainer(trainer, {"inputs": tokens, "targets": tokens}, cost.llama_dims(config))


def byte_rows(report: audit.Report, where: str, model_name: str, name: str) -> list[str]:
    """One table row per collective kind and level with bytes: predicted, compiled, whether equal."""
    predicted = report.predicted.bytes_by_kind_and_level()
    measured = report.measured.bytes_by_kind_and_level()
    rows = []
    for kind in sorted(set(predicted) | set(measured)):
        for level in ("intra", "inter"):
            p, m = predicted.get(kind, {}).get(level, 0), measured.get(kind, {}).get(level, 0)
            if p or m:
                cells = [where, model_name, name, kind, level, f"{p:,}", f"{m:,}", "yes" if p == m else "NO"]
                rows.append("| " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(results_file.RESULTS))
    args = parser.parse_args(argv)
    lines = [
        results_file.header("Tensor-parallel plans: predicted and compiled bytes per device and step"),
        "| target | model | plan | kind | level | predicted B | compiled B | equal |",
        "|---|---|---|---|---|---:|---:|---|",
    ]
    failures = 0
    for case in CASES:
        target, model_name = case[0], case[1]
        plan, report = run_case(*case)
        name = f"{plan.strategy}, {'SP' if plan.sequence_parallel else 'no SP'}, M={plan.micro_batches}, "
        name += f"remat {plan.remat}, {plan.precision.name}"
        lines += byte_rows(report, target or "cpu 2x4", model_name, name)
        failures += not report.bytes_match
        print(
            f"{target or 'cpu'} {name}: {'bytes equal' if report.bytes_match else 'bytes differ'}", flush=True
        )
    lines += ["", f"{len(CASES) - failures} of {len(CASES)} plans: every kind and level equal."]
    stem = results_file.dated_stem(args.out, "tensor_audit", "cpu8-and-h100x16-compiled")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(stem.with_suffix(".md"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
