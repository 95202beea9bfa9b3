"""The JAX peer: plain `jax.jit` with FSDP or ZeRO-1 `NamedSharding`s, XLA inserting every collective.

This is what JAX users run today (MaxText's FSDP, and ZeRO-1 through `shard_optimizer_over_data`),
built for the same model, optax chain, micro-batching, mixed precision and remat as amsp_jax's step,
so that the two can be compared on one mesh:

- The state is the fp32 master and the optax state, both `NamedSharding`s: in `fsdp` and `zero1`
  mode alike every leaf is split along its largest divisible dimension (never a stacked-layer one)
  over all devices of a `nodes × devices_per_node` mesh.
- The step casts the master to the compute dtype. `fsdp` keeps that copy sharded and lets XLA gather
  each layer's weights inside the layer scan; `zero1` constrains it to be replicated (one all-gather
  per step, in the compute dtype, as MaxText's ZeRO-1 does).
- M micro-batches run in a `lax.scan` with an fp32 gradient accumulator on the parameters'
  sharding (MaxText's `gradient_accumulation_loss_and_grad` in auto shard mode): sharded for `fsdp`,
  replicated for `zero1`; the optimizer then runs on the sharded master.
- Each layer's weights are constrained to be whole where the layer uses them (`gathered`), and so
  are the other leaves where the loss uses them. MaxText gets the same data flow from its activation
  constraints (batch-sharded activations leave XLA no choice but to gather the weights); without any
  hint XLA partitions the matmuls of a small micro-batch along the weights instead (all-reduces and
  all-to-alls of activations: tensor parallelism, not FSDP). The gradient's placement is left to XLA.
- With a tensor degree t (`make_mesh(..., tensor=t)`, MaxText's `tensor` axis): the mesh gains a
  `tensor` axis of t consecutive devices of a node; a leaf whose logical names map to the tensor
  axis by `DEFAULT_TENSOR_RULES` (heads, mlp, vocab) is split there, and FSDP splits the rest over the
  data axes. The per-layer hint keeps the tensor split and gathers over the data axes only, so XLA
  partitions each matmul Megatron's way (no sequence parallelism: MaxText's `tensor` axis, not
  `tensor_sequence`).
- Remat: each layer of the model's `LayerStack` runs under `jax.checkpoint(nothing_saveable,
  prevent_cse=False)`, MaxText's setting for scanned layers (`prevent_cse=not scan_layers`). Both
  the per-layer hint and the checkpoint go through the stack's `LayerContext` hook, which wraps the
  scan body exactly where amsp_jax's step puts its gather and checkpoint; no amsp collective is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from amsp_jax.compiled import audit
from amsp_jax.core.mesh import ordered_devices, plan_axes
from amsp_jax.core.space import Cluster, ddp
from amsp_jax.core.tensor import TENSOR, tensor_dim
from amsp_jax.layers.stack import LayerContext, StackOps, layer_context, recording_stacks

MODES = ("fsdp", "zero1")
MESH_AXES = ("inter", "intra")  # the data-parallel axes; `tensor` (TENSOR) comes last where t > 1

Path = tuple[str, ...]
LossFn = Callable[[Any, Any], jax.Array]


@flax.struct.dataclass
class PeerState:
    """The baseline's state: step, fp32 master parameters and optax state (both sharded)."""

    step: jax.Array
    master: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class PeerShardings:
    """Where everything lives: the state, the batch, and (`compute`) the compute copy and the gradient
    accumulator, which share the parameters' sharding: the master's for FSDP, replicated for ZeRO-1."""

    mesh: Mesh
    state: PeerState
    compute: Any
    batch: NamedSharding


