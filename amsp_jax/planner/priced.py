"""Plans priced by the full cost and time models: the chosen one, the presets beside it, and the error
that says what a request no plan fits would need."""

from __future__ import annotations

import dataclasses
import itertools

from amsp_jax.core.mesh import plan_axes
from amsp_jax.core.plan import REMAT_POLICIES, Plan, Precision
from amsp_jax.core.schedule import UPDATE, Implementation
from amsp_jax.core.space import Cluster, Placement, Strategy, preset
from amsp_jax.cost import Workload, memory, timing
from amsp_jax.planner.request import GIB, PlanError, Request
from amsp_jax.planner.terms import Candidate, Terms, build_terms, smallest_memory

PRESET_ROWS = ("ddp", "zero1", "zero2", "zero3", "mics", "hsdp", "zero++")


@dataclasses.dataclass(frozen=True)
class PricedPlan:
    """One row of `amsp-jax plan`: a plan priced by the full cost and time models, with whether it fits."""

    name: str
    strategy: Strategy
    description: str
    micro_batch_size: int
    micro_batches: int
    remat: str
    estimate: timing.Estimate
    memory_limit: float
    devices: int
    solve_time_s: float | None = None
    implementation: Implementation = dataclasses.field(default_factory=Implementation)
    sequence_parallel: bool = True
    tensor_matmul: str = "gather"

    def to_plan(self, cluster: Cluster, precision: Precision | str = "mixed") -> Plan:
        """The `Plan` that runs this row on `cluster` (a `Trainer` takes it as is)."""
        return Plan(
            cluster, self.strategy, self.micro_batches, precision=precision, remat=self.remat,
            hierarchical=self.implementation.hierarchical, prefetch=self.implementation.prefetch,
            keep_first_layer=self.implementation.keep_first_layer, memory_limit=self.memory_limit,
            sequence_parallel=self.sequence_parallel, tensor_matmul=self.tensor_matmul,
        )  # fmt: skip

    @property
    def memory_bytes(self) -> int:
        """Predicted peak bytes per device."""
        return self.estimate.prediction.memory.total

    @property
    def feasible(self) -> bool:
        """Whether the plan fits the device's usable memory."""
        return self.memory_bytes <= self.memory_limit

    @property
    def reason(self) -> str | None:
        """Why the plan cannot run, or None."""
        if self.feasible:
            return None
        return (
            f"needs {self.memory_bytes / GIB:.1f} GiB per device, {self.memory_limit / GIB:.1f} GiB available"
        )

    def update_bytes(self) -> dict[str, int]:
        """Of the bytes per device and step, those of the optimizer update's collectives, by level."""
        totals = {"intra": 0, "inter": 0}
        for t in self.estimate.prediction.transfers:
            if t.phase == UPDATE:
                totals[t.level] += t.bytes
        return totals

    def as_dict(self) -> dict[str, object]:
        """The JSON row of `amsp-jax plan --json`."""
        levels = self.estimate.prediction.bytes_by_level()
        return {
            "name": self.name,
            "strategy": self.description,
            "micro_batch_size": self.micro_batch_size,
            "micro_batches": self.micro_batches,
            "remat": self.remat,
            "collectives": "hierarchical" if self.implementation.hierarchical else "flat",
            "prefetch": self.implementation.prefetch,  # `Plan.prefetch`: None is the library's rule
            "keep_first_layer": self.implementation.keep_first_layer,
            "step_time_s": self.estimate.time.step_s,
            "mfu": self.estimate.time.mfu,
            "tokens_per_s": self.estimate.time.tokens_per_s(self.devices),
            "memory_bytes_per_device": self.memory_bytes,
            "bytes_per_device": {"intra": levels["intra"], "inter": levels["inter"]},
            "optimizer_update_bytes_per_device": self.update_bytes(),
            "feasible": self.feasible,
            "reason": self.reason,
        }


def _hpz(request: Request, zero3: Strategy, workload: Workload) -> timing.Estimate:
    """ZeRO++ hpZ: ZeRO-3 whose backward re-gather reads a secondary P copy sharded within the node.

    The secondary copy is filled from the forward's gather (no extra traffic), so the step is ZeRO-3's
    with the backward-gather phase of a node-sharded P, and memory gains that copy's P block.
    """
    cluster = request.cluster.cluster()
    secondary = Strategy(Placement(cluster.devices_per_node, 1), zero3.grads, zero3.opt_state)
    axes, secondary_axes = plan_axes(cluster, zero3), plan_axes(cluster, secondary)
    base = timing.estimate(axes, workload, request.cluster).prediction
    other = memory(secondary_axes, workload)
    backward = timing.traffic(secondary_axes, workload)[timing.BACKWARD_GATHER]
    groups = dict(timing.traffic(axes, workload))
    groups[timing.BACKWARD_GATHER] = backward
    backward_phase = {t.phase for t in base.transfers if "re-gather" in t.phase}
    transfers = tuple(t for t in base.transfers if t.phase not in backward_phase)
    transfers += tuple(
        t for t in timing.predict(secondary_axes, workload).transfers if t.phase in backward_phase
    )
    mem = dataclasses.replace(base.memory, params=base.memory.params + other.param_blocks)
    prediction = timing.Prediction(transfers, mem)
    return timing.Estimate(prediction, timing.step_time(groups, mem, workload, request.cluster))


