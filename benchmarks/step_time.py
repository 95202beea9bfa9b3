"""Step time, bytes and memory of amsp_jax beside the GSPMD peer: same model, mesh, batch, in one run.

For each model: the GSPMD FSDP and ZeRO-1 baselines (`benchmarks.peer_gspmd`), every amsp_jax preset
and the partitioner's plan, all in mixed precision with per-layer remat and the same micro-batching.
Every program is compiled first and read by `amsp_jax.compiled.audit.measure` (collective bytes per device
by link level, compiled memory per device); then the step times are taken interleaved (A B C A B C
…, after warm-up), each round starting one place later, so that a slow spell of a shared machine
hits every configuration alike. Configurations whose states do not fit in memory together are timed
in several groups, each with the GSPMD FSDP baseline as its anchor, so that every ratio compares
runs of the same rounds. The claim of issue 6 is checked on the measured bytes: amsp_jax's zero3 and
zero1 move no more bytes per device than GSPMD FSDP and ZeRO-1, across nodes and in total.

Run from the repository root:  .venv/bin/python -m benchmarks.step_time
Writes a new dated `step_time_<hardware>_<yyyymmdd-hhmm>` .md, .json and .png under `--out`; exits 1
if the claim fails.
"""

from __future__ import annotations

import os

# Simulated devices for the CPU backend; must be set before JAX starts. Other backends ignore it.
from amsp_jax.core.backend import cpu_flags  # imports no JAX

os.environ["XLA_FLAGS"] = cpu_flags(os.environ.get("XLA_FLAGS", ""), 8)

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
import optax

import amsp_jax as aj
from amsp_jax.compiled import audit, hlo
from amsp_jax.compiled.xla import compile_lowered, compiler_options
from amsp_jax.core.mesh import ordered_devices
from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn
from benchmarks import results_file
from benchmarks.peer_gspmd import CLAIM_PAIRS, build_gspmd_step, claim_violations, make_mesh, measure_peer

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ("ddp", "zero1", "zero2", "zero3", "mics")
ANCHOR = "gspmd-fsdp"
MIB = 2**20
MODELS = {
    "tiny": LlamaConfig.from_yaml(ROOT / "configs/models/tiny.yaml"),
    # ~100.7M parameters: GPT-2-small widths with LLaMA's SwiGLU and grouped-query attention.
    "100m": LlamaConfig(
        vocab_size=16384, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=512,
        name="100m",
    ),
}  # fmt: skip
# (sequence length, micro-batches) unless given. On the CPU the 100M model's step time is set by the
# bytes its collectives copy per micro-batch (gigabytes), hardly by the tokens: one short micro-batch
# keeps a step to seconds. Bytes do not depend on the sequence length.
DEFAULTS = {"tiny": (128, 2), "100m": (32, 1)}

