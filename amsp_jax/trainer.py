"""The sharded train step: P gathered per layer, G on its own placement, OS updated by optax under jit.

Data flow of one step, all in one `jit`:
  1. `shard_map`: for each of M micro-batches, the forward gathers each layer's P shard, the backward
     re-gathers it and reduce-scatters the layer's gradient into the G shard (fp32 accumulation);
     then once per step the 2-hop reduction lands the summed gradient in OS's placement.
  2. optax on the OS-sharded fp32 master weights (outside shard_map, so global reductions just work).
  3. `shard_map`: the new master cast to P's dtype and all-gathered (or sliced) onto P's placement.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from amsp_jax.compiled import gpu_target
from amsp_jax.compiled.xla import compile_scheduled, compiler_options, scheduler_slop_factor
from amsp_jax.core import optim_state
from amsp_jax.core.backend import selects_in_place
from amsp_jax.core.mesh import Layout, LeafLayout, batch_spec, leaf_layout, make_layout, pad, unpad
from amsp_jax.core.plan import Plan
from amsp_jax.core.schedule import LeafSchedule, Schedule, grad_dtype, largest_gather_bytes
from amsp_jax.core.schedule import build as build_schedule
from amsp_jax.cost import optimizer as optimizer_cost
from amsp_jax.cost.optimizer import ELEMENT_WISE, OptimizerUpdate
from amsp_jax.errors import AmspError, one_line
from amsp_jax.layers.stack import (
    Chain,
    LayerContext,
    Layers,
    StackOps,
    find_layers,
    first_layer_scope,
    layer_context,
    linen_blocks,
)
from amsp_jax.step import collectives

Path = tuple[str, ...]
LossFn = Callable[[Any, Any], jax.Array]


class TrainerError(AmspError):
    """A `Trainer` used in a way it cannot work: the message says what to do instead."""


@flax.struct.dataclass
class TrainState:
    """The sharded training state: P (compute dtype; empty where P and OS share one placement, since P is
    then the master cast as the step goes), fp32 master and optimizer state on OS, step, and the model's
    other variable collections (e.g. `batch_stats`; replicated)."""

    step: jax.Array
    params: Any
    master: Any
    opt_state: Any
    collections: Any = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Every parameter leaf's split, keyed by its path; which subtrees are gathered one layer at a time.

    `stacks` are subtrees with a leading layer dimension (a `LayerStack`, or a block run by a scan);
    `blocks` are the modules whose calls the step wraps (blocks of models written without
    `LayerStack`: loops, lists, `nn.scan`, nnx), stacked or not.
    """

    leaves: dict[Path, LeafLayout]
    stacks: tuple[Path, ...]
    treedef: Any
    blocks: tuple[Path, ...] = ()
    backward_unused: frozenset[Path] = frozenset()  # block leaves the backward pass does not read
    looked_up: frozenset[Path] = frozenset()  # leaves the forward only indexes (an input embedding)
    frozen: frozenset[Path] = frozenset()  # leaves not trained (`Trainer(frozen=...)`)
    # Leaves the optimizer's update communicates on: split the largest way (`sharding.shard_dims`).
    split_for_update: frozenset[Path] = frozenset()

    def stack_of(self, path: Path) -> Path | None:
        """The stacked subtree holding `path` (its leaves have a layer dimension), if any."""
        return next((s for s in self.stacks if path[: len(s)] == s), None)

    def block_of(self, path: Path) -> Path | None:
        """The wrapped block holding `path`, if any."""
        return next((b for b in self.blocks if path[: len(b)] == b), None)

    def per_layer(self, path: Path) -> bool:
        """Whether the step gathers `path` one layer at a time (else once per step, kept)."""
        return self.stack_of(path) is not None or self.block_of(path) is not None

    @property
    def layer_stacks(self) -> tuple[Path, ...]:
        """The `LayerStack` subtrees (which run their own layer scan)."""
        return tuple(s for s in self.stacks if s not in self.blocks)

    def in_layer_stack(self, path: Path) -> bool:
        """Whether `path` is a `LayerStack`'s leaf."""
        return any(path[: len(s)] == s for s in self.layer_stacks)

    def replicated(self) -> list[Path]:
        """Leaves that no dimension of could be split, so every component keeps them whole."""
        return [p for p, leaf in self.leaves.items() if leaf.dim is None]

    def padding(self) -> str | None:
        """The padded leaves in words (how many, the extra stored elements, the first names), or None."""
        padded = [p for p, leaf in self.leaves.items() if leaf.is_padded]
        if not padded:
            return None
        real = sum(math.prod(leaf.shape) for leaf in self.leaves.values())
        extra = sum(math.prod(self.leaves[p].padded) - math.prod(self.leaves[p].shape) for p in padded)
        names = ", ".join("/".join(map(str, p)) for p in padded[:4])
        more = f" (+{len(padded) - 4} more)" if len(padded) > 4 else ""
        return (
            f"{len(padded)} leaves have no dimension (or pair of dimensions) the group divides and are "
            f"stored padded to split evenly ({extra / real:.2%} more elements): {names}{more}"
        )

    def tree(self, fn: Callable[[Path, LeafLayout], Any]) -> Any:
        """A params-shaped tree of `fn(path, leaf)`."""
        return traverse_util.unflatten_dict({p: fn(p, leaf) for p, leaf in self.leaves.items()})


def _flatten(tree: Any) -> dict[Path, Any]:
    return traverse_util.flatten_dict(flax.core.unfreeze(tree))


def param_layout(
    layout: Layout,
    layers: Layers,
    frozen: Callable[[Path], bool] | None = None,
    update: OptimizerUpdate = ELEMENT_WISE,
) -> ParamLayout:
    """Split every leaf of the model's parameters for the layout, knowing its layers, which are frozen
    and on which the optimizer's update communicates (those keep the split its rules were measured on)."""
    stacks = layers.stacked
    flat = _flatten(layers.abstract_params)
    leaves = {
        path: leaf_layout(
            layout, leaf.shape, any(path[: len(s)] == s for s in stacks), not update.communicates_on(path)
        )
        for path, leaf in flat.items()
    }
    treedef = jax.tree.structure(layers.abstract_params)
    held = frozenset(p for p in leaves if frozen is not None and frozen(p))
    kept = frozenset(p for p in leaves if update.communicates_on(p))
    return ParamLayout(
        leaves, stacks, treedef, tuple(layers.blocks), layers.backward_unused, layers.looked_up, held, kept
    )


