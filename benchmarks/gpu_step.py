"""One GPU: MFU of a ~1B LLaMA step, and the time model's step time beside the measured one.

Runs on a machine with one CUDA GPU. First `amsp-jax profile` measures the device (its bf16 matmul
rate at the layer shapes, memory bandwidth) and writes the cluster config the time model reads; then,
for each (micro-batches, remat) pair, the real `Trainer` step of `configs/models/llama-1b.yaml`
(TinyLlama-1.1B's shape; mixed precision, AdamW, cuDNN flash attention) is compiled, its compiled
memory read, and it is timed: `--warmup` untimed steps, then `--steps` timed ones, each waited for.
The prediction is `amsp_jax.cost.timing.estimate` with the measured config, and with the shipped
`h100-dgx` one (datasheet peak × its assumed efficiency). MFU counts model FLOPs (Megatron-LM: 6Φ +
12·L·H·Q·T per token, no recompute, no causal halving) over the datasheet bf16 dense peak in
`configs/clusters/h100-dgx.yaml` (the H200 has the H100's tensor cores). Two steps of each pair
are traced with `jax.profiler` (`--trace`), and their GPU kernel time is summed by kind (matmuls,
attention, the rest) to say where a step's time goes; the first pair's trace is kept.

Each pair's results are written as soon as they exist (a new `gpu_step_<card>_<yyyymmdd-hhmm>.json` and
`.md` under `--out` per run), and no new pair starts after `--deadline-s`: the GPU lease is short.

Before the pairs a child process compiles the first one with the options a multi-GPU step gets
(`--no-options-check` skips it): an XLA that aborts on them ends only the child.

Run:  XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 PYTHONPATH=. python -m benchmarks.gpu_step --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from jax.sharding import NamedSharding

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit, gpu_target, hlo, xla
from amsp_jax.core import backend, config_files
from amsp_jax.core.mesh import batch_spec
from amsp_jax.cost import timing
from amsp_jax.cost.hardware import ClusterConfig, from_dict, load
from amsp_jax.models.llama import Llama, LlamaConfig, llama_spec, make_loss_fn
from benchmarks import results_file
from benchmarks.step_time import abstract, make_batch, optimizer

ROOT = Path(__file__).resolve().parent.parent
# M:remat[:global batch]; the first is traced. The last doubles the batch where the memory allows it.
DEFAULT_PAIRS = "1:none,1:full,2:none,4:none,1:dots,4:full,1:none:16"
# Kernel names by what they do, first match wins: cuBLAS/cuBLASLt and CUTLASS matmuls on Hopper
# (sm90_xmma, nvjet, cutlass), cuDNN's fused attention, then everything else XLA emits (fusions,
# copies, reductions, the optimizer's element-wise update).
KERNEL_KINDS = (
    ("attention", re.compile(r"fmha|flash|cudnn|attention", re.I)),
    ("matmul", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|dot", re.I)),
)


def card(device: Any) -> str:
    """A short file-name tag for a device kind: `h100` for "NVIDIA H100 80GB HBM3"."""
    kind = device.device_kind.lower()
    found = re.search(r"\b[a-z]\d{2,3}\b", kind)
    return found.group(0) if found else re.sub(r"[^a-z0-9]+", "-", kind).strip("-")


def card_of(profile: ClusterConfig) -> str:
    """`card`'s tag for the device a profile measured."""
    return card(argparse.Namespace(device_kind=profile.device_name))


def profile_device(out: Path) -> Path:
    """Run `amsp-jax profile` on this device (compute only: one device has no collective to time)."""
    from amsp_jax.cli import profile

    path = out / f"gpu_profile_{card(jax.devices()[0])}.yaml"
    args = argparse.Namespace(
        out=str(path), sizes="64KiB", repeats=5, nodes=None, name="one-gpu", no_passes=True
    )
    profile.run(args)
    return path


