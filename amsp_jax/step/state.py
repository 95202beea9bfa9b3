"""The sharded train state of a `StepProgram`: its shardings, a fresh state (from a key or from full
parameters), a state assembled from restored parts, and the full parameters back on the host.

P comes from the OS-sharded fp32 master by `refresh`: a cast, then the schedule's gathers (or a slice)
onto P's placement; where P and OS share one placement P is not stored and the step casts the master.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from amsp_jax.core import optim_state
from amsp_jax.core.mesh import pad, unpad
from amsp_jax.core.schedule import LeafSchedule
from amsp_jax.step import collectives
from amsp_jax.step.program import StepProgram, TrainerError, flatten


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


def check_state(state: Any) -> None:
    """Raise a clear error for what is not a live `TrainState` (not one, or consumed by a step)."""
    if not isinstance(state, TrainState):
        raise TrainerError(f"step() needs the TrainState init() returned, got {type(state).__name__}")
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        raise TrainerError(
            "this state was consumed by an earlier step(): the step takes ownership of (donates) the "
            "state it is given; use the state it returned, as in `state, metrics = trainer.step(state, "
            "batch)`"
        )


def component_shardings(program: StepProgram, component: str) -> Any:
    """A params-shaped tree of each leaf's `NamedSharding` under `component`'s placement."""
    mesh = program.layout.mesh
    return program.params.tree(lambda _, leaf: NamedSharding(mesh, leaf.specs[component]))


def abstract_master(program: StepProgram) -> Any:
    """Shapes of the fp32 master (stored shapes: padded where a leaf is)."""
    return program.params.tree(lambda _, leaf: jax.ShapeDtypeStruct(leaf.padded, jnp.float32))


def state_shardings(program: StepProgram) -> TrainState:
    """The `NamedSharding` of every leaf of the state."""
    mesh = program.layout.mesh
    opt = optim_state.state_shardings(
        program.optimizer, abstract_master(program), program.params.leaves, mesh
    )
    whole = NamedSharding(mesh, P())
    return TrainState(
        step=whole,
        params={} if program.schedule.params_from_master else component_shardings(program, "params"),
        master=component_shardings(program, "opt_state"),
        opt_state=opt,
        collections=jax.tree.map(lambda _: whole, program.collections),
    )


def abstract_state(program: StepProgram) -> TrainState:
    """Shapes, dtypes and shardings of the state, for restoring a checkpoint onto this plan."""
    shardings = state_shardings(program)
    abstract = jax.eval_shape(
        lambda m, c: fresh_state(program, m, c), abstract_master(program), program.collections
    )
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def fresh_state(program: StepProgram, master: Any, collections: Any) -> TrainState:
    """Step 0 from an fp32 master: P refreshed from it, a new optimizer state."""
    master = jax.lax.with_sharding_constraint(master, component_shardings(program, "opt_state"))
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=refresh(program, master),
        master=master,
        opt_state=program.optimizer.init(master),
        collections=collections,
    )


def init_state(program: StepProgram, key: jax.Array) -> TrainState:
    """Pure and jit-able: the initial state from `key`, laid out on the program's shardings (under your
    own `jit`, pass `out_shardings=state_shardings(program)`); parameters are created in their shards."""
    variables = program.example.init(program.model, key)
    leaves = program.params.leaves
    master = {
        p: pad(x.astype(jnp.float32), leaves[p].padded) for p, x in flatten(variables["params"]).items()
    }
    collections = {name: variables[name] for name in program.loss.collections}
    state = fresh_state(program, traverse_util.unflatten_dict(master), collections)
    return jax.lax.with_sharding_constraint(state, state_shardings(program))


def state_from_params(program: StepProgram, params: Any) -> TrainState:
    """A fresh state (step 0, new optimizer state) from a full parameter tree, e.g. pretrained.

    `params` is nested dicts of arrays (any array type and float dtype; cast to fp32) with the paths and
    shapes of `model.init(...)["params"]`, such as `amsp_jax.load_params(run_dir)` or
    `amsp_jax.read_params(file)` return; every process passes all of it.
    """
    flat = flatten(nn.meta.unbox(params))  # as a linen model's init makes them, logical names or not
    given = {path: tuple(np.shape(x)) for path, x in flat.items()}
    expected = {path: leaf.shape for path, leaf in program.params.leaves.items()}
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
    shardings = state_shardings(program)
    leaves = program.params.leaves
    host = traverse_util.unflatten_dict(
        {p: pad(np.asarray(flat[p], np.float32), leaves[p].padded) for p in expected}
    )
    master = jax.device_put(host, shardings.master)
    fresh = jax.jit(lambda m, c: fresh_state(program, m, c), out_shardings=shardings)
    return fresh(master, initial_collections(program))


def initial_collections(program: StepProgram) -> dict[str, Any]:
    """The carried collections as the model's init makes them (key 0)."""
    if not program.loss.collections:
        return {}
    variables = jax.jit(lambda k: program.example.init(program.model, k))(jax.random.key(0))
    return {name: variables[name] for name in program.loss.collections}


