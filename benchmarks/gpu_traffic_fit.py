"""No GPU: fit the GPU memory-traffic form (`amsp_jax.cost.memory_traffic`) on steps compiled for H100s.

On one GPU about a third of a ~1B LLaMA step is memory-bound kernels (`benchmarks/gpu_step.py`), and
their time is the bytes they touch over one bandwidth per card within about 15 % (`gpu_step
--traffic`). The time model prices those bytes with a linear form in the plan's blocks and the
model's shape (`amsp_jax.cost.memory_traffic`, whose docstring derives its terms). This compiles
probe steps for H100s here (no GPU; `amsp_jax.compiled.gpu_target`), counts their memory-bound
traffic (`amsp_jax.compiled.hlo.memory_traffic`) and fits the form's coefficients by least squares on
relative errors: small LLaMA shapes whose widths, vocabularies and tokens per parameter move each term
on its own, on one device (remat none / dots / full, one, two and four micro-batches; two of them at 1B-class
widths) and on four (ddp,
zero1, zero2, zero3, which set the P, G and OS blocks apart). No measured time enters the fit: the
measured steps of `benchmarks/results/gpu_step_*.json` stay an independent check (`gpu_step --reprice`).

It writes a dated results file (the fit's residuals, and the probes' rows as JSON beside it) and prints
the YAML of `amsp_jax/configs/traffic/xla-gpu.yaml`, to be copied there with the results file named.

Run:  JAX_PLATFORMS=cpu python -m benchmarks.gpu_traffic_fit            (compiles 90 probes)
      JAX_PLATFORMS=cpu python -m benchmarks.gpu_traffic_fit --probes PROBES.json   (refit, no compile)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import jaxlib
import numpy as np

from amsp_jax import cost
from amsp_jax.core import backend
from amsp_jax.cost import memory_traffic
from amsp_jax.models.llama import LlamaConfig
from benchmarks import results_file

# (width, layers, heads, kv heads, MLP width, vocabulary, sequence, sequences per micro-batch): widths,
# vocabularies and tokens per parameter apart, so that each term of the form has its own lever.
SHAPES = (
    (512, 2, 8, 4, 1376, 8192, 512, 4),
    (768, 3, 12, 4, 2048, 4096, 1024, 2),
    (1024, 2, 16, 8, 2816, 16384, 256, 8),
    (256, 4, 4, 2, 1024, 32000, 512, 4),
    (640, 2, 10, 2, 2560, 2048, 1024, 4),
    (1024, 3, 8, 8, 4096, 8192, 512, 2),
    (384, 2, 6, 6, 1024, 50000, 256, 8),
    (896, 2, 14, 2, 3072, 12000, 2048, 1),
    # 1B-class widths at two layers (none of the recorded runs' shapes): their layers' bytes dwarf the
    # rest, as in the measured steps.
    (1792, 2, 14, 2, 4864, 16000, 2048, 2),
    (2304, 2, 18, 6, 6144, 24000, 1024, 2),
)
# (shape, devices, strategy, micro-batches, remat): every remat and batching on one device; the
# placements that set P, G and OS apart on four.
JOBS = tuple(
    [(s, 1, "ddp", m, r) for s in SHAPES for m in (1, 2) for r in memory_traffic.REMATS]
    # Four micro-batches: the loop's terms apart from the per-micro-batch ones.
    + [(s, 1, "ddp", 4, r) for s in SHAPES[::3] for r in memory_traffic.REMATS]
    + [(s, 4, strategy, 1, "none") for s in SHAPES[:3] for strategy in ("ddp", "zero1", "zero2", "zero3")]
    + [(s, 4, strategy, 2, "none") for s in SHAPES[:3] for strategy in ("zero1", "zero3")]
)


def shape_config(shape: list[int] | tuple[int, ...]) -> LlamaConfig:
    """The probe LLaMA of one of `SHAPES`."""
    dim, layers, heads, kv_heads, ffn, vocab, seq, _ = shape
    return LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                       ffn_dim=ffn, max_seq_len=seq, name=f"probe-{dim}x{layers}")  # fmt: skip


def probe(job: tuple, topologies: dict[int, Any]) -> dict[str, Any]:
    """Compile one probe step for H100s and record its compiled traffic and memory blocks."""
    import jax

    import amsp_jax as aj
    from amsp_jax.compiled import audit
    from amsp_jax.cost import timing
    from amsp_jax.models.llama import Llama, make_loss_fn
    from benchmarks.gpu_step import compiled_traffic
    from benchmarks.step_time import make_batch, optimizer

    shape, devices, strategy, micro_batches, remat = job
    config = shape_config(shape)
    model = Llama(config)
    cluster = aj.Cluster(1, devices, "probe")
    host_batch = make_batch(config, shape[7] * micro_batches * devices, shape[6])
    plan = aj.Plan(cluster, aj.resolve(strategy, cluster), micro_batches, precision="mixed", remat=remat)
    trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model), devices=list(topologies[devices]))
    trainer.setup(jax.random.key(0), host_batch["inputs"])
    workload = audit.workload_of(trainer, host_batch, cost.llama_dims(config))
    blocks = timing.pass_blocks(cost.memory(trainer.layout, workload), workload)
    return {"shape": list(shape), "devices": devices, "strategy": strategy, "micro_batches": micro_batches,
            "remat": remat, "compiled": compiled_traffic(trainer, host_batch), "blocks": blocks}  # fmt: skip


def terms_of(row: dict[str, Any]) -> dict[str, float]:
    """The form's terms of a probe row (`memory_traffic.terms`), from its shape and recorded blocks."""
    shape = row["shape"]
    workload = cost.llama_workload(shape_config(shape), shape[6], shape[7], row["micro_batches"],
                                   "mixed", row["remat"])  # fmt: skip
    return memory_traffic.terms(row["blocks"], workload, row["devices"])