NOTES = [
    "- The GSPMD peer constrains each layer's weights to be whole where the layer uses them (what "
    "MaxText's batch-sharded activation constraints make XLA do); without a hint XLA partitions a small "
    "micro-batch's matmuls along the weights (tensor parallelism: all-reduces and all-to-alls of "
    "activations), which is not FSDP. The gradients' placement is left to XLA.",
    "- On the CPU, XLA compiles the peer's gradient reduction to an all-reduce followed by a local slice: "
    "its CPU pipeline has no `ReduceScatterCreator` pass (the GPU and TPU pipelines do). So on CPU the "
    "peer's gradient phase moves twice the bytes of a reduce-scatter. The line 'peer with reduce-"
    "scatters' halves the peer's all-reduce bytes to show the GPU form of the FSDP program.",
    "- Levels: every collective of the peer spans all 8 devices, so the audit counts all of its bytes "
    "as inter-node (a flat ring runs at its slowest link) and its intra-node count is zero by "
    "construction. By default amsp_jax splits each collective into an intra-node run and an inter-node "
    "run on the smaller piece, so most of its bytes stay in the node. The claim therefore compares "
    "inter-node bytes and total bytes, of the split form (the '-split' row where the planner issues "
    "flat collectives on this cluster, as it does on simulated CPU devices, where a split only adds a "
    "pass); amsp_jax's intra-node bytes are larger by construction.",
    "- Embedding gradient: the peer (FSDP) shards the embedding along the vocabulary and handles its "
    "gradient by all-gathering the micro-batch's token ids and output cotangents (tokens × dim, small) "
    "and scatter-adding into each device's vocabulary shard; amsp_jax reduce-scatters the whole "
    "vocab × dim gradient every micro-batch. Against the reduce-scatter form of the peer this is where "
    "amsp_jax zero3 moves more in total (see 'peer with reduce-scatters'); it still moves far less "
    "across nodes.",
    "- ZeRO-1: plain `jit` accumulates the gradient of replicated parameters in a replicated fp32 "
    "accumulator, so the peer all-reduces every micro-batch (MaxText avoids that only in explicit "
    "sharding mode with 'unreduced' gradients); amsp_jax's zero1 accumulates locally and reduces once "
    "per step.",
    "- Memory: amsp_jax keeps the bf16 compute copy P in the state beside the fp32 master (2 bytes per "
    "parameter over P's degree); the peer casts it inside the step. The 100M model's DDP (full "
    "replicas on 8 simulated devices of one host) does not fit the host's memory beside the others and "
    "is compiled and measured but not timed.",
    "- Step times on the CPU: the simulated devices share the host's cores and memory, a collective is "
    "a memory copy, and intra- and inter-node links are the same memory. Splitting a collective into an "
    "intra-node and an inter-node run then adds a second collective and its buffer and saves nothing "
    "(a 24 MiB reduce-scatter over 4 then 2 "
    "devices took 1.5× a flat 8-device one, an all-gather 1.2×, in a side measurement), and the "
    "explicit-prefetch layer loop that amsp_jax uses with one micro-batch buys no overlap, since the "
    "CPU backend does not overlap collectives with compute (in a side run of the 100M model, zero3 "
    "took 13.7 s with it and 10.5 s with the checkpointed scan, against 8.9 s for GSPMD FSDP, same "
    "bytes). CPU step times cannot show what the inter-node savings are worth on a cluster.",
]


