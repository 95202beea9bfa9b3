"""Predicted MFU from 8 to 8192 GPUs for LLaMA 7B/13B/30B/65B on the A800 cluster: presets vs the planner.

The AMSP setting (arXiv 2311.00257): 8 A800s per node, sequence 4096, a 4M-token global batch,
micro-batch 1. At 8192 GPUs 4M tokens are fewer than one sequence per device, so there the batch
is one sequence per device (32M tokens). Writes a dated
`benchmarks/results/scale_a800-modelled_<date>.md` and `.png`; its first table is AMSP's own setting,
1,024 GPUs: its published placement beside the planner's.

    python -m benchmarks.scale
"""

from __future__ import annotations

import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from amsp_jax.core.plan import REMAT_POLICIES
from amsp_jax.core.space import AMSP_PUBLISHED, Strategy
from amsp_jax.cost.hardware import ClusterConfig, load
from amsp_jax.models.llama import LlamaConfig, llama_spec
from amsp_jax.planner.priced import PRESET_ROWS, PricedPlan, best_batching, price, price_presets
from amsp_jax.planner.request import GIB, PlanError, Request, make_request
from amsp_jax.planner.search import fastest
from amsp_jax.planner.terms import build_terms
from benchmarks import results_file

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "configs" / "clusters" / "a800-8x-ib800.yaml"
MODELS = ("llama-7b", "llama-13b", "llama-30b", "llama-65b")
NODES = (1, 2, 4, 8, 16, 32, 64, 128, 1024)
AMSP_NODES = 128  # AMSP's test bed: 128 nodes of 8 A800s
SEQ_LEN = 4096
GLOBAL_BATCH_TOKENS = 4 * 2**20
COLUMNS = ("chosen", "amsp", *PRESET_ROWS)
STYLES = {
    "chosen": {"lw": 3, "color": "black"},
    "amsp": {"lw": 2, "ls": "--", "color": "C5"},
    **{name: {"lw": 1, "color": f"C{i}"} for i, name in enumerate(PRESET_ROWS) if name != "hsdp"},
    "hsdp": {"lw": 1, "ls": ":", "color": "C4"},  # the same strategy as mics
}


def amsp_request(model: LlamaConfig, hardware: ClusterConfig, nodes: int) -> Request:
    """The benchmark's request on `nodes` nodes: sequence 4096, micro-batch 1, at least a 4M-token batch."""
    devices = nodes * hardware.devices_per_node
    return make_request(
        llama_spec(model), hardware, nodes, seq_len=SEQ_LEN,
        global_batch_tokens=max(GLOBAL_BATCH_TOKENS, devices * SEQ_LEN), micro_batch_size=1,
    )  # fmt: skip


def evaluate_point(model: LlamaConfig, name: str, nodes: int) -> dict[str, PricedPlan | None]:
    """The planner's choice, AMSP's published strategy and every preset at one cluster size."""
    request = amsp_request(model, load(CLUSTER), nodes)
    terms = build_terms(request)
    row: dict[str, PricedPlan | None] = {r.name: r for r in price_presets(terms)}
    try:
        row["chosen"] = fastest(request, terms)
    except PlanError:
        row["chosen"] = None
    if name not in AMSP_PUBLISHED:
        row["amsp"] = None
        return row
    amsp = Strategy.parse(AMSP_PUBLISHED[name])
    try:
        amsp.validate(request.cluster.cluster())
    except ValueError:
        row["amsp"] = None  # e.g. OS over 4 nodes on fewer than 4 nodes
    else:
        c = best_batching(terms, amsp)
        row["amsp"] = price(request, amsp, c.micro_batch_size, c.remat, name="amsp")
    return row


def cell(e: PricedPlan | None) -> str:
    """MFU in percent, or why there is none."""
    if e is None:
        return "n/a"
    if not e.feasible:
        return f"OOM ({e.memory_bytes / GIB:.0f} GiB)"
    return f"{100 * e.estimate.time.mfu:.1f}"


def _summary(e: PricedPlan | None) -> str:
    """Strategy, remat, MFU and memory of one plan, as table cells."""
    if e is None:
        return "– | – | – | –"
    fits = "" if e.feasible else " (does not fit)"
    return (
        f"`{e.description}` | {e.remat} | {100 * e.estimate.time.mfu:.1f} | "
        f"{e.memory_bytes / GIB:.1f}{fits}"
    )


