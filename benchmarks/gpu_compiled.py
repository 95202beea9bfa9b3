"""amsp_jax's step compiled for an A100/H100 cluster on this machine (no GPU): bytes, memory, overlap.

For every plan, the real step is compiled by XLA's CUDA compiler for `--nodes` hosts of 8 GPUs of the
target (`amsp_jax.compiled.gpu_target`), and the audit reads the scheduled program: bytes per device and level
beside the cost model's, compiled memory per device (`memory_analysis`) beside `cost.memory`, and the
share of per-layer collective bytes that have matrix compute between their start and done. The GSPMD
peer (`benchmarks/peer_gspmd.py`, FSDP and ZeRO-1) is compiled for the same cluster.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/gpu_compiled.py --models llama-7b
writes a dated benchmarks/results/gpu_compiled_<target>_<date>.md (and .json). Nothing here is a GPU timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from amsp_jax import cost
from amsp_jax.compiled import audit, gpu_target, xla
from amsp_jax.core.mesh import plan_axes
from amsp_jax.core.plan import Plan
from amsp_jax.core.space import AMSP_PUBLISHED, PRESETS, Cluster, Strategy, ddp, preset
from amsp_jax.cost.hardware import load as load_cluster
from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn
from amsp_jax.trainer import Trainer
from benchmarks import peer_gspmd, results_file

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
PRESET_ROWS = ("zero1", "zero2", "zero3", "zero3/loop", "mics")


def _abstract(batch: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}


def amsp_row(
    config: LlamaConfig, devices: list[jax.Device], strategy: str, seq: int, memory_limit: float | None = None
) -> dict[str, Any]:
    """Compile amsp_jax's step for one plan and audit it. Suffixes choose the implementation: `/loop`
    runs the explicit-prefetch layer loop in place of the checkpointed scan (`Plan(prefetch=True)`);
    `/flat` issues collectives that span nodes as one flat collective (`hierarchical=False`); `@dots`
    or `@none` sets the remat policy (default full)."""
    cluster = Cluster.detect(devices)
    strategy, _, remat = strategy.partition("@")
    name, *suffixes = strategy.split("/")
    unknown = set(suffixes) - {"loop", "flat"}
    if unknown:
        raise SystemExit(f"unknown plan suffix {sorted(unknown)} in {strategy!r}; known: /loop, /flat")
    chosen = preset(name, cluster) if name in PRESETS else Strategy.parse(name)
    prefetch = True if "loop" in suffixes else None
    flat = "flat" in suffixes
    plan = Plan(
        cluster, chosen, 1, precision="mixed", remat=remat or "full", prefetch=prefetch,
        hierarchical=not flat, memory_limit=memory_limit,
    )  # fmt: skip
    model = Llama(config)
    trainer = Trainer(plan, model, optax.adamw(1e-4), make_loss_fn(model), devices=devices)
    trainer.setup(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))
    tokens = jax.ShapeDtypeStruct((cluster.num_devices, seq), jnp.int32)
    start = time.perf_counter()
    report = audit.audit_trainer(trainer, {"inputs": tokens, "targets": tokens}, cost.llama_dims(config))
    seconds = time.perf_counter() - start
    overlap = report.measured.overlap_summary()
    return {
        "system": "amsp_jax",
        "plan": strategy + (f"@{remat}" if remat else ""),
        "strategy": report.strategy,
        "compile_s": round(seconds, 1),
        "bytes_match": report.bytes_match,
        "predicted_bytes": report.predicted.bytes_by_level(),
        "compiled_bytes": report.measured.bytes_by_level(),
        "predicted_memory": report.predicted.memory.total,
        "predicted_breakdown": report.predicted.memory.as_dict(),
        "compiled_memory": report.measured.memory_bytes,
        "compiled_breakdown": report.measured.memory_stats,
        "per_layer_hidden_fraction": overlap.get("per_layer_hidden_fraction"),
        "overlap_by_phase": overlap.get("by_phase"),
        "predicted_issued": _total(report.predicted_launches()),
        "compiled_issued": _total(report.measured.launches_by_kind_and_level()),
    }


def _total(by_kind: dict[str, dict[str, int]]) -> int:
    """Collectives per step over every kind and level."""
    return sum(sum(levels.values()) for levels in by_kind.values())


def peer_row(config: LlamaConfig, devices: list[jax.Device], mode: str, seq: int) -> dict[str, Any]:
    """Compile the GSPMD peer's step for the same cluster and read it the same way."""
    cluster = Cluster.detect(devices)
    model = Llama(config)
    mesh = peer_gspmd.make_mesh(cluster, devices)
    example = jnp.zeros((1, seq), jnp.int32)
    init_fn, step_fn, shardings = peer_gspmd.build_gspmd_step(
        model, optax.adamw(1e-4), make_loss_fn(model), mesh, (example,), mode=mode
    )
    abstract_state = jax.eval_shape(init_fn, jax.random.key(0))
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings.state
    )
    tokens = jax.ShapeDtypeStruct((cluster.num_devices, seq), jnp.int32, sharding=shardings.batch)
    layer_bytes = 2 * sum(v.size // v.shape[0] for v in jax.tree.leaves(abstract_state.master) if v.ndim == 3)
    start = time.perf_counter()
    lowered = step_fn.lower(abstract_state, {"inputs": tokens, "targets": tokens})
    compiled = xla.compile_lowered(lowered, xla.gpu_options(layer_bytes))
    seconds = time.perf_counter() - start
    # The audit needs only the mesh's device → node map, which any strategy's axis plan carries.
    measured = audit.measure(compiled, plan_axes(cluster, ddp(cluster)), ("layers",))
    overlap = measured.overlap_summary()
    return {
        "system": "gspmd peer",
        "plan": mode,
        "strategy": mode,
        "compile_s": round(seconds, 1),
        "bytes_match": None,
        "predicted_bytes": None,
        "compiled_bytes": measured.bytes_by_level(),
        "predicted_memory": None,
        "compiled_memory": measured.memory_bytes,
        "compiled_breakdown": measured.memory_stats,
        "per_layer_hidden_fraction": overlap.get("per_layer_hidden_fraction"),
        "overlap_by_phase": overlap.get("by_phase"),
        "predicted_issued": None,
        "compiled_issued": _total(measured.launches_by_kind_and_level()),
    }


def _gb(value: int | None) -> str:
    return "–" if value is None else f"{value / 1e9:.2f}"


def _gib(value: int | None) -> str:
    return "–" if value is None else f"{value / GIB:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the rows of one model."""
    lines = [
        "| system | plan | bytes/device inter GB (pred / compiled) | intra GB (pred / compiled) "
        "| bytes equal | memory GiB pred | compiled | compiled ÷ pred | compiled args / temp GiB "
        "| per-layer bytes with compute between start and done | collectives issued (pred / compiled) "
        "| compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pred, comp = r["predicted_bytes"] or {}, r["compiled_bytes"]
        ratio = f"{r['compiled_memory'] / r['predicted_memory']:.2f}" if r["predicted_memory"] else "–"
        stats = r["compiled_breakdown"]
        hidden = r["per_layer_hidden_fraction"]
        lines.append(
            f"| {r['system']} | `{r['plan']}` | {_gb(pred.get('inter'))} / {_gb(comp['inter'])} "
            f"| {_gb(pred.get('intra'))} / {_gb(comp['intra'])} "
            f"| {'–' if r['bytes_match'] is None else 'yes' if r['bytes_match'] else 'no'} "
            f"| {_gib(r['predicted_memory'])} | {_gib(r['compiled_memory'])} | {ratio} "
            f"| {_gib(stats['argument_size_in_bytes'])} / {_gib(stats['temp_size_in_bytes'])} "
            f"| {'–' if hidden is None else f'{hidden:.0%}'} "
            f"| {r.get('predicted_issued') or '–'} / {r.get('compiled_issued', '–')} | {r['compile_s']} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Compile every plan of every model and write the results."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["llama-7b"])
    parser.add_argument("--target", default="a100-sxm-80")
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument(
        "--cluster",
        default="a800-8x-ib800",
        help="the cluster config whose memory budget the plans get (XLA's scheduler is told it)",
    )
    parser.add_argument(
        "--extra",
        nargs="*",
        default=[],
        metavar="MODEL=STRATEGY",
        help="more plans, e.g. the planner's choice: llama-30b=p=2x1,g=8x1,os=8x64@dots (from amsp-jax plan)",
    )
    parser.add_argument("--out", default=str(results_file.RESULTS), help="output directory")
    args = parser.parse_args()
    devices = gpu_target.topology(args.target, args.nodes, 8)
    budget = load_cluster(args.cluster).memory_limit
    results: dict[str, list[dict[str, Any]]] = {}
    out = results_file.dated_stem(args.out, "gpu_compiled", f"{args.target}x{args.nodes * 8}")
    for name in args.models:
        config = LlamaConfig.from_yaml(REPO / "configs" / "models" / f"{name}.yaml")
        plans = [*PRESET_ROWS, AMSP_PUBLISHED[name]] if name in AMSP_PUBLISHED else list(PRESET_ROWS)
        plans += [e.partition("=")[2] for e in args.extra if e.partition("=")[0] == name]
        rows = results.setdefault(name, [])
        for plan in plans:
            rows.append(amsp_row(config, devices, plan, args.seq_len, budget))
            print(name, rows[-1]["plan"], _gib(rows[-1]["compiled_memory"]), flush=True)
        if not args.no_peer:
            for mode in peer_gspmd.MODES:
                rows.append(peer_row(config, devices, mode, args.seq_len))
                print(name, mode, _gib(rows[-1]["compiled_memory"]), flush=True)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    body = [
        results_file.header(
            f"GPU-compiled step: {args.target}, {args.nodes} nodes x 8, seq {args.seq_len}, one sequence per "
            "device (M = 1), mixed precision, remat full unless the plan says `@dots`"
        ).rstrip("\n"),
        "",
        "Compiled by XLA's CUDA compiler on a CPU-only machine (`benchmarks/gpu_compiled.py`); no GPU ran. "
        f"amsp_jax's plans carry the memory budget of `{args.cluster}` ({budget / GIB:.1f} GiB per device), "
        "which XLA's scheduler is given.",
        "",
    ]
    for name, rows in results.items():
        body += [f"## {name}", "", table(rows), ""]
    out.with_suffix(".md").write_text("\n".join(body) + "\n")


if __name__ == "__main__":
    main()