def assemble(
    program: StepProgram, step: Any, master: Any, opt_state: Any, collections: Any = None
) -> TrainState:
    """A state from restored logical parts (P is derived from the master), on the program's shardings;
    `collections` default to the model's initial ones."""
    shardings = state_shardings(program)
    collections = initial_collections(program) if collections is None else collections

    def build(step: Any, master: Any, opt_state: Any, collections: Any) -> TrainState:
        params = refresh(program, master)
        return TrainState(jnp.asarray(step, jnp.int32), params, master, opt_state, collections)

    return jax.jit(
        build,
        in_shardings=(shardings.step, shardings.master, shardings.opt_state, shardings.collections),
        out_shardings=shardings,
    )(step, master, opt_state, collections)


def full_params(program: StepProgram, state: TrainState) -> Any:
    """The full fp32 master parameters as host numpy arrays (every process gets them all)."""
    if not isinstance(state, TrainState):
        raise TrainerError(f"full_params() needs a TrainState, got {type(state).__name__}")
    gathered = jax.jit(lambda m: m, out_shardings=NamedSharding(program.layout.mesh, P()))(state.master)
    flat = flatten(gathered)
    return program.params.tree(lambda path, leaf: unpad(np.asarray(flat[path]), leaf.shape))


def param_blocks(program: StepProgram, state: TrainState) -> Any:
    """The blocks the step gathers P from: the stored P, or the master where P is not stored (the gathers
    cast it)."""
    return state.master if program.schedule.params_from_master else state.params


def refresh(program: StepProgram, master: Any, previous: Any = None) -> Any:
    """New P from the OS-sharded master: cast, then the schedule's gathers (or a slice) onto P. With the
    `previous` P, frozen leaves keep theirs (they never change) and move nothing. Where P is not stored
    (`schedule.params_from_master`), nothing: the step casts the master as it goes."""
    layout, pl, schedule = program.layout, program.params, program.schedule
    if schedule.params_from_master:
        return {}
    dtype = jnp.dtype(program.plan.precision.param_dtype)
    kept = frozenset() if previous is None else pl.frozen

    def refresh_leaf(leaf: LeafSchedule, block: jax.Array) -> jax.Array:
        block = block.astype(dtype)
        if leaf.refresh_slice:
            return collectives.local_slice(layout, block, leaf.split.dims_of(leaf.refresh_slice))
        return collectives.execute(block, leaf.refresh, replicated=True)

    def body(master_blocks: Any, kept_blocks: Any) -> Any:
        flat, held = flatten(master_blocks), flatten(kept_blocks)
        refreshed = {
            p: held[p] if p in kept else refresh_leaf(schedule.leaves[p], x) for p, x in flat.items()
        }
        return traverse_util.unflatten_dict(refreshed)

    specs = lambda comp: pl.tree(lambda _, leaf: leaf.specs[comp])  # noqa: E731
    only_kept = lambda tree: traverse_util.unflatten_dict(  # noqa: E731
        {p: x for p, x in flatten(tree).items() if p in kept}
    )
    return jax.shard_map(
        body, mesh=layout.mesh, in_specs=(specs("opt_state"), only_kept(specs("params"))),
        out_specs=specs("params"),
    )(master, only_kept(previous) if kept else {})  # fmt: skip


def zero_padding(program: StepProgram, master: Any) -> Any:
    """`master` with the padding of padded leaves set to zero: their gradient there is already zero, so
    this only pins transforms that move a parameter without a gradient (noise, decoupled decay of a
    nonzero value) and keeps the padding out of every later statistic."""

    def zero(path: tuple[str, ...], x: jax.Array) -> jax.Array:
        leaf = program.params.leaves[path]
        if not leaf.is_padded:
            return x
        inside = jax.lax.broadcasted_iota(jnp.int32, x.shape, leaf.dim) < leaf.shape[leaf.dim]
        return jnp.where(inside, x, jnp.zeros_like(x))

    return traverse_util.unflatten_dict({p: zero(p, x) for p, x in flatten(master).items()})