def kernel_breakdown(trace_file: Path) -> dict[str, Any]:
    """GPU kernel seconds of a traced run by kind, from the profiler's trace.json.gz: the events on the
    GPU's stream lines (its module and op lines span the same kernels again)."""
    with gzip.open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M"]
    gpu_pids = {e["pid"] for e in meta if e.get("name") == "process_name" and "GPU" in e["args"]["name"]}
    lines = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in meta
        if e.get("name") == "thread_name" and e["pid"] in gpu_pids
    }
    streams = {key for key, name in lines.items() if name.startswith("Stream")}
    seconds: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for event in events:
        if event.get("ph") != "X" or event.get("pid") not in gpu_pids:
            continue
        if streams and (event["pid"], event.get("tid")) not in streams:
            continue
        name = event.get("name", "")
        kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(name)), "other")
        seconds[kind] = seconds.get(kind, 0.0) + event["dur"] * 1e-6
        by_name[name] = by_name.get(name, 0.0) + event["dur"] * 1e-6
    return {
        "gpu_lines": sorted(set(lines.values())),
        "seconds_by_kind": seconds,
        "top_kernels": sorted(by_name.items(), key=lambda kv: -kv[1])[:30],
    }


def make_trainer(
    model: Llama, host_batch: dict[str, np.ndarray], micro_batches: int, remat: str, device: Any = None
) -> aj.Trainer:
    """A set-up Trainer of one pair on `device` (default: this process's first)."""
    cluster = aj.Cluster(1, 1, "one-gpu")
    plan = aj.Plan(cluster, aj.resolve("ddp", cluster), micro_batches, precision="mixed", remat=remat)
    devices = [device or jax.devices()[0]]
    trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model), devices=devices)
    trainer.setup(jax.random.key(0), host_batch["inputs"])
    return trainer


def check_options(config: LlamaConfig, pair: str, args: argparse.Namespace) -> None:
    """Compile `pair` with the GPU options a multi-GPU step gets (one device gets only the memory budget)
    and print what was kept; run in a child process, since an XLA abort ends the process."""
    micro_batches, remat, *batch = pair.split(":")
    host_batch = make_batch(config, int(batch[0]) if batch else args.global_batch, args.seq_len)
    trainer = make_trainer(Llama(config), host_batch, int(micro_batches), remat)
    lowered = trainer.lower(trainer.abstract_state(), abstract(trainer.shard_batch(host_batch)))
    options = xla.gpu_options()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        xla.compile_lowered(lowered, options)
    print("OPTIONS_CHECK " + json.dumps({"options": options, "warnings": [str(w.message) for w in caught]}))


def options_check(args: argparse.Namespace) -> dict[str, Any]:
    """`check_options` in a child process: its exit status and its last output."""
    command = [sys.executable, "-m", "benchmarks.gpu_step", "--check-options", "--model", args.model,
               "--pairs", args.pairs.split(",")[0], "--global-batch", str(args.global_batch),
               "--seq-len", str(args.seq_len)]  # fmt: skip
    environment = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    lines = (done.stdout + done.stderr).splitlines()
    found = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("OPTIONS_CHECK ")]
    kept = [line for line in lines if not line.startswith(("W0000", "I0000"))]
    return {"returncode": done.returncode, "result": found[0] if found else None, "tail": kept[-12:]}


def run_pair(
    config: LlamaConfig,
    model: Llama,
    host_batch: dict[str, np.ndarray],
    micro_batches: int,
    remat: str,
    hardware: dict[str, Any],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], Any]:
    """Compile, predict and time one (micro-batches, remat) pair; its row and (compiled, state, batch)."""
    trainer = make_trainer(model, host_batch, micro_batches, remat)
    key = jax.random.key(0)
    batch = trainer.shard_batch(host_batch)
    abstract_batch = abstract(batch)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = trainer.compile(trainer.abstract_state(), abstract_batch)
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    state = trainer.init(key, host_batch["inputs"])
    losses = []
    for _ in range(args.warmup):
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
    if not all(np.isfinite(losses)):
        raise FloatingPointError(f"non-finite loss {losses}")
    row = {
        "micro_batches": micro_batches,
        "global_batch": len(host_batch["inputs"]),
        "remat": remat,
        "compile_s": compile_s,
        "compiler_warnings": [str(w.message) for w in caught],
        "cudnn_attention": "__cudnn$fmha" in text,
        "times_s": times,
        "measured_s": statistics.median(times),
        "fastest_s": min(times),
        "losses": losses,
        "compiled_bytes": {
            "arguments": memory.argument_size_in_bytes,
            "outputs": memory.output_size_in_bytes,
            "temporaries": memory.temp_size_in_bytes,
            "aliased": memory.alias_size_in_bytes,
        },
    }
    row.update(modelled(trainer, host_batch, config, hardware, row["measured_s"]))
    return row, (compiled, state, batch)


