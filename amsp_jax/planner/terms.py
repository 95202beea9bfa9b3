"""The priced terms of the decomposed time and memory model, per placement and pair of placements.

`build_terms` reads every term off the full cost model (`amsp_jax.cost`) on probe strategies; `Terms`
adds them up again for any candidate. Why the decomposition is exact is derived in
`amsp_jax.planner.ilp`, which solves over the same terms.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator

from amsp_jax.core.mesh import leaf_layout, plan_axes, shard_dims
from amsp_jax.core.plan import REMAT_POLICIES
from amsp_jax.core.schedule import Op, accumulates, params_from_master
from amsp_jax.core.space import Cluster, Placement, Strategy
from amsp_jax.core.tensor import TensorRuleError
from amsp_jax.cost import Leaf, Workload, largest_gather_bytes, leaf_ops, memory, timing
from amsp_jax.cost.hardware import ClusterConfig
from amsp_jax.planner.request import Request

Key = tuple[Placement, int]  # (placement, π)
PairKey = tuple[Placement, Placement, int]  # (placement, OS placement, π)


def placements(cluster: Cluster) -> list[Placement]:
    """Every placement that keeps whole nodes across nodes: (k, 1) for k | R, and (R, k) for k | N."""
    r, n = cluster.devices_per_node, cluster.nodes
    found = [Placement(k, 1) for k in range(1, r + 1) if r % k == 0]
    return found + [Placement(r, k) for k in range(2, n + 1) if n % k == 0]


def nested(a: Placement, b: Placement) -> bool:
    """Whether one of two placements contains the other (the groups of a valid strategy nest)."""
    return a.contains(b) or b.contains(a)


def largest(*items: Placement) -> Placement:
    """The placement of the largest group."""
    return max(items, key=lambda q: q.degree)


@dataclasses.dataclass(frozen=True)
class Candidate:
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
    possible: frozenset[Key]
    batchings: tuple[tuple[int, int], ...]
    remats: tuple[str, ...]
    p_time: dict[Key, dict[str, float]]
    g_time: dict[Key, dict[str, float]]
    reduction: dict[PairKey, float]
    refresh: dict[PairKey, float]
    passes: dict[tuple[str, Placement, int], float]  # (component, placement, π): memory-pass seconds
    # (G placement, π, micro-batch size): seconds of the passes over the micro-batches' fp32 accumulator
    accumulator_passes: dict[tuple[Placement, int, int], float]
    fixed_passes: dict[tuple[int, str], float]  # (micro-batch size, remat): passes every plan runs
    update: dict[tuple[Placement, Placement], float]  # (OS, largest group): the update's collectives
    # Memory (`cost.Memory`): the model states and each peak's terms, by what they depend on.
    p_memory: dict[Key, float]  # the stored P blocks
    p_layer_memory: dict[Key, float]  # one layer's gathered weights beyond the shard
    p_other_memory: dict[Key, float]  # the other leaves gathered beyond their shards, at the loss
    p_lookup_memory: dict[Key, float]  # of those, tables only indexed: gathered at the loss where held
    p_start_memory: dict[Key, float]  # gathered at the forward's start (`cost.Memory`'s `start` peak)
    g_memory: dict[tuple[Placement, int, bool], float]  # G blocks (accumulating: fp32)
    g_other_memory: dict[tuple[Placement, int, bool], float]  # of them, the other leaves'
    os_memory: dict[Key, float]  # master and moments
    os_update_memory: dict[Key, float]  # the update's new master
    pair_memory: dict[PairKey, dict[str, float]]  # (P, OS, π): each peak's term
    activations: dict[tuple[int, str], float]  # the memory passes' activation block
    activation_peaks: dict[tuple[int, str], dict[str, float]]  # (b, r): each peak's activation bytes
    compute: dict[tuple[int, str], timing.Compute]
    memory_limit: float

    def profile(self, strategy: Strategy) -> int:
        """π: the profile of the largest group (the smallest of the three components' profiles)."""
        return self.profile_of[largest(strategy.params, strategy.grads, strategy.opt_state)]

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
            timing.UPDATE: self.update[(o, largest(p, g, o))],
        }

    def step_time(self, candidate: Candidate, regather: Placement | None = None) -> timing.StepTime:
        """The step time of `candidate` by the decomposed model."""
        s, b, r = candidate.strategy, candidate.micro_batch_size, candidate.remat
        m = dict(self.batchings)[b]
        return timing.combine(
            self.communication(s, b, r, regather),
            self.compute[(b, r)],
            self.memory_passes(candidate),
            self.request.workload(b, m, r),
            self.request.cluster,
        )

    def memory_passes(self, candidate: Candidate) -> dict[str, float]:
        """Seconds of the step's memory-bound passes, by what they depend on (`timing.memory_times`)."""
        s, pi = candidate.strategy, self.profile(candidate.strategy)
        return {
            "params": 0.0 if params_from_master(s) else self.passes[("P", s.params, pi)],
            "grads": self.passes[("G", s.grads, pi)]
            + self.accumulator_passes[(s.grads, pi, candidate.micro_batch_size)],
            "opt_state": self.passes[("OS", s.opt_state, pi)],
            "every plan": self.fixed_passes[(candidate.micro_batch_size, candidate.remat)],
        }

    def memory(self, candidate: Candidate, extra_params: Placement | None = None) -> float:
        """Bytes per device of `candidate` (its largest peak, as `cost.Memory.total`); `extra_params`
        adds a second P copy of that placement."""
        return max(self.peaks(candidate).values()) + (
            0.0 if extra_params is None else self.p_memory[(extra_params, self.profile(candidate.strategy))]
        )

    def peaks(self, candidate: Candidate) -> dict[str, float]:
        """Bytes per device at each of `cost.PEAKS`, by the decomposed model."""
        s, b, r = candidate.strategy, candidate.micro_batch_size, candidate.remat
        pi = self.profile(s)
        m = dict(self.batchings)[b]
        acc = accumulates(m)
        grads = self.g_memory[(s.grads, pi, acc)]
        held = 0.0 if params_from_master(s) else self.p_memory[(s.params, pi)]
        held += self.os_memory[(s.opt_state, pi)]
        layer, other = self.p_layer_memory[(s.params, pi)], self.p_other_memory[(s.params, pi)]
        accumulation = grads if acc else 0.0
        prefetch = self.request.prefetches(m, r)
        other += self.p_lookup_memory[(s.params, pi)] if acc or prefetch else 0.0
        act = self.activation_peaks[(b, r)]
        pair = self.pair_memory.get((s.params, s.opt_state, pi), {})
        at_loss = self.g_other_memory[(s.grads, pi, True)] if acc else 0.0
        peaks = {
            "start": held + grads + self.p_start_memory[(s.params, pi)] + act["start"],
            "loss": held + grads + other + at_loss + act["loss"],
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


def valid_strategies(terms: Terms) -> Iterator[Strategy]:
    """Every strategy over the tabulated placements whose three groups nest pairwise."""
    for p, g, o in itertools.product(terms.placements, repeat=3):
        if nested(p, g) and nested(p, o) and nested(g, o):
            yield terms.request.strategy(p, g, o)


def candidates(terms: Terms) -> Iterator[Candidate]:
    """Every valid strategy at every batching and remat policy the terms hold."""
    for strategy in valid_strategies(terms):
        for (b, _), r in itertools.product(terms.batchings, terms.remats):
            yield Candidate(strategy, b, r)


def smallest_memory(terms: Terms) -> tuple[float, Candidate]:
    """The least memory any valid candidate needs, and that candidate."""
    return min(((terms.memory(c), c) for c in candidates(terms)), key=lambda item: item[0])


# ---- building the terms, step by step -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Profiles:
    """Which leaves each placement splits (its profile), and which (placement, π) pairs can occur."""

    profiles: tuple[frozenset[int], ...]
    profile_of: dict[Placement, int]
    holder: dict[Key, Placement]  # (x, π): the smallest group containing x that splits exactly π


def _profiles(qs: list[Placement], leaves: list[tuple[Leaf, int]], tensor: int) -> _Profiles:
    def profile_set(q: Placement) -> frozenset[int]:
        # Degree 1 counts as splitting every leaf (a whole leaf is its own block), so that profiles
        # shrink as groups grow; larger groups split (or pad) every leaf with a dimension, each tensor
        # rank's slice of it under t > 1.
        return frozenset(
            i
            for i, (leaf, _) in enumerate(leaves)
            if q.degree == 1 or shard_dims(leaf.local_shape(tensor), q.degree, leaf.stacked)[0] is not None
        )

    sets = {q: profile_set(q) for q in qs}
    profiles = tuple(sorted(set(sets.values()), key=lambda s: (-len(s), sorted(s))))
    profile_of = {q: profiles.index(sets[q]) for q in qs}
    # (x, π) is possible when some group containing x (x itself included) splits exactly profile π.
    holder: dict[Key, Placement] = {}
    for x in qs:
        for t in sorted((t for t in qs if t.contains(x)), key=lambda t: t.degree):
            holder.setdefault((x, profile_of[t]), t)
    return _Profiles(profiles, profile_of, holder)


class _Probes:
    """Per-leaf ops of probe strategies Strategy(x, x, o), grouped by overlap window, priced on demand:
    a leaf the profile splits takes the probe's ops, another leaf DDP's."""

    def __init__(self, request: Request, leaves: list[tuple[Leaf, int]], profiles: _Profiles):
        self.cluster, self.hardware, self.request = request.cluster.cluster(), request.cluster, request
        self.base, self.leaves, self.profiles = request.workload(), leaves, profiles.profiles
        self.per_leaf: dict[tuple[Placement, Placement], list[dict[str, list[tuple[int, Op]]]]] = {}
        self.gather_bytes: dict[tuple[Placement, Placement], int] = {}  # the probe's largest (padded)
        one = Placement(1, 1)
        self.unsplit = self.probe(one, one)

    def probe(self, x: Placement, o: Placement) -> list[dict[str, list[tuple[int, Op]]]]:
        """Each leaf's ops under Strategy(x, x, o), by overlap group."""
        if (x, o) not in self.per_leaf:
            axes = plan_axes(self.cluster, self.request.strategy(x, x, o))
            found = []
            for leaf, count in self.leaves:
                groups: dict[str, list[tuple[int, Op]]] = {}
                for op in leaf_ops(axes, self.base, leaf):
                    groups.setdefault(timing.group_of(op.phase, leaf.stacked), []).append((count, op))
                found.append(groups)
            self.per_leaf[(x, o)] = found
            self.gather_bytes[(x, o)] = largest_gather_bytes(axes, self.base)
        return self.per_leaf[(x, o)]

    def group_time(self, group: str, x: Placement, o: Placement, pi: int) -> float:
        """Seconds of one overlap group's collectives under Strategy(x, x, o) with profile π."""
        split = self.probe(x, o)
        parts = itertools.chain.from_iterable(
            (split[i] if i in self.profiles[pi] else self.unsplit[i]).get(group, ())
            for i in range(len(self.leaves))
        )
        return _merge_time(parts, group, self.base, self.gather_bytes[(x, o)], self.hardware)


def _merge_time(
    parts: Iterable[tuple[int, Op]], group: str, workload: Workload, layer_bytes: int, cluster: ClusterConfig
) -> float:
    issued = timing.issue(list(parts), group, workload, layer_bytes)
    return sum(timing.transfer_time(t, cluster) for t in issued)


def _communication_terms(qs: list[Placement], profiles: _Profiles, probes: _Probes) -> dict[str, dict]:
    """The collectives' seconds: P and G per (placement, π), the pairs' per (placement, OS, π), and
    the optimizer update's per (OS, largest group)."""
    p_time, g_time = {}, {}
    for x, pi in profiles.holder:
        gathers = (timing.FORWARD_GATHER, timing.BACKWARD_GATHER, timing.OTHER_GATHER)
        p_time[(x, pi)] = {g: probes.group_time(g, x, x, pi) for g in gathers}
        grads = (timing.LAYER_GRADS, timing.OTHER_GRADS)
        g_time[(x, pi)] = {g: probes.group_time(g, x, x, pi) for g in grads}
    reduction, refresh = {}, {}
    for a, o in itertools.product(qs, qs):
        if not nested(a, o):
            continue
        for pi in range(len(profiles.profiles)):
            if (largest(a, o), pi) in profiles.holder:
                reduction[(a, o, pi)] = probes.group_time(timing.REDUCTION, a, o, pi)
                refresh[(a, o, pi)] = probes.group_time(timing.REFRESH, a, o, pi)
    # The optimizer update's collectives (Muon's, Adafactor's) depend on the dimension each leaf is split
    # along, which the largest group's degree sets: one term per (OS, largest group) pair.
    update = {
        (o, t): probes.group_time(timing.UPDATE, t, o, profiles.profile_of[t])
        for o, t in itertools.product(qs, qs)
        if t.contains(o)
    }
    return {"p_time": p_time, "g_time": g_time, "reduction": reduction, "refresh": refresh, "update": update}


def _state_terms(request: Request, profiles: _Profiles, base: Workload) -> dict[str, dict]:
    """Memory of P, G and OS and their memory passes, from probes whose largest group has profile π,
    with one micro-batch on the checkpointed scan and with two (an accumulator, the other leaves held)."""
    cluster, hardware = request.cluster.cluster(), request.cluster
    fields = (
        "p_memory", "p_layer_memory", "p_other_memory", "p_lookup_memory", "p_start_memory", "g_memory",
        "g_other_memory",
    )  # fmt: skip
    out: dict[str, dict] = {
        name: {} for name in (*fields, "os_memory", "os_update_memory", "passes", "accumulator_passes")
    }
    scanned = request.workload(micro_batches=1, remat="full")
    scanned = scanned.with_(implementation=dataclasses.replace(request.implementation, prefetch=False))
    accumulating = scanned.with_(micro_batches=2)
    for (x, pi), t in profiles.holder.items():
        axes = plan_axes(cluster, request.strategy(x, x, t))
        single, two = memory(axes, scanned), memory(axes, accumulating)
        out["p_memory"][(x, pi)] = float(single.param_blocks)
        out["p_layer_memory"][(x, pi)] = float(single.peaks["backward"].gathered)
        out["p_other_memory"][(x, pi)] = float(single.peaks["loss"].gathered)
        out["p_lookup_memory"][(x, pi)] = float(two.peaks["loss"].gathered - single.peaks["loss"].gathered)
        out["p_start_memory"][(x, pi)] = float(single.peaks["start"].gathered)
        out["g_memory"][(x, pi, False)] = float(single.grads)
        out["g_memory"][(x, pi, True)] = float(two.grads)
        out["g_other_memory"][(x, pi, False)] = -float(single.peaks["backward"].grads)
        out["g_other_memory"][(x, pi, True)] = float(two.grads - two.peaks["backward"].grads)
        as_os = memory(plan_axes(cluster, request.strategy(t, t, x)), accumulating)
        out["os_memory"][(x, pi)] = float(as_os.master + as_os.opt_state)
        out["os_update_memory"][(x, pi)] = float(as_os.peaks["update"].opt_state)
        out["passes"][("P", x, pi)] = timing.params_time(two.param_blocks, base.num_params, hardware)
        out["passes"][("G", x, pi)] = timing.grads_time(two.grads, hardware)  # fp32: an accumulator
        for b, m in request.batchings():
            out["accumulator_passes"][(x, pi, b)] = timing.accumulator_time(two.grads, m, hardware)
        out["passes"][("OS", x, pi)] = timing.opt_state_time(as_os, base.precision.param_bytes, hardware)
    return out


def _pair_memory(request: Request, pairs: Iterable[PairKey]) -> dict[PairKey, dict[str, float]]:
    """Each peak's bytes that depend on P and OS together (`cost.Peak.p_with_os`), per (P, OS, π)."""
    cluster = request.cluster.cluster()
    scanned = request.workload(micro_batches=1, remat="full")
    scanned = scanned.with_(implementation=dataclasses.replace(request.implementation, prefetch=False))
    by_pair: dict[tuple[Placement, Placement], dict[str, float]] = {}  # the same for every π
    found = {}
    for a, o, pi in pairs:
        if (a, o) not in by_pair:
            pair = memory(plan_axes(cluster, request.strategy(a, a, o)), scanned).peaks
            by_pair[(a, o)] = {name: float(peak.p_with_os) for name, peak in pair.items()}
        found[(a, o, pi)] = dict(by_pair[(a, o)])
    return found


def batching_terms(request: Request, remats: tuple[str, ...]) -> dict[str, dict]:
    """Compute, activations and the passes every plan runs, per (micro-batch size, remat), read off DDP."""
    cluster, hardware = request.cluster.cluster(), request.cluster
    one = Placement(1, 1)
    ddp_axes = plan_axes(cluster, request.strategy(one, one, one))
    activations, activation_peaks, compute, fixed_passes = {}, {}, {}, {}
    for (b, m), r in itertools.product(request.batchings(), remats):
        w = request.workload(b, m, r)
        mem = memory(ddp_axes, w)
        activations[(b, r)] = float(mem.activations)
        activation_peaks[(b, r)] = {name: float(peak.activations) for name, peak in mem.peaks.items()}
        compute[(b, r)] = timing.compute_times(w, hardware)
        fixed_passes[(b, r)] = timing.fixed_pass_time(w, activations[(b, r)], hardware)
    return {
        "activations": activations,
        "activation_peaks": activation_peaks,
        "compute": compute,
        "fixed_passes": fixed_passes,
    }


def _lays_out(request: Request, q: Placement, leaves: Iterable[Leaf]) -> bool:
    """Whether every leaf can be split over placement `q` at the request's tensor degree: a tensor
    rank's slice that no dimension of divides must be padded, never on its tensor-split dimension."""
    axes = plan_axes(request.cluster.cluster(), request.strategy(q, q, q))
    try:
        for leaf in leaves:
            leaf_layout(axes, leaf)
    except TensorRuleError:
        return False
    return True


_STATE_FIELDS = (
    "p_memory", "p_layer_memory", "p_other_memory", "p_lookup_memory", "p_start_memory", "g_memory",
    "g_other_memory", "os_memory", "os_update_memory", "passes", "accumulator_passes", "pair_memory",
)  # fmt: skip


def issued_otherwise(a: Request, b: Request) -> bool:
    """Whether two requests differ at most in how collectives are issued (split or flat)."""
    issue = dataclasses.replace(a.implementation, hierarchical=b.implementation.hierarchical)
    return dataclasses.replace(a, implementation=issue) == b


def build_terms(request: Request, states_from: Terms | None = None) -> Terms:
    """Evaluate the cost model on probe strategies and tabulate every term of the decomposed model.

    `states_from`: terms of the same request with collectives issued the other way (`issued_otherwise`),
    whose model states' memory and memory passes are taken as they are: splitting a collective by level
    moves the same blocks, so no buffer changes."""
    if states_from is not None and not issued_otherwise(states_from.request, request):
        raise ValueError("states_from must be built for the same request, collectives issued otherwise")
    base = request.workload()
    qs = [q for q in placements(request.data_cluster()) if _lays_out(request, q, base.leaves)]
    leaves = timing.distinct_leaves(base)
    profiles = _profiles(qs, leaves, request.tensor)
    communication = _communication_terms(qs, profiles, _Probes(request, leaves, profiles))
    remats = tuple(r for r in REMAT_POLICIES if r in request.remats)
    if states_from is None:
        states = {
            **_state_terms(request, profiles, base),
            "pair_memory": _pair_memory(request, communication["refresh"]),
        }
    else:
        states = {name: getattr(states_from, name) for name in _STATE_FIELDS}
    return Terms(
        request=request,
        placements=tuple(qs),
        profiles=profiles.profiles,
        profile_of=profiles.profile_of,
        possible=frozenset(profiles.holder),
        batchings=tuple(request.batchings()),
        remats=remats,
        **communication,
        **states,
        **batching_terms(request, remats),
        memory_limit=request.cluster.memory_limit,
    )
