"""The cannon form (PrimePar's 2 x 2 square, t = 4) audited beside the gather and ring forms: the cost
model's bytes against the compiled program's, which collectives run inside a tensor group in the
layers, how many of the permutes' bytes have a matmul between start and done, and the memory, on the
8 simulated CPU devices (2 x 4) and compiled for 2 nodes of 8 H100s.

    python -m benchmarks.tensor_cannon [--out benchmarks/results]

writes a dated benchmarks/results/tensor_cannon_<hardware>_<date>.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from amsp_jax.compiled import audit, hlo
from benchmarks import results_file
from benchmarks.tensor_audit import byte_rows, run_case

# (target or None for the CPU mesh, model, strategy, micro-batches, remat, precision, matmul form)
CASES = [
    (None, "tiny kv4", "t=4,zero3", 1, "full", "fp32", "cannon"),
    (None, "tiny kv4", "t=4,p=1x2,g=1x2,os=1x2", 3, "dots", "mixed", "cannon"),
    (None, "tiny kv4", "t=4,mics", 2, "none", "fp32", "cannon"),
    ("h100-sxm", "wide", "t=4,zero3", 1, "full", "mixed", "gather"),
    ("h100-sxm", "wide", "t=4,zero3", 1, "full", "mixed", "ring"),
    ("h100-sxm", "wide", "t=4,zero3", 1, "full", "mixed", "cannon"),
    ("h100-sxm", "wide", "t=4,zero3", 1, "none", "mixed", "cannon"),
    ("h100-sxm", "wide", "t=4,zero3", 1, "none", "mixed", "gather"),
]


def group_kinds(report: audit.Report, degree: int) -> collections.Counter[str]:
    """Kinds of the per-layer collectives whose every group lies inside one tensor group (the tensor
    axis is the mesh's innermost, so a group is `degree` consecutive logical device ids)."""
    measured, found = report.measured, collections.Counter()
    for c in measured.collectives:
        groups = c.replica_groups or tuple(c.source_target_pairs)
        inside = groups and all(len({d // degree for d in g}) == 1 for g in groups)
        if inside and measured.is_per_layer(c) and not c.scalar and hlo.bytes_per_device(c):
            found[c.kind] += 1
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(results_file.RESULTS))
    args = parser.parse_args(argv)
    lines = [
        results_file.header("Cannon-form tensor matmuls: bytes, collectives in the group, overlap, memory"),
        "| target | model | plan | kind | level | predicted B | compiled B | equal |",
        "|---|---|---|---|---|---:|---:|---|",
    ]
    summary = [
        "",
        "Per plan: the kinds of the layers' collectives inside a tensor group (count of compiled ops), the",
        "permutes' bytes with a gemm between start and done (compiled for H100s: XLA's schedule; the CPU",
        "overlaps nothing), memory per device predicted (with each form's own terms) and compiled.",
        "",
        "| target | plan | in the group | permutes hidden | memory predicted | compiled | ratio |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    failures = 0
    for case in CASES:
        target, model_name, strategy, micro, remat, precision, form = case
        plan, report = run_case(target, model_name, strategy, True, micro, remat, precision, form)
        name = f"{plan.strategy}, {form}, M={micro}, remat {remat}, {precision}"
        where = target or "cpu 2x4"
        lines += byte_rows(report, where, model_name, name)
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(group_kinds(report, plan.strategy.tensor).items()))
        hidden, total = report.measured.hidden_bytes("collective-permute")
        share = f"{hidden / total:.1%}" if target and total else "-"
        predicted, compiled = report.predicted.memory.total, report.measured.memory_bytes
        memory = f"{predicted:,} | {compiled:,} | {report.memory_ratio:.3f}"
        summary.append(f"| {where} | {name} | {kinds} | {share} | {memory} |")
        failures += not report.bytes_match
        print(f"{where} {name}: {'bytes equal' if report.bytes_match else 'bytes differ'}", flush=True)
    lines += ["", f"{len(CASES) - failures} of {len(CASES)} plans: every kind and level equal.", *summary]
    stem = results_file.dated_stem(args.out, "tensor_cannon", "cpu8-and-h100x16-compiled")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(stem.with_suffix(".md"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
