"""Compiled zero3 memory per device of one GPT written five ways, against whole-tree gathering.

The model (8 blocks of width 128: linen `MultiHeadDotProductAttention`, `LayerNorm`, learned positions,
biases) is `benchmarks/gpt_styles.py`, as in the test suite; each style's step is compiled for 2 nodes x 4
simulated CPU devices, fp32, batch 8 of 8 tokens, and XLA's `memory_analysis()` read (arguments +
outputs - aliased + temporaries). Writes benchmarks/results/any_model_<hardware>_<date>.md and .json.

    python benchmarks/any_model.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import results_file  # noqa: E402
from benchmarks.gpt_styles import compiled_memory  # noqa: E402

ROWS = [
    ("LayerStack", "stack", None),
    ("linen loop", "loop", None),
    ("linen nn.scan", "scan", None),
    ("nnx list", "nnx list", None),
    ("nnx vmap + scan", "nnx scan", None),
    ("linen loop, whole tree (layers=())", "loop", ()),
]


def main() -> None:
    results = []
    for name, style, layers in ROWS:
        memory, full = compiled_memory(style, layers)
        results.append({"style": name, "memory_bytes": memory, "full_params_bytes": full})
        print(f"{name:<36} {memory / 2**20:7.2f} MiB  ({memory / full:.2f} x full P)", flush=True)
    lines = [
        "| style | compiled memory per device | ÷ full fp32 P |",
        "|---|---|---|",
        *(
            f"| {r['style']} | {r['memory_bytes'] / 2**20:.2f} MiB | "
            f"{r['memory_bytes'] / r['full_params_bytes']:.2f} |"
            for r in results
        ),
    ]
    stem = results_file.dated_stem(results_file.RESULTS, "any_model", results_file.hardware())
    stem.with_suffix(".md").write_text(
        results_file.header("Per-layer gathering for any model: compiled zero3 memory")
        + "2x4 CPU devices, fp32, 8 blocks of width 128.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
