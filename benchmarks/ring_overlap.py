"""How much of the ring form's transfers XLA hides, and which options change it: the share of
collective-permute bytes with a gemm between start and done in the program compiled for 2 nodes of 8
H100s (LLaMA 2,048 wide, sequence 2,048, `t=4,zero3`, remat full, mixed), with the step's own XLA
options and with one changed at a time, then at t = 2 and 8 with the step's options and with four
collectives in flight, the exposed permutes by where they come from, and the bytes of the step's
all-gathers and reduce-scatters (the placements' and the vocabulary's) with a gemm between start and
done.

    python -m benchmarks.ring_overlap [--out benchmarks/results]

writes a dated benchmarks/results/ring_overlap_h100x16-compiled-jaxlib<version>_<date>.md. Run it
with each jaxlib to compare (a variant an XLA version does not have is skipped).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from amsp_jax.compiled import compile_step, xla
from benchmarks import results_file
from benchmarks.tensor_audit import run_case

LIMIT, ESTIMATOR = xla.OVERLAP_LIMIT, xla.ANALYTICAL_ESTIMATOR
# (name, change to the step's options: None where the variant does not apply to these options)
def _without(options: dict[str, Any], key: str) -> dict[str, Any] | None:
    return {k: v for k, v in options.items() if k != key} if key in options else None


VARIANTS: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any] | None]]] = [
    ("the step's options", lambda o: o),
    ("four collectives in flight", lambda o: o | {LIMIT: 4} if LIMIT in o else None),
    ("no analytical latency estimator", lambda o: _without(o, ESTIMATOR)),
]
# (tensor degree, variant): every variant at t = 4; the step's options and four collectives in flight
# at the other degrees in a node
CASES = [(4, variant) for variant in VARIANTS] + [(t, VARIANTS[i]) for t in (2, 8) for i in (0, 1)]


def where(op_name: str) -> str:
    """Which part of the step a collective comes from, by its JAX operation's name."""
    part = "backward, recomputed forward" if "rematted_computation" in op_name else "backward"
    part = part if "transpose(" in op_name else "forward"
    return ("layers, " if "/layers/" in op_name else "head, ") + part


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(results_file.RESULTS))
    args = parser.parse_args(argv)
    jaxlib = metadata.version("jaxlib")
    lines = [
        results_file.header(f"Ring-form overlap compiled for H100s, jaxlib {jaxlib}"),
        "| t | XLA options | permute bytes hidden | all | hidden | exposed permutes by where "
        "| all-gather bytes hidden | reduce-scatter bytes hidden |",
        "|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    original = compile_step.compiler_options
    for degree, (name, change) in CASES:
        skipped: list[bool] = []

        def options(*a: Any, change: Callable = change, skipped: list = skipped, **k: Any) -> Any:
            found = original(*a, **k)
            changed = change(found)
            skipped.append(changed is None)
            return found if changed is None else changed

        compile_step.compiler_options = options
        try:
            _, report = run_case("h100-sxm", "wide", f"t={degree},zero3", True, 1, "full", "mixed", "ring")
        finally:
            compile_step.compiler_options = original
        if any(skipped):
            lines.append(f"| {degree} | {name} | - | - | - | (not an option of this jaxlib's step) | - | - |")
            continue
        hidden, total = report.measured.hidden_bytes("collective-permute")
        measured = report.measured
        exposed = collections.Counter(
            where(c.op_name) for c, o in zip(measured.collectives, measured.overlaps, strict=True)
            if c.kind == "collective-permute" and not o.hidden
        )  # fmt: skip
        parts = ", ".join(f"{k} x{n}" for k, n in sorted(exposed.items()))
        others = [measured.hidden_bytes(kind) for kind in ("all-gather", "reduce-scatter")]
        shares = " | ".join(f"{h:,} of {n:,} ({h / max(n, 1):.1%})" for h, n in others)
        share = f"{hidden:,} | {total:,} | {hidden / total:.1%}"
        lines.append(f"| {degree} | {name} | {share} | {parts} | {shares} |")
        print(lines[-1], flush=True)
    lines += ["", "The step's XLA options: `amsp_jax.compiled.xla.compiler_options`."]
    stem = results_file.dated_stem(args.out, "ring_overlap", f"h100x16-compiled-jaxlib{jaxlib}")
    path = stem.parent / f"{stem.name}.md"  # the version's dots are not a suffix
    path.write_text("\n".join(lines) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