def modelled(
    trainer: aj.Trainer,
    host_batch: dict[str, np.ndarray],
    config: LlamaConfig,
    hardware: dict[str, Any],
    measured_s: float,
) -> dict[str, Any]:
    """A pair's numbers that come from the models, not the clock: its MFU (model FLOPs over the
    measured time) and each cluster config's prediction beside the measured step."""
    workload = audit.workload_of(trainer, host_batch, cost.llama_dims(config))
    model_flops = workload.flops_per_token() * workload.tokens_per_device()
    peak = hardware["h100-dgx (datasheet)"].peak_flops
    predicted = {name: timing.estimate(trainer.layout, workload, hw) for name, hw in hardware.items()}
    return {
        "micro_batch_size": workload.micro_batch_size,
        "tokens": workload.tokens_per_device(),
        "mfu": model_flops / measured_s / peak,
        "model_tflops_per_s": model_flops / measured_s / 1e12,
        "predicted": {
            name: {
                "step_s": e.time.step_s,
                "compute_s": e.time.compute_s,
                "memory_s": dict(e.time.memory_s),
                "ratio": e.time.step_s / measured_s,
                "memory_bytes": e.prediction.memory.total,
            }
            for name, e in predicted.items()
        },
    }


def hardware_for(profiled: ClusterConfig) -> dict[str, ClusterConfig]:
    """The two cluster configs a pair is priced with, for one device: the device's profile and the
    shipped `h100-dgx` datasheet config (whose peak is also MFU's)."""
    return {"profiled": profiled.with_shape(1, 1), "h100-dgx (datasheet)": load("h100-dgx").with_shape(1, 1)}


# How far from its measured step a repriced pair may land (issue 45: every recorded pair within it).
REPRICE_TOLERANCE = 0.15


def reprice(path: Path, target: str = "h100-sxm") -> str:
    """One line per pair of a recorded run, its MFU and prediction before and after `repriced`, then
    the planner's one-GPU choice among the run's pairs beside the fastest measured (`planner_choice`)."""
    report, lines = repriced(path, target)
    return "\n".join([lines, *(line for _, line in planner_choice(report))])


def reprice_all(paths: list[Path], target: str = "h100-sxm") -> str:
    """`reprice` of every run, then how many pairs landed within `REPRICE_TOLERANCE` and in how many
    runs the planner chose the fastest measured pair."""
    lines, ratios, choices = [], [], []
    for path in paths:
        report, text = repriced(path, target)
        found = planner_choice(report)
        lines += [text, *(line for _, line in found)]
        ratios += [row["predicted"]["profiled"]["ratio"] for row in report["rows"] if "mfu" in row]
        choices += [ok for ok, _ in found]
    within = sum(abs(r - 1) <= REPRICE_TOLERANCE for r in ratios)
    lines.append(
        f"{within} of {len(ratios)} pairs within ±{REPRICE_TOLERANCE:.0%} of the measured step "
        f"(predicted / measured {min(ratios):.2f}-{max(ratios):.2f}); the planner's choice is the fastest "
        f"measured pair in {sum(choices)} of {len(choices)} runs"
    )
    return "\n".join(lines)


def compiled_by(report: dict[str, Any]) -> AbstractContextManager[None]:
    """Predict as for the XLA that compiled a recorded run (its `jax`): which GPU traffic form and
    per-version behaviours apply follows that version, not the one installed here."""
    return backend.predicting_for(report.get("jax"))


