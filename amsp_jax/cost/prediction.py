"""The cost model's prediction for one plan: every collective's bytes and the memory per device."""

from __future__ import annotations

import dataclasses

from amsp_jax.core.mesh import AxisPlan
from amsp_jax.cost.device_memory import Memory, memory
from amsp_jax.cost.tensor_traffic import tensor_transfers
from amsp_jax.cost.traffic import Transfer, bytes_by_kind_and_level, bytes_by_level, communication
from amsp_jax.cost.workload import Workload


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Communication and memory of one plan on one workload."""

    transfers: tuple[Transfer, ...]
    memory: Memory

    def bytes_by_level(self) -> dict[str, int]:
        """{intra, inter} totals per device per step."""
        return bytes_by_level(self.transfers)

    def bytes_by_kind_and_level(self) -> dict[str, dict[str, int]]:
        """{kind: {intra, inter}} totals per device per step."""
        return bytes_by_kind_and_level(self.transfers)


def predict(axes: AxisPlan, workload: Workload) -> Prediction:
    """Bytes and memory of `workload` under the strategy that `axes` was planned for."""
    transfers = (*communication(axes, workload), *tensor_transfers(axes, workload))
    return Prediction(transfers, memory(axes, workload))
