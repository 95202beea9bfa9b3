"""The planner's entry points: `choose` (the fastest `Plan` that fits) and `price_alternatives` (that
plan beside the presets, each priced: the table `amsp-jax plan` prints)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any

import numpy as np

from amsp_jax.core.plan import Plan, Precision
from amsp_jax.core.schedule import Implementation
from amsp_jax.core.space import Cluster, Strategy, resolve
from amsp_jax.cost import ModelDims, timing
from amsp_jax.cost.hardware import ClusterConfig
from amsp_jax.cost.trace import ModelSpec, trace
from amsp_jax.planner.ilp import solve
from amsp_jax.planner.priced import PricedPlan, best_batching, nothing_fits, price, price_presets
from amsp_jax.planner.request import PlanError, Request, implementations, make_request, tensor_options
from amsp_jax.planner.terms import Terms, batching_terms, build_terms, issued_otherwise


def fastest(request: Request, terms: Terms | None = None) -> PricedPlan:
    """The ILP's choice for `request`, priced by the full models; PlanError when nothing fits.

    The tensor degree with sequence parallelism on or off (`tensor_options`) and the implementation
    choices (`implementations`) are an outer enumeration: one ILP per choice, the fastest wins.
    `terms` (built for `request` as given) skips that enumeration.
    """
    start = time.perf_counter()
    best = min(solved_options(request, terms, prune=True), key=lambda row: row.estimate.time.step_s)
    return dataclasses.replace(best, solve_time_s=time.perf_counter() - start)


def _lower_bound(option: Request) -> float:
    """Seconds no plan of `option` beats: its fastest batching's compute and tensor collectives."""
    return min(
        timing.compute_times(option.workload(b, m, r), option.cluster).serial
        for (b, m), r in itertools.product(option.batchings(), option.remats)
    )


def fused_terms(gather: Terms, fused: Request) -> Terms:
    """The terms of `fused` (the ring or cannon form) from those of the same request in the gather
    form with sequence parallelism: the placements' terms are the same, so only the terms of each
    batching (the tensor transfers' time in its compute, the activations' peaks) are built again."""
    built: dict[str, Any] = batching_terms(fused, gather.remats)
    return dataclasses.replace(gather, request=fused, **built)


def solved_options(
    request: Request,
    terms: Terms | None = None,
    prune: bool = False,
    built_for: Terms | None = None,
    per_degree: bool = False,
) -> list[PricedPlan]:
    """The ILP's choice for each option of the outer enumeration (`fastest`), priced by the full
    models; options where nothing fits are left out, and PlanError when that is all of them.
    `prune`: skip an option whose compute alone (`_lower_bound`) is no faster than the best found, or
    with `per_degree` the best found at its tensor degree (so the best at each degree is still found).
    `built_for`: terms already built for one of the options (its request), used for it."""
    start = time.perf_counter()
    options = [(request, terms)] if terms is not None else [
        (dataclasses.replace(at, implementation=i), None)
        for at in tensor_options(request)
        for i in implementations(at)
    ]  # fmt: skip
    found: list[PricedPlan] = []
    tried: list[Terms] = []
    gather: dict[tuple[int, Implementation], Terms] = {}  # sequence-parallel gather form's, per (t, impl.)
    for option, given in options:
        rivals = (row for row in found if not per_degree or row.strategy.tensor == option.tensor)
        fastest_yet = min((row.estimate.time.step_s for row in rivals), default=float("inf"))
        if prune and given is None and _lower_bound(option) >= fastest_yet:
            continue
        key = (option.tensor, option.implementation)
        if given is None and option.tensor_matmul != "gather" and key in gather:
            built = fused_terms(gather[key], option)
        elif given is None and built_for is not None and built_for.request == option:
            built = built_for
        else:
            twin = next((t for t in tried if issued_otherwise(t.request, option)), None)
            built = given or build_terms(option, states_from=twin)
        if option.sequence_parallel and option.tensor_matmul == "gather":
            gather[key] = built
        tried.append(built)
        solution = solve(built)
        if solution is None:
            continue
        c = solution.candidate
        elapsed = time.perf_counter() - start
        found.append(price(option, c.strategy, c.micro_batch_size, c.remat, solve_time_s=elapsed))
    if not found:
        raise nothing_fits(tried[0])
    return found


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
    optimizer: str = "adam",
) -> Plan:
    """The fastest `Plan` that fits, for a Flax model (linen, or nnx behind `NnxModel`) as written.

    `model` is traced (`amsp_jax.cost.trace.trace`, with `layers` and `dims`) unless it already is a
    `ModelSpec` (e.g. `amsp_jax.models.llama.llama_spec`). `example_inputs` are what the model's
    `init` takes; the first array's second dimension is the sequence length. `global_batch` counts
    sequences per optimizer step. `cluster` is a `ClusterConfig`, a cluster YAML or shipped name, or a
    `Cluster` (hardware from its name's config, else this host's profile, `cost.host_profile`); `nodes`
    overrides its node count.
    `micro_batch_size` and `remat` fix those knobs instead of searching them; `optimizer` (adam,
    adafactor or muon) prices its update's collectives. `keep_first_layer`: plans with micro-batches
    keep each `LayerStack`'s first layer gathered (`Plan.keep_first_layer`), its memory counted.
    Raises `PlanError` when nothing fits, saying what the smallest plan needs and what would fit.
    """
    shapes = [np.shape(x) for x in example_inputs if len(np.shape(x)) >= 2]
    if not shapes:
        raise PlanError("example_inputs need a (batch, sequence, ...) array to read the sequence length from")
    spec = model if isinstance(model, ModelSpec) else trace(model, example_inputs, layers, dims)
    request = make_request(
        spec, cluster, nodes, seq_len=shapes[0][1], global_batch=global_batch, precision=precision,
        micro_batch_size=micro_batch_size, remat=remat, optimizer=optimizer,
        keep_first_layer=keep_first_layer,
    )  # fmt: skip
    return fastest(request).to_plan(request.cluster.cluster(), request.precision)


