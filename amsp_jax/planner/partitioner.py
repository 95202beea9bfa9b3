"""The scale-aware partitioner: the fastest P/G/OS placement, micro-batch size and remat policy that fits.

`choose(model, cluster, nodes, seq_len=..., global_batch_tokens=...)` is the entry point. It builds
the *decomposed* time and memory model (`Terms`), solves an ILP over it (pulp, HiGHS), and re-evaluates
the winner with the full cost and time models (`amsp_jax.cost`, `amsp_jax.cost.timing`).

Why the decomposition is exact. Under the whole-node rule every component's collectives run over
one intra-node run of `intra` devices and one inter-node run of `inter` nodes, so each phase's bytes
depend only on the placements of the components it moves between — except for one coupling: how a
leaf is split (one dimension, two, or padded: `sharding.leaf_layout`) is set by the largest group.
The set of leaves split at all is the smallest of the three components' *profiles* (the leaves their
own degree would split: every leaf with a dimension, for any degree above 1). Padding is priced at
the degree of the probe each term is read from, not the largest group's: where a leaf pads (no
dimension or pair of dimensions divides), the decomposed time and memory are off by that padding's
share, a fraction of a per mille for LLaMA; `evaluate` prices a plan by the full model. With π the
profile, the step is

    P terms (p, π)     forward gathers, backward re-gathers, other-leaf gathers; P and gathered memory
    G terms (g, π)     per-micro-batch reduce-scatters; G memory (with an accumulator, once more beside it)
    OS terms (o, π)    master and moments memory (master again in the update's peak); update time
    pair (g, o, π)     the once-per-step reduction onto OS
    pair (p, o, π)     the P refresh from the new master
    (b, r)             compute, activations; the per-micro-batch terms scale with M = n / b

and `timing.combine` turns them into a step time with max(0, ·) per overlap window. The ILP has one
binary per (component, placement), per micro-batch size and per remat policy, one per profile, and
continuous product variables z for (component, placement, profile), (G, OS, profile),
(P, OS, profile) and (b, r) tied to the binaries by assignment constraints (exact for one-hot
groups); each max(0, ·) is a continuous variable bounded below by the window's expression (big-M
where the expression depends on b or r), exact at the optimum. Valid combinations of placements are
enforced by the existence of the pair variables (nesting of G/OS and P/OS) and a linear constraint
for P/G. `brute_force` enumerates every valid combination of the same `Terms`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pulp

from amsp_jax.core import config_files
from amsp_jax.core.backend import selects_in_place
from amsp_jax.core.mesh import plan_axes, shard_dims
from amsp_jax.core.plan import REMAT_POLICIES, Plan, Precision
from amsp_jax.core.schedule import UPDATE, Implementation, Op, accumulates, params_from_master, uses_prefetch
from amsp_jax.core.space import Cluster, Placement, Strategy, preset
from amsp_jax.cost import (
    Workload,
    largest_gather_bytes,
    leaf_ops,
    llama_workload,
    looped_blocks,
    memory,
    timing,
)
from amsp_jax.cost import optimizer as optimizer_cost
from amsp_jax.cost.hardware import ClusterConfig, for_cluster
from amsp_jax.cost.hardware import load as load_cluster
from amsp_jax.cost.trace import ModelSpec
from amsp_jax.models.llama import LlamaConfig, ModelConfigError, muon_dimension_numbers

GIB = 2**30


class PlanError(ValueError):
    """A request no plan can serve: nothing fits, or the batch does not divide over the devices."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What to plan: a model on a cluster, with the step's sequence length, batch and the knobs to search."""

    model: LlamaConfig | ModelSpec
    cluster: ClusterConfig
    seq_len: int
    global_batch_tokens: int
    precision: Precision = dataclasses.field(default_factory=Precision)
    micro_batch_sizes: tuple[int, ...] | None = None
    remats: tuple[str, ...] = REMAT_POLICIES
    implementation: Implementation = dataclasses.field(default_factory=Implementation)
    optimizer: str = "adam"  # adam (any element-wise optimizer), adafactor or muon

    @property
    def devices(self) -> int:
        """Devices of the cluster."""
        return self.cluster.nodes * self.cluster.devices_per_node

    def sequences_per_device(self) -> int:
        """Sequences each device processes per step; raises PlanError when the batch does not divide."""
        if self.global_batch_tokens % self.seq_len:
            raise PlanError(
                f"the global batch of {self.global_batch_tokens} tokens is not a whole number of "
                f"{self.seq_len}-token sequences"
            )
        sequences = self.global_batch_tokens // self.seq_len
        if sequences % self.devices:
            smallest = self.devices * self.seq_len
            raise PlanError(
                f"{sequences} sequences per step do not divide over {self.devices} devices (data "
                f"parallelism gives each device whole sequences); use a global batch that is a multiple "
                f"of {smallest} tokens, e.g. {max(1, -(-self.global_batch_tokens // smallest)) * smallest}"
            )
        return sequences // self.devices

    def batchings(self) -> list[tuple[int, int]]:
        """(micro-batch size, micro-batches) pairs with b × M = sequences per device."""
        per_device = self.sequences_per_device()
        sizes = [b for b in range(1, per_device + 1) if per_device % b == 0]
        if self.micro_batch_sizes is not None:
            wrong = [b for b in self.micro_batch_sizes if b not in sizes]
            if wrong:
                raise PlanError(
                    f"micro-batch size(s) {wrong} do not divide the {per_device} sequences per device"
                )
            sizes = [b for b in sizes if b in self.micro_batch_sizes]
        return [(b, per_device // b) for b in sizes]

    def workload(self, micro_batch_size: int = 1, micro_batches: int = 1, remat: str = "full") -> Workload:
        """The cost model's workload for one choice of batching and remat on this cluster's hardware."""
        knobs = (self.seq_len, micro_batch_size, micro_batches, self.precision, remat)
        if isinstance(self.model, ModelSpec):
            w = self.model.workload(*knobs)
        else:
            w = llama_workload(self.model, *knobs)
        return w.with_(
            min_collective_itemsize=self.cluster.collective_min_itemsize,
            update_in_place=selects_in_place(self.cluster.platform),
            platform=self.cluster.platform,
            implementation=self.implementation,
            optimizer=_update_rules(
                tuple((leaf.path, leaf.shape) for leaf in w.leaves),
                self.optimizer,
                isinstance(self.model, LlamaConfig),
            ),
        )

    def prefetches(self, micro_batches: int, remat: str) -> bool:
        """Whether the step runs the explicit-prefetch loop for this batching and remat."""
        if isinstance(self.model, ModelSpec) and not self.model.prefetchable:
            return False  # blocks run by a scan (nn.scan, nnx.scan) gather in the loop, no prefetch
        stack = not (isinstance(self.model, ModelSpec) and looped_blocks(self.model.leaves))
        return uses_prefetch(micro_batches, remat, self.model.n_layers, self.implementation.prefetch, stack)


@functools.cache
def _update_rules(
    leaves: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...], kind: str, llama: bool
) -> optimizer_cost.OptimizerUpdate:
    """What `kind`'s update communicates on these leaves: Muon on every matrix of a LLaMA, on another
    model on its 2-D leaves (optax's default)."""
    return optimizer_cost.for_kind(kind, dict(leaves), muon_dimension_numbers if llama else None)


def placements(cluster: Cluster) -> list[Placement]:
    """Every placement that keeps whole nodes across nodes: (k, 1) for k | R, and (R, k) for k | N."""
    r, n = cluster.devices_per_node, cluster.nodes
    found = [Placement(k, 1) for k in range(1, r + 1) if r % k == 0]
    return found + [Placement(r, k) for k in range(2, n + 1) if n % k == 0]


def _nested(a: Placement, b: Placement) -> bool:
    return a.contains(b) or b.contains(a)


def _top(*items: Placement) -> Placement:
    return max(items, key=lambda q: q.degree)


@dataclasses.dataclass(frozen=True)
class Choice:
    """One point of the search: placements of P, G, OS, the micro-batch size and the remat policy."""

    strategy: Strategy
    micro_batch_size: int
    remat: str


@dataclasses.dataclass(frozen=True)
class Terms:
    """The decomposed model: every step-time and memory term, keyed by what it depends on.

    Times are seconds of one micro-batch's worth (`per micro-batch` groups) or of the step; memories
    are bytes per device; π is an index into `profiles`.
    """

    request: Request
    placements: tuple[Placement, ...]
    profiles: tuple[frozenset[int], ...]
    profile_of: dict[Placement, int]
    possible: frozenset[tuple[Placement, int]]
    batchings: tuple[tuple[int, int], ...]
    remats: tuple[str, ...]
    p_time: dict[tuple[Placement, int], dict[str, float]]
    g_time: dict[tuple[Placement, int], dict[str, float]]
    reduction: dict[tuple[Placement, Placement, int], float]
    refresh: dict[tuple[Placement, Placement, int], float]
    passes: dict[tuple[str, Placement, int], float]  # (component, placement, π): memory-pass seconds
    fixed_passes: dict[tuple[int, str], float]  # (micro-batch size, remat): passes every plan runs
    update: dict[tuple[Placement, Placement], float]  # (OS, largest group): the update's collectives
    # Memory (`cost.Memory`): the model states and each peak's terms, by what they depend on.
    p_memory: dict[tuple[Placement, int], float]  # the stored P blocks
    p_layer_memory: dict[tuple[Placement, int], float]  # one layer's gathered weights beyond the shard
    p_other_memory: dict[tuple[Placement, int], float]  # the other leaves gathered beyond their shards
    g_memory: dict[tuple[Placement, int, bool], float]  # G blocks (accumulating: fp32)
    g_other_memory: dict[tuple[Placement, int, bool], float]  # of them, the other leaves'
    os_memory: dict[tuple[Placement, int], float]  # master and moments
    os_update_memory: dict[tuple[Placement, int], float]  # the update's new master
    pair_memory: dict[tuple[Placement, Placement, int], dict[str, float]]  # (P, OS, π): each peak's term
    activations: dict[tuple[int, str], float]  # the memory passes' activation block
    activation_peaks: dict[tuple[int, str], dict[str, float]]  # (b, r): each peak's activation bytes
    compute: dict[tuple[int, str], timing.Compute]
    memory_limit: float

    def profile(self, strategy: Strategy) -> int:
        """π: the profile of the largest group (the smallest of the three components' profiles)."""
        return self.profile_of[_top(strategy.params, strategy.grads, strategy.opt_state)]

    def covers(self, strategy: Strategy) -> bool:
        """Whether every placement of `strategy` is one the tables hold."""
        return all(q in self.profile_of for q in (strategy.params, strategy.grads, strategy.opt_state))

    def communication(
        self, strategy: Strategy, micro_batch_size: int, remat: str, regather: Placement | None = None
    ) -> dict[str, float]:
        """Seconds of each overlap group; `regather` runs the backward gather from another P copy."""
        p, g, o = strategy.params, strategy.grads, strategy.opt_state
        pi = self.profile(strategy)
        m = dict(self.batchings)[micro_batch_size]
        pt, gt = self.p_time[(p, pi)], self.g_time[(g, pi)]
        backward = self.p_time[(regather or p, pi)][timing.BACKWARD_GATHER] if remat != "none" else 0.0
        return {
            timing.FORWARD_GATHER: m * pt[timing.FORWARD_GATHER],
            timing.BACKWARD_GATHER: m * backward,
            timing.LAYER_GRADS: m * gt[timing.LAYER_GRADS],
            timing.OTHER_GRADS: m * gt[timing.OTHER_GRADS],
            timing.OTHER_GATHER: pt[timing.OTHER_GATHER],
            timing.REFRESH: self.refresh[(p, o, pi)],
            timing.REDUCTION: self.reduction[(g, o, pi)],
            timing.UPDATE: self.update[(o, _top(p, g, o))],
        }

    def step_time(self, choice: Choice, regather: Placement | None = None) -> timing.StepTime:
        """The step time of `choice` by the decomposed model."""
        s, b, r = choice.strategy, choice.micro_batch_size, choice.remat
        m = dict(self.batchings)[b]
        return timing.combine(
            self.communication(s, b, r, regather),
            self.compute[(b, r)],
            self.memory_passes(choice),
            self.request.workload(b, m, r),
            self.request.cluster,
        )

    def memory_passes(self, choice: Choice) -> dict[str, float]:
        """Seconds of the step's memory-bound passes, by what they depend on (`timing.memory_times`)."""
        s, pi = choice.strategy, self.profile(choice.strategy)
        return {
            "params": 0.0 if params_from_master(s) else self.passes[("P", s.params, pi)],
            "grads": self.passes[("G", s.grads, pi)],
            "opt_state": self.passes[("OS", s.opt_state, pi)],
            "every plan": self.fixed_passes[(choice.micro_batch_size, choice.remat)],
        }

    def memory(self, choice: Choice, extra_params: Placement | None = None) -> float:
        """Bytes per device of `choice` (its largest peak, as `cost.Memory.total`); `extra_params` adds a
        second P copy of that placement."""
        return max(self.peaks(choice).values()) + (
            0.0 if extra_params is None else self.p_memory[(extra_params, self.profile(choice.strategy))]
        )

    def peaks(self, choice: Choice) -> dict[str, float]:
        """Bytes per device at each of `cost.PEAKS`, by the decomposed model."""
        s, b, r = choice.strategy, choice.micro_batch_size, choice.remat
        pi = self.profile(s)
        m = dict(self.batchings)[b]
        acc = accumulates(m)
        grads = self.g_memory[(s.grads, pi, acc)]
        held = 0.0 if params_from_master(s) else self.p_memory[(s.params, pi)]
        held += self.os_memory[(s.opt_state, pi)]
        layer, other = self.p_layer_memory[(s.params, pi)], self.p_other_memory[(s.params, pi)]
        accumulation = grads if acc else 0.0
        prefetch = self.request.prefetches(m, r)
        act = self.activation_peaks[(b, r)]
        pair = self.pair_memory.get((s.params, s.opt_state, pi), {})
        peaks = {
            "loss": held + grads + other + accumulation + act["loss"],
            "backward": held
            + grads
            + (3 if prefetch else 1) * layer
            + (other if acc or prefetch else 0.0)
            + accumulation
            - self.g_other_memory[(s.grads, pi, acc)]
            + act["backward"],
            "update": held + grads + self.os_update_memory[(s.opt_state, pi)],
            "refresh": held,
        }
        return {name: total + pair.get(name, 0.0) for name, total in peaks.items()}


def _merge_time(
    parts: Iterable[tuple[int, Op]], group: str, workload: Workload, layer_bytes: int, cluster: ClusterConfig
) -> float:
    issued = timing.issue(list(parts), group, workload, layer_bytes)
    return sum(timing.transfer_time(t, cluster) for t in issued)


def build_terms(request: Request) -> Terms:
    """Evaluate the cost model on probe strategies and tabulate every term of the decomposed model."""
    cluster = request.cluster.cluster()
    hardware = request.cluster
    qs = placements(cluster)
    base = request.workload()
    leaves = timing.distinct_leaves(base)

    def profile_set(q: Placement) -> frozenset[int]:
        # Degree 1 splits nothing, but a whole leaf is also its own block: count it as splitting every
        # leaf, which keeps profiles shrinking as groups grow (and the probes of DDP are the same).
        # Every larger group splits every leaf that has a dimension to split (padding it where none
        # divides), so profiles differ only for scalars.
        return frozenset(
            i
            for i, (leaf, _) in enumerate(leaves)
            if q.degree == 1 or shard_dims(leaf.shape, q.degree, leaf.stacked)[0] is not None
        )

    sets = {q: profile_set(q) for q in qs}
    profiles = tuple(sorted(set(sets.values()), key=lambda s: (-len(s), sorted(s))))
    profile_of = {q: profiles.index(sets[q]) for q in qs}
    # (x, π) is possible when some group containing x (x itself included) splits exactly profile π.
    holder: dict[tuple[Placement, int], Placement] = {}
    for x in qs:
        for t in sorted((t for t in qs if t.contains(x)), key=lambda t: t.degree):
            holder.setdefault((x, profile_of[t]), t)
    possible = frozenset(holder)

    # Per-leaf ops when split, from probes Strategy(x, x, o); and when not split, from DDP.
    per_leaf: dict[tuple[Placement, Placement], list[dict[str, list[tuple[int, Op]]]]] = {}
    gather_bytes: dict[tuple[Placement, Placement], int] = {}  # the probe's largest gather (padded)

    def probe(x: Placement, o: Placement) -> list[dict[str, list[tuple[int, Op]]]]:
        if (x, o) not in per_leaf:
            axes = plan_axes(cluster, Strategy(x, x, o))
            found = []
            for leaf, count in leaves:
                groups: dict[str, list[tuple[int, Op]]] = {}
                for op in leaf_ops(axes, base, leaf):
                    groups.setdefault(timing.group_of(op.phase, leaf.stacked), []).append((count, op))
                found.append(groups)
            per_leaf[(x, o)] = found
            gather_bytes[(x, o)] = largest_gather_bytes(axes, base)
        return per_leaf[(x, o)]

    one = Placement(1, 1)
    unsplit = probe(one, one)

    def group_time(group: str, x: Placement, o: Placement, pi: int) -> float:
        split = probe(x, o)
        parts = itertools.chain.from_iterable(
            (split[i] if i in profiles[pi] else unsplit[i]).get(group, ()) for i in range(len(leaves))
        )
        return _merge_time(parts, group, base, gather_bytes[(x, o)], hardware)

    p_time, g_time = {}, {}
    for x, pi in possible:
        p_time[(x, pi)] = {
            g: group_time(g, x, x, pi)
            for g in (timing.FORWARD_GATHER, timing.BACKWARD_GATHER, timing.OTHER_GATHER)
        }
        g_time[(x, pi)] = {g: group_time(g, x, x, pi) for g in (timing.LAYER_GRADS, timing.OTHER_GRADS)}
    reduction, refresh = {}, {}
    for a, o in itertools.product(qs, qs):
        if not _nested(a, o):
            continue
        for pi in range(len(profiles)):
            if (_top(a, o), pi) in possible:
                reduction[(a, o, pi)] = group_time(timing.REDUCTION, a, o, pi)
                refresh[(a, o, pi)] = group_time(timing.REFRESH, a, o, pi)

    # Memory: the fields and peak terms of probes whose largest group has profile π, with one
    # micro-batch on the checkpointed scan and with two (an accumulator, the other leaves held).
    remats = tuple(r for r in REMAT_POLICIES if r in request.remats)
    p_memory, p_layer_memory, p_other_memory, g_memory, g_other_memory = {}, {}, {}, {}, {}
    os_memory, os_update_memory, passes = {}, {}, {}
    scanned = request.workload(micro_batches=1, remat="full")
    scanned = scanned.with_(implementation=dataclasses.replace(request.implementation, prefetch=False))
    accumulating = scanned.with_(micro_batches=2)
    for (x, pi), t in holder.items():
        axes = plan_axes(cluster, Strategy(x, x, t))
        single, two = memory(axes, scanned), memory(axes, accumulating)
        p_memory[(x, pi)] = float(single.param_blocks)
        p_layer_memory[(x, pi)] = float(single.peaks["backward"].gathered)
        p_other_memory[(x, pi)] = float(single.peaks["loss"].gathered)
        g_memory[(x, pi, False)], g_memory[(x, pi, True)] = float(single.grads), float(two.grads)
        g_other_memory[(x, pi, False)] = -float(single.peaks["backward"].grads)
        g_other_memory[(x, pi, True)] = float(two.grads - two.peaks["backward"].grads)
        as_os = memory(plan_axes(cluster, Strategy(t, t, x)), accumulating)
        os_memory[(x, pi)] = float(as_os.master + as_os.opt_state)
        os_update_memory[(x, pi)] = float(as_os.peaks["update"].opt_state)
        passes[("P", x, pi)] = timing.pass_time("params", two.param_blocks, hardware) + (
            timing.stored_params_time(two.param_blocks, base.num_params, hardware)
        )
        passes[("G", x, pi)] = timing.pass_time("grads", two.grads, hardware)  # fp32: an accumulator
        passes[("OS", x, pi)] = timing.opt_state_time(as_os, base.precision.param_bytes, hardware)
    pair_memory = {}
    for a, o, pi in refresh:
        pair = memory(plan_axes(cluster, Strategy(a, a, o)), scanned).peaks
        pair_memory[(a, o, pi)] = {name: float(peak.p_with_os) for name, peak in pair.items()}
    # The optimizer update's collectives (Muon's, Adafactor's) depend on the dimension each leaf is split
    # along, which the largest group's degree sets: one term per (OS, largest group) pair.
    update = {
        (o, t): group_time(timing.UPDATE, t, o, profile_of[t])
        for o, t in itertools.product(qs, qs)
        if t.contains(o)
    }

    batchings = tuple(request.batchings())
    activations, activation_peaks, compute, fixed_passes = {}, {}, {}, {}
    ddp_axes = plan_axes(cluster, Strategy(one, one, one))
    for (b, m), r in itertools.product(batchings, remats):
        w = request.workload(b, m, r)
        mem = memory(ddp_axes, w)
        activations[(b, r)] = float(mem.activations)
        activation_peaks[(b, r)] = {name: float(peak.activations) for name, peak in mem.peaks.items()}
        compute[(b, r)] = timing.compute_times(w, hardware)
        fixed_passes[(b, r)] = timing.fixed_pass_time(w.num_params, activations[(b, r)], m, hardware)
    return Terms(
        request=request,
        placements=tuple(qs),
        profiles=profiles,
        profile_of=profile_of,
        possible=possible,
        batchings=batchings,
        remats=remats,
        p_time=p_time,
        g_time=g_time,
        reduction=reduction,
        refresh=refresh,
        passes=passes,
        fixed_passes=fixed_passes,
        update=update,
        p_memory=p_memory,
        p_layer_memory=p_layer_memory,
        p_other_memory=p_other_memory,
        g_memory=g_memory,
        g_other_memory=g_other_memory,
        os_memory=os_memory,
        os_update_memory=os_update_memory,
        pair_memory=pair_memory,
        activations=activations,
        activation_peaks=activation_peaks,
        compute=compute,
        memory_limit=hardware.memory_limit,
    )


def valid_strategies(terms: Terms) -> Iterator[Strategy]:
    """Every strategy over the tabulated placements whose three groups nest pairwise."""
    for p, g, o in itertools.product(terms.placements, repeat=3):
        if _nested(p, g) and _nested(p, o) and _nested(g, o):
            yield Strategy(p, g, o)


@dataclasses.dataclass(frozen=True)
class Solution:
    """The optimum of the decomposed model: the choice, its step time and memory, and how long it took."""

    choice: Choice
    step_s: float
    memory_bytes: float
    solve_time_s: float
    objective_s: float | None = None


def brute_force(terms: Terms) -> Solution | None:
    """The fastest choice that fits, by enumerating every valid combination of the decomposed model."""
    start = time.perf_counter()
    best: tuple[float, Choice, float] | None = None
    for strategy in valid_strategies(terms):
        for (b, _), r in itertools.product(terms.batchings, terms.remats):
            choice = Choice(strategy, b, r)
            mem = terms.memory(choice)
            if mem > terms.memory_limit:
                continue
            step = terms.step_time(choice).step_s
            if best is None or step < best[0]:
                best = (step, choice, mem)
    if best is None:
        return None
    return Solution(best[1], best[0], best[2], time.perf_counter() - start)


def smallest_memory(terms: Terms) -> tuple[float, Choice]:
    """The least memory any valid choice needs, and that choice."""
    return min(
        (
            (terms.memory(Choice(s, b, r)), Choice(s, b, r))
            for s in valid_strategies(terms)
            for (b, _), r in itertools.product(terms.batchings, terms.remats)
        ),
        key=lambda item: item[0],
    )


COMPONENTS = ("P", "G", "OS")


@functools.cache
def _quiet_highs() -> None:
    """Build one HiGHS instance with the process's stdout pointed at /dev/null: highspy 1.16 prints a
    banner to the C stdout on the first one a process builds, whatever its options say, which would
    corrupt `amsp-jax plan --json`; later instances print nothing."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _highs() -> pulp.LpSolver:
    """HiGHS, exact (no optimality gap), through highspy: the solver pulp 3 and pulp 4 both run in
    process (pulp 4, which Python 3.12 installs, no longer bundles CBC)."""
    _quiet_highs()
    return pulp.HiGHS(msg=False, gapRel=0, gapAbs=0)


def _optimal(solved: object) -> bool:
    """Whether `LpProblem.solve`'s answer is a proven optimum: pulp 3 answers a status code (1:
    optimal), pulp 4 a record holding one."""
    return int(getattr(solved, "status", solved)) == 1


def solve(terms: Terms, fixed: Choice | None = None) -> Solution | None:
    """The fastest choice that fits, by the ILP over the decomposed model (None when nothing fits).

    `fixed` pins every binary to one choice, so the ILP's objective can be checked against the model.
    """
    start = time.perf_counter()
    qs, pis = terms.placements, range(len(terms.profiles))
    prob = pulp.LpProblem("amsp_plan", pulp.LpMinimize)
    x = {(c, q): prob.add_variable(f"x_{c}_{q}", cat="Binary") for c in COMPONENTS for q in qs}
    u = {pi: prob.add_variable(f"u_{pi}", cat="Binary") for pi in pis}
    mb = {b: prob.add_variable(f"m_{b}", cat="Binary") for b, _ in terms.batchings}
    rho = {r: prob.add_variable(f"r_{r}", cat="Binary") for r in terms.remats}

    def product(name: str) -> pulp.LpVariable:
        return prob.add_variable(name, lowBound=0, upBound=1)

    z = {(c, q, pi): product(f"z_{c}_{q}_{pi}") for c in COMPONENTS for q, pi in terms.possible}
    z_red = {k: product(f"zr_{k[0]}_{k[1]}_{k[2]}") for k in terms.reduction}
    z_ref = {k: product(f"zf_{k[0]}_{k[1]}_{k[2]}") for k in terms.refresh}
    w = {(b, r): product(f"w_{b}_{r}") for (b, _), r in itertools.product(terms.batchings, terms.remats)}

    def total(items: Iterable[pulp.LpAffineExpression | pulp.LpVariable]) -> pulp.LpAffineExpression:
        return pulp.lpSum(list(items))

    for c in COMPONENTS:
        prob += total(x[(c, q)] for q in qs) == 1
        for q in qs:
            prob += total(z[(c, q, pi)] for pi in pis if (q, pi) in terms.possible) == x[(c, q)]
        for pi in pis:
            prob += total(z[(c, q, pi)] for q in qs if (q, pi) in terms.possible) == u[pi]
    prob += total(mb.values()) == 1
    prob += total(rho.values()) == 1
    for b, _ in terms.batchings:
        prob += total(w[(b, r)] for r in terms.remats) == mb[b]
    for r in terms.remats:
        prob += total(w[(b, r)] for b, _ in terms.batchings) == rho[r]
    # Pair variables exist only for nested pairs, so these also forbid non-nested G/OS and P/OS.
    for first, table in (("G", z_red), ("P", z_ref)):
        for q in qs:
            prob += total(v for (a, _, _), v in table.items() if a == q) == x[(first, q)]
            prob += total(v for (_, o, _), v in table.items() if o == q) == x[("OS", q)]
        for pi in pis:
            prob += total(v for (_, _, k), v in table.items() if k == pi) == u[pi]
    for a, b in itertools.product(qs, qs):
        if not _nested(a, b):
            prob += x[("P", a)] + x[("G", b)] <= 1
    # π is the profile of the largest group: every component splits at least π, one exactly π.
    profile_sets = [terms.profiles[terms.profile_of[q]] for q in qs]
    for pi in pis:
        for c in COMPONENTS:
            prob += u[pi] <= total(
                x[(c, q)] for q, s in zip(qs, profile_sets, strict=True) if s >= terms.profiles[pi]
            )
        prob += u[pi] <= total(x[(c, q)] for c in COMPONENTS for q in qs if terms.profile_of[q] == pi)

    # Memory (GiB, for the solver's tolerances): one expression per peak of `cost.Memory`, each under
    # the limit. Held all step: the stored P, G and OS. P on OS's placement is not stored
    # (`schedule.params_from_master`): the pair variable of the refresh from OS onto the same
    # placement takes its bytes off.
    from_master = {(a, o, pi): v for (a, o, pi), v in z_ref.items() if params_from_master(Strategy(a, a, o))}
    held = total(terms.p_memory[k] / GIB * z[("P", *k)] for k in terms.possible)
    held -= total(terms.p_memory[(a, pi)] / GIB * v for (a, _, pi), v in from_master.items())
    held += total(terms.os_memory[k] / GIB * z[("OS", *k)] for k in terms.possible)
    # The schedule's rules as products of binaries: with an accumulator G is in fp32 and one
    # micro-batch's gradient sits beside it, and the other leaves stay gathered through the backward;
    # the prefetch loop holds two more gathered layers and the other leaves for the (batching, remat)
    # pairs that run it.
    micro = dict(terms.batchings)
    no_accumulator = total(mb[b] for b, m in terms.batchings if not accumulates(m))
    prefetching = total(w[(b, r)] for (b, r) in w if terms.request.prefetches(micro[b], r))
    grads, loss, backward = pulp.lpSum([]), pulp.lpSum([]), pulp.lpSum([])
    for q, pi in terms.possible:
        single, fp32 = terms.g_memory[(q, pi, False)], terms.g_memory[(q, pi, True)]
        other_single, other_fp32 = terms.g_other_memory[(q, pi, False)], terms.g_other_memory[(q, pi, True)]
        accumulator = product(f"acc_{q}_{pi}")
        prob += accumulator >= z[("G", q, pi)] - no_accumulator
        grads += single / GIB * z[("G", q, pi)] + (fp32 - single) / GIB * accumulator
        loss += fp32 / GIB * accumulator
        backward += -other_single / GIB * z[("G", q, pi)]
        backward += (fp32 - other_fp32 + other_single) / GIB * accumulator
        loss += terms.p_other_memory[(q, pi)] / GIB * z[("P", q, pi)]
        backward += terms.p_layer_memory[(q, pi)] / GIB * z[("P", q, pi)]
        if terms.p_other_memory[(q, pi)]:
            kept = product(f"ko_{q}_{pi}")
            prob += kept >= z[("P", q, pi)] - no_accumulator
            prob += kept >= z[("P", q, pi)] + prefetching - 1  # never both: the loop needs M = 1
            backward += terms.p_other_memory[(q, pi)] / GIB * kept
        if terms.p_layer_memory[(q, pi)]:
            ahead = product(f"pf_{q}_{pi}")
            prob += ahead >= z[("P", q, pi)] + prefetching - 1
            backward += 2 * terms.p_layer_memory[(q, pi)] / GIB * ahead
    peaks = {
        "loss": held + grads + loss + total(terms.activation_peaks[k]["loss"] / GIB * w[k] for k in w),
        "backward": held + grads + backward
        + total(terms.activation_peaks[k]["backward"] / GIB * w[k] for k in w),
        "update": held
        + grads
        + total(terms.os_update_memory[k] / GIB * z[("OS", *k)] for k in terms.possible),
        "refresh": held,
    }
    for name in peaks:
        peaks[name] += total(terms.pair_memory[k][name] / GIB * v for k, v in z_ref.items())
    if math.isfinite(terms.memory_limit):
        for expression in peaks.values():
            prob += expression <= terms.memory_limit / GIB

    # Step time: compute + memory passes + one exposed-time variable per overlap window, bounded below by
    # both arms of `timing.exposed` (exact at the optimum, where it sits on the larger one).
    # Times enter in units of 1e-4 of the longest compute, so HiGHS's absolute tolerances (1e-7 on
    # constraints, 1e-6 on integrality; the optimality gap is set to 0) stay far below the
    # differences between plans that the tests compare (1e-6 relative).
    scale = 1e4 / max(c.total for c in terms.compute.values())
    exposed = {name: prob.add_variable(f"e_{name.replace(' ', '_')}", lowBound=0) for name in timing.WINDOWS}
    # Where collectives cannot overlap compute, every window exposes all of its communication.
    hardware = terms.request.cluster
    kappa = hardware.overlap_interference if hardware.overlap_enabled else 1.0
    step_level = {
        "step start": (
            total(terms.p_time[(q, pi)][timing.OTHER_GATHER] * z[("P", q, pi)] for q, pi in terms.possible)
            + total(t * z_ref[k] for k, t in terms.refresh.items()),
            total(terms.compute[k].first_forward * w[k] for k in w),
        ),
        "reduction": (
            total(t * z_red[k] for k, t in terms.reduction.items()),
            total(terms.request.cluster.reduction_overlap * terms.compute[k].last_backward * w[k] for k in w),
        ),
        "optimizer update": (_update_time(prob, terms, x, product), pulp.lpSum([])),
    }
    for name, (comm, hide) in step_level.items():
        prob += exposed[name] >= scale * (comm - hide)
        prob += exposed[name] >= scale * kappa * comm
    # Per-micro-batch windows scale with M = n / b, so they get one big-M pair per (b, r).
    tables = {"P": terms.p_time, "G": terms.g_time}
    for (b, r), wk in w.items():
        compute = terms.compute[(b, r)]
        per_micro_batch = {
            "forward": ([(timing.FORWARD_GATHER, "P")], compute.forward_layers),
            "backward": (
                ([(timing.BACKWARD_GATHER, "P")] if r != "none" else []) + [(timing.LAYER_GRADS, "G")],
                compute.backward_layers,
            ),
            "other leaves": ([(timing.OTHER_GRADS, "G")], compute.forward_other + compute.backward_other),
        }
        for name, (groups, hide) in per_micro_batch.items():
            comm = total(
                micro[b] * tables[c][(q, pi)][group] * z[(c, q, pi)]
                for group, c in groups
                for q, pi in terms.possible
            )
            most = sum(micro[b] * max(tables[c][k][group] for k in terms.possible) for group, c in groups)
            if most - hide > 0:
                prob += exposed[name] >= scale * (comm - hide - (most - hide) * (1 - wk))
            if kappa * most > 0:
                prob += exposed[name] >= scale * kappa * (comm - most * (1 - wk))

    prob += (
        scale * total(terms.compute[k].total * w[k] for k in w)
        + scale * total(terms.passes[(c, *k)] * z[(c, *k)] for c in COMPONENTS for k in terms.possible)
        # A P that is the master (no stored block) has no passes of its own: the pair variable takes
        # them off, as it takes its bytes off the memory.
        - scale * total(terms.passes[("P", a, pi)] * v for (a, _, pi), v in from_master.items())
        + scale * total(terms.fixed_passes[k] * w[k] for k in w)
        + total(exposed.values())
    )
    if fixed is not None:
        pinned = zip(
            COMPONENTS, (fixed.strategy.params, fixed.strategy.grads, fixed.strategy.opt_state), strict=True
        )
        for c, q in pinned:
            prob += x[(c, q)] == 1
        prob += mb[fixed.micro_batch_size] == 1
        prob += rho[fixed.remat] == 1
    if not _optimal(prob.solve(_highs())):
        return None

    def chosen(variables: dict) -> object:
        return max(variables, key=lambda key: variables[key].value() or 0.0)

    strategy = Strategy(*(chosen({q: x[(c, q)] for q in qs}) for c in COMPONENTS))
    choice = Choice(strategy, chosen(mb), chosen(rho))
    return Solution(
        choice,
        terms.step_time(choice).step_s,
        terms.memory(choice),
        time.perf_counter() - start,
        pulp.value(prob.objective) / scale,
    )


def _update_time(
    prob: pulp.LpProblem, terms: Terms, x: dict, product: Callable[[str], pulp.LpVariable]
) -> pulp.LpAffineExpression:
    """Seconds of the optimizer update's collectives: the term of (OS placement, largest group), through
    y_t (t is the largest group of the three components) and products x_OS,o · y_t."""
    priced = {k: v for k, v in terms.update.items() if v}
    if not priced:
        return pulp.lpSum([])
    qs = terms.placements
    y = {q: prob.add_variable(f"top_{q}", cat="Binary") for q in qs}
    prob += pulp.lpSum(list(y.values())) == 1
    for q in qs:
        larger = pulp.lpSum([x[(c, r)] for c in COMPONENTS for r in qs if r.degree > q.degree])
        for c in COMPONENTS:
            prob += y[q] >= x[(c, q)] - larger
    both = {(o, t): product(f"wu_{o}_{t}") for o, t in priced}
    for (o, t), v in both.items():
        prob += v >= x[("OS", o)] + y[t] - 1
    return pulp.lpSum([priced[k] * v for k, v in both.items()])


# ---- full-model evaluation of chosen and preset plans ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Evaluated:
    """A plan re-evaluated by the full cost and time models, with whether it fits the device."""

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

    def to_plan(self, cluster: Cluster, precision: Precision | str = "mixed") -> Plan:
        """The `Plan` that runs this choice on `cluster` (a `Trainer` takes it as is)."""
        return Plan(
            cluster, self.strategy, self.micro_batches, precision=precision, remat=self.remat,
            hierarchical=self.implementation.hierarchical, prefetch=self.implementation.prefetch,
            keep_first_layer=self.implementation.keep_first_layer, memory_limit=self.memory_limit,
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


def evaluate(
    request: Request,
    strategy: Strategy,
    micro_batch_size: int,
    remat: str,
    name: str = "chosen",
    hpz: bool = False,
    solve_time_s: float | None = None,
) -> Evaluated:
    """One plan by the full cost and time models (`hpz`: ZeRO++'s secondary copy, see `_hpz`)."""
    micro_batches = dict(request.batchings())[micro_batch_size]
    workload = request.workload(micro_batch_size, micro_batches, remat)
    if hpz:
        estimate = _hpz(request, strategy, workload)
        description = f"{strategy},hpz={Placement(request.cluster.devices_per_node, 1)}"
    else:
        estimate = timing.estimate(plan_axes(request.cluster.cluster(), strategy), workload, request.cluster)
        description = str(strategy)
    return Evaluated(
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
    )


def best_batching(terms: Terms, strategy: Strategy, hpz: bool = False) -> Choice:
    """The fastest (micro-batch size, remat) for a fixed strategy that fits, else the smallest one."""
    node = Placement(terms.request.cluster.devices_per_node, 1) if hpz else None
    options = [Choice(strategy, b, r) for (b, _), r in itertools.product(terms.batchings, terms.remats)]
    if terms.covers(strategy):
        scored = [(terms.step_time(c, node).step_s, terms.memory(c, node), c) for c in options]
    else:  # a placement off the whole-node grid: the full model, one batching at a time
        scored = []
        for c in options:
            e = evaluate(terms.request, strategy, c.micro_batch_size, c.remat, hpz=hpz).estimate
            scored.append((e.time.step_s, float(e.prediction.memory.total), c))
    fitting = [item for item in scored if item[1] <= terms.memory_limit]
    if fitting:
        return min(fitting, key=lambda item: item[0])[2]
    return min(scored, key=lambda item: item[1])[2]


PRESET_ROWS = ("ddp", "zero1", "zero2", "zero3", "mics", "hsdp", "zero++")


def alternatives(terms: Terms) -> list[Evaluated]:
    """The usual presets, each at its own best micro-batch size and remat policy."""
    cluster = terms.request.cluster.cluster()
    rows = []
    for name in PRESET_ROWS:
        hpz = name == "zero++"
        strategy = preset("zero3" if hpz else name, cluster)
        choice = best_batching(terms, strategy, hpz)
        rows.append(evaluate(terms.request, strategy, choice.micro_batch_size, choice.remat, name, hpz))
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


def make_request(
    model: LlamaConfig | ModelSpec | str | Path,
    cluster: ClusterConfig | Cluster | str | Path,
    nodes: int | None = None,
    *,
    seq_len: int,
    global_batch_tokens: int | None = None,
    global_batch: int | None = None,
    precision: str | Precision = "mixed",
    micro_batch_size: int | None = None,
    remat: str | None = None,
    optimizer: str = "adam",
    keep_first_layer: bool = False,
) -> Request:
    """A `Request` from model/cluster configs, files or shipped names; the batch in tokens or sequences.
    `keep_first_layer`: plans with micro-batches keep it (`amsp_jax.core.schedule.keeps_first_layer`)."""
    if not isinstance(model, LlamaConfig | ModelSpec):
        model = LlamaConfig.from_yaml(config_files.find("models", model, ModelConfigError))
    if isinstance(cluster, Cluster):
        hardware = for_cluster(cluster)
    elif isinstance(cluster, ClusterConfig):
        hardware = cluster
    else:
        hardware = load_cluster(cluster)
    if nodes is not None:
        hardware = hardware.with_shape(nodes)
    if (global_batch_tokens is None) == (global_batch is None):
        raise PlanError("give the global batch either in tokens (global_batch_tokens) or in sequences")
    tokens = global_batch_tokens if global_batch_tokens is not None else global_batch * seq_len
    if remat is not None and remat not in REMAT_POLICIES:
        raise PlanError(f"unknown remat policy {remat!r}; use one of {REMAT_POLICIES}")
    if optimizer not in optimizer_cost.KINDS:
        raise PlanError(f"unknown optimizer {optimizer!r}; use one of {optimizer_cost.KINDS}")
    return Request(
        model=model,
        cluster=hardware,
        seq_len=seq_len,
        global_batch_tokens=tokens,
        precision=Precision.named(precision) if isinstance(precision, str) else precision,
        micro_batch_sizes=None if micro_batch_size is None else (micro_batch_size,),
        remats=REMAT_POLICIES if remat is None else (remat,),
        optimizer=optimizer,
        implementation=Implementation(keep_first_layer=keep_first_layer),
    )


def implementations(request: Request) -> list[Implementation]:
    """The ways of issuing the step's collectives worth comparing on this cluster.

    Split (hierarchical) and flat collectives differ only where a group spans nodes. The explicit
    prefetch loop exists to overlap the next layer's gather with compute; where the cluster cannot
    overlap collectives with compute it only adds work, so it is left off there. Keeping the first
    layer across micro-batches is the request's (its memory buys overlap the time model does not price).
    """
    prefetch = None if request.cluster.overlap_enabled else False
    splits = (True, False) if request.cluster.nodes > 1 else (True,)
    return [dataclasses.replace(request.implementation, hierarchical=h, prefetch=prefetch) for h in splits]


def plan(request: Request, terms: Terms | None = None) -> Evaluated:
    """The ILP's choice for `request`, re-evaluated by the full models; PlanError when nothing fits.

    The implementation choices (`implementations`) are an outer enumeration: one ILP per choice, the
    fastest wins. `terms` (built for `request` as given) skips that enumeration.
    """
    start = time.perf_counter()
    candidates = [(request, terms)] if terms is not None else [
        (dataclasses.replace(request, implementation=i), None) for i in implementations(request)
    ]  # fmt: skip
    best: Evaluated | None = None
    first_terms = None
    for candidate, given in candidates:
        built = given or build_terms(candidate)
        first_terms = first_terms or built
        solution = solve(built)
        if solution is None:
            continue
        c = solution.choice
        evaluated = evaluate(
            candidate, c.strategy, c.micro_batch_size, c.remat, solve_time_s=time.perf_counter() - start
        )
        if best is None or evaluated.estimate.time.step_s < best.estimate.time.step_s:
            best = evaluated
    if best is None:
        assert first_terms is not None
        raise nothing_fits(first_terms)
    return dataclasses.replace(best, solve_time_s=time.perf_counter() - start)


def choose(
    model: LlamaConfig | ModelSpec | str | Path,
    cluster: ClusterConfig | Cluster | str | Path,
    nodes: int | None = None,
    *,
    seq_len: int,
    global_batch_tokens: int | None = None,
    global_batch: int | None = None,
    precision: str | Precision = "mixed",
    micro_batch_size: int | None = None,
    remat: str | None = None,
    optimizer: str = "adam",
) -> Evaluated:
    """The fastest plan that fits: `.strategy`, `.micro_batch_size`, `.micro_batches`, `.remat`, `.estimate`.

    `model` is a `LlamaConfig`, a traced `workload.ModelSpec` (any Flax model: `amsp_jax.choose`
    takes the model itself), a model YAML or a shipped model's name (`llama-7b`); `cluster` a
    `ClusterConfig`, a cluster YAML or shipped name (`a800-8x-ib800`), or a bare `space.Cluster`
    (hardware then from the shipped config of its name, else `cpu-sim`); `nodes` overrides the config's node
    count. Give the global batch in tokens or, as `global_batch`, in sequences. `micro_batch_size`
    and `remat` fix those knobs instead of searching them; `optimizer` (adam, adafactor or muon) adds
    the collectives its update needs on sharded leaves (`amsp_jax.cost.optimizer`). Raises `PlanError`
    when nothing fits, saying how much memory the smallest plan needs and what would fit.
    """
    return plan(
        make_request(
            model,
            cluster,
            nodes,
            seq_len=seq_len,
            global_batch_tokens=global_batch_tokens,
            global_batch=global_batch,
            precision=precision,
            micro_batch_size=micro_batch_size,
            remat=remat,
            optimizer=optimizer,
        )
    )