def fit(rows: list[dict[str, Any]]) -> tuple[dict[str, float], np.ndarray]:
    """The coefficients minimising the squared relative error over `rows`, none negative (a kernel
    touches no negative bytes; unconstrained, terms that move together trade signs), and each row's
    fitted / compiled traffic."""
    from scipy.optimize import nnls  # jax's own dependency

    x = np.array([[terms_of(row)[name] for name in memory_traffic.TERMS] for row in rows])
    y = np.array([row["compiled"] for row in rows], dtype=float)
    coefficients, _ = nnls(x / y[:, None], np.ones_like(y))
    return dict(zip(memory_traffic.TERMS, map(float, coefficients), strict=True)), x @ coefficients / y


def yaml_text(coefficients: dict[str, float], source: str) -> str:
    """The traffic form's config file."""
    lines = [
        "# Bytes the memory-bound kernels of a GPU step touch per byte of each term of",
        "# amsp_jax/cost/memory_traffic.py (its docstring derives the terms), fitted on probe steps",
        "# compiled for H100s without a GPU (no measured time enters them). Source:",
        *(f"# {line}" for line in source.splitlines()),
        f"name: {backend.traffic_form()}",
        "coefficients:",
    ]
    lines += [f"  {name}: {coefficients[name]:.4g}" for name in memory_traffic.TERMS if "." not in name]
    for group, prefix, said in (
        ("activations", "", "by the step's remat"),
        ("loop_activations", "loop.", "more, with more than one micro-batch"),
    ):
        lines.append(f"  {group}:     # per 2·T·L·width, {said}")
        for remat in memory_traffic.REMATS:
            values = (coefficients[f"{prefix}{remat}.{w}"] for w in memory_traffic.WIDTHS)
            widths = ", ".join(f"{w}: {v:.4g}" for w, v in zip(memory_traffic.WIDTHS, values, strict=True))
            lines.append(f"    {remat}: {{{widths}}}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", help="a JSON of probe rows written before: refit without compiling")
    parser.add_argument("--out", default=str(results_file.RESULTS), help="output directory")
    args = parser.parse_args()
    began = time.perf_counter()
    if args.probes:
        rows = json.loads(Path(args.probes).read_text())["rows"]
    else:
        from amsp_jax.compiled import gpu_target

        topologies = {n: gpu_target.topology("h100-sxm", 1, n) for n in (1, 4)}
        rows = []
        for job in JOBS:
            rows.append(probe(job, topologies))
            print(json.dumps(rows[-1]), flush=True)
    coefficients, ratios = fit(rows)
    stem = results_file.dated_stem(args.out, "gpu_traffic_fit", "h100-compiled")
    lines = [
        results_file.header(
            "GPU memory traffic form fitted on probe steps compiled for H100s (no GPU)"
        ).rstrip(),
        "",
        f"{len(rows)} probe steps; the probes' rows: `{stem.name}.json`. Fitted / compiled traffic "
        f"{ratios.min():.3f}-{ratios.max():.3f} (median |error| {np.median(np.abs(ratios - 1)):.1%}).",
        "",
        "| width | layers | vocab | seq | batch | devices | strategy | M | remat | compiled GB "
        "| fitted / compiled |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for row, ratio in zip(rows, ratios, strict=True):
        dim, layers, _, _, _, vocab, seq, batch = row["shape"]
        lines.append(
            f"| {dim} | {layers} | {vocab} | {seq} | {batch} | {row['devices']} | {row['strategy']} "
            f"| {row['micro_batches']} | {row['remat']} | {row['compiled'] / 1e9:.3f} | {ratio:.3f} |"
        )
    command = "python -m benchmarks.gpu_traffic_fit" + (f" --probes {args.probes}" if args.probes else "")
    source = (
        f"`{command}`, {time.strftime('%Y-%m-%d')}, jax/jaxlib {jaxlib.__version__}, CPU-only host; "
        f"results: benchmarks/results/{stem.name}.md"
    )
    text = yaml_text(coefficients, source)
    config = f"amsp_jax/configs/traffic/{backend.traffic_form()}.yaml"
    lines += ["", f"The coefficients (`{config}`):", "", "```yaml", text + "```",
              "", f"{time.perf_counter() - began:.0f} s on this machine."]  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