@dataclasses.dataclass(frozen=True)
class Alternatives:
    """The chosen (or given) plan beside the best plan at each other tensor degree and every preset,
    each priced by the full models."""

    request: Request
    chosen: PricedPlan
    presets: tuple[PricedPlan, ...]
    solve_time_s: float  # building the terms and solving (or pricing the given strategy)
    by_tensor: tuple[PricedPlan, ...] = ()  # the fastest plan at each other tensor degree searched

    @property
    def rows(self) -> tuple[PricedPlan, ...]:
        """The chosen plan first, then the best at each tensor degree, then the presets."""
        return (self.chosen, *self.by_tensor, *self.presets)


def _fastest_per_tensor_degree(rows: list[PricedPlan]) -> dict[int, PricedPlan]:
    best: dict[int, PricedPlan] = {}
    for row in rows:
        t = row.strategy.tensor
        if t not in best or row.estimate.time.step_s < best[t].estimate.time.step_s:
            best[t] = row
    return best


def price_alternatives(request: Request, strategy: Strategy | str | None = None) -> Alternatives:
    """The fastest plan for `request` beside the best at each other tensor degree searched (named
    `t=<degree>`; degrees where nothing fits are left out), or `strategy` (a `Strategy` or preset name or
    string) at its best batching and remat; then the presets at theirs. PlanError when nothing fits."""
    start = time.perf_counter()
    flat = dataclasses.replace(request, tensor=1, sequence_parallel=True)
    terms = build_terms(flat)
    per_degree: dict[int, PricedPlan] = {}
    if strategy is None:
        options = solved_options(request, prune=True, built_for=terms, per_degree=True)
        per_degree = _fastest_per_tensor_degree(options)
        chosen = min(per_degree.values(), key=lambda row: row.estimate.time.step_s)
    else:
        if not isinstance(strategy, Strategy):
            strategy = resolve(strategy, request.cluster.cluster())
        at = dataclasses.replace(request, tensor=strategy.tensor)
        best = best_batching(terms if strategy.tensor == 1 else build_terms(at), strategy)
        chosen = price(at, strategy, best.micro_batch_size, best.remat)
    solve_time = time.perf_counter() - start
    by_tensor = tuple(
        dataclasses.replace(row, name=f"t={t}")
        for t, row in sorted(per_degree.items())
        if t != chosen.strategy.tensor
    )
    chosen = dataclasses.replace(chosen, solve_time_s=solve_time)
    return Alternatives(request, chosen, tuple(price_presets(terms)), solve_time, by_tensor)