def make_mesh(cluster: Cluster, devices: Sequence[jax.Device] | None = None, tensor: int = 1) -> Mesh:
    """A `(nodes, devices_per_node)` mesh, node-major, so device position // devices_per_node is its node;
    with `tensor` > 1, `(nodes, devices_per_node / tensor, tensor)`: a tensor group is consecutive
    devices of one node."""
    devices = ordered_devices(devices)[: cluster.num_devices]
    if len(devices) != cluster.num_devices:
        raise ValueError(f"the cluster {cluster} needs {cluster.num_devices} devices, JAX has {len(devices)}")
    if tensor == 1:
        grid = np.array(devices, dtype=object).reshape(cluster.nodes, cluster.devices_per_node)
        return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    axes = (*MESH_AXES, TENSOR)
    shape = (cluster.nodes, cluster.devices_per_node // tensor, tensor)
    return Mesh(np.array(devices, dtype=object).reshape(shape), axes, axis_types=(AxisType.Auto,) * 3)


def fsdp_spec(shape: Sequence[int], stacked: bool, num_devices: int, tensor_dim: int | None = None) -> P:
    """Split along the largest dimension divisible by the (data-parallel) device count, over the data
    axes; a leaf with none stays whole (a `NamedSharding` must divide its dimension; MaxText's rule).
    `tensor_dim`: that dimension goes on the tensor axis instead, and is not the FSDP one."""
    first = 1 if stacked else 0
    divisible = [
        d for d in range(first, len(shape)) if shape[d] % num_devices == 0 and d != tensor_dim
    ]
    dim = max(divisible, key=lambda d: (shape[d], -d)) if divisible else None
    entries: list[Any] = [None] * len(shape)
    if dim is not None:
        entries[dim] = MESH_AXES
    if tensor_dim is not None:
        entries[tensor_dim] = TENSOR
    return P(*entries)


def tensor_dims(boxed: Any, stacks: tuple[Path, ...]) -> dict[Path, int | None]:
    """Each leaf's dimension on the tensor axis by its logical names and `DEFAULT_TENSOR_RULES` (a
    stacked leaf's names leave out its layer dimension)."""
    flat = traverse_util.flatten_dict(boxed, is_leaf=lambda _, x: isinstance(x, nn.meta.AxisMetadata))
    found = {}
    for path, leaf in flat.items():
        names = getattr(leaf, "names", None)
        stacked = any(path[: len(s)] == s for s in stacks)
        dim = tensor_dim(tuple(names)) if names is not None else None
        found[path] = None if dim is None else dim + int(stacked)
    return found


def gathered_spec(spec: P, stacked: bool) -> P:
    """`spec` gathered over the data axes, the tensor split kept (a stacked leaf's one layer: without
    its layer dimension)."""
    entries = [entry if entry == TENSOR else None for entry in spec]
    return P(*(entries[1:] if stacked else entries))


def _flatten(tree: Any) -> dict[Path, Any]:
    return traverse_util.flatten_dict(flax.core.unfreeze(tree))


def gathered(sharding: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    """Identity constraining its value to `sharding`; its gradient's placement is left to XLA."""

    @jax.custom_vjp
    def constrain(x: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, sharding)

    def forward(x: jax.Array) -> tuple[jax.Array, None]:
        return constrain(x), None

    def backward(_: None, cotangent: jax.Array) -> tuple[jax.Array]:
        # A constraint here too (what the plain constraint's transpose does) would force the whole
        # gradient onto every device, an all-reduce where a reduce-scatter will do.
        return (cotangent,)

    constrain.defvjp(forward, backward)
    return constrain


def _split_micro_batches(x: jax.Array, micro_batches: int) -> jax.Array:
    """(B, ...) → (M, B/M, ...), micro-batch m = rows i·M + m, so every device keeps its own rows."""
    split = x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:])
    return jnp.swapaxes(split, 0, 1)