def optimizer() -> optax.GradientTransformation:
    """The optax chain of both sides: global-norm clipping, then AdamW."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))


@dataclasses.dataclass
class Entry:
    """One configuration: its compiled step, what the audit reads from it, and its timings."""

    name: str
    strategy: str
    compiled: jax.stages.Compiled
    measured: audit.Measured
    compile_s: float
    make_state: Callable[[], Any]
    batch: Any
    state: Any = None
    times: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    anchor_median: float | None = None
    note: str = ""

    def resident_bytes(self) -> int:
        """Per-device bytes held between steps: the state and the batch (the step's arguments)."""
        return self.measured.memory_stats["argument_size_in_bytes"]

    def transient_bytes(self) -> int:
        """Per-device bytes a running step needs beyond its arguments."""
        return self.measured.memory_bytes - self.resident_bytes()

    def run(self) -> float:
        """One step; its wall time in seconds."""
        start = time.perf_counter()
        self.state, metrics = self.compiled(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        elapsed = time.perf_counter() - start
        self.losses.append(float(metrics["loss"]))
        return elapsed


def choose_cluster(spec: str) -> tuple[aj.Cluster, list[jax.Device]]:
    """The cluster and its devices: `NxR`, or `auto` (2 × 4 simulated on CPU, else 2 × n/2 or detected)."""
    devices = ordered_devices()
    on_cpu = devices[0].platform == "cpu"
    if spec != "auto":
        nodes, _, per_node = spec.partition("x")
        cluster = aj.Cluster(int(nodes), int(per_node), "cpu-sim" if on_cpu else "given")
    elif on_cpu:
        cluster = aj.Cluster(2, 4, "cpu-sim")
    elif len(devices) >= 2 and len(devices) % 2 == 0 and jax.process_count() == 1:
        # One host: its devices split into two "nodes", so that inter-node placements exist at all.
        cluster = aj.Cluster(2, len(devices) // 2, "one-host-split")
    else:
        cluster = aj.Cluster.detect(devices)
    if len(devices) < cluster.num_devices:
        raise SystemExit(f"{cluster} needs {cluster.num_devices} devices; JAX has {len(devices)}")
    return cluster, devices[: cluster.num_devices]


def make_batch(config: LlamaConfig, global_batch: int, seq_len: int) -> dict[str, np.ndarray]:
    """A fixed random next-token batch."""
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (global_batch, seq_len + 1), np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def abstract(tree: Any, shardings: Any = None) -> Any:
    """`ShapeDtypeStruct`s of a tree of arrays, with their own shardings or `shardings`'."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def chosen_plan(
    config: LlamaConfig, cluster: aj.Cluster, seq_len: int, global_batch: int, fallback: str
) -> tuple[aj.Plan, str]:
    """The planner's whole choice (strategy and how it issues its collectives; micro-batch size 1,
    full remat), else `fallback`; and its source."""
    micro_batches = global_batch // cluster.num_devices
    try:
        from amsp_jax.models.llama import llama_spec

        tokens = np.zeros((1, seq_len), np.int32)
        chosen = aj.choose(
            llama_spec(config), (tokens,), cluster, global_batch=global_batch, micro_batch_size=1,
            remat="full",
        )  # fmt: skip
    except Exception as error:  # the planner is young: any failure falls back, and says why
        reason = f"{type(error).__name__}: {error}"
        plan = aj.Plan(cluster, aj.resolve(fallback, cluster), micro_batches, precision="mixed", remat="full")
        return plan, f"--chosen {fallback} (the planner failed: {reason})"
    source = "amsp_jax.choose at micro-batch size 1 and full remat"
    return dataclasses.replace(chosen, cluster=cluster), source


def build_entries(
    config: LlamaConfig,
    cluster: aj.Cluster,
    devices: list[jax.Device],
    seq_len: int,
    micro_batches: int,
    chosen: str,
) -> tuple[list[Entry], str]:
    """Compile and measure every configuration of one model; states are made later, group by group."""
    model = Llama(config)
    loss_fn = make_loss_fn(model)
    global_batch = cluster.num_devices * micro_batches
    host_batch = make_batch(config, global_batch, seq_len)
    key = jax.random.key(0)
    options = compiler_options(devices[0].platform, devices=len(devices))
    entries: list[Entry] = []

    mesh = make_mesh(cluster, devices)
    for mode, label in (("fsdp", "GSPMD FSDP"), ("zero1", "GSPMD ZeRO-1")):
        start = time.perf_counter()
        init_fn, step_fn, shardings = build_gspmd_step(
            model, optimizer(), loss_fn, mesh, (host_batch["inputs"],), mode=mode, micro_batches=micro_batches
        )
        batch = jax.device_put(host_batch, shardings.batch)
        state = abstract(jax.eval_shape(init_fn, key), shardings.state)
        compiled = compile_lowered(step_fn.lower(state, abstract(batch)), options)
        measured = measure_peer(compiled, cluster)
        make_state = lambda init_fn=init_fn: init_fn(key)  # noqa: E731
        entries.append(
            Entry(f"gspmd-{mode}", label, compiled, measured, time.perf_counter() - start, make_state, batch)
        )

    the_choice, source = chosen_plan(config, cluster, seq_len, global_batch, chosen)
    # The presets issue their collectives as the planner does on this cluster (split or flat); where
    # that is not the library's default (split collectives: what a GPU cluster runs), one more zero3
    # row runs the default, and the bytes claims read that row (`claim_row`).
    amsp = [
        (name, aj.Plan(cluster, aj.resolve(name, cluster), micro_batches, precision="mixed", remat="full",
                       hierarchical=the_choice.hierarchical, prefetch=the_choice.prefetch))
        for name in PRESETS
    ] + [("chosen", the_choice)]  # fmt: skip
    defaults = aj.Plan(cluster, aj.resolve("zero3", cluster), micro_batches, precision="mixed", remat="full")
    if defaults.implementation != the_choice.implementation:
        amsp.append(("zero3-split", defaults))
    for name, plan in amsp:
        start = time.perf_counter()
        strategy = (
            str(plan.strategy)
            + ("" if plan.hierarchical else ", flat")
            + (", scan" if plan.prefetch is False else "")
        )
        trainer = aj.Trainer(plan, model, optimizer(), loss_fn, devices)
        trainer.setup(key, host_batch["inputs"])
        batch = trainer.shard_batch(host_batch)
        compiled = trainer.compile(trainer.abstract_state(), abstract(batch))
        measured = audit.measure(compiled, trainer.layout)
        make_state = lambda trainer=trainer: trainer.init(key, host_batch["inputs"])  # noqa: E731
        entries.append(
            Entry(
                f"amsp-{name}", strategy, compiled, measured, time.perf_counter() - start, make_state, batch
            )
        )
    return entries, source


def memory_budget(devices: list[jax.Device]) -> tuple[int, str]:
    """Bytes per device the timed states may use together, and how that was decided."""
    if devices[0].platform == "cpu":
        meminfo = Path("/proc/meminfo")
        lines = meminfo.read_text().splitlines() if meminfo.exists() else []
        available = next(
            (int(ln.split()[1]) * 1024 for ln in lines if ln.startswith("MemAvailable")), 8 << 30
        )
        # The simulated devices share the host's memory; leave room for the compiler and other processes.
        budget = int(0.7 * available) // len(devices)
        return budget, f"70% of the host's available memory ({available / 2**30:.1f} GiB) over the devices"
    limit = (devices[0].memory_stats() or {}).get("bytes_limit", 0)
    return int(0.8 * limit), f"80% of one device's memory ({limit / 2**30:.1f} GiB)"


def plan_groups(entries: list[Entry], budget: int) -> list[list[Entry]]:
    """Groups that fit the budget together, each led by the anchor; entries that never fit get a note."""
    anchor = next(e for e in entries if e.name == ANCHOR)
    groups: list[list[Entry]] = []

    def fits(group: list[Entry]) -> bool:
        return sum(e.resident_bytes() for e in group) + max(e.transient_bytes() for e in group) <= budget

    for entry in sorted((e for e in entries if e is not anchor), key=Entry.resident_bytes):
        if not fits([anchor, entry]):
            need = entry.measured.memory_bytes / MIB
            entry.note = f"not timed: needs {need:,.0f} MiB per device beside the anchor, over the budget"
            continue
        group = next((g for g in groups if fits([*g, entry])), None)
        if group is None:
            groups.append([anchor, entry])
        else:
            group.append(entry)
    return groups or [[anchor]]


def time_groups(groups: list[list[Entry]], warmup: int, steps: int, say: Callable[[str], None]) -> None:
    """Warm up, then time `steps` interleaved rounds in each group; the anchor runs in every group."""
    for index, group in enumerate(groups):
        for entry in group:
            entry.state = entry.state or entry.make_state()
        for _ in range(warmup):
            for entry in group:
                entry.run()
        times: dict[str, list[float]] = {e.name: [] for e in group}
        for round_ in range(steps):
            shift = round_ % len(group)
            for entry in group[shift:] + group[:shift]:
                times[entry.name].append(entry.run())
        anchor_median = statistics.median(times[ANCHOR])
        for entry in group:
            entry.times += times[entry.name]
            if entry.name != ANCHOR:
                entry.state = None  # frees its device memory for the next group
                entry.anchor_median = anchor_median
                if len(groups) > 1:
                    entry.note = f"timed in group {index}, beside the anchor's median {anchor_median:.3f} s"
        gc.collect()
        medians = ", ".join(f"{name} {statistics.median(t):.3f}s" for name, t in times.items())
        say(f"  group {index}: {medians}")
    groups[0][0].state = None


def by_executions(measured: audit.Measured) -> list[dict[str, Any]]:
    """Bytes per device by (kind, level, executions per step): the phases, as the program runs them."""
    totals: dict[tuple[str, str, int], int] = {}
    for c, level in measured.model_state_collectives():
        key = (c.kind, level, c.trip_count)
        totals[key] = totals.get(key, 0) + hlo.bytes_per_device(c)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return [{"kind": k, "level": lv, "executions": n, "bytes": b} for (k, lv, n), b in ranked if b]


def reduce_scatter_form(measured: audit.Measured) -> dict[str, int]:
    """{intra, inter} bytes with every tensor all-reduce counted as the reduce-scatter it stands for.

    Only meaningful for the FSDP peer, whose all-reduces (on CPU) are gradient reductions followed
    by a local slice, which the GPU pipeline compiles to reduce-scatters: half the ring bytes.
    """
    totals = measured.bytes_by_level()
    for level, size in measured.bytes_by_kind_and_level().get("all-reduce", {}).items():
        totals[level] -= size // 2
    return totals


def entry_json(entry: Entry, anchor: Entry) -> dict[str, Any]:
    """One configuration's results as JSON-ready data."""
    median = statistics.median(entry.times) if entry.times else None
    anchor_median = entry.anchor_median or (statistics.median(anchor.times) if anchor.times else None)
    return {
        "name": entry.name,
        "strategy": entry.strategy,
        "step_times_s": [round(t, 4) for t in entry.times],
        "median_step_s": median,
        "ratio_to_gspmd_fsdp": median / anchor_median if median and anchor_median else None,
        "bytes_per_device": entry.measured.bytes_by_level(),
        "bytes_by_kind": entry.measured.bytes_by_kind_and_level(),
        "bytes_by_executions": by_executions(entry.measured),
        "scalar_reduction_bytes": entry.measured.scalar_bytes(),
        "memory_bytes_per_device": entry.measured.memory_bytes,
        "memory_breakdown": entry.measured.memory_stats,
        "compile_s": round(entry.compile_s, 2),
        "losses": [round(x, 5) for x in entry.losses],
        "note": entry.note,
    }


def run_model(
    name: str,
    args: argparse.Namespace,
    cluster: aj.Cluster,
    devices: list[jax.Device],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Everything for one model: compile, measure, time, check the claim."""
    config = MODELS[name]
    seq_len = args.seq_len or DEFAULTS[name][0]
    micro_batches = args.micro_batches or DEFAULTS[name][1]
    say(f"{name}: {config.num_params() / 1e6:.1f}M parameters, seq {seq_len}, M={micro_batches}")
    start = time.perf_counter()
    entries, chosen_source = build_entries(config, cluster, devices, seq_len, micro_batches, args.chosen)
    say(f"  compiled and measured {len(entries)} programs in {time.perf_counter() - start:.0f} s")
    budget, budget_source = memory_budget(devices)
    groups = plan_groups(entries, budget)
    time_groups(groups, args.warmup, args.steps, say)
    anchor = entries[0]
    results = [entry_json(e, anchor) for e in entries]
    by_name = {r["name"]: r for r in results}
    claims = []
    for amsp_name, peer_name in CLAIM_PAIRS.items():
        amsp_name = claim_row(amsp_name, by_name)
        ours, theirs = by_name[amsp_name]["bytes_per_device"], by_name[peer_name]["bytes_per_device"]
        problems = claim_violations(ours, theirs)
        claims.append({"amsp": amsp_name, "peer": peer_name, "holds": not problems, "problems": problems})
    first_losses = [r["losses"][0] for r in results if r["losses"]]
    return {
        "model": name,
        "config": dataclasses.asdict(config),
        "parameters": config.num_params(),
        "seq_len": seq_len,
        "micro_batches": micro_batches,
        "micro_batch_size": 1,
        "global_batch": cluster.num_devices * micro_batches,
        "chosen_source": chosen_source,
        "memory_budget": {"bytes_per_device": budget, "source": budget_source, "groups": len(groups)},
        "entries": results,
        "claims": claims,
        "peer_fsdp_reduce_scatter_form": reduce_scatter_form(anchor.measured),
        # Same init and batch everywhere: the first losses agree up to bf16 rounding.
        "first_loss_spread": (max(first_losses) - min(first_losses)) / max(first_losses)
        if first_losses
        else None,
    }


def claim_row(name: str, by_name: dict[str, Any]) -> str:
    """The row a bytes claim reads: the split-collectives variant where one was timed (the planner
    issues flat collectives where splitting saves nothing, as on simulated CPU devices; the
    inter-node saving is the split form's)."""
    return f"{name}-split" if f"{name}-split" in by_name else name


def _mib(size: float) -> str:
    mib = size / MIB
    return f"{mib:,.0f}" if mib >= 100 else f"{mib:.3g}"


def _model_section(model: dict[str, Any]) -> list[str]:
    lines = [
        f"## {model['model']}: {model['parameters'] / 1e6:.1f}M parameters, seq {model['seq_len']}, "
        f"M={model['micro_batches']} micro-batches of 1 sequence per device, "
        f"global batch {model['global_batch']}",
        "",
        f"The chosen plan: {model['chosen_source']}. Timing memory budget: "
        f"{model['memory_budget']['source']}; {model['memory_budget']['groups']} group(s), each with GSPMD "
        "FSDP as its anchor.",
        "",
        "| configuration | P / G / OS | median step (s) | vs GSPMD FSDP | intra MiB | inter MiB | total MiB "
        "| memory MiB/device |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for e in model["entries"]:
        b = e["bytes_per_device"]
        median = f"{e['median_step_s']:.3f}" if e["median_step_s"] else "not timed"
        ratio = f"{e['ratio_to_gspmd_fsdp']:.2f}×" if e["ratio_to_gspmd_fsdp"] else "—"
        ratio = "1.00×" if e["name"] == ANCHOR else ratio
        cells = [e["name"], e["strategy"], median, ratio, _mib(b["intra"]), _mib(b["inter"])]
        cells += [_mib(b["intra"] + b["inter"]), _mib(e["memory_bytes_per_device"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {e['name']}: {e['note']}" for e in model["entries"] if e["note"])]
    lines += [
        "",
        "Claim (amsp_jax moves no more bytes per device than the peer, inter-node and in total):",
        "",
    ]
    for claim in model["claims"]:
        verdict = "holds" if claim["holds"] else "FAILS: " + "; ".join(claim["problems"])
        lines.append(f"- {claim['amsp']} vs {claim['peer']}: {verdict}")
    rs = model["peer_fsdp_reduce_scatter_form"]
    by_name = {e["name"]: e for e in model["entries"]}
    zero3_name = claim_row("amsp-zero3", by_name)
    zero3 = by_name[zero3_name]["bytes_per_device"]
    lines += [
        "- Peer with reduce-scatters (its GPU form, an estimate): GSPMD FSDP would move "
        f"{rs['inter']:,} B across nodes and {rs['intra'] + rs['inter']:,} B in total, against "
        f"{zero3_name}'s {zero3['inter']:,} B and {zero3['intra'] + zero3['inter']:,} B.",
        "",
        "Bytes by collective, level and executions per step (MiB), the phases as each program runs them:",
        "",
    ]
    for e in model["entries"]:
        if e["name"] in {claim_row(n, by_name) for n in CLAIM_PAIRS} | set(CLAIM_PAIRS.values()):
            parts = [
                f"{p['kind']} {p['level']} ×{p['executions']}: {_mib(p['bytes'])}"
                for p in e["bytes_by_executions"]
            ]
            lines.append(f"- {e['name']}: " + ", ".join(parts))
    compile_s = ", ".join(f"{e['name']} {e['compile_s']:.0f}" for e in model["entries"])
    lines += [
        "",
        f"First-step loss spread across configurations: {model['first_loss_spread']:.1e} (relative). "
        f"Compile and measure time (s): {compile_s}.",
        "",
    ]
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The results file."""
    env = report["environment"]
    lines = [
        "# Step time, bytes and memory: amsp_jax beside the GSPMD peer",
        "",
        f"- Command: `{env['command']}`, {env['date']}, {env['wall_s']:.0f} s in all.",
        f"- Device: {env['device']}; {env['cluster']}; jax {env['jax']}, jaxlib {env.get('jaxlib', '?')}, "
        f"Python {env['python']}.",
        f"- Machine load (1-minute load average): {env['load_start']:.2f} at the start, "
        f"{env['load_end']:.2f} at the end, on {env['cpus']} CPUs. {env['load_note']}",
        "- Setup: the same LLaMA, batch and optax chain (clip 1.0, AdamW) on both sides; bf16 compute copy, "
        "fp32 master and moments, fp32 gradient accumulation over M micro-batches of 1 sequence per device; "
        "per-layer remat (`nothing_saveable`). GSPMD: plain `jax.jit` with `NamedSharding`s "
        "(`benchmarks/peer_gspmd.py`). amsp_jax: `Trainer` with each preset and the partitioner's plan.",
        "- Bytes: per device and step, read by `amsp_jax.compiled.audit.measure` from each compiled program "
        f"(ring convention; a collective whose group spans nodes counts as inter-node). {env['wire_note']}",
        "- Memory: per device, from the compiled program (arguments + outputs − donated + temporaries).",
        "- Step time: median of the timed steps; the ratio is over the anchor's median in the same rounds.",
        "",
    ]
    for model in report["models"]:
        lines += _model_section(model)
    lines += ["## What the numbers mean", "", *report["notes"], ""]
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    """Per model: step time relative to GSPMD FSDP, and bytes per device by level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 3.8 * len(models)), squeeze=False)
    for row, model in zip(axes, models, strict=True):
        entries = model["entries"]
        names = [e["name"] for e in entries]
        ratios = [1.0 if e["name"] == ANCHOR else (e["ratio_to_gspmd_fsdp"] or 0.0) for e in entries]
        colors = ["tab:gray" if n.startswith("gspmd") else "tab:blue" for n in names]
        row[0].bar(names, ratios, color=colors)
        row[0].axhline(1.0, color="black", lw=0.8)
        row[0].set_ylabel("step time / GSPMD FSDP")
        row[0].set_title(f"{model['model']}: median step time (no bar: not timed)")
        intra = np.array([e["bytes_per_device"]["intra"] for e in entries]) / MIB
        inter = np.array([e["bytes_per_device"]["inter"] for e in entries]) / MIB
        row[1].bar(names, intra, label="intra-node", color="tab:green")
        row[1].bar(names, inter, bottom=intra, label="inter-node", color="tab:red")
        row[1].set_ylabel("MiB per device per step")
        row[1].set_title(f"{model['model']}: bytes moved (audit of each compiled step)")
        row[1].legend()
        for ax in row:
            ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(argv: list[str], devices: list[jax.Device], cluster: aj.Cluster) -> dict[str, Any]:
    """Where and how the benchmark ran."""
    device = devices[0]
    on_cpu = device.platform == "cpu"
    where = f", simulated on {os.cpu_count()} CPU cores ({platform.machine()})" if on_cpu else ""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join([".venv/bin/python", "-m", "benchmarks.step_time", *argv]),
        "device": f"{len(devices)} x {device.device_kind} ({device.platform}){where}",
        "cluster": f"cluster {cluster.nodes} nodes x {cluster.devices_per_node} devices ({cluster.name})",
        "jax": jax.__version__,
        "python": platform.python_version(),
        "jaxlib": jaxlib.__version__,
        "cpus": os.cpu_count(),
        "wire_note": (
            "XLA's CPU backend runs bf16 collectives in fp32, so on CPU every byte count, on both sides, is "
            "for fp32 on the wire."
            if on_cpu
            else ""
        ),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the results; exit status 1 when the bytes claim fails."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="tiny,100m", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration first")
    parser.add_argument(
        "--micro-batches", type=int, default=0, help="per step (default per model: see --seq-len)"
    )
    parser.add_argument("--seq-len", type=int, default=0, help=f"default per model (seq, M): {DEFAULTS}")
    parser.add_argument("--chosen", default="p=1x1,g=1x1,os=4x2", help="strategy when the partitioner fails")
    parser.add_argument("--cluster", default="auto", help="NODESxDEVICES, or auto")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results"), help="output directory")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    started = time.perf_counter()
    load_start = os.getloadavg()[0]

    def say(line: str) -> None:
        print(line, flush=True)

    cluster, devices = choose_cluster(args.cluster)
    env = environment(argv, devices, cluster)
    say(f"{env['device']}; {env['cluster']}")
    models = [run_model(name.strip(), args, cluster, devices, say) for name in args.models.split(",") if name]
    load_end = os.getloadavg()[0]
    # Only the load before the first compile measures other work: XLA runs the simulated devices on a
    # thread pool, so this benchmark's own threads raise the later values.
    busy = load_start > 2.5
    env |= {
        "load_start": load_start,
        "load_end": load_end,
        "load_note": (
            "Other work was running when it started: step times are noisy; the interleaving spreads the "
            "noise over every configuration alike."
            if busy
            else "The machine was otherwise idle when it started; the end value counts this benchmark's "
            "own threads."
        ),
        "wall_s": time.perf_counter() - started,
    }
    report = {"environment": env, "models": models, "notes": NOTES}
    stem = results_file.dated_stem(args.out, "step_time", results_file.hardware())
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    chart(report, stem.with_suffix(".png"))
    failed = [
        f"{m['model']}: {c['amsp']} vs {c['peer']}: {p}"
        for m in models
        for c in m["claims"]
        for p in c["problems"]
    ]
    for line in failed:
        say(f"CLAIM FAILS {line}")
    say(f"wrote {stem}.{{md,json,png}} in {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
