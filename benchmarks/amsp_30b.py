"""What AMSP's LLaMA-30B run at 1,024 A800s had that the time model's default comparison leaves out.

The scale table prices AMSP's placements with the fastest remat policy that fits; for 30B that is
`dots` (52.9 % MFU), where AMSP measured 42 %. This prices the run as the paper (arXiv 2311.00257v2)
describes it, one difference at a time, on the shipped A800 config, and checks the same settings
against the paper's 64-GPU measurements (its Table V), in tokens per GPU per second. Nothing is
fitted: every row is the unchanged cost and time model with one setting the paper states.

The paper's run, beside what the time model prices by default:
  - activation recomputation on for 30B, off for 7B and 13B (section VI-A-4): the whole layer, as
    PyTorch's checkpointing does (its Fig. 9c); `dots` keeps the matmul outputs, which the run had
    no policy for;
  - the Broadcast that spreads updated parameters not overlapped with the next forward in the
    end-to-end runs (section VI-A-4), where the time model hides the refresh behind it;
  - the gradients reduced by one AllReduce over the sdp/sp devices that share a P shard, each keeping
    the part its optimizer state needs (select & drop, sections IV-C-2 and V-C-2), in buckets of
    512 Mi elements (InternLM's reduce_bucket_size), where the time model reduce-scatters within the
    OS group and all-reduces across groups;
  - MFU by Megatron-LM's formula with the attention square whole (footnote 2), as here; its Table V
    pairs tokens/s with MFU at a ratio that gives the FLOPs per token it counted for each model.

    python -m benchmarks.amsp_30b
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

from amsp_jax.core.space import AMSP_PUBLISHED, Strategy
from amsp_jax.cost import timing
from amsp_jax.cost.hardware import ClusterConfig, load
from amsp_jax.models.llama import LlamaConfig, llama_spec
from amsp_jax.planner.priced import PricedPlan, price
from amsp_jax.planner.request import GIB, Request, make_request
from benchmarks import results_file
from benchmarks.scale import AMSP_NODES, CLUSTER, GLOBAL_BATCH_TOKENS, ROOT, SEQ_LEN

PAPER = "arXiv 2311.00257v2"
# Section VI-B-1: MFU at 1,024 GPUs (the introduction's 13B/30B sentence says 51 % and 43 %).
PAPER_MFU = {"llama-7b": 0.51, "llama-13b": 0.52, "llama-30b": 0.42}
# Section VI-A-4: "Activation recomputation is applied during the training of LLaMA-30B, while it is
# disabled for LLaMA-7B and LLaMA-13B."
PAPER_REMAT = {"llama-7b": "none", "llama-13b": "none", "llama-30b": "full"}
# Table V, 64 GPUs, micro-batch 1 sequence of 4,096 tokens, M = 1, 2, 4, 8 micro-batches: tokens per GPU
# per second and MFU with every overlap, and with all but the Broadcast's (the end-to-end setting).
TABLE_V_NODES = 8
TABLE_V_M = (1, 2, 4, 8)
TABLE_V = {
    "llama-7b": {
        "all overlaps": ((3525, 4119, 4416, 4503), (0.57, 0.62, 0.65, 0.67)),
        "no Broadcast overlap": ((3346, 3991, 4329, 4438), (0.54, 0.60, 0.64, 0.65)),
    },
    "llama-13b": {
        "all overlaps": ((1918, 2082, 2183, 2230), (0.53, 0.58, 0.61, 0.62)),
        "no Broadcast overlap": ((1895, 1920, 2160, 2184), (0.53, 0.54, 0.60, 0.61)),
    },
    "llama-30b": {
        "all overlaps": ((825, 856, 872, 880), (0.48, 0.50, 0.50, 0.51)),
        "no Broadcast overlap": ((759, 814, 847, 859), (0.44, 0.47, 0.49, 0.50)),
    },
}
BUCKET_ELEMENTS = 512 * 2**20  # InternLM's hybrid_zero_optimizer reduce_bucket_size
GRAD_BYTES = 2  # the paper's G is 2Φ bytes (section IV-D): 16-bit gradients on the wire


@dataclasses.dataclass(frozen=True)
class Run:
    """One priced variant: step seconds, throughput and MFU at the model's own FLOPs per token."""

    step_s: float
    tokens_per_device: int
    flops_per_token: float
    peak_flops: float
    memory_gib: float

    @property
    def tgs(self) -> float:
        """Tokens per GPU per second."""
        return self.tokens_per_device / self.step_s

    def mfu(self, flops_per_token: float | None = None) -> float:
        """Model FLOPs utilisation, at another FLOPs-per-token count where one is given."""
        return self.tgs * (flops_per_token or self.flops_per_token) / self.peak_flops