def _blocks_summary(pl: ParamLayout) -> str:
    """`Block_0 .. Block_11 (12 blocks)`, `layers (scanned, 12 layers)`: the wrapped blocks in words."""
    scanned = [b for b in pl.blocks if b in pl.stacks]
    looped = [b for b in pl.blocks if b not in pl.stacks]
    parts = []
    for block in scanned:
        layers = next(leaf.shape[0] for p, leaf in pl.leaves.items() if p[: len(block)] == block)
        parts.append(f"{'/'.join(map(str, block))} (scanned, {layers} layers)")
    if looped:
        names = ["/".join(map(str, b)) for b in looped]
        parts.append(names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} blocks)")
    return ", ".join(parts)


def _without(optimizer: optax.GradientTransformation, frozen: Callable[[Path], bool]) -> Any:
    """`optimizer` on the trained leaves only: frozen ones get zero updates and keep no state."""

    def labels(params: Any) -> Any:
        def label(key_path: tuple[Any, ...], _: Any) -> str:
            path = tuple(getattr(k, "key", k) for k in key_path)
            return "frozen" if frozen(path) else "trained"

        return jax.tree_util.tree_map_with_path(label, params)

    return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, labels)


def rng_for(
    seed: int, step: jax.Array | int, micro_batch: jax.Array | int, shard: jax.Array | int
) -> jax.Array:
    """The key `loss_fn` gets for one micro-batch of one batch shard: `shard` is the index of the
    device's slice of the global batch (slices in order), `micro_batch` the index within that slice."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(jax.random.fold_in(key, micro_batch), shard)


class Trainer:
    """Trains a Flax linen model with an optax optimizer under a plan, one jitted step at a time."""

    def __init__(
        self,
        plan: Plan,
        model: nn.Module,
        optimizer: optax.GradientTransformation,
        loss_fn: LossFn,
        devices: list[jax.Device] | None = None,
        layers: tuple[type, ...] | None = None,
        has_aux: bool = False,
        rng_seed: int | None = None,
        frozen: Callable[[Path], bool] | None = None,
        collections: tuple[str, ...] = (),
    ) -> None:
        """`loss_fn(params, batch) -> mean loss` over one micro-batch; `params` as `model.init` makes them.

        `layers`: the block classes to gather one at a time (as FSDP wraps modules); by default they
        are found in the model (blocks run by a scan, sibling instances of one class).
        `has_aux`: `loss_fn` returns `(loss, metrics)`, a dict of scalars averaged like the loss into
        the step's metrics. `rng_seed`: `loss_fn(params, batch, rng)` gets a key (e.g. for dropout),
        `rng_for(seed, step, micro_batch, shard)`: a different one per step, micro-batch and batch shard.
        `frozen(path) -> bool` names parameters not to train (path: the tuple of keys, e.g.
        `lambda path: path[0] == "embed"`): they are gathered as the others, but get no gradient (no
        reduce-scatter, no reduction), no optimizer state (`optimizer` sees only the trained ones) and
        no refresh; their fp32 master copy stays, for checkpoints and `full_params`.
        `collections`: variable collections other than `params` the model updates as it trains (e.g.
        `("batch_stats",)`), carried in the state whole on every device: `loss_fn` gets them as
        `variables=` (a dict by collection) and returns `(loss, updated)`, or `(loss, (metrics,
        updated))` with `has_aux`; micro-batches update them in turn, and each step averages the
        devices' results (integers: their maximum). Blocks gathered per layer must not hold them.
        """
        self.plan = plan
        self.model = model
        self.frozen = frozen
        self.optimizer = optimizer if frozen is None else _without(optimizer, frozen)
        self.loss_fn = loss_fn
        self.layers = layers
        self.has_aux = has_aux
        self.rng_seed = rng_seed
        self.collections = tuple(collections)
        self._abstract_collections: dict[str, Any] = {}
        self._example_inputs: tuple[Any, ...] = ()
        self.layout = make_layout(plan.cluster, plan.strategy, devices)
        self.params_layout: ParamLayout | None = None
        self._schedule: tuple[ParamLayout, Schedule] | None = None
        self._compiled: dict[Any, Any] = {}
        self._evaluate: Callable[..., jax.Array] | None = None

    # ---- state -------------------------------------------------------------------------------------


    @property
    def schedule(self) -> Schedule:
        """The step's collectives per leaf, as the step runs them and the cost model prices them."""
        pl = self.params_layout
        assert pl is not None, "call setup() or init() first"
        if self._schedule is None or self._schedule[0] is not pl:
            plan = self.plan
            leaves = [
                (path, leaf.shape, pl.stack_of(path) is not None, pl.per_layer(path),
                 path not in pl.backward_unused, path in pl.frozen, path not in pl.split_for_update,
                 pl.stack_of(path) or pl.block_of(path), pl.in_layer_stack(path))
                for path, leaf in pl.leaves.items()
            ]  # fmt: skip
            built = build_schedule(
                self.layout, leaves, plan.micro_batches, plan.remat, plan.precision.param_bytes,
                plan.precision.reduce_bytes, plan.implementation,
            )  # fmt: skip
            self._schedule = (pl, built)
        return self._schedule[1]

    def _sharding(self, component: str) -> Any:
        assert self.params_layout is not None, "call init() first"
        return self.params_layout.tree(lambda _, leaf: NamedSharding(self.layout.mesh, leaf.specs[component]))

    def state_shardings(self) -> TrainState:
        """The `NamedSharding` of every leaf of the state."""
        assert self.params_layout is not None, "call init() first"
        master = self._sharding("opt_state")
        opt = optim_state.state_shardings(
            self.optimizer, self._abstract_master(), self.params_layout.leaves, self.layout.mesh
        )
        whole = NamedSharding(self.layout.mesh, P())
        return TrainState(
            step=whole,
            params={} if self.schedule.params_from_master else self._sharding("params"),
            master=master,
            opt_state=opt,
            collections=jax.tree.map(lambda _: whole, self._abstract_collections),
        )

    def _abstract_master(self) -> Any:
        assert self.params_layout is not None, "call init() first"
        return self.params_layout.tree(lambda _, leaf: jax.ShapeDtypeStruct(leaf.padded, jnp.float32))

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, for restoring a checkpoint onto this plan."""
        shardings = self.state_shardings()
        abstract = jax.eval_shape(self._fresh_state, self._abstract_master(), self._abstract_collections)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
        )

    def setup(self, key: jax.Array, *example_inputs: Any) -> None:
        """Trace the model once to learn its parameter shapes and layer stacks (no memory used)."""
        found = find_layers(self.model, key, example_inputs, self.layers)
        abstract = found.abstract_params
        for path, leaf in _flatten(abstract).items():
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise TrainerError(
                    f"parameter {'/'.join(map(str, path))} is {leaf.dtype}: every parameter is trained "
                    "from an fp32 master copy by its gradient; keep integer state out of the 'params' "
                    "collection (e.g. in a flax variable of another collection, or a constant)"
                )
        if self.plan.keep_first_layer and self.plan.micro_batches > 1 and not found.stacks:
            raise TrainerError(
                "keep_first_layer keeps a LayerStack's first layer gathered across micro-batches, and "
                "this model has no LayerStack; build its layers with amsp_jax.LayerStack, or leave "
                "keep_first_layer off"
            )
        self._abstract_collections = self._find_collections(found, key, example_inputs)
        update = optimizer_cost.describe(self.optimizer, abstract)
        self.params_layout = param_layout(self.layout, found, self.frozen, update)
        self._example_inputs = example_inputs

    def _find_collections(self, found: Layers, key: jax.Array, example_inputs: tuple[Any, ...]) -> dict:
        """Shapes of the carried collections; an error when one is missing or lives in a gathered block."""
        if not self.collections:
            return {}
        variables = jax.eval_shape(lambda k: self.model.init(k, *example_inputs), key)
        missing = [c for c in self.collections if c not in variables]
        if missing:
            raise TrainerError(
                f"the model's init makes no {', '.join(missing)} collection (it has: "
                f"{', '.join(sorted(variables))}); pass collections it has, e.g. collections=('batch_stats',)"
            )
        for name in self.collections:
            for path in _flatten(variables[name]):
                block = next((b for b in (*found.stacks, *found.blocks) if path[: len(b)] == b), None)
                if block is not None:
                    raise TrainerError(
                        f"{name}/{'/'.join(map(str, path))} lives in {'/'.join(map(str, block))}, a block "
                        "gathered one layer at a time, which cannot update a collection; gather the whole "
                        "tree with Trainer(..., layers=())"
                    )
        return {name: variables[name] for name in self.collections}

    @property
    def example_inputs(self) -> tuple[Any, ...]:
        """The inputs `setup` traced the model with."""
        return self._example_inputs

    def init(self, key: jax.Array, *example_inputs: Any) -> TrainState:
        """Initialise the sharded state; parameters are created directly in their OS shards."""
        self.setup(key, *example_inputs)
        return jax.jit(self.init_fn, out_shardings=self.state_shardings())(key)

    def init_fn(self, key: jax.Array) -> TrainState:
        """Pure and jit-able: the initial state from `key` (after `setup`), laid out on the plan's
        shardings. Under your own `jit`, pass `out_shardings=trainer.state_shardings()`."""
        assert self.params_layout is not None, "call setup(key, *example_inputs) first"
        variables = self.model.init(key, *self._example_inputs)
        params = _flatten(variables["params"])
        leaves = self.params_layout.leaves
        master = {p: pad(x.astype(jnp.float32), leaves[p].padded) for p, x in params.items()}
        collections = {name: variables[name] for name in self.collections}
        state = self._fresh_state(traverse_util.unflatten_dict(master), collections)
        return jax.lax.with_sharding_constraint(state, self.state_shardings())

    def step_fn(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        """Pure and jit-able: one optimizer step on a global batch already on the devices (see
        `shard_batch`), for your own `jit`, metrics and loop. `step()` is this, compiled and cached."""
        assert self.params_layout is not None, "call setup(key, *example_inputs) first"
        new_state, metrics = self._train_step(state, batch)
        return jax.lax.with_sharding_constraint(new_state, self.state_shardings()), metrics

    def state_from_params(self, params: Any) -> TrainState:
        """A fresh state (step 0, new optimizer state) from a full parameter tree, e.g. pretrained.

        `params` is nested dicts of arrays (any array type and float dtype; cast to fp32) with the
        paths and shapes of `model.init(...)["params"]`, such as `amsp_jax.load_params(run_dir)` or
        `amsp_jax.read_params(file)` return. `setup()` must have run; every process passes all of it.
        """
        assert self.params_layout is not None, "call setup() or init() first"
        flat = _flatten(params)
        given = {path: tuple(np.shape(x)) for path, x in flat.items()}
        expected = {path: leaf.shape for path, leaf in self.params_layout.leaves.items()}
        if given != expected:
            name = lambda p: "/".join(map(str, p))  # noqa: E731
            wrong = [
                f"{name(p)}: {given.get(p, 'missing')} here {expected.get(p, 'none')}"
                for p in sorted(set(given) | set(expected), key=str)
                if given.get(p) != expected.get(p)
            ]
            more = f" (+{len(wrong) - 4} more)" if len(wrong) > 4 else ""
            raise ValueError(
                f"the parameters do not fit this model: {'; '.join(wrong[:4])}{more}; give the parameters "
                "of the model this Trainer trains (same config)"
            )
        shardings = self.state_shardings()
        leaves = self.params_layout.leaves
        host = traverse_util.unflatten_dict(
            {p: pad(np.asarray(flat[p], np.float32), leaves[p].padded) for p in expected}
        )
        master = jax.device_put(host, shardings.master)
        collections = self._initial_collections()
        return jax.jit(self._fresh_state, out_shardings=shardings)(master, collections)

    def _initial_collections(self) -> dict[str, Any]:
        """The carried collections as the model's init makes them (key 0)."""
        if not self.collections:
            return {}
        variables = jax.jit(lambda k: self.model.init(k, *self._example_inputs))(jax.random.key(0))
        return {name: variables[name] for name in self.collections}

    def assemble(self, step: Any, master: Any, opt_state: Any, collections: Any = None) -> TrainState:
        """A state from restored logical parts (P is derived from the master), on this plan's shardings;
        `collections` default to the model's initial ones."""
        shardings = self.state_shardings()
        collections = self._initial_collections() if collections is None else collections

        def build(step: Any, master: Any, opt_state: Any, collections: Any) -> TrainState:
            params = self._refresh(master)
            return TrainState(jnp.asarray(step, jnp.int32), params, master, opt_state, collections)

        return jax.jit(
            build,
            in_shardings=(shardings.step, shardings.master, shardings.opt_state, shardings.collections),
            out_shardings=shardings,
        )(step, master, opt_state, collections)

    def _fresh_state(self, master: Any, collections: Any) -> TrainState:
        master = jax.lax.with_sharding_constraint(master, self._sharding("opt_state"))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=self._refresh(master),
            master=master,
            opt_state=self.optimizer.init(master),
            collections=collections,
        )

    def full_params(self, state: TrainState) -> Any:
        """The full fp32 master parameters as host numpy arrays (every process gets them all)."""
        assert self.params_layout is not None, "call init() first"
        gathered = jax.jit(lambda m: m, out_shardings=NamedSharding(self.layout.mesh, P()))(state.master)
        flat = _flatten(gathered)
        return self.params_layout.tree(lambda path, leaf: unpad(np.asarray(flat[path]), leaf.shape))

    # ---- the step ----------------------------------------------------------------------------------

    def _param_blocks(self, state: TrainState) -> Any:
        """The blocks the step gathers P from: the stored P, or the master where P is not stored (the
        gathers cast it)."""
        return state.master if self.schedule.params_from_master else state.params

    def _refresh(self, master: Any, previous: Any = None) -> Any:
        """New P from the OS-sharded master: cast, then the schedule's gathers (or a slice) onto P. With
        the `previous` P, frozen leaves keep theirs (they never change) and move nothing. Where P is not
        stored (`schedule.params_from_master`), nothing: the step casts the master as it goes."""
        layout, pl, schedule = self.layout, self.params_layout, self.schedule
        assert pl is not None
        if schedule.params_from_master:
            return {}
        dtype = jnp.dtype(self.plan.precision.param_dtype)
        kept = frozenset() if previous is None else pl.frozen

        def refresh_leaf(leaf: LeafSchedule, block: jax.Array) -> jax.Array:
            block = block.astype(dtype)
            if leaf.refresh_slice:
                return collectives.local_slice(layout, block, leaf.split.dims_of(leaf.refresh_slice))
            return collectives.execute(block, leaf.refresh, replicated=True)

        def body(master_blocks: Any, kept_blocks: Any) -> Any:
            flat, held = _flatten(master_blocks), _flatten(kept_blocks)
            refreshed = {
                p: held[p] if p in kept else refresh_leaf(schedule.leaves[p], x) for p, x in flat.items()
            }
            return traverse_util.unflatten_dict(refreshed)

        specs = lambda comp: pl.tree(lambda _, leaf: leaf.specs[comp])  # noqa: E731
        only_kept = lambda tree: traverse_util.unflatten_dict(  # noqa: E731
            {p: x for p, x in _flatten(tree).items() if p in kept}
        )
        return jax.shard_map(
            body, mesh=layout.mesh, in_specs=(specs("opt_state"), only_kept(specs("params"))),
            out_specs=specs("params"),
        )(master, only_kept(previous) if kept else {})  # fmt: skip

    def _micro_loss(self) -> Callable[..., tuple[jax.Array, Any]]:
        """`micro_loss((sinks, first-layer sinks), P blocks, first layers, micro-batch, rng, collections)
        -> (loss, (metrics, updated collections))` for use inside shard_map: gathers P (per layer in
        stacks and blocks), runs the user's loss, and routes gradients into the G-shaped sinks; a kept
        first layer's (`_first_layers`) into its full-size sink."""
        layout, pl, plan, schedule = self.layout, self.params_layout, self.plan, self.schedule
        assert pl is not None
        reduce_dtype = jnp.dtype(plan.precision.reduce_dtype)
        grad_dtype = self._grad_dtype()
        remat, policy = plan.remat_policy()

        param_dtype = jnp.dtype(plan.precision.param_dtype)

        def gather_weights(leaf: LeafSchedule, block: jax.Array) -> jax.Array:
            return collectives.gather_weights(layout, block, leaf, param_dtype)

        def gather_fn(leaf: LeafSchedule) -> Callable[[jax.Array, jax.Array], jax.Array]:
            if leaf.frozen:  # no gradient, so no reduce-scatter: the sink stays zero
                return lambda block, _: jax.lax.stop_gradient(gather_weights(leaf, block))
            return collectives.make_gather(layout, leaf, param_dtype, reduce_dtype, grad_dtype)

        def reduce_fn(leaf: LeafSchedule, grad: jax.Array) -> jax.Array:
            if leaf.frozen:  # the weight gradient is dropped (and its computation with it)
                block = leaf.split.block_shape(layout, "grads")[int(leaf.stacked) :]
                return collectives.mark_varying(jnp.zeros(block, grad_dtype), layout.all_axes)
            return collectives.reduce_gradient(grad, leaf, reduce_dtype, grad_dtype)

        def per_leaf(fn: Callable[..., jax.Array], leaves: dict[Path, LeafSchedule]) -> Callable[..., Any]:
            def apply(*trees: Any) -> Any:
                flats = [_flatten(t) for t in trees]
                return traverse_util.unflatten_dict(
                    {p: fn(leaves[p], *(f[p] for f in flats)) for p in flats[0]}
                )

            return apply

        def layer_ops(stack: Path) -> tuple[StackOps, dict[Path, LeafSchedule]]:
            inner = {p[len(stack) :]: leaf for p, leaf in schedule.leaves.items() if p[: len(stack)] == stack}
            gathers = {p: gather_fn(leaf) for p, leaf in inner.items()}
            return StackOps(
                gather_with_sink=per_leaf(lambda g, block, sink: g(block, sink), gathers),
                gather=per_leaf(gather_weights, inner),
                reduce=per_leaf(reduce_fn, inner),
            ), inner

        stack_ops: dict[Path, StackOps] = {}
        prefetching: set[Path] = set()
        for stack in pl.layer_stacks:
            stack_ops[stack], inner = layer_ops(stack)
            if schedule.prefetches(next(iter(inner.values())).layers):
                prefetching.add(stack)
        block_ops = {block: layer_ops(block)[0] for block in pl.blocks}
        looped = [b for b in pl.blocks if b not in pl.stacks]
        if looped and schedule.prefetches(len(looped), stack=False):
            prefetching.update(looped)
        top_sinks = {
            p: collectives.make_sink(leaf, reduce_dtype, grad_dtype)
            for p, leaf in schedule.leaves.items()
            if not pl.per_layer(p) and not leaf.frozen
        }

        def with_sink(path: Path, full: jax.Array, sink: jax.Array) -> jax.Array:
            return top_sinks[path](full, sink) if path in top_sinks else full

        def per_stack(flat: dict[Path, Any]) -> dict[Path, Any]:
            """`flat`'s leaves of each `LayerStack` as a tree of the stack's layer (stacks without any
            left out)."""
            trees = {
                stack: {p[len(stack) :]: v for p, v in flat.items() if p[: len(stack)] == stack}
                for stack in pl.layer_stacks
            }
            return {stack: traverse_util.unflatten_dict(tree) for stack, tree in trees.items() if tree}

        def micro_loss(
            all_sinks: tuple[dict[Path, jax.Array], dict[Path, jax.Array]], blocks: dict[Path, jax.Array],
            first: dict[Path, jax.Array], micro_batch: Any, rng: Any, variables: Any,
        ) -> tuple[jax.Array, Any]:  # fmt: skip
            sinks, first_sinks = all_sinks
            # Leaves outside layers: already gathered (`_gather_other_leaves`), each micro-batch
            # attaches its sink. A LayerStack's: shards (it gathers each layer). A wrapped block's:
            # (shard, sink) pairs, which its interceptor gathers call by call.
            tree = {
                p: (b, sinks[p]) if pl.block_of(p) else b if pl.per_layer(p) else with_sink(p, b, sinks[p])
                for p, b in blocks.items()
            }
            attached = {
                p: collectives.attach_full_sink(w, first_sinks[p]) if p in first_sinks else w
                for p, w in first.items()
            }
            stack_sinks, first_weights = per_stack(sinks), per_stack(attached)
            context = LayerContext(
                stack_ops, stack_sinks, policy, remat, frozenset(prefetching), block_ops, Chain(),
                first_weights,
            )  # fmt: skip
            params = traverse_util.unflatten_dict(tree)
            args = (params, micro_batch) if self.rng_seed is None else (params, micro_batch, rng)
            kwargs = {"variables": variables} if self.collections else {}
            with layer_context(context), linen_blocks():
                out = self.loss_fn(*args, **kwargs)
            loss, aux = out if self.has_aux or self.collections else (out, None)
            if self.collections:
                metrics, variables = aux if self.has_aux else ({}, aux)
            else:
                metrics = aux if self.has_aux else {}
            metrics = jax.tree.map(lambda m: jnp.asarray(m, jnp.float32), metrics)
            return loss.astype(jnp.float32), (metrics, variables)

        return micro_loss

    def _gather_other_leaves(self, blocks: dict[Path, jax.Array]) -> dict[Path, jax.Array]:
        """`blocks` with every leaf outside the layers gathered whole, once, for all micro-batches.

        Issued before the micro-batch loop rather than left to XLA: its GPU pipeline does not hoist
        these loop-invariant gathers out of the loop (the CPU one does), so they would run M times.
        """
        pl, schedule = self.params_layout, self.schedule
        assert pl is not None
        dtype = jnp.dtype(self.plan.precision.param_dtype)

        def gathered(path: Path, block: jax.Array) -> jax.Array:
            full = collectives.gather_weights(self.layout, block, schedule.leaves[path], dtype)
            return jax.lax.stop_gradient(full) if path in pl.frozen else full

        return {p: b if pl.per_layer(p) else gathered(p, b) for p, b in blocks.items()}

    def _first_layers(self, blocks: dict[Path, jax.Array]) -> dict[Path, jax.Array]:
        """The first layer of every `LayerStack` leaf that keeps it (`schedule.keeps_first_layer`),
        gathered once for all micro-batches, as `_gather_other_leaves` gathers the other leaves."""
        schedule = self.schedule
        dtype = jnp.dtype(self.plan.precision.param_dtype)
        first = {}
        for p, b in blocks.items():
            if schedule.leaves[p].keeps_first_layer:
                with jax.named_scope(first_layer_scope(p)):
                    gathered = collectives.gather_weights(self.layout, b[0], schedule.leaves[p], dtype)
                first[p] = jax.lax.stop_gradient(gathered)
        return first

    def _grad_dtype(self) -> jnp.dtype:
        """The dtype G is held in (`schedule.grad_dtype`)."""
        return jnp.dtype(grad_dtype(self.plan.micro_batches, self.plan.precision.reduce_dtype))

    def _sinks(self, blocks: dict[Path, jax.Array]) -> dict[Path, jax.Array]:
        """Zero G blocks, typed varying over every axis like the gradients that land in them."""
        pl = self.params_layout
        assert pl is not None
        dtype = self._grad_dtype()
        return {
            p: collectives.mark_varying(
                jnp.zeros(pl.leaves[p].block_shape(self.layout, "grads"), dtype), self.layout.all_axes
            )
            for p in blocks
        }

    def _rngs(self, step: jax.Array) -> jax.Array | None:
        """Inside shard_map: this device's key for each micro-batch of `step` (see `rng_for`)."""
        if self.rng_seed is None:
            return None
        axes = batch_spec(self.layout, 1)[0]
        shard = jnp.zeros((), jnp.int32)
        for axis in (axes,) if isinstance(axes, str) else axes:
            shard = shard * self.layout.axis_size(axis) + jax.lax.axis_index(axis)
        micro = jnp.arange(self.plan.micro_batches)
        return jax.vmap(lambda m: rng_for(self.rng_seed, step, m, shard))(micro)

    def _split_micro_batches(self, local_batch: Any) -> Any:
        micro = self.plan.micro_batches
        return jax.tree.map(lambda x: x.reshape(micro, x.shape[0] // micro, *x.shape[1:]), local_batch)

    def _gradients(
        self, params: Any, batch: Any, step: jax.Array, variables: Any
    ) -> tuple[Any, jax.Array, Any, Any]:
        """The summed-then-averaged gradient on OS's placement, mean loss, mean metrics and the updated
        collections (averaged over devices), from P shards, a batch and the carried collections."""
        layout, pl, plan, schedule = self.layout, self.params_layout, self.plan, self.schedule
        assert pl is not None
        count = layout.cluster.num_devices * plan.micro_batches
        reduce_dtype = jnp.dtype(plan.precision.reduce_dtype)
        all_axes = layout.all_axes
        micro_loss = self._micro_loss()

        def to_opt_state(path: Path, g_block: jax.Array) -> jax.Array:
            if path in pl.frozen:  # the optimizer gives frozen leaves zero updates whatever they get
                return jnp.zeros(pl.leaves[path].block_shape(layout, "opt_state"), jnp.float32)
            reduced = collectives.execute(g_block.astype(reduce_dtype), schedule.leaves[path].reduction, True)
            return reduced.astype(jnp.float32) / count

        def across_devices(x: jax.Array) -> jax.Array:
            if jnp.issubdtype(x.dtype, jnp.floating):
                return (jax.lax.psum(x, all_axes) / layout.cluster.num_devices).astype(x.dtype)
            return jax.lax.pmax(x, all_axes)

        value_and_grad = jax.value_and_grad(micro_loss, has_aux=True)

        def body(
            param_blocks: Any, local_batch: Any, step: jax.Array, variables: Any
        ) -> tuple[Any, jax.Array, Any, Any]:
            blocks = _flatten(param_blocks)
            split = self._split_micro_batches(local_batch)
            first = self._first_layers(blocks)
            # A micro-batch's first-layer gradient comes in the reduce dtype and is summed in fp32.
            first_sinks = {
                p: collectives.mark_varying(jnp.zeros(w.shape, reduce_dtype), all_axes)
                for p, w in first.items()
                if p not in pl.frozen
            }
            sinks = (self._sinks(blocks), first_sinks)
            blocks = self._gather_other_leaves(blocks)
            rngs = self._rngs(step)
            # Each device updates the collections with its own micro-batches, in turn.
            variables = jax.tree.map(lambda x: collectives.mark_varying(x, all_axes), variables)

            def micro_step(carry: tuple[Any, Any, Any], xs: Any) -> tuple[Any, None]:
                (accumulated, first_sums), sums, variables = carry
                (loss, (metrics, variables)), (grads, first_grads) = value_and_grad(
                    sinks, blocks, first, *xs, variables
                )
                accumulated = jax.tree.map(jnp.add, accumulated, grads)
                first_sums = jax.tree.map(jnp.add, first_sums, first_grads)
                sums = jax.tree.map(jnp.add, sums, (loss, metrics))
                return ((accumulated, first_sums), sums, variables), None

            if not schedule.accumulates:
                # No accumulator: one fp32 G-sized buffer less.
                only = jax.tree.map(lambda x: x[0], (split, rngs))
                (loss, (metrics, variables)), accumulated = value_and_grad(
                    sinks, blocks, first, *only, variables
                )
                sums = (loss, metrics)
            else:
                one = jax.tree.map(lambda x: x[0], (split, rngs))
                loss_shape, (metrics_shape, _) = jax.eval_shape(
                    micro_loss, sinks, blocks, first, *one, variables
                )
                zeros = jax.tree.map(
                    lambda s: collectives.mark_varying(jnp.zeros(s.shape, s.dtype), all_axes),
                    (loss_shape, metrics_shape),
                )
                first_sums = {p: s.astype(jnp.float32) for p, s in first_sinks.items()}
                carry = ((sinks[0], first_sums), zeros, variables)
                (accumulated, sums, variables), _ = jax.lax.scan(micro_step, carry, (split, rngs))
            accumulated, first_grads = accumulated
            for p, full in first_grads.items():
                # The kept first layer's gradient, summed over the micro-batches, onto G once.
                leaf = schedule.leaves[p]
                with jax.named_scope(first_layer_scope(p)):
                    reduced = collectives.reduce_gradient(full, leaf, reduce_dtype, accumulated[p].dtype)
                accumulated[p] = accumulated[p].at[0].add(reduced)
            grads = {p: to_opt_state(p, g) for p, g in accumulated.items()}
            loss, metrics = jax.tree.map(lambda x: jax.lax.psum(x, all_axes) / count, sums)
            return traverse_util.unflatten_dict(grads), loss, metrics, jax.tree.map(across_devices, variables)

        specs = lambda comp: pl.tree(lambda _, leaf: leaf.specs[comp])  # noqa: E731
        batch_specs = jax.tree.map(lambda x: batch_spec(layout, x.ndim), batch)
        return jax.shard_map(
            body,
            mesh=layout.mesh,
            in_specs=(specs("params"), batch_specs, P(), P()),
            out_specs=(specs("opt_state"), P(), P(), P()),
        )(params, batch, step, variables)

    def _eval_loss(self, params: Any, batch: Any, step: jax.Array, variables: Any) -> jax.Array:
        """Mean loss of a batch, forward only, gathering P as the step does (per layer in stacks)."""
        layout, pl = self.layout, self.params_layout
        assert pl is not None
        micro_loss = self._micro_loss()
        count = layout.cluster.num_devices * self.plan.micro_batches

        def body(param_blocks: Any, local_batch: Any, step: jax.Array, variables: Any) -> jax.Array:
            blocks = _flatten(param_blocks)
            sinks = (self._sinks(blocks), {})
            blocks = self._gather_other_leaves(blocks)
            losses = jax.lax.map(
                lambda xs: micro_loss(sinks, blocks, {}, *xs, variables)[0],
                (self._split_micro_batches(local_batch), self._rngs(step)),
            )
            return jax.lax.psum(losses.sum(), layout.all_axes) / count

        specs = pl.tree(lambda _, leaf: leaf.specs["params"])
        batch_specs = jax.tree.map(lambda x: batch_spec(layout, x.ndim), batch)
        return jax.shard_map(
            body, mesh=layout.mesh, in_specs=(specs, batch_specs, P(), P()), out_specs=P()
        )(params, batch, step, variables)

    def evaluate(self, state: TrainState, batch: Any) -> jax.Array:
        """Mean loss of a global batch under the current P, without gradients (e.g. held-out loss)."""
        self.check_batch(batch)
        if not all(isinstance(x, jax.Array) and len(x.devices()) > 1 for x in jax.tree.leaves(batch)):
            batch = self.shard_batch(batch)
        if self._evaluate is None:

            def evaluate(state: TrainState, batch: Any) -> jax.Array:
                return self._eval_loss(self._param_blocks(state), batch, state.step, state.collections)

            self._evaluate = jax.jit(evaluate, out_shardings=NamedSharding(self.layout.mesh, P()))
        return self._evaluate(state, batch)

    def _train_step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        grads, loss, metrics, collections = self._gradients(
            self._param_blocks(state), batch, state.step, state.collections
        )
        grad_norm = optax.tree.norm(grads)
        # As optax.apply_if_finite: a non-finite loss or gradient leaves master and optimizer state as
        # they were; the step still counts. A select of new against old where XLA writes it in place,
        # else a branch (`backend.selects_in_place`: the form that needs fewer OS-sized temporaries).
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def apply(master: Any, opt_state: Any, _: Any) -> tuple[Any, Any, Any]:
            updates, opt_state = self.optimizer.update(grads, opt_state, master)
            return self._zero_padding(optax.apply_updates(master, updates)), opt_state, collections

        def keep(master: Any, opt_state: Any, old_collections: Any) -> tuple[Any, Any, Any]:
            return master, opt_state, old_collections

        old = (state.master, state.opt_state, state.collections)
        if selects_in_place(self.layout.platform):
            master, opt_state, collections = jax.tree.map(
                lambda new, kept: jnp.where(finite, new, kept), apply(*old), old
            )
        else:
            master, opt_state, collections = jax.lax.cond(finite, apply, keep, *old)
        params = self._refresh(master, state.params)
        new_state = TrainState(state.step + 1, params, master, opt_state, collections)
        return new_state, {**metrics, "loss": loss, "grad_norm": grad_norm}

    def _zero_padding(self, master: Any) -> Any:
        """`master` with the padding of padded leaves set to zero: their gradient there is already zero,
        so this only pins transforms that move a parameter without a gradient (noise, decoupled decay of
        a nonzero value) and keeps the padding out of every later statistic."""
        pl = self.params_layout
        assert pl is not None

        def zero(path: Path, x: jax.Array) -> jax.Array:
            leaf = pl.leaves[path]
            if not leaf.is_padded:
                return x
            inside = jax.lax.broadcasted_iota(jnp.int32, x.shape, leaf.dim) < leaf.shape[leaf.dim]
            return jnp.where(inside, x, jnp.zeros_like(x))

        flat = _flatten(master)
        return traverse_util.unflatten_dict({p: zero(p, x) for p, x in flat.items()})

    def check_batch(self, batch: Any) -> None:
        """Raise a clear error when the global batch does not split into devices × micro-batches."""
        devices, micro = self.layout.cluster.num_devices, self.plan.micro_batches
        leaves = jax.tree.leaves(batch)
        if not leaves or not all(hasattr(x, "shape") for x in leaves):
            raise TrainerError(
                "a batch is a tree of arrays with the global batch as their first dimension, e.g. "
                f"{{'inputs': tokens, 'targets': tokens}}; got {type(batch).__name__}"
            )
        sizes = {x.shape[0] if len(x.shape) else None for x in leaves}
        if None in sizes or len(sizes) != 1:
            raise TrainerError(f"every batch leaf needs the same leading batch dimension, got {sizes}")
        size = sizes.pop()
        unit = devices * micro
        if size % unit:
            raise TrainerError(
                f"global batch {size} does not split into {devices} devices x {micro} micro-batches; "
                f"use a multiple of {unit} (e.g. {max(1, size // unit) * unit})"
            )

    def shard_batch(self, batch: Any) -> Any:
        """Place a global host batch on the devices, split along its first dimension."""
        self.check_batch(batch)
        if isinstance(jax.tree.leaves(batch)[0], jax.Array) and jax.process_count() == 1:
            batch = jax.tree.map(np.asarray, batch)
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(
                np.shape(x),
                NamedSharding(self.layout.mesh, batch_spec(self.layout, np.ndim(x))),
                lambda i: x[i],
            ),
            batch,
        )

    def lower(self, state: Any, batch: Any) -> jax.stages.Lowered:
        """The lowered (not yet compiled) step for this state and batch structure."""
        self.check_batch(batch)
        shardings = self.state_shardings()
        batch_shardings = jax.tree.map(
            lambda x: NamedSharding(self.layout.mesh, batch_spec(self.layout, len(x.shape))), batch
        )
        replicated = NamedSharding(self.layout.mesh, P())
        step = jax.jit(
            self._train_step,
            in_shardings=(shardings, batch_shardings),
            out_shardings=(shardings, replicated),
            donate_argnums=0,
        )
        return step.lower(state, batch)

    def compile(self, state: Any, batch: Any) -> jax.stages.Compiled:
        """The compiled step for this state and batch structure (cached), with the overlap flags on GPU."""
        key = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), batch)
        key = str(jax.tree.structure(batch)), tuple(jax.tree.leaves(key))
        if key not in self._compiled:
            options = compiler_options(
                self.layout.platform,
                self._largest_gather_bytes(),
                self._slop_factor(state, batch),
                self.layout.mesh.size,
            )
            lowered = self.lower(state, batch)
            if self.layout.mesh.devices.flat[0] in jax.devices():
                self._compiled[key] = compile_scheduled(lowered, options, self.layout)
            else:
                # Compiled for a topology this process has no client for (a GPU target on a CPU
                # machine): JAX's persistent cache would store it but cannot load it back ("PjRtCompiler
                # must be constructed with a Client"), so no compile time is long enough to store it.
                least = jax.config.jax_persistent_cache_min_compile_time_secs
                jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
                try:
                    self._compiled[key] = compile_scheduled(lowered, options, self.layout)
                finally:
                    jax.config.update("jax_persistent_cache_min_compile_time_secs", least)
        return self._compiled[key]

    def _slop_factor(self, state: Any, batch: Any) -> int | None:
        """XLA's scheduler budget for the plan's `memory_limit` (`xla.scheduler_slop_factor`); None without
        a limit, or on a device whose memory no shipped GPU target describes."""
        device_memory = gpu_target.device_memory(self.layout.mesh.devices.flat[0].device_kind)
        if self.plan.memory_limit is None or device_memory is None:
            return None
        shardings = self.state_shardings()
        io_bytes = sum(
            math.prod(sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
            for x, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True)
        )
        io_bytes += sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(batch)) // len(
            self.layout.mesh.devices.flat
        )
        return scheduler_slop_factor(self.plan.memory_limit, device_memory, io_bytes)

    def _largest_gather_bytes(self) -> int:
        """Bytes of the largest single gather: one layer of a stack, or all the other leaves together."""
        pl = self.params_layout
        assert pl is not None
        return largest_gather_bytes(
            (
                (pl.stack_of(path) or pl.block_of(path),
                 int(np.prod(leaf.padded)) // (leaf.shape[0] if pl.stack_of(path) else 1))
                for path, leaf in pl.leaves.items()
            ),
            self.plan.precision.param_bytes,
        )  # fmt: skip

    def describe(self) -> str:
        """The plan as laid out for this model: mesh axes, component axes, gathering, replicated leaves."""
        pl = self.params_layout
        lines = [f"plan        {self.plan.describe()}"]
        mesh = ", ".join(f"{name}={size}{' (inter-node)' if self.layout.is_inter(name) else ''}"
                         for name, size in self.layout.axis_sizes)  # fmt: skip
        lines.append(f"mesh        {mesh}")
        for component in ("params", "grads", "opt_state"):
            axes = self.layout.axes(component) or ("replicated",)
            placement = getattr(self.plan.strategy, component)
            lines.append(f"{component:<11} {placement} over {', '.join(axes)}")
        if pl is None:
            return "\n".join(lines)
        if self.schedule.params_from_master:
            lines.append("stored P    none: P and OS share one placement, so the gathers cast the master")
        if pl.layer_stacks:
            stacks = ", ".join("/".join(map(str, s)) for s in pl.layer_stacks)
            lines.append(f"gathering   per layer inside the layer scan of {stacks}")
        if pl.blocks:
            lines.append(f"gathering   per layer: each call of {_blocks_summary(pl)} gathers its own weights")
        if not pl.stacks and not pl.blocks:
            lines.append(
                "gathering   whole tree: no layers found (no LayerStack, scanned block or repeated block "
                "class), so every parameter is gathered once per step and stays gathered (memory of the "
                "full P); name the block classes with Trainer(..., layers=(Block,))"
            )
        sharded = any(self.layout.axes(c) for c in ("params", "grads", "opt_state"))
        replicated = pl.replicated()
        if replicated and sharded:
            names = ", ".join("/".join(map(str, p)) for p in replicated)
            lines.append(f"replicated  {len(replicated)} leaves have no dimension to split: {names}")
        if pl.frozen:
            count = sum(math.prod(pl.leaves[p].shape) for p in pl.frozen)
            names = ", ".join(sorted("/".join(map(str, p)) for p in pl.frozen)[:4])
            lines.append(
                f"frozen      {len(pl.frozen)} leaves ({count:,} parameters): gathered, never reduced, "
                f"updated or refreshed; no optimizer state: {names}{' ...' if len(pl.frozen) > 4 else ''}"
            )
        if self.collections:
            count = sum(math.prod(x.shape) for x in jax.tree.leaves(self._abstract_collections))
            lines.append(
                f"carried     {', '.join(self.collections)} ({count:,} values): whole on every device, "
                "updated by each micro-batch in turn, averaged over devices each step"
            )
        two = ["/".join(map(str, p)) for p, leaf in pl.leaves.items() if leaf.minor_dim is not None]
        if two:
            more = f" (+{len(two) - 4} more)" if len(two) > 4 else ""
            lines.append(
                f"two dims    {len(two)} leaves split over two dimensions (no one dimension divides; a "
                f"node's devices split one, the nodes the other): {', '.join(two[:4])}{more}"
            )
        padding = pl.padding()
        if padding:
            lines.append(f"padded      {padding}")
        return "\n".join(lines)

    def step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step over a global batch (host arrays or already sharded); returns new state.

        The step takes ownership of `state` (its buffers are donated): use the returned state from then
        on. A step whose loss or gradient norm is not finite leaves the parameters and optimizer state
        as they were (only `step` advances), as `optax.apply_if_finite` does.
        """
        if self.params_layout is None:
            raise TrainerError("call trainer.init(key, example_inputs) before step(), or setup() and restore")
        if not isinstance(state, TrainState):
            raise TrainerError(f"step() needs the TrainState init() returned, got {type(state).__name__}")
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
            raise TrainerError(
                "this state was consumed by an earlier step(): the step takes ownership of (donates) the "
                "state it is given; use the state it returned, as in `state, metrics = trainer.step(state, "
                "batch)`"
            )
        self.check_batch(batch)
        if not all(isinstance(x, jax.Array) and len(x.devices()) > 1 for x in jax.tree.leaves(batch)):
            batch = self.shard_batch(batch)
        try:
            compiled = self.compile(state, batch)
        except TypeError as error:
            # jax.grad's message for a loss of any shape but (): say what the loss function must return.
            if "scalar-output" not in str(error):
                raise
            raise TrainerError(
                f"loss_fn must return a scalar, the mean loss of the micro-batch ({one_line(error)}); reduce "
                "it, e.g. with jnp.mean"
            ) from None
        return compiled(state, batch)
