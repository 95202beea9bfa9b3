"""The plan checked against the program: compile the real step, count its collectives and memory.

Every collective of the compiled HLO is read with its kind, bytes, replica groups and the trip counts
of the loops around it (`amsp_jax.compiled.hlo`), classified intra- or inter-node from the mesh's device→node
map, and summed per kind and level. The same sums come from the cost model; `match` says whether
they agree exactly. Scalar reductions (loss, norms) are listed but not compared.

On a GPU program (`amsp_jax.compiled.gpu_target`) the audit also reads the schedule: for every collective, the
matrix compute XLA placed between its start and done, and whether XLA made it synchronous. Each
collective gets a phase from the JAX operation it came from (forward, backward, update) and is per-layer
when it belongs to a layer stack; the overlap summary is the per-layer bytes that have compute to hide
behind, and the exposed collectives by name and phase.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

from amsp_jax import cost
from amsp_jax.compiled import hlo
from amsp_jax.compiled.compile_step import compiled_memory
from amsp_jax.core.backend import selects_in_place
from amsp_jax.core.mesh import AxisPlan
from amsp_jax.cost import optimizer as optimizer_cost
from amsp_jax.cost.trace import trace
from amsp_jax.layers.stack import FIRST_LAYER_SCOPE, STACK_PARAM
from amsp_jax.step.functions import tensor_boundaries
from amsp_jax.step.state import abstract_master

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
    overlaps: tuple[hlo.Overlap, ...] = ()  # one per collective, in the same order
    layer_scopes: tuple[str, ...] = ()  # name scopes of the layer stacks, e.g. "layers"

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

    def launches_by_kind_and_level(self) -> dict[str, dict[str, int]]:
        """{kind: {intra, inter}} collectives issued per step (loop trip counts applied), scalars left out."""
        totals: dict[str, dict[str, int]] = {}
        for c, level in self.model_state_collectives():
            if hlo.bytes_per_device(c):
                totals.setdefault(c.kind, {"intra": 0, "inter": 0})[level] += c.trip_count
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

    def is_per_layer(self, c: hlo.Collective) -> bool:
        """Whether `c` moves a layer stack's weights or gradients (any of its combined parts does)."""
        return any(f"/{scope}/" in part for scope in self.layer_scopes for part in _parts(c.op_name))

    def in_layer_loop(self, c: hlo.Collective) -> bool:
        """Whether `c` came from inside a layer loop's body (peeled copies of the body included)."""
        return any(
            f"/{scope}/while/body/" in part for scope in self.layer_scopes for part in _parts(c.op_name)
        )

    def hidden_bytes(self, kind: str) -> tuple[int, int]:
        """(bytes with matrix compute between start and done, all bytes) of the collectives of `kind`."""
        hidden = total = 0
        for c, o in zip(self.collectives, self.overlaps, strict=True):
            if c.kind == kind and not c.scalar:
                size = hlo.bytes_per_device(c)
                total, hidden = total + size, hidden + (size if o.hidden else 0)
        return hidden, total

    def overlap_summary(self) -> dict[str, Any]:
        """Per-layer bytes with compute between start and done vs exposed, by phase; the exposed ones."""
        if not self.overlaps:
            return {}
        by_phase: dict[str, dict[str, int]] = {}
        exposed = []
        for (c, level), o in zip(zip(self.collectives, self.levels, strict=True), self.overlaps, strict=True):
            size = hlo.bytes_per_device(c)
            if c.scalar or not size:
                continue
            group = ("per-layer " if self.is_per_layer(c) else "") + phase_of(c.op_name)
            totals = by_phase.setdefault(group, {"hidden": 0, "exposed": 0})
            totals["hidden" if o.hidden else "exposed"] += size
            if not o.hidden:
                exposed.append(
                    {
                        "name": c.name,
                        "kind": c.kind,
                        "phase": group,
                        "level": level,
                        "executions": c.trip_count,
                        "bytes": size,
                        "why": _why_exposed(o),
                    }
                )
        per_layer = {k: v for k, v in by_phase.items() if k.startswith("per-layer")}
        hidden = sum(v["hidden"] for v in per_layer.values())
        total = hidden + sum(v["exposed"] for v in per_layer.values())
        return {
            "per_layer_bytes": total,
            "per_layer_hidden_bytes": hidden,
            "per_layer_hidden_fraction": round(hidden / total, 4) if total else None,
            "by_phase": dict(sorted(by_phase.items())),
            "exposed": sorted(exposed, key=lambda e: -e["bytes"]),
        }

    def collectives_json(self) -> list[dict[str, Any]]:
        """Each collective as JSON-ready data: kind, bytes, level, phase, and its overlap where read."""
        return [
            {
                "kind": c.kind,
                "name": c.name,
                "dtype": c.dtype,
                "level": level,
                "group_size": max((len(g) for g in c.replica_groups), default=0),
                "executions": c.trip_count,
                "bytes_per_device": hlo.bytes_per_device(c),
                "scalar": c.scalar,
                "phase": phase_of(c.op_name),
                "per_layer": self.is_per_layer(c),
                "in_layer_loop": self.in_layer_loop(c),
                **(
                    {
                        "asynchronous": o.asynchronous,
                        "is_sync": o.is_sync,
                        "compute_between": len(o.compute),
                        "other_kernels_between": o.other_kernels,
                        "hidden": o.hidden,
                    }
                    if o
                    else {}
                ),
            }
            for c, level, o in zip(
                self.collectives, self.levels, self.overlaps or (None,) * len(self.collectives), strict=True
            )
        ]


