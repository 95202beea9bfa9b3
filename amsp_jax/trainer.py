"""`Trainer`: the step's pure functions (`amsp_jax.step.functions`) behind a small object that builds
the step program once, from the model and how it is called, and keeps the compiled step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from amsp_jax.compiled import compile_step
from amsp_jax.core.leaf import Path
from amsp_jax.core.mesh import make_layout
from amsp_jax.core.plan import Plan
from amsp_jax.core.tensor import DEFAULT_TENSOR_RULES, Rules, normalize_rules
from amsp_jax.layers.discovery import Example
from amsp_jax.step import batch as batches
from amsp_jax.step import state as states
from amsp_jax.step.batch import rng_for
from amsp_jax.step.describe import describe, describe_layout
from amsp_jax.step.functions import eval_loss, init_state, train_step
from amsp_jax.step.program import LossFn, LossSpec, StepProgram, TrainerError, build_program
from amsp_jax.step.state import TrainState

__all__ = ["TrainState", "Trainer", "TrainerError", "rng_for"]


def _on_program(fn: Callable[..., Any]) -> Any:
    """A method calling `fn(trainer.program, ...)`."""

    @functools.wraps(fn)
    def method(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        return fn(self.program, *args, **kwargs)

    return method


class Trainer:
    """Trains a Flax model (linen, or nnx behind `NnxModel`) with an optax optimizer under a plan."""

    def __init__(
        self, plan: Plan, model: Any, optimizer: optax.GradientTransformation, loss_fn: LossFn,
        devices: list[jax.Device] | None = None, layers: tuple[type, ...] | None = None,
        has_aux: bool = False, rng_seed: int | None = None, frozen: Callable[[Path], bool] | None = None,
        collections: tuple[str, ...] = (), tensor_rules: Rules = DEFAULT_TENSOR_RULES,
    ) -> None:  # fmt: skip
        """`loss_fn(params, batch) -> mean loss` of one micro-batch (`params` as `model.init` makes them).
        `layers`: the block classes to gather one at a time (default: found). `has_aux`: `loss_fn` returns
        `(loss, metrics)`. `rng_seed`: `loss_fn(params, batch, rng)` gets `rng_for(seed, step, micro_batch,
        shard)`. `frozen(path) -> bool`: parameters not trained. `collections`: variable collections the
        model updates (e.g. `("batch_stats",)`): `loss_fn` gets them as `variables=` and returns `(loss,
        updated)` (`(loss, (metrics, updated))` with `has_aux`). `tensor_rules`: (logical name, "tensor"
        or None) pairs deciding which weight dimension a tensor degree t > 1 splits (first match wins)."""
        self.plan, self.model, self.optimizer, self.loss_fn = plan, model, optimizer, loss_fn
        self.layers, self.frozen, self.tensor_rules = layers, frozen, normalize_rules(tensor_rules)
        self.loss = LossSpec(loss_fn, has_aux, rng_seed, tuple(collections))
        self.layout = make_layout(plan.cluster, plan.strategy, devices)
        self._program: StepProgram | None = None  # built by `setup` (or `init`)
        self._compiled: dict[Any, Any] = {}

    @property
    def program(self) -> StepProgram:
        """The step program `init` (or `setup`) built."""
        if self._program is None:
            raise TrainerError(
                "call trainer.init(key, example_inputs) before step() or any use of the step, or setup() "
                "and restore a checkpoint"
            )
        return self._program

    def setup(self, key: jax.Array, *args: Any, **kwargs: Any) -> StepProgram:
        """Build the step program from the model called as `model.init(key, *args, **kwargs)` (shapes
        suffice; nothing is allocated)."""
        program = build_program(
            self.plan, self.layout, self.model, self.optimizer, self.loss, key, Example(args, kwargs),
            self.layers, self.frozen, self.tensor_rules,
        )  # fmt: skip
        self._program, self._compiled = program, {}
        return program

    def init(self, key: jax.Array, *args: Any, **kwargs: Any) -> TrainState:
        """Set up from the example inputs, as `model.init(key, *args, **kwargs)` takes them, and create the
        sharded state: parameters are created directly in their OS shards."""
        program = self.setup(key, *args, **kwargs)
        init = functools.partial(init_state, program)
        return jax.jit(init, out_shardings=states.state_shardings(program))(key)

    def init_fn(self, key: jax.Array) -> TrainState:
        """Pure and jit-able (after `setup`): the initial state from `key`, on the plan's shardings."""
        return init_state(self.program, key)

    def step_fn(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        """Pure and jit-able: one step on a batch already on the devices (`shard_batch`)."""
        new_state, metrics = train_step(self.program, state, batch)
        return jax.lax.with_sharding_constraint(new_state, self.state_shardings()), metrics

    def step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step over a global batch (host arrays or already sharded); returns the new state.

        The step takes ownership of `state` (its buffers are donated): use the returned state. A step whose
        loss or gradient norm is not finite leaves parameters and optimizer state as they were.
        """
        program = self.program
        states.check_state(state)
        batch = batches.on_devices(program.layout, program.plan, batch)
        return self.compile(state, batch)(state, batch)

    def compile(self, state: Any, batch: Any) -> jax.stages.Compiled:
        """The compiled step for this state and batch structure (cached), with the plan's XLA options."""
        key = compile_step.cache_key(batch)
        if key not in self._compiled:
            self._compiled[key] = compile_step.compile_step(self.program, state, batch)
        return self._compiled[key]

    def evaluate(self, state: TrainState, batch: Any) -> jax.Array:
        """Mean loss of a global batch under the current P, without gradients (e.g. held-out loss)."""
        program = self.program
        batch = batches.on_devices(program.layout, program.plan, batch)
        if "evaluate" not in self._compiled:
            replicated = NamedSharding(program.layout.mesh, P())
            self._compiled["evaluate"] = jax.jit(
                functools.partial(eval_loss, program), out_shardings=replicated
            )
        return self._compiled["evaluate"](state, batch)

    def describe(self) -> str:
        """The plan as laid out for this model (before `init`: the plan and mesh only)."""
        if self._program is not None:
            return describe(self._program)
        return "\n".join(describe_layout(self.plan, self.layout))

    def shard_batch(self, batch: Any) -> Any:
        """Place a global host batch on the devices, split along its first dimension."""
        return batches.shard_batch(self.layout, self.plan, batch)

    # The program's parts and state conversions, for checkpoints, audits and your own loop.
    params_layout = property(lambda self: self.program.params)
    schedule = property(lambda self: self.program.schedule)
    state_shardings = _on_program(states.state_shardings)
    abstract_state = _on_program(states.abstract_state)
    state_from_params = _on_program(states.state_from_params)
    assemble = _on_program(states.assemble)
    full_params = _on_program(states.full_params)
    lower = _on_program(compile_step.lower)