def load_model(name: str) -> LlamaConfig:
    """A shipped LLaMA config."""
    return LlamaConfig.from_yaml(ROOT / "configs" / "models" / f"{name}.yaml")


def request_for(name: str, hardware: ClusterConfig, nodes: int, micro_batches: int | None = None) -> Request:
    """The paper's batch: sequence 4,096, micro-batch 1, 4M tokens, or `micro_batches` per GPU (Table V)."""
    devices = nodes * hardware.devices_per_node
    tokens = GLOBAL_BATCH_TOKENS if micro_batches is None else devices * SEQ_LEN * micro_batches
    return make_request(
        llama_spec(load_model(name)), hardware, nodes, seq_len=SEQ_LEN, global_batch_tokens=tokens,
        micro_batch_size=1,
    )  # fmt: skip


def amsp_reduction_s(plan: PricedPlan, request: Request) -> float:
    """Seconds of AMSP's gradient reduction: one AllReduce of the 16-bit gradient of Φ/sp parameters over
    the sdp/sp devices that share a P shard, in buckets."""
    hardware = request.cluster
    strategy, workload = plan.strategy, request.workload()
    shard = workload.num_params // strategy.params.degree
    group = request.devices // strategy.params.degree
    nodes = hardware.nodes // strategy.params.inter
    size = 2 * (group - 1) * shard * GRAD_BYTES // group
    return hardware.collective_time(
        "all-reduce",
        "inter" if nodes > 1 else "intra",
        size,
        math.ceil(shard / BUCKET_ELEMENTS),
        group,
        nodes,
    )


def priced(
    request: Request,
    strategy: Strategy,
    remat: str,
    broadcast_exposed: bool = False,
    amsp_reduce: bool = False,
) -> Run:
    """AMSP's placement priced by the time model, with the run's refresh and reduction where asked."""
    plan = price(request, strategy, 1, remat, name="amsp")
    t, hardware = plan.estimate.time, request.cluster
    step = t.step_s
    compute = timing.compute_times(request.workload(1, plan.micro_batches, remat), hardware)
    if broadcast_exposed:
        # The refresh waits for nothing and hides behind nothing; the other leaves' gather still overlaps.
        hidden = timing.exposed(t.communication_s[timing.OTHER_GATHER], compute.first_forward,
                                hardware.overlap_interference)  # fmt: skip
        step += hidden + t.communication_s[timing.REFRESH] - t.exposed_s["step start"]
    if amsp_reduce:
        window = hardware.reduction_overlap * compute.last_backward
        seconds = timing.exposed(amsp_reduction_s(plan, request), window, hardware.overlap_interference)
        step += seconds - t.exposed_s["reduction"]
    return Run(step, t.tokens_per_device, t.model_flops_per_device / t.tokens_per_device, t.peak_flops,
               plan.memory_bytes / GIB)  # fmt: skip


def implied_flops_per_token(name: str) -> float:
    """FLOPs per token the paper counted for a model: MFU × peak / tokens per GPU per second over Table V's
    rows (median)."""
    peak = load(CLUSTER).peak_flops
    ratios = [
        mfu * peak / tgs
        for tgs_row, mfu_row in TABLE_V[name].values()
        for tgs, mfu in zip(tgs_row, mfu_row, strict=True)
    ]
    return statistics.median(ratios)