def measure(compiled: jax.stages.Compiled, axes: AxisPlan, layer_scopes: tuple[str, ...] = ()) -> Measured:
    """Read collectives, their overlap and memory of a compiled program laid out on `axes`' mesh."""
    node_of_device = axes.node_of_device()
    text = compiled.as_text()
    found = tuple(hlo.parse_collectives(text, axes.cluster.num_devices))
    levels = tuple("inter" if hlo.crosses(c, node_of_device) else "intra" for c in found)
    total, stats = compiled_memory(compiled)
    by_name = hlo.overlaps(text)
    overlap = tuple(by_name[c.name.removesuffix(".scalars")] for c in found)
    return Measured(found, levels, total, stats, overlap, layer_scopes)


def _parts(op_name: str) -> list[str]:
    """The JAX operations of a (possibly combined, `a:b:c`) collective's op_name."""
    return op_name.split(":")


def phase_of(op_name: str) -> str:
    """`forward`, `backward`, `update` (after the gradient: reductions, refresh) or `first layer` (a kept
    first layer's once-per-step gather and reduce-scatter), `+`-joined if mixed."""
    phases = {
        "backward" if "transpose(" in part else "forward" if "jvp(" in part
        else "first layer" if f"/{FIRST_LAYER_SCOPE}/" in part else "update"
        for part in _parts(op_name)
    }  # fmt: skip
    return "+".join(sorted(phases))


def _why_exposed(o: hlo.Overlap) -> str:
    if not o.asynchronous:
        return "synchronous collective"
    if o.is_sync:
        return "XLA made the pair synchronous (nothing scheduled between start and done)"
    return f"no matrix compute between start and done ({o.other_kernels} other kernels)"


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

    def predicted_launches(self) -> dict[str, dict[str, int]]:
        """{kind: {intra, inter}} collectives the time model expects XLA to issue per step."""
        totals: dict[str, dict[str, int]] = {}
        for t in self.predicted.transfers:
            totals.setdefault(t.kind, {"intra": 0, "inter": 0})[t.level] += t.executions
        return totals

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
            "jaxlib": metadata.version("jaxlib"),
            "predicted": {
                "bytes_per_device": self.predicted.bytes_by_level(),
                "by_kind": self.predicted.bytes_by_kind_and_level(),
                "launches_by_kind": self.predicted_launches(),
                "phases": [dataclasses.asdict(t) for t in self.predicted.transfers],
            },
            "measured": {
                "bytes_per_device": self.measured.bytes_by_level(),
                "by_kind": self.measured.bytes_by_kind_and_level(),
                "launches_by_kind": self.measured.launches_by_kind_and_level(),
                "scalar_reduction_bytes": self.measured.scalar_bytes(),
                "collectives": self.measured.collectives_json(),
            },
            "overlap": self.measured.overlap_summary(),
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
        launched, issued = self.predicted_launches(), self.measured.launches_by_kind_and_level()
        lines = [
            # The schedule, and so the overlap below, is the installed XLA's: it differs between releases.
            f"strategy {self.strategy} (compiled by jaxlib {metadata.version('jaxlib')})",
            f"{'collective':<19}{'level':<7}{'predicted B':>17}{'measured B':>17}      "
            f"{'issued: predicted':>18}{'compiled':>10}",
        ]
        for kind in sorted(set(predicted) | set(measured)):
            for level in ("intra", "inter"):
                p = predicted.get(kind, {}).get(level, 0)
                m = measured.get(kind, {}).get(level, 0)
                if p or m:
                    lines.append(
                        bytes_row(kind, level, p, m, launched.get(kind, {}).get(level, 0),
                                  issued.get(kind, {}).get(level, 0))
                    )  # fmt: skip
        lines.append("phases (predicted):")
        for t in self.predicted.transfers:
            lines.append(f"  {t.phase:<40}{t.kind:<19}{t.level:<7}{t.bytes:>17,}  {t.executions} issued")
        mem = self.predicted.memory
        peaks = ", ".join(f"{name} {mem.peak(name):,}" for name in cost.PEAKS)
        lines.append(
            f"memory per device: predicted {mem.total:,} B at the {mem.peak_name} peak (P {mem.params:,}, "
            f"G {mem.grads:,}, OS {mem.master + mem.opt_state:,}; peaks: {peaks}); "
            f"compiled {self.measured.memory_bytes:,} B (ratio {self.memory_ratio:.2f}, bound "
            f"±{MEMORY_TOLERANCE:.0%})"
        )
        lines.append(f"scalar reductions (loss, norms; not compared): {self.measured.scalar_bytes():,} B")
        lines += _overlap_lines(self.measured.overlap_summary())
        lines.append("MATCH" if self.match else "MISMATCH")
        return "\n".join(lines)

    def dumps(self) -> str:
        """JSON text."""
        return json.dumps(self.to_json(), indent=2)


