"""The plan checked against the program: compile the real step, count its collectives and memory.

Every collective of the compiled HLO is read with its kind, bytes, replica groups and the trip counts
of the loops around it (`amsp_jax.hlo`), classified intra- or inter-node from the mesh's device→node
map, and summed per kind and level. The same sums come from the cost model; `match` says whether
they agree exactly. Scalar reductions (loss, norms) are listed but not compared.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from amsp_jax import cost, hlo
from amsp_jax.sharding import AxisPlan

# Compiled memory on the CPU backend vs the cost model's estimate (activations and temporaries are an
# estimate of XLA's buffer assignment); the tests assert this bound.
MEMORY_TOLERANCE = 0.35


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the compiled program moves and holds per device."""

    collectives: tuple[hlo.Collective, ...]
    levels: tuple[str, ...]
    memory_bytes: int
    memory_stats: dict[str, int]

    def model_state_collectives(self) -> list[tuple[hlo.Collective, str]]:
        """Collectives that move tensors (not scalar loss/norm reductions), with their level."""
        return [(c, lv) for c, lv in zip(self.collectives, self.levels, strict=True) if not c.scalar]

    def bytes_by_kind_and_level(self) -> dict[str, dict[str, int]]:
        """{kind: {intra, inter}} per device per step, scalars left out."""
        totals: dict[str, dict[str, int]] = {}
        for c, level in self.model_state_collectives():
            size = hlo.bytes_per_device(c)
            if size:
                totals.setdefault(c.kind, {"intra": 0, "inter": 0})[level] += size
        return totals

    def bytes_by_level(self) -> dict[str, int]:
        """{intra, inter} per device per step, scalars left out."""
        totals = {"intra": 0, "inter": 0}
        for by_level in self.bytes_by_kind_and_level().values():
            for level, size in by_level.items():
                totals[level] += size
        return totals

    def scalar_bytes(self) -> int:
        """Bytes of the scalar reductions (loss, gradient norms)."""
        return sum(hlo.bytes_per_device(c) for c in self.collectives if c.scalar)


def compiled_memory(compiled: jax.stages.Compiled) -> tuple[int, dict[str, int]]:
    """Peak bytes per device of a compiled program: arguments + outputs - donated aliases + temporaries."""
    stats = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
    values = {f: int(getattr(stats, f)) for f in fields}
    total = values[fields[0]] + values[fields[1]] - values[fields[2]] + values[fields[3]]
    return total, values


def measure(compiled: jax.stages.Compiled, axes: AxisPlan) -> Measured:
    """Read collectives and memory of a compiled program laid out on `axes`' mesh."""
    node_of_device = axes.node_of_device()
    found = tuple(hlo.parse_collectives(compiled.as_text(), axes.cluster.num_devices))
    levels = tuple("inter" if hlo.crosses(c, node_of_device) else "intra" for c in found)
    total, stats = compiled_memory(compiled)
    return Measured(found, levels, total, stats)