def candidates(hardware: ClusterConfig) -> list[str]:
    """The 30B table: each difference alone from the default comparison, then together."""
    name = "llama-30b"
    request = request_for(name, hardware, AMSP_NODES)
    strategy = Strategy.parse(AMSP_PUBLISHED[name])
    base = priced(request, strategy, "dots")
    run = priced(request, strategy, "full", broadcast_exposed=True, amsp_reduce=True)
    paper_flops = implied_flops_per_token(name)
    full = priced(request, strategy, "full")
    exposed = priced(request, strategy, "dots", broadcast_exposed=True)
    reduced = priced(request, strategy, "dots", amsp_reduce=True)
    rows = [
        ("the scale table's comparison: remat `dots` (fastest that fits here)", "–", base, None),
        ("remat `full` (whole-layer recomputation)", "VI-A-4, Fig. 9c", full, None),
        ("Broadcast refresh not overlapped (remat `dots`)", "VI-A-4", exposed, None),
        ("one AllReduce over 128 nodes, select & drop (remat `dots`)", "IV-C-2, V-C-2", reduced, None),
        ("**the run: remat `full`, Broadcast exposed, AllReduce**", "all three", run, None),
        ("the run, MFU at the FLOPs/token the paper counted for its 30B", "Table V", run, paper_flops),
    ]
    lines = [
        "## LLaMA-30B, AMSP's placement `p=8x1,g=8x1,os=8x4`, 1,024 A800s",
        "",
        f"AMSP measured **{100 * PAPER_MFU[name]:.0f} %** MFU. Each row changes the default comparison by "
        "what the paper says its run did (section in the paper); the last rows combine them. TGS: tokens "
        "per GPU per second; GiB: predicted memory per GPU (73.6 usable).",
        "",
        "| candidate | paper | predicted MFU | vs default (points) | step (s) | TGS | GiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, where, r, flops in rows:
        mfu = r.mfu(flops)
        lines.append(
            f"| {label} | {where} | {100 * mfu:.1f} % | {100 * (mfu - base.mfu()):+.1f} | {r.step_s:.2f} | "
            f"{r.tgs:.0f} | {r.memory_gib:.1f} |"
        )
    none = priced(request, strategy, "none", broadcast_exposed=True, amsp_reduce=True)
    # InternLM's `checkpoint` may name a fraction of the layers; the step is linear in that fraction.
    measured_step = run.tokens_per_device * run.flops_per_token / (PAPER_MFU[name] * run.peak_flops)
    fraction = (measured_step - none.step_s) / (run.step_s - none.step_s)
    lines += [
        "",
        f"Without recomputation the placement needs {none.memory_gib:.0f} GiB per GPU here (it does not fit; "
        "the paper's run recomputed). InternLM's `checkpoint` setting may also name a fraction of the "
        f"layers: the run above reaches the measured {100 * PAPER_MFU[name]:.0f} % with "
        f"{100 * fraction:.0f} % of the layers recomputed (the paper gives no fraction). Had the paper "
        "counted the recomputed FLOPs (HFU, Megatron-LM's factor 4 instead of 3 on the layers), its 30B "
        f"MFU would be {100 * run.mfu() * 4 / 3:.1f} % for the run "
        f"above; Table V's 30B rows instead imply {paper_flops / 1e9:.1f} GFLOP per token, below the "
        f"{run.flops_per_token / 1e9:.1f} of LLaMA-30B's shape (6,656 × 60 layers, FFN 17,920) by the same "
        "formula, so recomputation is not counted.",
        "",
    ]
    return lines


def all_models(hardware: ClusterConfig) -> list[str]:
    """7B, 13B and 30B at 1,024 GPUs: the default comparison and the run the paper describes."""
    lines = [
        "## The three models at 1,024 A800s",
        "",
        "Default: the fastest remat that fits here (the scale table). The run: the paper's remat, Broadcast "
        "exposed, AllReduce reduction. Predicted MFU at LLaMA's own FLOPs per token.",
        "",
        "| model | placement | AMSP measured | default | remat | the run | remat | run ÷ measured |",
        "|---|---|---:|---:|---|---:|---|---:|",
    ]
    for name, placement in AMSP_PUBLISHED.items():
        request = request_for(name, hardware, AMSP_NODES)
        strategy = Strategy.parse(placement)
        fits = {r: priced(request, strategy, r) for r in ("none", "dots", "full")}
        best = max((r for r, v in fits.items() if v.memory_gib <= hardware.memory_limit / GIB),
                   key=lambda r: fits[r].mfu())  # fmt: skip
        run = priced(request, strategy, PAPER_REMAT[name], broadcast_exposed=True, amsp_reduce=True)
        lines.append(
            f"| {name} | `{placement}` | {100 * PAPER_MFU[name]:.0f} % | {100 * fits[best].mfu():.1f} % | "
            f"{best} | {100 * run.mfu():.1f} % | {PAPER_REMAT[name]} | {run.mfu() / PAPER_MFU[name]:.2f} |"
        )
    return [*lines, ""]


def table_v(hardware: ClusterConfig) -> list[str]:
    """The paper's 64-GPU measurements (Table V, no Broadcast overlap) against the run as priced here."""
    lines = [
        f"## Against the paper's 64-GPU measurements (Table V, {TABLE_V_NODES} nodes)",
        "",
        "Tokens per GPU per second (TGS) need no FLOP count. Measured: Table V's row without Broadcast "
        "overlap (the end-to-end setting); predicted: the run as above (the paper's remat, Broadcast "
        "exposed, AllReduce) with M micro-batches of one sequence per GPU.",
        "",
        "| model | remat | M | measured TGS | predicted TGS | predicted ÷ measured | measured MFU "
        "| predicted MFU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, placement in AMSP_PUBLISHED.items():
        strategy = Strategy.parse(placement)
        tgs_row, mfu_row = TABLE_V[name]["no Broadcast overlap"]
        for m, tgs, mfu in zip(TABLE_V_M, tgs_row, mfu_row, strict=True):
            request = request_for(name, hardware, TABLE_V_NODES, m)
            run = priced(request, strategy, PAPER_REMAT[name], broadcast_exposed=True, amsp_reduce=True)
            lines.append(
                f"| {name} | {PAPER_REMAT[name]} | {m} | {tgs} | {run.tgs:.0f} | {run.tgs / tgs:.2f} | "
                f"{100 * mfu:.0f} % | {100 * run.mfu():.1f} % |"
            )
    lines += [
        "",
        "FLOPs per token: what Table V's MFU ÷ TGS ratio says the paper counted (median of its 8 rows per "
        "model), beside the Megatron-LM count at LLaMA's shape that this repository's MFU uses.",
        "",
        "| model | paper's count (GFLOP/token) | LLaMA's shape (GFLOP/token) | paper ÷ LLaMA |",
        "|---|---:|---:|---:|",
    ]
    for name in AMSP_PUBLISHED:
        ours = request_for(name, hardware, TABLE_V_NODES, 1).workload().flops_per_token()
        paper = implied_flops_per_token(name)
        lines.append(f"| {name} | {paper / 1e9:.1f} | {ours / 1e9:.1f} | {paper / ours:.3f} |")
    return [*lines, ""]


def main() -> None:
    """Write the dated results file."""
    start = time.perf_counter()
    hardware = load(CLUSTER)
    body = [*candidates(hardware), *all_models(hardware), *table_v(hardware)]
    stem = results_file.dated_stem(results_file.RESULTS, "amsp_30b", "a800-modelled")
    lines = [
        results_file.header("AMSP's LLaMA-30B at 1,024 A800s: what the run had (predicted)").rstrip(),
        "",
        f"Computed in {time.perf_counter() - start:.1f} s from the cost and time models with "
        f"`{CLUSTER.relative_to(ROOT)}` (compute efficiency {hardware.compute_efficiency:g}, unchanged) and "
        f"the settings of {PAPER} (section VI-A): sequence 4,096, micro-batch 1, 4M-token batch (M = 1 at "
        "1,024 GPUs), FlashAttention-2, BF16, 4 HDR InfiniBand per node without SHARP. No GPU ran these.",
        "",
        *body,
    ]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {stem}.md in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
