"""The planner's best plan at each tensor degree for LLaMA 7B-65B on A800-80GB clusters (modelled).

For each model, cluster size and sequence length, `amsp-jax plan`'s search at every tensor degree t
the node allows (1, 2, 4, 8), sequence parallelism on and off, jointly with the P/G/OS placements,
the micro-batch size and remat; one row per t: its fastest plan that fits, with the predicted step
time, MFU and peak memory per device; then, at t = 4 (where the cannon form's 2 x 2 square exists),
the fastest plan of each matmul form. Everything here is the cost and time model's prediction on the
shipped `a800-8x-ib800` config (A800 80GB: an A100 with NVLink capped at 400 GB/s, 8 per node,
4 x 200 Gb/s InfiniBand per node); nothing is measured.

    python -m benchmarks.tensor_plan [--models llama-7b,llama-65b] [--devices 64,1024] [--seq 2048,8192]
"""

from __future__ import annotations

import argparse
import time

from amsp_jax.core.tensor import CANNON_DEGREE
from amsp_jax.models.llama import llama_spec
from amsp_jax.planner.priced import PricedPlan
from amsp_jax.planner.request import GIB, PlanError, make_request
from amsp_jax.planner.search import price_alternatives, solved_options
from benchmarks import results_file

CLUSTER = "a800-8x-ib800"
TOKENS_PER_STEP = 4 * 2**20  # about 4M tokens per optimizer step, as LLaMA's runs


def rows(model: str, devices: int, seq_len: int) -> list[str]:
    """One Markdown row per tensor degree: the planner's best plan there, or why none fits."""
    request = make_request(
        llama_spec(model), CLUSTER, devices // 8, seq_len=seq_len,
        global_batch_tokens=max(TOKENS_PER_STEP, devices * seq_len),
    )  # fmt: skip
    try:
        table = price_alternatives(request)
    except PlanError as e:
        return [f"| {model} | {devices} | {seq_len:,} | - | nothing fits: {e} | | | | | | |"]
    found = sorted((table.chosen, *table.by_tensor), key=lambda row: row.strategy.tensor)
    out = []
    for row in found:
        t = row.estimate.time
        mark = " **chosen**" if row is table.chosen else ""
        out.append(
            f"| {model} | {devices} | {seq_len:,} | {row.strategy.tensor} | `{row.description}`{mark} | "
            f"{row.micro_batch_size} | {row.micro_batches} | {row.remat} | {t.step_s:.2f} | "
            f"{100 * t.mfu:.1f} % | {row.memory_bytes / GIB:.1f} |"
        )
    return out


def forms_at_square(model: str, devices: int, seq_len: int) -> list[str]:
    """One Markdown row per matmul form at t = 4 (the cannon form's square): its fastest plan."""
    request = make_request(
        llama_spec(model), CLUSTER, devices // 8, seq_len=seq_len,
        global_batch_tokens=max(TOKENS_PER_STEP, devices * seq_len), tensor_degrees=(CANNON_DEGREE,),
    )  # fmt: skip
    best: dict[str, PricedPlan] = {}
    for row in solved_options(request):
        form = row.tensor_matmul if row.sequence_parallel else "gather, no-sp"
        if form not in best or row.estimate.time.step_s < best[form].estimate.time.step_s:
            best[form] = row
    out = []
    for form, row in sorted(best.items(), key=lambda item: item[1].estimate.time.step_s):
        t = row.estimate.time
        out.append(
            f"| {model} | {devices} | {seq_len:,} | {form} | `{row.description}` | {row.micro_batch_size} | "
            f"{row.micro_batches} | {row.remat} | {t.step_s:.2f} | {t.tensor_s:.2f} | {100 * t.mfu:.1f} % |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-7b,llama-13b,llama-30b,llama-65b")
    parser.add_argument("--devices", default="64,256,1024")
    parser.add_argument("--seq", default="2048,8192")
    args = parser.parse_args()
    start = time.perf_counter()
    lines = [
        "| model | GPUs | seq | t | best plan at this t | b | M | remat | step s | MFU | GiB/dev |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in args.models.split(","):
        for devices in map(int, args.devices.split(",")):
            for seq_len in map(int, args.seq.split(",")):
                lines += rows(model, devices, seq_len)
                print(lines[-1], flush=True)
    square = [
        "",
        f"At t = {CANNON_DEGREE}, the fastest plan of each matmul form (`tensor s`: the tensor transfers' "
        "time on the step's critical path, after what hides behind block products):",
        "",
        "| model | GPUs | seq | form | plan | b | M | remat | step s | tensor s | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in args.models.split(","):
        for devices in map(int, args.devices.split(",")):
            for seq_len in map(int, args.seq.split(",")):
                square += forms_at_square(model, devices, seq_len)
                print(square[-1], flush=True)
    lines += square
    stem = results_file.dated_stem(results_file.RESULTS, "tensor_plan", "a800x64-1024-modelled")
    text = results_file.header("The best plan at each tensor degree, LLaMA 7B-65B on A800s (modelled)")
    text += (
        f"\nCluster config `{CLUSTER}`; {TOKENS_PER_STEP:,} tokens per step (or one sequence per device "
        "where that is more); mixed precision, Adam. `no-sp`: sequence parallelism off. Rows where "
        "nothing fits at a degree are left out. Predicted by the cost and time models; nothing was "
        f"run. {time.perf_counter() - start:.0f} s to plan.\n\n" + "\n".join(lines) + "\n"
    )
    stem.with_suffix(".md").write_text(text)
    print(stem.with_suffix(".md"))


if __name__ == "__main__":
    main()
