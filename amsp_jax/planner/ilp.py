"""The ILP over the decomposed model (pulp, HiGHS), and the enumeration it is checked against.

The planner builds the *decomposed* time and memory model (`amsp_jax.planner.terms.Terms`), solves an
ILP over it, and re-evaluates the winner with the full cost and time models (`amsp_jax.cost`,
`amsp_jax.cost.timing`; `amsp_jax.planner.priced`).

Why the decomposition is exact. Under the whole-node rule every component's collectives run over
one intra-node run of `intra` devices and one inter-node run of `inter` nodes, so each phase's bytes
depend only on the placements of the components it moves between — except for one coupling: how a
leaf is split (one dimension, two, or padded: `sharding.leaf_layout`) is set by the largest group.
The set of leaves split at all is the smallest of the three components' *profiles* (the leaves their
own degree would split: every leaf with a dimension, for any degree above 1). Padding is priced at
the degree of the probe each term is read from, not the largest group's: where a leaf pads (no
dimension or pair of dimensions divides), the decomposed time and memory are off by that padding's
share of the bytes; `price` prices a plan by the full model. With π the profile, the step is

    P terms (p, π)     forward gathers, backward re-gathers, other-leaf gathers; P and gathered memory
    G terms (g, π)     per-micro-batch reduce-scatters; G memory (with an accumulator, once more beside it)
    OS terms (o, π)    master and moments memory (master again in the update's peak); update time
    pair (g, o, π)     the once-per-step reduction onto OS
    pair (p, o, π)     the P refresh from the new master
    (b, r)             compute, activations; the per-micro-batch terms scale with M = n / b
    (g, π, b)          the passes over the micro-batches' accumulator (G's block, M times)

and `timing.combine` turns them into a step time with max(0, ·) per overlap window. The ILP has one
binary per (component, placement), per micro-batch size and per remat policy, one per profile, and
continuous product variables z for (component, placement, profile), (G, OS, profile),
(P, OS, profile), (G, profile, b) and (b, r) tied to the binaries by assignment constraints (exact for one-hot
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
from collections.abc import Iterable

import pulp

from amsp_jax.core.schedule import accumulates, params_from_master
from amsp_jax.core.space import Strategy
from amsp_jax.cost import timing
from amsp_jax.planner.request import GIB
from amsp_jax.planner.terms import Candidate, Terms, candidates, nested

COMPONENTS = ("P", "G", "OS")

Expression = pulp.LpAffineExpression


@dataclasses.dataclass(frozen=True)
class Solution:
    """The optimum of the decomposed model: the candidate, its step time and memory, and how long it took."""

    candidate: Candidate
    step_s: float
    memory_bytes: float
    solve_time_s: float
    objective_s: float | None = None


def brute_force(terms: Terms) -> Solution | None:
    """The fastest candidate that fits, by enumerating every valid combination of the decomposed model."""
    start = time.perf_counter()
    best: tuple[float, Candidate, float] | None = None
    for candidate in candidates(terms):
        mem = terms.memory(candidate)
        if mem > terms.memory_limit:
            continue
        step = terms.step_time(candidate).step_s
        if best is None or step < best[0]:
            best = (step, candidate, mem)
    if best is None:
        return None
    return Solution(best[1], best[0], best[2], time.perf_counter() - start)


@functools.cache
def _quiet_highs() -> None:
    """Build one HiGHS instance with the process's stdout pointed at /dev/null: highspy 1.16 prints a
    banner to the C stdout on the first one a process builds, whatever its options say, which would
    corrupt `amsp-jax plan --json`; later ones print nothing."""
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
    """HiGHS, exact (no optimality gap), through highspy: pulp 3 and pulp 4 both run it in process
    (pulp 4 no longer bundles CBC)."""
    _quiet_highs()
    return pulp.HiGHS(msg=False, gapRel=0, gapAbs=0)


def _optimal(solved: object) -> bool:
    """Whether `LpProblem.solve`'s answer is a proven optimum: pulp 3 answers a status code (1:
    optimal), pulp 4 a record holding one."""
    return int(getattr(solved, "status", solved)) == 1


def _total(items: Iterable[Expression | pulp.LpVariable]) -> Expression:
    return pulp.lpSum(list(items))


class _Problem:
    """The ILP's variables and constraints over one `Terms`, built in the order the module derives them."""

    def __init__(self, terms: Terms):
        self.terms = terms
        self.qs, self.pis = terms.placements, range(len(terms.profiles))
        self.micro = dict(terms.batchings)
        self.prob = pulp.LpProblem("amsp_plan", pulp.LpMinimize)
        add = self.prob.add_variable
        self.x = {(c, q): add(f"x_{c}_{q}", cat="Binary") for c in COMPONENTS for q in self.qs}
        self.u = {pi: add(f"u_{pi}", cat="Binary") for pi in self.pis}
        self.mb = {b: add(f"m_{b}", cat="Binary") for b, _ in terms.batchings}
        self.rho = {r: add(f"r_{r}", cat="Binary") for r in terms.remats}
        self.z = {(c, q, pi): self.product(f"z_{c}_{q}_{pi}") for c in COMPONENTS for q, pi in terms.possible}
        self.z_red = {k: self.product(f"zr_{k[0]}_{k[1]}_{k[2]}") for k in terms.reduction}
        self.z_ref = {k: self.product(f"zf_{k[0]}_{k[1]}_{k[2]}") for k in terms.refresh}
        pairs = itertools.product(terms.batchings, terms.remats)
        self.w = {(b, r): self.product(f"w_{b}_{r}") for (b, _), r in pairs}
        # A P on OS's placement is not stored (`schedule.params_from_master`): the pair variable of the
        # refresh from OS onto the same placement takes its bytes and passes off.
        self.from_master = {
            (a, o, pi): v for (a, o, pi), v in self.z_ref.items() if params_from_master(Strategy(a, a, o))
        }

    def product(self, name: str) -> pulp.LpVariable:
        """A continuous variable in [0, 1] standing for a product of binaries."""
        return self.prob.add_variable(name, lowBound=0, upBound=1)

    def assign(self) -> None:
        """One placement per component, one batching and remat, the products tied to them, valid nesting
        and the profile of the largest group."""
        prob, x, u, z, terms, qs, pis = self.prob, self.x, self.u, self.z, self.terms, self.qs, self.pis
        for c in COMPONENTS:
            prob += _total(x[(c, q)] for q in qs) == 1
            for q in qs:
                prob += _total(z[(c, q, pi)] for pi in pis if (q, pi) in terms.possible) == x[(c, q)]
            for pi in pis:
                prob += _total(z[(c, q, pi)] for q in qs if (q, pi) in terms.possible) == u[pi]
        prob += _total(self.mb.values()) == 1
        prob += _total(self.rho.values()) == 1
        for b, _ in terms.batchings:
            prob += _total(self.w[(b, r)] for r in terms.remats) == self.mb[b]
        for r in terms.remats:
            prob += _total(self.w[(b, r)] for b, _ in terms.batchings) == self.rho[r]
        # Pair variables exist only for nested pairs, so these also forbid non-nested G/OS and P/OS.
        for first, table in (("G", self.z_red), ("P", self.z_ref)):
            for q in qs:
                prob += _total(v for (a, _, _), v in table.items() if a == q) == x[(first, q)]
                prob += _total(v for (_, o, _), v in table.items() if o == q) == x[("OS", q)]
            for pi in pis:
                prob += _total(v for (_, _, k), v in table.items() if k == pi) == u[pi]
        for a, b in itertools.product(qs, qs):
            if not nested(a, b):
                prob += x[("P", a)] + x[("G", b)] <= 1
        # π is the profile of the largest group: every component splits at least π, one exactly π.
        profile_sets = [terms.profiles[terms.profile_of[q]] for q in qs]
        for pi in pis:
            for c in COMPONENTS:
                prob += u[pi] <= _total(
                    x[(c, q)] for q, s in zip(qs, profile_sets, strict=True) if s >= terms.profiles[pi]
                )
            prob += u[pi] <= _total(x[(c, q)] for c in COMPONENTS for q in qs if terms.profile_of[q] == pi)

    def held(self) -> Expression:
        """GiB held all step: the stored P (none where it is the master), and OS."""
        terms, z = self.terms, self.z
        held = _total(terms.p_memory[k] / GIB * z[("P", *k)] for k in terms.possible)
        held -= _total(terms.p_memory[(a, pi)] / GIB * v for (a, _, pi), v in self.from_master.items())
        held += _total(terms.os_memory[k] / GIB * z[("OS", *k)] for k in terms.possible)
        return held

    def schedule_memory(self) -> tuple[Expression, Expression, Expression]:
        """GiB of G, and the loss and backward peaks' gathered and accumulated terms, by the schedule's
        rules as products of binaries: with an accumulator G is in fp32 and one micro-batch's gradient
        sits beside it, and the other leaves stay gathered through the backward; the prefetch loop holds
        two more gathered layers and the other leaves for the (batching, remat) pairs that run it."""
        terms, z, prob = self.terms, self.z, self.prob
        no_accumulator = _total(self.mb[b] for b, m in terms.batchings if not accumulates(m))
        prefetching = _total(
            self.w[(b, r)] for (b, r) in self.w if terms.request.prefetches(self.micro[b], r)
        )
        grads, loss, backward = pulp.lpSum([]), pulp.lpSum([]), pulp.lpSum([])
        for q, pi in terms.possible:
            single, fp32 = terms.g_memory[(q, pi, False)], terms.g_memory[(q, pi, True)]
            other_single = terms.g_other_memory[(q, pi, False)]
            other_fp32 = terms.g_other_memory[(q, pi, True)]
            accumulator = self.product(f"acc_{q}_{pi}")
            prob += accumulator >= z[("G", q, pi)] - no_accumulator
            grads += single / GIB * z[("G", q, pi)] + (fp32 - single) / GIB * accumulator
            loss += other_fp32 / GIB * accumulator
            backward += -other_single / GIB * z[("G", q, pi)]
            backward += (fp32 - other_fp32 + other_single) / GIB * accumulator
            loss += terms.p_other_memory[(q, pi)] / GIB * z[("P", q, pi)]
            backward += terms.p_layer_memory[(q, pi)] / GIB * z[("P", q, pi)]
            other, lookup = terms.p_other_memory[(q, pi)], terms.p_lookup_memory[(q, pi)]
            if other or lookup:
                kept = self.product(f"ko_{q}_{pi}")
                prob += kept >= z[("P", q, pi)] - no_accumulator
                prob += kept >= z[("P", q, pi)] + prefetching - 1  # never both: the loop needs M = 1
                loss += lookup / GIB * kept
                backward += (other + lookup) / GIB * kept
            if terms.p_layer_memory[(q, pi)]:
                ahead = self.product(f"pf_{q}_{pi}")
                prob += ahead >= z[("P", q, pi)] + prefetching - 1
                backward += 2 * terms.p_layer_memory[(q, pi)] / GIB * ahead
        return grads, loss, backward

    def fit_memory(self) -> None:
        """One expression per peak of `cost.Memory`, in GiB (for the solver's tolerances), under the limit."""
        terms, w = self.terms, self.w
        held = self.held()
        grads, loss, backward = self.schedule_memory()
        start = _total(terms.p_start_memory[k] / GIB * self.z[("P", *k)] for k in terms.possible)
        peaks = {
            "start": held + grads + start
            + _total(terms.activation_peaks[k]["start"] / GIB * w[k] for k in w),
            "loss": held + grads + loss + _total(terms.activation_peaks[k]["loss"] / GIB * w[k] for k in w),
            "backward": held + grads + backward
            + _total(terms.activation_peaks[k]["backward"] / GIB * w[k] for k in w),
            "update": held
            + grads
            + _total(terms.os_update_memory[k] / GIB * self.z[("OS", *k)] for k in terms.possible),
            "refresh": held,
        }  # fmt: skip
        for name in peaks:
            peaks[name] += _total(terms.pair_memory[k][name] / GIB * v for k, v in self.z_ref.items())
        if math.isfinite(terms.memory_limit):
            for expression in peaks.values():
                self.prob += expression <= terms.memory_limit / GIB

    def update_time(self) -> Expression:
        """Seconds of the optimizer update's collectives: the term of (OS placement, largest group),
        through y_t (t is the largest group of the three components) and products x_OS,o · y_t."""
        priced = {k: v for k, v in self.terms.update.items() if v}
        if not priced:
            return pulp.lpSum([])
        prob, x, qs = self.prob, self.x, self.qs
        y = {q: prob.add_variable(f"top_{q}", cat="Binary") for q in qs}
        prob += _total(y.values()) == 1
        for q in qs:
            larger = _total(x[(c, r)] for c in COMPONENTS for r in qs if r.degree > q.degree)
            for c in COMPONENTS:
                prob += y[q] >= x[(c, q)] - larger
        both = {(o, t): self.product(f"wu_{o}_{t}") for o, t in priced}
        for (o, t), v in both.items():
            prob += v >= x[("OS", o)] + y[t] - 1
        return _total(priced[k] * v for k, v in both.items())

    def exposed_windows(self, scale: float) -> dict[str, pulp.LpVariable]:
        """One exposed-time variable per overlap window, bounded below by both arms of `timing.exposed`
        (exact at the optimum, where it sits on the larger one)."""
        terms, z, w, prob = self.terms, self.z, self.w, self.prob
        exposed = {
            name: prob.add_variable(f"e_{name.replace(' ', '_')}", lowBound=0) for name in timing.WINDOWS
        }
        hardware = terms.request.cluster
        # Where collectives cannot overlap compute, every window exposes all of its communication.
        kappa = hardware.overlap_interference if hardware.overlap_enabled else 1.0
        step_level = {
            "step start": (
                _total(terms.p_time[k][timing.OTHER_GATHER] * z[("P", *k)] for k in terms.possible)
                + _total(t * self.z_ref[k] for k, t in terms.refresh.items()),
                _total(terms.compute[k].first_forward * w[k] for k in w),
            ),
            "reduction": (
                _total(t * self.z_red[k] for k, t in terms.reduction.items()),
                _total(hardware.reduction_overlap * terms.compute[k].last_backward * w[k] for k in w),
            ),
            "optimizer update": (self.update_time(), pulp.lpSum([])),
        }
        for name, (comm, hide) in step_level.items():
            prob += exposed[name] >= scale * (comm - hide)
            prob += exposed[name] >= scale * kappa * comm
        for (b, r), wk in w.items():
            self.per_micro_batch_windows(exposed, scale, kappa, b, r, wk)
        return exposed

    def per_micro_batch_windows(
        self, exposed: dict[str, pulp.LpVariable], scale: float, kappa: float, b: int, r: str, wk: object
    ) -> None:
        """The windows that scale with M = n / b: one big-M pair of bounds per (b, r)."""
        terms, prob = self.terms, self.prob
        tables = {"P": terms.p_time, "G": terms.g_time}
        compute = terms.compute[(b, r)]
        per_micro_batch = {
            "forward": ([(timing.FORWARD_GATHER, "P")], compute.forward_layers),
            "backward": (
                ([(timing.BACKWARD_GATHER, "P")] if r != "none" else []) + [(timing.LAYER_GRADS, "G")],
                compute.backward_layers,
            ),
            "other leaves": ([(timing.OTHER_GRADS, "G")], compute.forward_other + compute.backward_other),
        }
        m = self.micro[b]
        for name, (groups, hide) in per_micro_batch.items():
            comm = _total(
                m * tables[c][(q, pi)][group] * self.z[(c, q, pi)]
                for group, c in groups
                for q, pi in terms.possible
            )
            most = sum(m * max(tables[c][k][group] for k in terms.possible) for group, c in groups)
            if most - hide > 0:
                prob += exposed[name] >= scale * (comm - hide - (most - hide) * (1 - wk))
            if kappa * most > 0:
                prob += exposed[name] >= scale * kappa * (comm - most * (1 - wk))

    def minimise_step_time(self) -> float:
        """The objective: compute, memory passes and exposed communication; returns its time scale.

        Times enter in units of 1e-4 of the longest compute, so HiGHS's absolute tolerances (1e-7 on
        constraints, 1e-6 on integrality; the optimality gap is set to 0) stay far below the
        differences between plans that the tests compare (1e-6 relative).
        """
        terms, z, w = self.terms, self.z, self.w
        scale = 1e4 / max(c.total for c in terms.compute.values())
        exposed = self.exposed_windows(scale)
        self.prob += (
            scale * _total(terms.compute[k].serial * w[k] for k in w)
            + scale * _total(terms.passes[(c, *k)] * z[(c, *k)] for c in COMPONENTS for k in terms.possible)
            # A P that is the master (no stored block) has no passes of its own.
            - scale * _total(terms.passes[("P", a, pi)] * v for (a, _, pi), v in self.from_master.items())
            + scale * _total(terms.fixed_passes[k] * w[k] for k in w)
            + scale * self.accumulator_time()
            + _total(exposed.values())
        )
        return scale

    def accumulator_time(self) -> Expression:
        """Seconds of the passes over the micro-batches' accumulator, which depend on G's placement and
        the micro-batch count together: products z_G · m_b (exact at the optimum, where each sits on
        its lower bound)."""
        prob, found = self.prob, pulp.lpSum([])
        for (q, pi, b), seconds in self.terms.accumulator_passes.items():
            if seconds and (q, pi) in self.terms.possible:
                both = self.product(f"za_{q}_{pi}_{b}")
                prob += both >= self.z[("G", q, pi)] + self.mb[b] - 1
                found += seconds * both
        return found

    def pin(self, fixed: Candidate) -> None:
        """Every binary set to `fixed`, so that the objective can be checked against the model."""
        s = fixed.strategy
        for c, q in zip(COMPONENTS, (s.params, s.grads, s.opt_state), strict=True):
            self.prob += self.x[(c, q)] == 1
        self.prob += self.mb[fixed.micro_batch_size] == 1
        self.prob += self.rho[fixed.remat] == 1

    def chosen(self) -> Candidate:
        """The candidate the solved binaries select."""

        def pick(variables: dict) -> object:
            return max(variables, key=lambda key: variables[key].value() or 0.0)

        picked = (pick({q: self.x[(c, q)] for q in self.qs}) for c in COMPONENTS)
        strategy = self.terms.request.strategy(*picked)
        return Candidate(strategy, pick(self.mb), pick(self.rho))


def solve(terms: Terms, fixed: Candidate | None = None) -> Solution | None:
    """The fastest candidate that fits, by the ILP over the decomposed model (None when nothing fits).

    `fixed` pins every binary to one candidate, so the ILP's objective can be checked against the model.
    """
    start = time.perf_counter()
    problem = _Problem(terms)
    problem.assign()
    problem.fit_memory()
    scale = problem.minimise_step_time()
    if fixed is not None:
        problem.pin(fixed)
    if not _optimal(problem.prob.solve(_highs())):
        return None
    candidate = problem.chosen()
    return Solution(
        candidate,
        terms.step_time(candidate).step_s,
        terms.memory(candidate),
        time.perf_counter() - start,
        pulp.value(problem.prob.objective) / scale,
    )
