"""Plan any Flax model: trace it (`amsp_jax.cost.trace`), then ask the partitioner for the fastest fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from amsp_jax.core.plan import Plan, Precision
from amsp_jax.core.space import Cluster
from amsp_jax.cost import ModelDims
from amsp_jax.cost.hardware import ClusterConfig
from amsp_jax.cost.trace import trace
from amsp_jax.planner import partitioner


def choose(
    model: Any,
    example_inputs: tuple[Any, ...],
    cluster: ClusterConfig | Cluster | str | Path,
    *,
    global_batch: int,
    nodes: int | None = None,
    precision: str | Precision = "mixed",
    layers: tuple[type, ...] | None = None,
    dims: ModelDims | None = None,
    micro_batch_size: int | None = None,
    remat: str | None = None,
    keep_first_layer: bool = False,
) -> Plan:
    """The fastest `Plan` that fits, for a Flax model (linen, or nnx behind `NnxModel`) as written.

    `example_inputs` are what the model's `init` takes; the first array's second dimension is the
    sequence length. `global_batch` counts sequences per optimizer step. `cluster` is a
    `ClusterConfig`, a cluster YAML or shipped name, or a `Cluster` (hardware from its name's config,
    else `cpu-sim`). `layers` and `dims` as in `workload.trace`. Raises `partitioner.PlanError` when
    nothing fits, saying what the smallest plan needs. `keep_first_layer`: plans with micro-batches
    keep each `LayerStack`'s first layer gathered (`Plan.keep_first_layer`), its memory counted.
    """
    spec = trace(model, example_inputs, layers, dims)
    shapes = [np.shape(x) for x in example_inputs if len(np.shape(x)) >= 2]
    if not shapes:
        raise partitioner.PlanError(
            "example_inputs need a (batch, sequence, ...) array to read the sequence length from"
        )
    request = partitioner.make_request(
        spec, cluster, nodes, seq_len=shapes[0][1], global_batch=global_batch, precision=precision,
        micro_batch_size=micro_batch_size, remat=remat, keep_first_layer=keep_first_layer,
    )  # fmt: skip
    chosen = partitioner.plan(request)
    return chosen.to_plan(request.cluster.cluster(), request.precision)
