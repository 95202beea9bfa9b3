"""Which XLA settings overlap the step's per-layer collectives on the installed jaxlib (compiled, no GPU).

XLA renames, removes and re-defaults its GPU scheduling options between releases (jaxlib 0.11 dropped
`xla_gpu_enable_pipelined_*` as compile options and moved loop pipelining under effort level O1), and
the share of per-layer collective bytes with matrix compute between start and done moved with it. This
compiles one plan under a set of variants, each in its own process (XLA reads `XLA_FLAGS` once per
process, and aborts on a flag it does not know), and tabulates the overlap audit of each:

    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.xla_overlap --model llama-7b --strategies zero3 mics

A variant adds `XLA_FLAGS`, overrides the library's compile options (`amsp_jax.compiled.xla.gpu_options`) or
passes `amsp-jax audit` flags (`--prefetch loop`). `--list-flags` also writes the GPU scheduling flags
the installed XLA binaries name. Every variant compiles the way the library does, the second compile
with a profile of instruction costs included (`amsp_jax.compiled.xla.compile_scheduled`: from jaxlib 0.11, or
wherever a variant leaves out the analytical estimator). Nothing here is a GPU timing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import results_file

REPO = Path(__file__).resolve().parent.parent
MARKER = "XLA_OVERLAP_RESULT "
# XLA's ExecutionOptions effort levels (`jax_optimization_level`): O1 is what the library asks for.
EFFORT = {"O2": 29, "O3": 39}

_PIPELINE = ("all_gather", "reduce_scatter", "all_reduce")
# A variant is settings joined by "+" ("loop+limit2"); each setting adds XLA_FLAGS, overrides the library's
# compile options, or passes `amsp-jax audit` flags.
SETTINGS: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "library": ("", {}, []),
    "loop": ("", {}, ["--prefetch", "loop"]),
    "flat": ("", {}, ["--flat-collectives"]),
    "O2": ("", {"optimization_level": EFFORT["O2"]}, []),
    "O3": ("", {"optimization_level": EFFORT["O3"]}, []),
    "early": ("--xla_gpu_experimental_collective_start_as_early_as_possible=true", {}, []),
    "sol": ("--xla_gpu_enable_analytical_sol_latency_estimator=true", {}, []),
    # The speed-of-light estimator's network, for an 8-GPU node with 25 GB/s of NIC per GPU (XLA's
    # H100 example); without a collective perf table it prices NVLink collectives approximately.
    "sol-network": (
        "--xla_gpu_enable_analytical_sol_latency_estimator=true "
        "--xla_gpu_analytical_latency_estimator_options=nccl_op_launch_us=45,nic_speed_gbps=25,chunk_prep_us=6,rtt_us=31,gpus_per_node=8,chunk_size_bytes=4194304",
        {},
        [],
    ),
    "analytical": ("", {"xla_gpu_enable_analytical_latency_estimator": True}, []),
    **{
        f"limit{n}": ("", {"xla_gpu_experimental_parallel_collective_overlap_limit": n}, [])
        for n in (1, 2, 4)
    },
    "scaleup2": ("--xla_gpu_experimental_parallel_scale_up_collective_overlap_limit=2", {}, []),
    "multistream": ("--xla_gpu_experimental_enable_collective_multi_streaming=true", {}, []),
    "no-double-buffering": ("", {"xla_gpu_enable_while_loop_double_buffering": False}, []),
    # jaxlib 0.11's pipelining modes (default|off|on|explicit), as flags and as compile options.
    "pipeline-on": (" ".join(f"--xla_gpu_pipeline_{kind}=on" for kind in _PIPELINE), {}, []),
    "pipeline-on-option": ("", {f"xla_gpu_pipeline_{kind}": "on" for kind in _PIPELINE}, []),
}
DEFAULT_VARIANTS = ("library", "loop", "flat", "O2", "early", "sol", "limit1", "limit4", "loop+limit1",
                    "no-double-buffering", "pipeline-on", "pipeline-on+loop")  # fmt: skip


def variant(name: str) -> tuple[str, dict[str, Any], list[str]]:
    """The XLA_FLAGS, compile-option overrides and audit flags of a "+"-joined variant name."""
    unknown = [part for part in name.split("+") if part not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown setting {', '.join(unknown)} in {name!r}; known: {', '.join(SETTINGS)}")
    parts = [SETTINGS[part] for part in name.split("+")]
    flags = " ".join(filter(None, (p[0] for p in parts)))
    return flags, {k: v for p in parts for k, v in p[1].items()}, [a for p in parts for a in p[2]]


FLAG_WORDS = re.compile(
    rb"(?<![A-Za-z0-9_])xla_(?:gpu_)?[a-z0-9_]*(?:pipelin|collective|overlap|latency|schedul|double_buffer)"
    rb"[a-z0-9_]*(?![A-Za-z0-9_])"
)


def scheduling_flags() -> list[str]:
    """The XLA option names about collective scheduling that the installed jaxlib's binaries contain."""
    import importlib.util

    roots = []
    for package in ("jaxlib", "jax_plugins"):
        spec = importlib.util.find_spec(package)
        if spec and spec.submodule_search_locations:
            roots.extend(Path(p) for p in spec.submodule_search_locations)
    names: set[str] = set()
    for root in roots:
        for library in root.rglob("*.so*"):
            names.update(m.decode() for m in FLAG_WORDS.findall(library.read_bytes()) if b"proto" not in m)
    return sorted(names)