def bytes_row(kind: str, level: str, predicted: int, measured: int, launched: int, issued: int) -> str:
    """One line of the audit's bytes table: columns wide enough for a 1,024-GPU step's bytes (tens of GB)."""
    verdict = "ok" if predicted == measured else "DIFFERS"
    return f"{kind:<19}{level:<7}{predicted:>17,}{measured:>17,}  {verdict:<8}{launched:>14,}{issued:>10,}"


def _overlap_lines(summary: dict[str, Any]) -> list[str]:
    """The overlap summary as text lines (none for a program without a schedule to read)."""
    if not summary:
        return []
    fraction = summary["per_layer_hidden_fraction"]
    lines = [
        "overlap (compute between start and done, per step and device):",
        f"  per-layer bytes with compute to hide behind: {summary['per_layer_hidden_bytes']:,} of "
        f"{summary['per_layer_bytes']:,}" + (f" ({fraction:.1%})" if fraction is not None else ""),
    ]
    for phase, totals in summary["by_phase"].items():
        lines.append(f"  {phase:<32}hidden {totals['hidden']:>14,}  exposed {totals['exposed']:>14,}")
    for e in summary["exposed"]:
        runs = f"{e['level']} x{e['executions']}"
        lines.append(
            f"  exposed {e['name']:<28} {e['kind']:<15} {runs:<10}{e['phase']:<24} {e['bytes']:>14,}  "
            f"{e['why']}"
        )
    return lines


def _nonzero(totals: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {k: v for k, v in totals.items() if any(v.values())}


def workload_of(trainer: Any, batch: Any, dims: cost.ModelDims) -> cost.Workload:
    """The cost model's workload for a set-up Trainer and a global batch `{"inputs": (B, T), ...}`."""
    program = trainer.program
    leaves = tuple(split.leaf for split in program.params.leaves.values())
    global_batch, seq_len = jax.tree.leaves(batch)[0].shape[:2]
    plan, platform = program.plan, program.layout.platform
    micro_batch_size = global_batch // (program.layout.data_devices * plan.micro_batches)
    boundaries = ()
    if program.layout.tensor > 1:
        boundaries = tensor_boundaries(program, trainer.abstract_state(), batch)
    return cost.Workload(
        leaves,
        dims,
        seq_len,
        micro_batch_size,
        plan.micro_batches,
        plan.precision,
        plan.remat,
        min_collective_itemsize=4 if platform == "cpu" else 1,
        implementation=plan.implementation,
        # Described on the stored (padded) master, which the compiled update runs on.
        optimizer=optimizer_cost.describe(program.optimizer, abstract_master(program)),
        update_in_place=selects_in_place(platform),
        platform=platform,
        boundaries=boundaries,
        sequence_parallel=plan.sequence_parallel,
    )


def audit_trainer(
    trainer: Any, batch: Any, dims: cost.ModelDims | None = None, dump_hlo: str | None = None
) -> Report:
    """Compile a set-up `trainer`'s step for `batch` (shapes suffice) and compare it with the cost model.

    `dims` (for the memory and time model) default to those `amsp_jax.cost.trace.trace` infers from the
    trainer's model.
    """
    program = trainer.program
    if dims is None:
        dims = trace(program.model, program.example, program.classes).dims
    abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    compiled = trainer.compile(trainer.abstract_state(), abstract_batch)
    if dump_hlo:
        Path(dump_hlo).write_text(compiled.as_text())
    predicted = cost.predict(program.layout, workload_of(trainer, batch, dims))
    # A stack's parameters live under its module's path plus STACK_PARAM; ops are named by the module path.
    pl = program.params
    scopes = tuple(
        "/".join(map(str, stack[:-1] if stack[-1] == STACK_PARAM else stack))
        for stack in (*pl.stacks, *pl.blocks)
    )
    measured = measure(compiled, program.layout, scopes)
    return Report(str(program.plan.strategy), predicted, measured)
