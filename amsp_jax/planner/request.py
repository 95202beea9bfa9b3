"""What is asked of the planner: a model's description on a cluster, the step's batch, the memory limit
(the cluster's), and which knobs to search."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amsp_jax.core.backend import selects_in_place
from amsp_jax.core.plan import REMAT_POLICIES, Precision
from amsp_jax.core.schedule import Implementation, uses_prefetch
from amsp_jax.core.space import Cluster, Placement, Strategy
from amsp_jax.core.tensor import CANNON_DEGREE, MATMUL_FORMS
from amsp_jax.cost import Workload, host_profile, looped_blocks
from amsp_jax.cost import optimizer as optimizer_cost
from amsp_jax.cost.hardware import ClusterConfig, for_cluster
from amsp_jax.cost.hardware import load as load_cluster
from amsp_jax.cost.trace import ModelSpec
from amsp_jax.errors import AmspError

GIB = 2**30


class PlanError(AmspError):
    """A request no plan can serve: nothing fits, or the batch does not divide over the devices."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What to plan: a model on a cluster, with the step's sequence length, batch and the knobs to search."""

    model: ModelSpec
    cluster: ClusterConfig
    seq_len: int
    global_batch_tokens: int
    precision: Precision = dataclasses.field(default_factory=Precision)
    micro_batch_sizes: tuple[int, ...] | None = None
    remats: tuple[str, ...] = REMAT_POLICIES
    implementation: Implementation = dataclasses.field(default_factory=Implementation)
    optimizer: str = "adam"  # adam (any element-wise optimizer), adafactor or muon
    # The tensor degree and sequence parallelism this request's terms are built for, and the degrees
    # the search tries (None: every one the model and the node allow, `tensor_options`).
    tensor: int = 1
    sequence_parallel: bool = True
    tensor_matmul: str = "gather"
    tensor_degrees: tuple[int, ...] | None = (1,)

    @property
    def devices(self) -> int:
        """Devices of the cluster."""
        return self.cluster.nodes * self.cluster.devices_per_node

    @property
    def data_devices(self) -> int:
        """Data-parallel ranks: the devices over the tensor degree."""
        return self.devices // self.tensor

    def data_cluster(self) -> Cluster:
        """The cluster the P/G/OS placements range over: each node's devices over the tensor degree."""
        return self.strategy(Placement(), Placement(), Placement()).data_parallel(self.cluster.cluster())

    def strategy(self, params: Placement, grads: Placement, opt_state: Placement) -> Strategy:
        """A strategy of these placements at this request's tensor degree."""
        return Strategy(params, grads, opt_state, self.tensor)

    def sequences_per_device(self) -> int:
        """Sequences each data-parallel rank processes per step (a tensor group shares them); raises
        PlanError when the batch does not divide."""
        if self.global_batch_tokens % self.seq_len:
            raise PlanError(
                f"the global batch of {self.global_batch_tokens} tokens is not a whole number of "
                f"{self.seq_len}-token sequences"
            )
        sequences = self.global_batch_tokens // self.seq_len
        if sequences % self.data_devices:
            smallest = self.data_devices * self.seq_len
            raise PlanError(
                f"{sequences} sequences per step do not divide over {self.data_devices} data-parallel "
                "ranks (data parallelism gives each rank whole sequences); use a global batch that is a "
                f"multiple of {smallest} tokens, e.g. "
                f"{max(1, -(-self.global_batch_tokens // smallest)) * smallest}"
            )
        return sequences // self.data_devices

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
        w = self.model.workload(
            self.seq_len, micro_batch_size, micro_batches, self.precision, remat, self.tensor,
            self.sequence_parallel, self.tensor_matmul,
        )  # fmt: skip
        return w.with_(
            min_collective_itemsize=self.cluster.collective_min_itemsize,
            update_in_place=selects_in_place(self.cluster.platform),
            platform=self.cluster.platform,
            implementation=self.implementation,
            optimizer=_update_rules(
                tuple((leaf.path, leaf.shape) for leaf in w.leaves),
                self.optimizer,
                self.model.muon_dimensions,
            ),
        )

    def prefetches(self, micro_batches: int, remat: str) -> bool:
        """Whether the step runs the explicit-prefetch loop for this batching and remat."""
        if not self.model.prefetchable:
            return False  # blocks run by a scan (nn.scan, nnx.scan) gather in the loop, no prefetch
        stack = not looped_blocks(self.model.leaves)
        return uses_prefetch(micro_batches, remat, self.model.n_layers, self.implementation.prefetch, stack)


@functools.cache
def _update_rules(
    leaves: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...],
    kind: str,
    muon_dimensions: Callable[[Any], Any] | None,
) -> optimizer_cost.OptimizerUpdate:
    """What `kind`'s update communicates on these leaves (cached: reading optax's state takes a trace)."""
    return optimizer_cost.for_kind(kind, dict(leaves), muon_dimensions)