def amsp_setting(table: dict[str, dict[int, dict[str, PricedPlan | None]]]) -> list[str]:
    """AMSP's placement (its best remat that fits, and every remat) beside the planner's, at 1,024 GPUs."""
    hardware = load(CLUSTER)
    lines = [
        f"## AMSP's setting: {AMSP_NODES} nodes x {hardware.devices_per_node} A800, 4M-token batch, "
        "micro-batch 1",
        "",
        "Predicted (cost and time models). MFU in percent; memory in GiB per GPU "
        f"({hardware.memory_limit / GIB:.1f} usable).",
        "",
        "| model | AMSP's placement | remat | MFU | GiB | planner's choice | remat | MFU | GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in MODELS:
        row = table[name][AMSP_NODES]
        lines.append(f"| {name} | {_summary(row['amsp'])} | {_summary(row['chosen'])} |")
    lines += [
        "",
        "AMSP's placement at each remat policy (MFU / GiB; `!`: does not fit):",
        "",
        "| model | placement | " + " | ".join(REMAT_POLICIES) + " |",
        "|---|---|" + "---|" * len(REMAT_POLICIES),
    ]
    for name, strategy in AMSP_PUBLISHED.items():
        model = LlamaConfig.from_yaml(ROOT / "configs" / "models" / f"{name}.yaml")
        request = amsp_request(model, hardware, AMSP_NODES)
        cells = []
        for remat in REMAT_POLICIES:
            e = price(request, Strategy.parse(strategy), 1, remat, name="amsp")
            fits = "" if e.feasible else " !"
            cells.append(f"{100 * e.estimate.time.mfu:.1f} / {e.memory_bytes / GIB:.1f}{fits}")
        lines.append(f"| {name} | `{strategy}` | " + " | ".join(cells) + " |")
    return [*lines, ""]


def main() -> None:
    """Run every point, write the table and the plot."""
    stem = results_file.dated_stem(results_file.RESULTS, "scale", "a800-modelled")
    start = time.perf_counter()
    table: dict[str, dict[int, dict[str, PricedPlan | None]]] = {}
    for name in MODELS:
        model = LlamaConfig.from_yaml(ROOT / "configs" / "models" / f"{name}.yaml")
        table[name] = {nodes: evaluate_point(model, name, nodes) for nodes in NODES}
    hardware = load(CLUSTER)
    lines = [
        results_file.header("Predicted MFU at scale (LLaMA on the A800 cluster)").rstrip(),
        "",
        f"Computed in {time.perf_counter() - start:.0f} s from the cost and time "
        f"models with `{CLUSTER.relative_to(ROOT)}` ({hardware.devices_per_node} A800 80GB per node, 4x HDR, "
        f"{hardware.memory_limit / GIB:.1f} GiB usable per GPU, compute efficiency "
        f"{hardware.compute_efficiency:g}). Sequence {SEQ_LEN}, micro-batch 1, global batch "
        f"{GLOBAL_BATCH_TOKENS:,} tokens (one sequence per GPU at 8192 GPUs). MFU in percent (Megatron "
        "formula); `OOM (x GiB)`: the preset's smallest-memory remat still needs x GiB; `n/a`: the strategy "
        "does not exist at that size. `amsp` is AMSP's published strategy for the model, forced; `chosen` "
        "is the planner's (ILP) choice, shown with its strategy. Each preset takes its best remat policy.",
        "",
        *amsp_setting(table),
    ]
    for name in MODELS:
        lines += [f"## {name}", "", "| GPUs | chosen strategy | remat | " + " | ".join(COLUMNS) + " |"]
        lines.append("|" + "---|" * (len(COLUMNS) + 3))
        for nodes, row in table[name].items():
            chosen = row["chosen"]
            what = (chosen.description, chosen.remat) if chosen else ("nothing fits", "")
            cells = " | ".join(cell(row[c]) for c in COLUMNS)
            lines.append(f"| {nodes * hardware.devices_per_node} | `{what[0]}` | {what[1]} | {cells} |")
        lines.append("")
    stem.with_suffix(".md").write_text("\n".join(lines))

    fig, axes = plt.subplots(1, len(MODELS), figsize=(5 * len(MODELS), 4.5), sharey=True)
    for ax, name in zip(axes, MODELS, strict=True):
        gpus = [n * hardware.devices_per_node for n in NODES]
        for column in COLUMNS:
            points = [
                (g, 100 * e.estimate.time.mfu)
                for g, e in zip(gpus, (table[name][n][column] for n in NODES), strict=True)
                if e is not None and e.feasible
            ]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=column, **STYLES[column])
        ax.set_xscale("log", base=2)
        ax.set_title(f"{name}, seq {SEQ_LEN}, 4M-token batch")
        ax.set_xlabel("GPUs (A800, 8 per node)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("predicted MFU (%)")
    handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    print(f"wrote {stem}.md and .png in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