def repriced(path: Path, target: str = "h100-sxm") -> tuple[dict[str, Any], str]:
    """A run's report with its model-derived numbers (MFU, predictions) recomputed by today's models and
    its own profile, its measured times kept; the step is rebuilt here for one GPU of `target` (compiled
    for nothing). The recorded files are never rewritten. Also one line per pair, before and after, and
    whether it lands within `REPRICE_TOLERANCE` of the measured step."""
    report = json.loads(path.read_text())
    config = model_of(report)
    model = Llama(config)
    device = gpu_target.topology(target, 1, 1)[0]
    hardware = hardware_for(from_dict(yaml.safe_load(report["profile"])))
    lines = []
    for row in report["rows"]:
        if "mfu" not in row:
            continue
        host_batch = make_batch(config, row["global_batch"], report["seq_len"])
        trainer = make_trainer(model, host_batch, row["micro_batches"], row["remat"], device)
        before = (row["mfu"], row["predicted"]["profiled"]["ratio"])
        with compiled_by(report):
            row.update(modelled(trainer, host_batch, config, hardware, row["measured_s"]))
        ratio = row["predicted"]["profiled"]["ratio"]
        lines.append(
            f"{report['device']}, {report['model']}, batch {row['global_batch']}, M={row['micro_batches']} "
            f"{row['remat']}: MFU {before[0]:.1%} -> {row['mfu']:.1%}, predicted (profiled) / measured "
            f"{before[1]:.2f} -> {ratio:.2f}"
            + ("" if abs(ratio - 1) <= REPRICE_TOLERANCE else f" (outside ±{REPRICE_TOLERANCE:.0%})")
        )
    report.setdefault("repriced", []).append(time.strftime("%Y-%m-%d"))
    return report, "\n".join(lines)