def hardware_of(cluster: ClusterConfig | Cluster | str | Path, nodes: int | None = None) -> ClusterConfig:
    """A cluster's hardware: a config as is, a YAML or shipped name loaded, `host` this host's profile
    (`cost.host_profile`), a bare `Cluster` by its name (`cost.hardware.for_cluster`); `nodes`
    overrides the node count."""
    if isinstance(cluster, Cluster):
        hardware = for_cluster(cluster)
    elif isinstance(cluster, ClusterConfig):
        hardware = cluster
    elif str(cluster) == host_profile.HOST:
        # This host's CPU mesh of `nodes` x 4 devices, as many as the CLI gives the CPU platform.
        return host_profile.load(nodes or 2, 4)
    else:
        hardware = load_cluster(cluster)
    return hardware if nodes is None else hardware.with_shape(nodes)


def make_request(
    model: ModelSpec,
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
    tensor_degrees: tuple[int, ...] | None = None,
) -> Request:
    """A `Request` for a model's description on a cluster; the batch in tokens or sequences.

    `model` is a `ModelSpec`: traced from a Flax model (`amsp_jax.cost.trace.trace`) or written by the
    model (`amsp_jax.models.llama.llama_spec`). `cluster` is a `ClusterConfig`, a cluster YAML or
    shipped name, or a bare `Cluster` (`hardware_of`); `nodes` overrides its node count.
    `micro_batch_size` and `remat` fix those knobs instead of searching them; `optimizer` (adam,
    adafactor or muon) adds the collectives its update needs on sharded leaves. `keep_first_layer`:
    plans with micro-batches keep it (`amsp_jax.core.schedule.keeps_first_layer`). `tensor_degrees`:
    the tensor degrees to search (None: every one the model and the node allow, `tensor_options`).
    """
    if not isinstance(model, ModelSpec):
        raise PlanError(
            f"the planner takes a ModelSpec, got {type(model).__name__}; trace a Flax model with "
            "amsp_jax.cost.trace.trace, or describe a LLaMA with amsp_jax.models.llama.llama_spec"
        )
    if (global_batch_tokens is None) == (global_batch is None):
        raise PlanError("give the global batch either in tokens (global_batch_tokens) or in sequences")
    tokens = global_batch_tokens if global_batch_tokens is not None else global_batch * seq_len
    if remat is not None and remat not in REMAT_POLICIES:
        raise PlanError(f"unknown remat policy {remat!r}; use one of {REMAT_POLICIES}")
    if optimizer not in optimizer_cost.KINDS:
        raise PlanError(f"unknown optimizer {optimizer!r}; use one of {optimizer_cost.KINDS}")
    return Request(
        model=model,
        cluster=hardware_of(cluster, nodes),
        seq_len=seq_len,
        global_batch_tokens=tokens,
        precision=Precision.named(precision) if isinstance(precision, str) else precision,
        micro_batch_sizes=None if micro_batch_size is None else (micro_batch_size,),
        remats=REMAT_POLICIES if remat is None else (remat,),
        optimizer=optimizer,
        implementation=Implementation(keep_first_layer=keep_first_layer),
        tensor_degrees=tensor_degrees,
    )


def tensor_problem(request: Request, tensor: int) -> str | None:
    """Why `request`'s model cannot run at tensor degree `tensor` on its cluster, or None."""
    if tensor == 1:
        return None
    r = request.cluster.devices_per_node
    if r % tensor:
        return f"t={tensor} does not divide the {r} devices per node (a tensor group stays in one node)"
    if request.model.boundaries is None:
        return f"{request.model.name} does not describe its tensor-parallel boundaries (plan it at t=1)"
    for leaf in request.model.leaves:
        if leaf.tensor_dim is not None and leaf.shape[leaf.tensor_dim] % tensor:
            return (
                f"t={tensor} does not divide dimension {leaf.tensor_dim} ({leaf.shape[leaf.tensor_dim]}) "
                f"of {'/'.join(map(str, leaf.path))}"
            )
    try:
        dataclasses.replace(request, tensor=tensor).sequences_per_device()
    except PlanError as e:
        return str(e)
    return None


def tensor_options(request: Request) -> list[Request]:
    """`request` at every (tensor degree, sequence parallelism, matmul form) the search tries: the
    degrees asked for (`Request.tensor_degrees`; None: every divisor of the devices per node the model
    allows), each with sequence parallelism on (where t divides the sequence; in the `gather` and the
    `ring` form, and at t = 4 the `cannon` form) and off (`gather`). PlanError where a degree asked
    for by name cannot run."""
    named = request.tensor_degrees is not None
    r = request.cluster.devices_per_node
    degrees = request.tensor_degrees or tuple(t for t in range(1, r + 1) if r % t == 0)
    found = []
    for t in degrees:
        problem = tensor_problem(request, t)
        if problem is not None:
            if named:
                raise PlanError(f"cannot plan tensor degree {t}: {problem}")
            continue
        forms = [(True, "gather")]
        if t > 1:
            fused = [form for form in MATMUL_FORMS if form != "cannon" or t == CANNON_DEGREE]
            forms = [(True, form) for form in fused] if request.seq_len % t == 0 else []
            forms.append((False, "gather"))
        found += [
            dataclasses.replace(request, tensor=t, sequence_parallel=on, tensor_matmul=form)
            for on, form in forms
        ]
    return found


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