@dataclasses.dataclass(frozen=True)
class Report:
    """Prediction beside measurement for one plan."""

    strategy: str
    predicted: cost.Prediction
    measured: Measured

    @property
    def bytes_match(self) -> bool:
        """Whether predicted and measured bytes agree exactly per kind and level."""
        return _nonzero(self.predicted.bytes_by_kind_and_level()) == _nonzero(
            self.measured.bytes_by_kind_and_level()
        )

    @property
    def memory_ratio(self) -> float:
        """Compiled ÷ predicted memory per device."""
        return self.measured.memory_bytes / max(self.predicted.memory.total, 1)

    @property
    def match(self) -> bool:
        """Bytes equal and memory within `MEMORY_TOLERANCE`."""
        return self.bytes_match and abs(self.memory_ratio - 1) <= MEMORY_TOLERANCE

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {
            "strategy": self.strategy,
            "predicted": {
                "bytes_per_device": self.predicted.bytes_by_level(),
                "by_kind": self.predicted.bytes_by_kind_and_level(),
                "phases": [dataclasses.asdict(t) for t in self.predicted.transfers],
            },
            "measured": {
                "bytes_per_device": self.measured.bytes_by_level(),
                "by_kind": self.measured.bytes_by_kind_and_level(),
                "scalar_reduction_bytes": self.measured.scalar_bytes(),
                "collectives": [
                    {
                        "kind": c.kind,
                        "name": c.name,
                        "dtype": c.dtype,
                        "level": level,
                        "group_size": max((len(g) for g in c.replica_groups), default=0),
                        "executions": c.trip_count,
                        "bytes_per_device": hlo.bytes_per_device(c),
                        "scalar": c.scalar,
                    }
                    for c, level in zip(self.measured.collectives, self.measured.levels, strict=True)
                ],
            },
            "memory": {
                "predicted_bytes_per_device": self.predicted.memory.total,
                "predicted_breakdown": self.predicted.memory.as_dict(),
                "compiled_bytes_per_device": self.measured.memory_bytes,
                "compiled_breakdown": self.measured.memory_stats,
                "ratio": round(self.memory_ratio, 4),
                "tolerance": MEMORY_TOLERANCE,
            },
            "bytes_match": self.bytes_match,
            "match": self.match,
        }

    def table(self) -> str:
        """A text table: per kind and level, predicted beside measured; then memory."""
        predicted, measured = (
            self.predicted.bytes_by_kind_and_level(),
            self.measured.bytes_by_kind_and_level(),
        )
        lines = [
            f"strategy {self.strategy}",
            f"{'collective':<16}{'level':<7}{'predicted B':>14}{'measured B':>14}  ",
        ]
        for kind in sorted(set(predicted) | set(measured)):
            for level in ("intra", "inter"):
                p = predicted.get(kind, {}).get(level, 0)
                m = measured.get(kind, {}).get(level, 0)
                if p or m:
                    lines.append(f"{kind:<16}{level:<7}{p:>14,}{m:>14,}  {'ok' if p == m else 'DIFFERS'}")
        lines.append("phases (predicted):")
        for t in self.predicted.transfers:
            lines.append(f"  {t.phase:<40}{t.kind:<16}{t.level:<7}{t.bytes:>14,}  x{t.executions}")
        mem = self.predicted.memory
        lines.append(
            f"memory per device: predicted {mem.total:,} B (P {mem.params:,}, G {mem.grads:,}, "
            f"OS {mem.master + mem.opt_state:,}, gathered {mem.gathered:,}, activations {mem.activations:,}, "
            f"temporaries {mem.temporaries:,}); compiled {self.measured.memory_bytes:,} B "
            f"(ratio {self.memory_ratio:.2f}, bound ±{MEMORY_TOLERANCE:.0%})"
        )
        lines.append(f"scalar reductions (loss, norms; not compared): {self.measured.scalar_bytes():,} B")
        lines.append("MATCH" if self.match else "MISMATCH")
        return "\n".join(lines)

    def dumps(self) -> str:
        """JSON text."""
        return json.dumps(self.to_json(), indent=2)


def _nonzero(totals: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {k: v for k, v in totals.items() if any(v.values())}


def workload_of(trainer: Any, batch: Any, dims: cost.ModelDims) -> cost.Workload:
    """The cost model's workload for a set-up Trainer and a global batch `{"inputs": (B, T), ...}`."""
    layout = trainer.params_layout
    leaves = tuple(
        cost.LeafShape(path, leaf.shape, layout.stack_of(path) is not None)
        for path, leaf in layout.leaves.items()
    )
    global_batch, seq_len = jax.tree.leaves(batch)[0].shape[:2]
    plan = trainer.plan
    micro_batch_size = global_batch // (plan.cluster.num_devices * plan.micro_batches)
    on_cpu = trainer.layout.mesh.devices.flat[0].platform == "cpu"
    return cost.Workload(
        leaves,
        dims,
        seq_len,
        micro_batch_size,
        plan.micro_batches,
        plan.precision,
        plan.remat,
        min_collective_itemsize=4 if on_cpu else 1,
    )


def audit_trainer(trainer: Any, batch: Any, dims: cost.ModelDims, dump_hlo: str | None = None) -> Report:
    """Compile a set-up `trainer`'s step for `batch` (shapes suffice) and compare it with the cost model."""
    abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    compiled = trainer.compile(trainer.abstract_state(), abstract_batch)
    if dump_hlo:
        Path(dump_hlo).write_text(compiled.as_text())
    predicted = cost.predict(trainer.layout, workload_of(trainer, batch, dims))
    return Report(str(trainer.plan.strategy), predicted, measure(compiled, trainer.layout))