def build_gspmd_step(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    mesh: Mesh,
    example_inputs: tuple[Any, ...],
    mode: str = "fsdp",
    micro_batches: int = 1,
    compute_dtype: str = "bfloat16",
    remat: bool = True,
) -> tuple[Callable[[jax.Array], PeerState], jax.stages.Wrapped, PeerShardings]:
    """`(init_fn(key) -> state, step_fn(state, batch) -> (state, metrics), shardings)` of the baseline.

    `loss_fn(params, micro_batch) -> mean loss`; `example_inputs` are `model.init`'s arguments after the
    key (shapes suffice); `step_fn` is jitted with its shardings and donates the state.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {MODES}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    dtype = jnp.dtype(compute_dtype)
    tensor = dict(mesh.shape).get(TENSOR, 1)
    if tensor > 1 and mode != "fsdp":
        raise ValueError(f"a tensor axis runs with mode 'fsdp' only, not {mode!r}")
    num_devices = mesh.devices.size // tensor

    with recording_stacks() as recorded:
        boxed = jax.eval_shape(lambda k: model.init(k, *example_inputs)["params"], jax.random.key(0))
    abstract = nn.meta.unbox(boxed)
    stacks = tuple(recorded)
    flat = _flatten(abstract)
    split = tensor_dims(boxed, stacks) if tensor > 1 else dict.fromkeys(flat)
    stacked = {path: any(path[: len(s)] == s for s in stacks) for path in flat}
    specs = {
        path: fsdp_spec(leaf.shape, stacked[path], num_devices, split[path]) for path, leaf in flat.items()
    }
    unflatten = traverse_util.unflatten_dict
    master_shardings = unflatten({p: NamedSharding(mesh, s) for p, s in specs.items()})
    replicated = NamedSharding(mesh, P())
    per_leaf = master_shardings if mode == "fsdp" else jax.tree.map(lambda _: replicated, master_shardings)

    abstract_master = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), abstract)
    opt_shardings = optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, abstract_master),
        master_shardings,
        transform_non_params=lambda _: replicated,
    )
    state_shardings = PeerState(step=replicated, master=master_shardings, opt_state=opt_shardings)
    batch_sharding = NamedSharding(mesh, P(MESH_AXES))
    shardings = PeerShardings(mesh, state_shardings, per_leaf, batch_sharding)

    layer_counts = {s: next(v.shape[0] for p, v in flat.items() if p[: len(s)] == s) for s in stacks}
    # Where each leaf is used: whole (t = 1), or gathered over the data axes with its tensor split kept.
    used = {p: gathered(NamedSharding(mesh, gathered_spec(spec, stacked[p]))) for p, spec in specs.items()}

    def stack_ops(stack: Path) -> StackOps:
        hints = unflatten({p[len(stack) :]: h for p, h in used.items() if p[: len(stack)] == stack})

        def whole_layer(layer_params: Any, _sink: Any = None) -> Any:
            return jax.tree.map(lambda hint, x: hint(x), hints, layer_params)

        # Plain scan, no prefetch: the hook only places the hint and the checkpoint in the scan body.
        return StackOps(gather_with_sink=whole_layer, gather=whole_layer, reduce=lambda grads: grads)

    ops = {stack: stack_ops(stack) for stack in stacks}

    def layer_context_() -> LayerContext:
        return LayerContext(
            stacks=ops,
            # The hook scans a per-layer "sink" beside the weights; the baseline has no use for one.
            sinks={s: jnp.zeros((n,), jnp.float32) for s, n in layer_counts.items()},
            remat_policy=jax.checkpoint_policies.nothing_saveable if remat else None,
            remat=remat,
        )

    def micro_loss(params: Any, micro_batch: Any) -> jax.Array:
        # Stacked leaves get the hint per layer, inside the scan; the others here, where the loss uses them.
        leaves = _flatten(params)
        hinted = {p: x if stacked[p] else used[p](x) for p, x in leaves.items()}
        with layer_context(layer_context_()):
            return loss_fn(unflatten(hinted), micro_batch).astype(jnp.float32)

    def init_fn(key: jax.Array) -> PeerState:
        def make(k: jax.Array) -> PeerState:
            params = nn.meta.unbox(model.init(k, *example_inputs))["params"]
            master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
            return PeerState(jnp.zeros((), jnp.int32), master, optimizer.init(master))

        return jax.jit(make, out_shardings=state_shardings)(key)

    def step(state: PeerState, batch: Any) -> tuple[PeerState, dict[str, jax.Array]]:
        compute = jax.tree.map(lambda x: x.astype(dtype), state.master)
        compute = jax.lax.with_sharding_constraint(compute, per_leaf)
        micro = jax.tree.map(lambda x: _split_micro_batches(x, micro_batches), batch)
        micro = jax.lax.with_sharding_constraint(micro, NamedSharding(mesh, P(None, MESH_AXES)))

        def micro_step(carry: tuple[Any, jax.Array], micro_batch: Any) -> tuple[tuple[Any, jax.Array], None]:
            accumulated, loss_sum = carry
            loss, grads = jax.value_and_grad(micro_loss)(compute, micro_batch)
            accumulated = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), accumulated, grads)
            accumulated = jax.lax.with_sharding_constraint(accumulated, per_leaf)
            return (accumulated, loss_sum + loss), None

        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), state.master)
        zeros = jax.lax.with_sharding_constraint(zeros, per_leaf)
        (accumulated, loss_sum), _ = jax.lax.scan(micro_step, (zeros, jnp.zeros((), jnp.float32)), micro)
        # Pins the loop carry too: else XLA may carry the accumulator on the master's sharding and
        # all-gather it in every micro-batch to add the replicated gradient.
        accumulated = jax.lax.with_sharding_constraint(accumulated, per_leaf)
        grads = jax.tree.map(lambda g: g / micro_batches, accumulated)
        grads = jax.lax.with_sharding_constraint(grads, master_shardings)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.master)
        master = optax.apply_updates(state.master, updates)
        metrics = {"loss": loss_sum / micro_batches, "grad_norm": optax.tree.norm(grads)}
        return PeerState(state.step + 1, master, opt_state), metrics

    step_fn = jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, {"loss": replicated, "grad_norm": replicated}),
        donate_argnums=0,
    )
    return init_fn, step_fn, shardings


# The claim: these amsp_jax presets move no more bytes per device than these GSPMD programs.
CLAIM_PAIRS = {"amsp-zero3": "gspmd-fsdp", "amsp-zero1": "gspmd-zero1"}


def measure_peer(compiled: jax.stages.Compiled, cluster: Cluster) -> audit.Measured:
    """`audit.measure` of a compiled baseline step on `make_mesh(cluster)` (device position → node)."""
    # The audit only needs the cluster's device → node map, which any strategy's axis plan carries.
    return audit.measure(compiled, plan_axes(cluster, ddp(cluster)))


def claim_violations(amsp: dict[str, int], peer: dict[str, int]) -> list[str]:
    """Where amsp_jax's `{intra, inter}` bytes per device exceed the peer's, inter-node and in total.

    Intra-node bytes alone are not compared: the peer's collectives span all devices of both nodes,
    so the audit counts all of their bytes as inter-node and the peer's intra-node count is zero by
    construction; amsp_jax's hierarchical collectives move most of the same bytes inside the node.
    """
    problems = []
    if amsp["inter"] > peer["inter"]:
        problems.append(f"inter-node {amsp['inter']:,} B > {peer['inter']:,} B")
    if amsp["intra"] + amsp["inter"] > peer["intra"] + peer["inter"]:
        problems.append(f"total {amsp['intra'] + amsp['inter']:,} B > {peer['intra'] + peer['inter']:,} B")
    return problems
