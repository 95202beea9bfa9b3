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
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import results_file
from benchmarks.tensor_audit import byte_rows, run_case

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
        target, model_name, strategy, micro, remat, precision, form = case
        plan, report = run_case(target, model_name, strategy, True, micro, remat, precision, form)
        name = f"{plan.strategy}, {plan.tensor_matmul}, M={plan.micro_batches}, remat {plan.remat}, "
        name += plan.precision.name
        lines += byte_rows(report, target or "cpu 2x4", model_name, name)
        measured = report.measured.bytes_by_kind_and_level()
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
