"""No GPU: predict the memory traffic of a GPU step from the model's shape, checked on the runs' own steps.

On one GPU about a third of a ~1B LLaMA step is memory-bound kernels (`benchmarks/gpu_step.py`), and
their time is the bytes they touch over one bandwidth per card within about 15 % (`gpu_step
--traffic`). What the time model lacks is those bytes for a step it has not compiled. The cost
model's memory blocks do not carry them across shapes on a GPU: the stored activations say little
about the traffic of a recomputed layer, and the logits' traffic grows with the vocabulary. This fits
a form with the shape in it:

    bytes = a·4Φ + b·4Φ·M + c·4·T·V + Σ_remat (d_r·2·T·L·D + e_r·2·T·L·F + f_r·2·T·L·K)

(Φ parameters, M micro-batches, T tokens per step, V vocabulary, L layers, D width, F MLP width, K the
key/value width; d, e, f for the step's remat only) by weighted least squares (relative errors) on
small LLaMA shapes compiled for one H100 here, then predicts the compiled traffic of every traced
pair of the given `gpu_step` runs, compiled the same way, and prints both with the other kernels'
measured seconds. It also prices each pair as the time model would with that traffic: its compute
as the run's profile priced it, plus the predicted bytes at the profile's memory bandwidth (the
largest elementwise pass `amsp-jax profile` timed), beside the measured step. Nothing here runs on a
GPU, and the time model does not use the fit yet.

Run:  JAX_PLATFORMS=cpu python -m benchmarks.gpu_traffic_fit \
      benchmarks/results/gpu_step_h100_20261126-0743.json ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from amsp_jax.compiled import gpu_target
from amsp_jax.cost.hardware import from_dict
from amsp_jax.models.llama import Llama, LlamaConfig
from benchmarks import results_file
from benchmarks.gpu_step import compiled_traffic, make_trainer, model_of, traced_pairs
from benchmarks.step_time import make_batch

REMATS = ("none", "dots", "full")
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
)


def features(config: LlamaConfig, tokens: int, micro_batches: int, remat: str) -> list[float]:
    """The form's terms for one step of `config` over `tokens` tokens."""
    params = 4.0 * config.num_params()
    kv_width = config.n_kv_heads * (config.dim // config.n_heads)
    per_layer = 2.0 * tokens * config.n_layers
    terms = [params, params * micro_batches, 4.0 * tokens * config.vocab_size]
    for mode in REMATS:
        on = per_layer if mode == remat else 0.0
        terms += [on * config.dim, on * config.ffn_dim, on * kv_width]
    return terms


def fit(device) -> tuple[np.ndarray, float]:
    """The form's coefficients from the probe shapes, and the largest |fitted / compiled − 1| there."""
    rows, traffic = [], []
    for dim, layers, heads, kv_heads, ffn, vocab, seq, batch in SHAPES:
        config = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                             ffn_dim=ffn, max_seq_len=seq, name=f"probe-{dim}x{layers}")  # fmt: skip
        model = Llama(config)
        for micro_batches in (1, 2):
            host_batch = make_batch(config, batch * micro_batches, seq)
            for remat in REMATS:
                trainer = make_trainer(model, host_batch, micro_batches, remat, device)
                traffic.append(compiled_traffic(trainer, host_batch))
                rows.append(features(config, batch * micro_batches * seq, micro_batches, remat))
    x, y = np.array(rows), np.array(traffic, dtype=float)
    coefficients, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    return coefficients, float(np.max(np.abs(x @ coefficients / y - 1)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="JSON", help="gpu_step results with traced pairs")
    parser.add_argument("--out", default=str(results_file.RESULTS), help="output directory")
    args = parser.parse_args()
    began = time.perf_counter()
    device = gpu_target.topology("h100-sxm", 1, 1)[0]
    coefficients, fit_error = fit(device)
    lines = [
        results_file.header(
            "GPU memory traffic from the model's shape (compiled for one H100, no GPU)"
        ).rstrip(),
        "",
        f"The form (module docstring) fitted on {len(SHAPES) * 2 * len(REMATS)} probe steps "
        f"({len(SHAPES)} shapes, M = 1 and 2, remat none / dots / full) reproduces their compiled traffic "
        f"within ±{fit_error:.0%}; below, each run's traced pairs, compiled the same way.",
        "",
        "| run | model | batch | M | remat | compiled GB | predicted GB | predicted / compiled "
        "| other kernels, measured ms | compiled GB / measured s (TB/s) | profiled TB/s "
        "| step: compute + predicted GB at profiled TB/s (s) | measured step (s) | ratio |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for path in args.runs:
        report = json.loads(Path(path).read_text())
        config = model_of(report)
        bandwidth = from_dict(yaml.safe_load(report["profile"])).hbm_bandwidth
        for row, host_batch, trainer, other_s in traced_pairs(report, device):
            tokens = row["global_batch"] * report["seq_len"]
            compiled = compiled_traffic(trainer, host_batch)
            terms = features(config, tokens, row["micro_batches"], row["remat"])
            predicted = float(np.dot(terms, coefficients))
            step = row["predicted"]["profiled"]["compute_s"] + predicted / bandwidth
            measured = row["measured_s"]
            lines.append(
                f"| {Path(path).stem} | {report['model']} | {row['global_batch']} | {row['micro_batches']} "
                f"| {row['remat']} | {compiled / 1e9:.0f} | {predicted / 1e9:.0f} "
                f"| {predicted / compiled:.2f} | {other_s * 1e3:.1f} | {compiled / other_s / 1e12:.2f} "
                f"| {bandwidth / 1e12:.2f} | {step:.3f} | {measured:.3f} | {step / measured:.2f} |"
            )
    lines += ["", f"{time.perf_counter() - began:.0f} s on this machine."]
    stem = results_file.dated_stem(args.out, "gpu_traffic_fit", "h100-compiled")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
