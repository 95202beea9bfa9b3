"""What XLA does per backend that the schedule and the cost model must know before anything compiles.

The step asks XLA for these (`compiled.xla.gpu_options`), and the schedule and the cost model read them
from here, so the three cannot disagree.
"""

from __future__ import annotations

import math

_MIB = 1 << 20
# XLA compares a reduce-scatter's combine threshold with the scattered block, so a threshold of one
# gathered layer would merge several layers' gradients into one collective that nothing can hide;
# 32 MiB keeps them per layer (benchmarks/results/xla_overlap_a100-sxm-80x1024_20261126-2229.md).
REDUCE_SCATTER_COMBINE_BYTES = 32 * _MIB


def combine_thresholds(platform: str, layer_bytes: int = 0) -> dict[str, float]:
    """Bytes up to which XLA merges independent collectives of one kind into one, by kind (a kind it
    never merges is absent); the size compared is the merged op's result. `layer_bytes`: the step's
    largest single gather (`schedule.largest_gather_bytes`).

    On GPU these are the options `compiled.xla.gpu_options` sets: a gathered layer at least, so that one
    layer's gathers become one collective. XLA:CPU merges all-reduces without a limit and never merges
    all-gathers or reduce-scatters.
    """
    if platform == "cpu":
        return {"all-reduce": math.inf}
    combine = max(layer_bytes, 64 * _MIB)
    return {
        "all-gather": combine,
        "reduce-scatter": REDUCE_SCATTER_COMBINE_BYTES,
        "all-reduce": 2 * combine,
    }


def selects_in_place(platform: str) -> bool:
    """Whether XLA writes `where(ok, new, old)` over an element-wise optimizer update in place.

    XLA:GPU fuses the update and the select into kernels that write the new state over the old;
    XLA:CPU materialises the new moments before the select, so old and new are alive together.
    """
    return platform != "cpu"