def child(args: argparse.Namespace) -> int:
    """One compile and audit in this process, with the variant's option overrides; prints one JSON line."""
    import warnings

    from amsp_jax import cli

    # Before JAX loads: the audit checks that the host platform has the cluster's device count.
    cli.simulate_host_devices(["audit", *args.audit])
    from amsp_jax.compiled import xla

    overrides = json.loads(args.overrides)
    library_options = xla.gpu_options
    xla.gpu_options = lambda *a, **k: library_options(*a, **k) | overrides
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli.main(["audit", *args.audit, "--json"])
    report = json.loads(out.getvalue()) if out.getvalue().strip().startswith("{") else None
    result = {
        "rc": rc,
        "seconds": round(time.perf_counter() - started, 1),
        "warnings": [str(w.message)[:300] for w in caught if "compile" in str(w.message)],
        "report": report,
    }
    print(MARKER + json.dumps(result))
    return 0


def run_variant(name: str, strategy: str, base: list[str], timeout: float) -> dict[str, Any]:
    """Run one variant's compile in a fresh process and return what it reports (or how it failed)."""
    flags, overrides, audit_flags = variant(name)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # The child sizes the host platform to the cluster (the audit checks the device count).
    inherited = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = " ".join(filter(None, [inherited.strip(), flags]))
    command = [sys.executable, "-m", "benchmarks.xla_overlap", "--child", "--overrides",
               json.dumps(overrides), "--", *base, "--strategy", strategy, *audit_flags]  # fmt: skip
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": name, "strategy": strategy, "xla_flags": flags, "error": f"over {timeout:.0f} s"}
    row: dict[str, Any] = {"variant": name, "strategy": strategy, "xla_flags": flags,
                           "overrides": overrides, "audit_flags": audit_flags,
                           "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    result = json.loads(lines[-1][len(MARKER) :]) if lines else None
    report = result and result["report"]
    if report is None:
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        telling = [
            line for line in errors if re.search(r"Check failed|Unknown flag|parsing failed|[Ee]rror", line)
        ]
        row["error"] = " | ".join((telling or errors)[-2:])[-600:] or f"exit {done.returncode}"
        return row
    row["warnings"] = result["warnings"]
    overlap = report["overlap"]
    row["hidden_fraction"] = overlap["per_layer_hidden_fraction"]
    row["by_phase"] = overlap["by_phase"]
    row["exposed"] = [
        f"{e['name']} {e['kind']} {e['level']} x{e['executions']} {e['phase']}: {e['why']}"
        for e in overlap["exposed"]
    ][:8]
    row["compiled_gib"] = report["memory"]["compiled_bytes_per_device"] / 2**30
    row["predicted_gib"] = report["memory"]["predicted_bytes_per_device"] / 2**30
    row["bytes_match"] = report["bytes_match"]
    row["jaxlib"] = report["jaxlib"]
    return row


def markdown(rows: list[dict[str, Any]], command: str, jaxlib: str) -> str:
    """The table of hidden shares per variant and strategy, then each row's exposed collectives."""
    lines = [f"# Per-layer collective overlap by XLA setting (jaxlib {jaxlib}, compiled, no GPU ran)", "",
             f"`{command}`", "",
             "| variant | strategy | per-layer bytes with compute between start and done | compiled GiB "
             "(predicted) | bytes equal | note |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['variant']} | {row['strategy']} | – | – | – | {row['error'][:160]} |")
            continue
        dropped = "; ".join(w[:120] for w in row["warnings"])
        # A plan with P and G replicated (the planner's choice at 1,024 GPUs) has no per-layer collective.
        fraction = row["hidden_fraction"]
        share = "no per-layer collective" if fraction is None else f"{100 * fraction:.1f}%"
        lines.append(
            f"| {row['variant']} | {row['strategy']} | {share} | "
            f"{row['compiled_gib']:.2f} ({row['predicted_gib']:.2f}) | "
            f"{'yes' if row['bytes_match'] else 'no'} | {dropped} |"
        )
    lines.append("")
    for row in rows:
        if row.get("exposed"):
            lines.append(f"- {row['variant']} / {row['strategy']}: " + "; ".join(row["exposed"][:4]))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--target", default="a100-sxm-80")
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    # The planner's choice for LLaMA-7B at 1,024 GPUs keeps no activations for recompute: `--remat none`.
    parser.add_argument("--remat", default="full", choices=["none", "dots", "full"])
    parser.add_argument(
        "--memory-limit", type=float, default=73.6, help="GiB per device (the A800 cluster's); 0: no budget"
    )
    parser.add_argument("--strategies", nargs="+", default=["zero3", "mics"])
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), help="settings joined by +")
    parser.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--timeout", type=float, default=300, help="seconds one compile may take")
    parser.add_argument("--list-flags", action="store_true", help="also list XLA's scheduling flag names")
    parser.add_argument("--out", type=Path, help="a directory for a new dated xla_overlap_*.md and .json")
    parser.add_argument("audit", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    base = ["--model", args.model, "--target", args.target, "--nodes", str(args.nodes),
            "--devices-per-node", str(args.devices_per_node), "--seq-len", str(args.seq_len),
            "--precision", "mixed", "--remat", args.remat]  # fmt: skip
    if args.memory_limit > 0:
        base += ["--memory-limit", str(args.memory_limit)]
    for name in args.variants:
        variant(name)
    jobs = [(v, s) for v in args.variants for s in args.strategies]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda job: run_variant(job[0], job[1], base, args.timeout), jobs))
    jaxlib = next((r["jaxlib"] for r in rows if "jaxlib" in r), "?")
    command = "python -m benchmarks.xla_overlap " + " ".join(sys.argv[1:])
    text = markdown(rows, command, jaxlib)
    print(text)
    result: dict[str, Any] = {"command": command, "jaxlib": jaxlib, "rows": rows}
    if args.list_flags:
        result["scheduling_flags"] = scheduling_flags()
        print("\n".join(result["scheduling_flags"]))
    if args.out:
        devices = args.nodes * args.devices_per_node
        stem = results_file.dated_stem(args.out, "xla_overlap", f"{args.target}x{devices}")
        title = f"Per-layer collective overlap, {args.model} on {args.target} x {devices} (compiled only)"
        # The header carries the title and command that the table's own first lines repeat.
        stem.with_suffix(".md").write_text(results_file.header(title) + text.split("\n", 4)[4])
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