def planner_pick(
    config: LlamaConfig, hardware: ClusterConfig, seq_len: int, batch: int, pairs: list[tuple[int, str]]
) -> tuple[int, str]:
    """The planner's choice of (micro-batches, remat) among `pairs` for one GPU of `hardware`: the
    fastest that fits by its own terms (`amsp_jax.planner.terms`), as the ILP prices them."""
    from amsp_jax.planner.request import make_request
    from amsp_jax.planner.terms import Candidate, build_terms

    hardware = hardware.with_shape(1, 1)
    terms = build_terms(make_request(llama_spec(config), hardware, seq_len=seq_len, global_batch=batch))
    strategy = aj.resolve("ddp", hardware.cluster())

    def predicted(pair: tuple[int, str]) -> float:
        candidate = Candidate(strategy, batch // pair[0], pair[1])
        fits = terms.memory(candidate) <= terms.memory_limit
        return terms.step_time(candidate).step_s if fits else float("inf")

    return min(pairs, key=predicted)


def planner_choice(report: dict[str, Any]) -> list[tuple[bool, str]]:
    """Per global batch of a run: whether the planner's choice among the run's measured (micro-batches,
    remat) pairs, on the run's profile (`planner_pick`), is the fastest measured one, and a line."""
    config = model_of(report)
    hardware = from_dict(yaml.safe_load(report["profile"]))
    found = []
    rows = [row for row in report["rows"] if "measured_s" in row]
    for batch in sorted({row["global_batch"] for row in rows}):
        pairs = {(row["micro_batches"], row["remat"]): row["measured_s"] for row in rows
                 if row["global_batch"] == batch}  # fmt: skip
        if len(pairs) < 2:
            continue
        with compiled_by(report):
            chosen = planner_pick(config, hardware, report["seq_len"], batch, list(pairs))
        fastest = min(pairs, key=pairs.__getitem__)
        ok = pairs[chosen] == pairs[fastest]
        found.append((ok, (
            f"{report['device']}, {report['model']}, batch {batch}: the planner chooses M={chosen[0]} "
            f"{chosen[1]} ({pairs[chosen]:.4f} s measured) of {len(pairs)} pairs; fastest measured M="
            f"{fastest[0]} {fastest[1]} ({pairs[fastest]:.4f} s)" + ("" if ok else " (NOT the fastest)")
        )))  # fmt: skip
    return found


def predict(config: LlamaConfig, args: argparse.Namespace) -> str:
    """No GPU: each pair's predicted step on the device `--profile` describes, and the planner's choice
    among the pairs, written to a dated `gpu_step-prediction_<card>_*.md` before the pairs run."""
    profile = load(args.profile)
    hardware = hardware_for(profile)
    device = gpu_target.topology("h100-sxm", 1, 1)[0]
    model = Llama(config)
    pairs = [pair.split(":") for pair in args.pairs.split(",")]
    peak = hardware["h100-dgx (datasheet)"].peak_flops
    lines = [
        f"Model `{args.model}`: {config.num_params():,} parameters; sequences of {args.seq_len} tokens, "
        f"mixed precision, AdamW, one GPU priced by the profile `{args.profile}` "
        f"({profile.device_name}). MFU: model FLOPs over {peak / 1e12:.0f} TFLOP/s.",
        "",
        "| batch | M | remat | predicted s | compute s | memory-bound s | of it, every plan | predicted GiB "
        "| predicted MFU |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    by_batch: dict[int, list[tuple[int, str]]] = {}
    for micro_batches, remat, *batch in pairs:
        host_batch = make_batch(config, int(batch[0]) if batch else args.global_batch, args.seq_len)
        trainer = make_trainer(model, host_batch, int(micro_batches), remat, device)
        workload = audit.workload_of(trainer, host_batch, cost.llama_dims(config))
        priced = timing.estimate(trainer.layout, workload, hardware["profiled"])
        estimate, memory = priced.time, priced.prediction.memory.total
        flops = workload.flops_per_token() * workload.tokens_per_device()
        by_batch.setdefault(len(host_batch["inputs"]), []).append((int(micro_batches), remat))
        lines.append(
            f"| {len(host_batch['inputs'])} | {micro_batches} | {remat} | {estimate.step_s:.4f} "
            f"| {estimate.compute_s:.4f} | {sum(estimate.memory_s.values()):.4f} "
            f"| {estimate.memory_s['every plan']:.4f} | {memory / 2**30:.1f} "
            f"| {flops / estimate.step_s / peak:.1%} |"
        )
    lines.append("")
    for batch, among in by_batch.items():
        chosen = planner_pick(config, profile, args.seq_len, batch, among)
        lines.append(f"The planner's choice among these pairs at batch {batch}: M={chosen[0]} {chosen[1]}.")
    return "\n".join(lines) + "\n"


def trace_step(run: Any, out: Path, keep: bool) -> dict[str, Any]:
    """Trace two steps of a compiled pair with `jax.profiler`; their GPU kernel time by kind. With
    `keep`, the trace is copied to `gpu_trace_<card>.json.gz` under `out`."""
    compiled, state, batch = run
    trace_dir = out / "trace" / str(time.monotonic_ns())
    start = time.perf_counter()
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(2):
            state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
    wall = time.perf_counter() - start
    (trace_file,) = sorted(trace_dir.rglob("*.trace.json.gz"))[-1:]
    if keep:
        shutil.copyfile(trace_file, out / f"gpu_trace_{card(jax.devices()[0])}.json.gz")
    return {"steps": 2, "wall_s": wall, **kernel_breakdown(trace_file)}


def markdown(report: dict[str, Any]) -> str:
    """The report as a table: per pair, measured and predicted step time, MFU, memory."""
    lines = [
        f"# {report['model']} on one {report['device']}",
        "",
        f"`{report['command']}` ({report['date']}; jax {report['jax']}). Sequences of "
        f"{report['seq_len']} tokens, mixed precision, AdamW. MFU: model "
        f"FLOPs over {report['peak_flops'] / 1e12:.0f} TFLOP/s."
        + (
            f" MFU and predictions recomputed with the models of {report['repriced'][-1]} "
            "(`--reprice`), the times as measured."
            if report.get("repriced")
            else ""
        ),
        "",
        "| batch | M | remat | measured s | fastest s | MFU | predicted s (profiled) | ratio | predicted s "
        "(datasheet) | ratio | compiled GiB | predicted GiB | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| | {row['micro_batches']} | {row['remat']} | failed: {row['error']} |")
            continue
        profiled, datasheet = row["predicted"].values()
        compiled = row["compiled_bytes"]
        total = compiled["arguments"] + compiled["outputs"] + compiled["temporaries"] - compiled["aliased"]
        lines.append(
            f"| {row['global_batch']} | {row['micro_batches']} | {row['remat']} | "
            f"{row['measured_s']:.4f} | {row['fastest_s']:.4f} | "
            f"{row['mfu']:.1%} | {profiled['step_s']:.4f} | {profiled['ratio']:.2f} | "
            f"{datasheet['step_s']:.4f} | {datasheet['ratio']:.2f} | {total / 2**30:.2f} | "
            f"{profiled['memory_bytes'] / 2**30:.2f} | {row['compile_s']:.0f} |"
        )
    check = report.get("options_check")
    if check:
        kept = check["result"]
        said = (
            f"compiled; XLA warned: {kept['warnings'] or 'nothing'}"
            if kept
            else "failed: " + " / ".join(check["tail"][-3:])
        )
        lines += ["", f"The first pair compiled with the options a multi-GPU step gets (child process, exit "
                  f"{check['returncode']}): {said}"]  # fmt: skip
    traced = [row for row in report["rows"] if row.get("trace")]
    if traced:
        lines += [
            "",
            "GPU kernel seconds per step by kind (`jax.profiler` trace of two steps):",
            "",
            "| batch | M | remat | matmul | attention | other | kernels | measured step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in traced:
            kinds = {k: v / row["trace"]["steps"] for k, v in row["trace"]["seconds_by_kind"].items()}
            lines.append(
                f"| {row['global_batch']} | {row['micro_batches']} | {row['remat']} | "
                + " | ".join(f"{kinds.get(k, 0.0):.4f}" for k in ("matmul", "attention", "other"))
                + f" | {sum(kinds.values()):.4f} | {row['measured_s']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def model_of(report: dict[str, Any]) -> LlamaConfig:
    """The model a run measured: the shape it recorded, else (runs before it did) the shipped config of
    its name, checked against its parameter count."""
    if "model_config" in report:
        return LlamaConfig(**report["model_config"])
    config = LlamaConfig.from_yaml(config_files.find("models", report["model"]))
    if config.num_params() != report["parameters"]:
        raise SystemExit(
            f"gpu_step: the shipped model {report['model']!r} has {config.num_params():,} parameters, the "
            f"run measured {report['parameters']:,}: the config changed since the run"
        )
    return config


def traced_pairs(report: dict[str, Any], device: Any = None) -> Iterator[tuple[dict, dict, Any, float]]:
    """Per traced pair of a run, rebuilt for its own model: (row, host batch, its Trainer on `device`
    or the local one, the other kernels' measured seconds per step)."""
    config = model_of(report)
    model = Llama(config)
    for row in report["rows"]:
        if not row.get("trace"):
            continue
        host_batch = make_batch(config, row["global_batch"], report["seq_len"])
        trainer = make_trainer(model, host_batch, row["micro_batches"], row["remat"], device)
        other_s = row["trace"]["seconds_by_kind"].get("other", 0.0) / row["trace"]["steps"]
        yield row, host_batch, trainer, other_s


def other_kernel_features(report: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, float]:
    """Per traced pair of a run: (fp32 weight bytes × M, one micro-batch's activation bytes × M, 1) as
    the cost model counts them, the measured seconds of the other kernels per step, and the run's
    profiled memory bandwidth."""
    hardware = from_dict(yaml.safe_load(report["profile"])).with_shape(1, 1)
    dims = cost.llama_dims(model_of(report))
    features, seconds = [], []
    for row, host_batch, trainer, other_s in traced_pairs(report):
        workload = audit.workload_of(trainer, host_batch, dims)
        memory = timing.estimate(trainer.layout, workload, hardware).prediction.memory
        blocks = timing.pass_blocks(memory, workload)
        micro_batches = row["micro_batches"]
        features.append([micro_batches * blocks["model"], micro_batches * blocks["activations"], 1.0])
        seconds.append(other_s)
    return np.array(features), np.array(seconds), hardware.hbm_bandwidth


def cross_fit(paths: list[str]) -> str:
    """Fit the other kernels' seconds of each run as passes per micro-batch over the fp32 weights and the
    activations plus a constant, and predict every other run's at the ratio of the profiled memory
    bandwidths: whether the form carries from one card to another."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    data = {f"{report['device']}, {report['model']}": other_kernel_features(report) for report in reports}
    lines = []
    for fitted, (features, seconds, bandwidth) in data.items():
        coefficients, *_ = np.linalg.lstsq(features, seconds, rcond=None)
        per_byte = coefficients[:2] * bandwidth
        lines.append(
            f"fitted on {fitted}: {per_byte[0]:.3g} bytes per fp32 weight byte and {per_byte[1]:.3g} per "
            f"activation byte per micro-batch, {coefficients[2] * 1e3:.3g} ms per step; fitted/measured "
            + " ".join(f"{r:.2f}" for r in features @ coefficients / seconds)
        )
        for other, (other_features, other_seconds, other_bandwidth) in data.items():
            if other != fitted:
                predicted = other_features @ coefficients * bandwidth / other_bandwidth
                lines.append(
                    f"  predicts {other}: " + " ".join(f"{r:.2f}" for r in predicted / other_seconds)
                )
    return "\n".join(lines)


def compiled_traffic(trainer: aj.Trainer, host_batch: dict[str, np.ndarray]) -> int:
    """Bytes the memory-bound kernels of a pair's step touch, compiled here (`hlo.memory_traffic`)."""
    spec = NamedSharding(trainer.layout.mesh, batch_spec(trainer.layout, 2))
    batch = abstract(host_batch, {k: spec for k in host_batch})
    return hlo.memory_traffic(trainer.compile(trainer.abstract_state(), batch).as_text())


def traffic_check(paths: list[str], target: str = "h100-sxm") -> str:
    """For every traced pair of each run: the bytes its memory-bound kernels touch in the step compiled
    here for one GPU of `target` (`hlo.memory_traffic`), over the other kernels' measured seconds: the
    bandwidth they ran at. One bandwidth per card for every pair means the compiled traffic prices
    them."""
    device = gpu_target.topology(target, 1, 1)[0]
    lines = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        rates = []
        for row, host_batch, trainer, seconds in traced_pairs(report, device):
            traffic = compiled_traffic(trainer, host_batch)
            rates.append(traffic / seconds)
            lines.append(
                f"{report['device']}: batch {row['global_batch']}, M={row['micro_batches']}, "
                f"remat={row['remat']}: {traffic / 1e9:.0f} GB in {seconds * 1e3:.1f} ms, "
                f"{rates[-1] / 1e12:.2f} TB/s"
            )
        spread = f"{min(rates) / 1e12:.2f}-{max(rates) / 1e12:.2f} TB/s"
        lines.append(f"{report['device']}, {report['model']}: {spread} over {len(rates)} pairs")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "configs/models/llama-1b.yaml"))
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--pairs", default=DEFAULT_PAIRS, help=f"M:remat[:batch],... ({DEFAULT_PAIRS})")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--deadline-s", type=float, default=420.0, help="start no pair after this")
    parser.add_argument("--profile", default=None, help="a cluster YAML to use instead of profiling")
    parser.add_argument("--trace", choices=("all", "first", "none"), default="all", help="pairs to trace")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--check-options", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--traffic",
        nargs="+",
        metavar="JSON",
        help="no GPU: compile each run's traced pairs for an H100 here and divide their memory traffic by "
        "the other kernels' measured time",
    )
    parser.add_argument(
        "--cross-fit",
        nargs="+",
        metavar="JSON",
        help="no GPU: fit the other kernels' time of each run's traced pairs and predict the others'",
    )
    parser.add_argument(
        "--reprice",
        nargs="+",
        metavar="JSON",
        help="no GPU: recompute each run's MFU and predictions with today's models (its times kept), "
        "print them beside the recorded ones and write them to a dated results file under --out",
    )
    parser.add_argument(
        "--predict",
        action="store_true",
        help="no GPU: write each pair's predicted step on the --profile device to a dated results file",
    )
    parser.add_argument(
        "--options-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first compile a pair with the multi-GPU options in a child process",
    )
    args = parser.parse_args()
    config = LlamaConfig.from_yaml(args.model)
    if args.cross_fit:
        print(cross_fit(args.cross_fit))
        return 0
    if args.traffic:
        print(traffic_check(args.traffic))
        return 0
    if args.predict:
        if not args.profile:
            parser.error("--predict prices the pairs with a recorded profile: give --profile")
        text = predict(config, args)
        stem = results_file.dated_stem(args.out, "gpu_step-prediction", card_of(load(args.profile)))
        stem.with_suffix(".md").write_text(
            results_file.header(f"One GPU: {config.name} step, predicted") + text
        )
        print(text)
        return 0
    if args.reprice:
        text = reprice_all([Path(path) for path in args.reprice])
        # Written as measured on the cards the runs timed: the times are theirs, only the models are here.
        stem = results_file.dated_stem(args.out, "gpu_step-reprice", "h100-h200")
        title = "One GPU: every recorded run repriced by today's time model"
        stem.with_suffix(".md").write_text(results_file.header(title) + "```text\n" + text + "\n```\n")
        print(text)
        return 0
    if args.check_options:
        check_options(config, args.pairs.split(",")[0], args)
        return 0
    # Before this process takes the GPU: the child compiles there.
    checked = options_check(args) if args.options_check else None
    if checked:
        print(
            f"compile with amsp_jax's GPU options: exit {checked['returncode']}",
            checked["result"],
            flush=True,
        )
    began = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform})", flush=True)
    profiled = Path(args.profile) if args.profile else profile_device(out)
    hardware = hardware_for(load(profiled))
    model = Llama(config)
    report: dict[str, Any] = {
        "model": config.name,
        "model_config": dataclasses.asdict(config),
        "parameters": config.num_params(),
        "device": device.device_kind,
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python -m benchmarks.gpu_step", *sys.argv[1:]]),
        "global_batch": args.global_batch,
        "seq_len": args.seq_len,
        "peak_flops": hardware["h100-dgx (datasheet)"].peak_flops,
        "profile": profiled.read_text(),
        "options_check": checked,
        "rows": [],
    }

    stem = results_file.dated_stem(out, "gpu_step", card(device))

    def write() -> None:
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        title = f"One GPU: {config.name} step"
        stem.with_suffix(".md").write_text(results_file.header(title) + markdown(report))

    for index, pair in enumerate(args.pairs.split(",")):
        if time.perf_counter() - began > args.deadline_s:
            print(f"deadline: {pair} and later pairs skipped", flush=True)
            break
        micro_batches, remat, *batch = pair.split(":")
        host_batch = make_batch(config, int(batch[0]) if batch else args.global_batch, args.seq_len)
        try:
            row, run = run_pair(config, model, host_batch, int(micro_batches), remat, hardware, args)
        except Exception as error:  # one pair's failure (e.g. out of memory) must not lose the others
            traceback.print_exc()
            row = {"micro_batches": int(micro_batches), "remat": remat, "error": repr(error)[:300]}
            run = None
        report["rows"].append(row)
        if "mfu" in row:
            predicted = ", ".join(f"{k} {v['step_s']:.4f} s" for k, v in row["predicted"].items())
            print(f"M={micro_batches} remat={remat}: {row['measured_s']:.4f} s, MFU {row['mfu']:.1%}, "
                  f"predicted {predicted}", flush=True)  # fmt: skip
        if run is not None and (args.trace == "all" or (args.trace == "first" and index == 0)):
            try:
                row["trace"] = trace_step(run, out, keep=index == 0)
            except Exception:
                traceback.print_exc()
        write()
        del run
        gc.collect()
        jax.clear_caches()
    write()
    print(markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
