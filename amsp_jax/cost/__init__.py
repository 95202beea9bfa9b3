"""What a plan costs before it runs: the workload of a model, bytes per collective, memory,
optimizer-update traffic, time, hardware configs."""

from amsp_jax.cost.device_memory import PEAKS, Memory, Peak, activation_bytes, memory
from amsp_jax.cost.prediction import Prediction, predict
from amsp_jax.cost.traffic import (
    Transfer,
    bytes_by_kind_and_level,
    bytes_by_level,
    communication,
    issued,
    largest_gather_bytes,
    leaf_ops,
    leaf_transfers,
    link_bytes,
    rounded_bytes,
    schedule_leaf,
    transfer,
)
from amsp_jax.cost.workload import (
    FP32,
    Leaf,
    ModelDims,
    Workload,
    llama_dims,
    llama_workload,
    looped_blocks,
)

__all__ = [
    "FP32",
    "PEAKS",
    "Leaf",
    "Memory",
    "ModelDims",
    "Peak",
    "Prediction",
    "Transfer",
    "Workload",
    "activation_bytes",
    "bytes_by_kind_and_level",
    "bytes_by_level",
    "communication",
    "issued",
    "largest_gather_bytes",
    "leaf_ops",
    "leaf_transfers",
    "link_bytes",
    "llama_dims",
    "llama_workload",
    "looped_blocks",
    "memory",
    "predict",
    "rounded_bytes",
    "schedule_leaf",
    "transfer",
]
