"""The planner: the fastest P/G/OS placements, micro-batching and remat for a model on a cluster, by an
ILP that is exact against enumeration.

`choose` gives the `Plan`; `price_alternatives` prices it beside the presets (what `amsp-jax plan`
prints) for a `Request` from `make_request`. The steps: `request` (what is asked), `terms` (the priced
terms of the decomposed model), `ilp` (the problem over them), `priced` (plans priced by the full
models), `search` (the entry points). The planner reads a model only through its description
(`amsp_jax.cost.trace.ModelSpec`), never the model's code.
"""

from amsp_jax.planner.priced import PricedPlan
from amsp_jax.planner.request import PlanError, Request, make_request
from amsp_jax.planner.search import Alternatives, choose, price_alternatives

__all__ = [
    "Alternatives",
    "PlanError",
    "PricedPlan",
    "Request",
    "choose",
    "make_request",
    "price_alternatives",
]