def price(
    request: Request,
    strategy: Strategy,
    micro_batch_size: int,
    remat: str,
    name: str = "chosen",
    hpz: bool = False,
    solve_time_s: float | None = None,
) -> PricedPlan:
    """One plan by the full cost and time models (`hpz`: ZeRO++'s secondary copy, see `_hpz`)."""
    if strategy.tensor != request.tensor:
        request = dataclasses.replace(request, tensor=strategy.tensor)
    micro_batches = dict(request.batchings())[micro_batch_size]
    workload = request.workload(micro_batch_size, micro_batches, remat)
    if hpz:
        estimate = _hpz(request, strategy, workload)
        description = f"{strategy},hpz={Placement(request.cluster.devices_per_node, 1)}"
    else:
        estimate = timing.estimate(plan_axes(request.cluster.cluster(), strategy), workload, request.cluster)
        description = str(strategy)
        if strategy.tensor > 1:
            description += "" if request.tensor_matmul == "gather" else f",{request.tensor_matmul}"
            description += "" if request.sequence_parallel else ",no-sp"
    return PricedPlan(
        name,
        strategy,
        description,
        micro_batch_size,
        micro_batches,
        remat,
        estimate,
        request.cluster.memory_limit,
        request.devices,
        solve_time_s,
        request.implementation,
        request.sequence_parallel,
        request.tensor_matmul,
    )


def best_batching(terms: Terms, strategy: Strategy, hpz: bool = False) -> Candidate:
    """The fastest (micro-batch size, remat) for a fixed strategy that fits, else the smallest one."""
    node = Placement(terms.request.cluster.devices_per_node, 1) if hpz else None
    options = [Candidate(strategy, b, r) for (b, _), r in itertools.product(terms.batchings, terms.remats)]
    if terms.covers(strategy):
        scored = [(terms.step_time(c, node).step_s, terms.memory(c, node), c) for c in options]
    else:  # a placement off the whole-node grid: the full model, one batching at a time
        scored = []
        for c in options:
            e = price(terms.request, strategy, c.micro_batch_size, c.remat, hpz=hpz).estimate
            scored.append((e.time.step_s, float(e.prediction.memory.total), c))
    fitting = [item for item in scored if item[1] <= terms.memory_limit]
    if fitting:
        return min(fitting, key=lambda item: item[0])[2]
    return min(scored, key=lambda item: item[1])[2]


def price_presets(terms: Terms) -> list[PricedPlan]:
    """The usual presets (`PRESET_ROWS`), each at its own best micro-batch size and remat policy."""
    cluster = terms.request.cluster.cluster()
    rows = []
    for name in PRESET_ROWS:
        hpz = name == "zero++"
        strategy = preset("zero3" if hpz else name, cluster)
        best = best_batching(terms, strategy, hpz)
        rows.append(price(terms.request, strategy, best.micro_batch_size, best.remat, name, hpz))
    return rows


def nothing_fits(terms: Terms) -> PlanError:
    """The error for a request no plan fits: the least memory any plan needs, and what would fit."""
    request = terms.request
    need, smallest = smallest_memory(terms)
    hardware = request.cluster
    lines = [
        f"no plan fits: the smallest ({smallest.strategy}, micro-batch {smallest.micro_batch_size}, "
        f"remat {smallest.remat}) needs {need / GIB:.1f} GiB per device, but {hardware.name} allows "
        f"{hardware.memory_limit / GIB:.1f} GiB ({hardware.memory_bytes / GIB:.0f} GiB x "
        f"{hardware.usable_memory_fraction:g} usable)."
    ]
    for factor in (2, 4, 8, 16, 32, 64):
        nodes = hardware.nodes * factor
        devices = nodes * hardware.devices_per_node
        bigger = dataclasses.replace(
            request,
            cluster=hardware.with_shape(nodes),
            global_batch_tokens=devices * request.seq_len,
            micro_batch_sizes=None,
        )
        bigger_need, _ = smallest_memory(build_terms(bigger))
        if bigger_need <= hardware.memory_limit:
            lines.append(
                f"{nodes} nodes would fit (the smallest plan needs {bigger_need / GIB:.1f} GiB there), "
                f"with a global batch that is a multiple of {devices * request.seq_len} tokens."
            )
            break
    lines.append(f"A device with at least {need / hardware.usable_memory_fraction / GIB:.1f} GiB would fit.")
    if request.micro_batch_sizes or tuple(request.remats) != REMAT_POLICIES:
        lines.append("Letting the planner pick the micro-batch size and remat policy may also help.")
    return PlanError(" ".join(lines))
