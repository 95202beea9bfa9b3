"""The step as pure functions over a `StepProgram`: `init_state(program, key)`, `train_step(program,
state, batch)` and `eval_loss(program, state, batch)`, each jit-able as they are.

One `train_step`, all in one `jit`:
  1. `shard_map`: for each of M micro-batches, the forward gathers each layer's P shard, the backward
     re-gathers it and reduce-scatters the layer's gradient into the G shard (fp32 accumulation);
     then once per step the 2-hop reduction lands the summed gradient in OS's placement.
  2. optax on the OS-sharded fp32 master weights (outside shard_map, so global reductions just work).
  3. `shard_map`: the new master cast to P's dtype and all-gathered (or sliced) onto P's placement.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from amsp_jax.core.backend import selects_in_place
from amsp_jax.layers.tensor import Boundary, recording_boundaries
from amsp_jax.step.gradients import gradients, mean_loss
from amsp_jax.step.program import StepProgram
from amsp_jax.step.state import TrainState, init_state, param_blocks, refresh, zero_padding

__all__ = ["eval_loss", "init_state", "tensor_boundaries", "train_step"]


def train_step(
    program: StepProgram, state: TrainState, batch: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch already on the devices: the new state and the step's
    metrics (`loss`, `grad_norm`, and the loss's own where `has_aux`). Under your own `jit`, pass
    `out_shardings=(state_shardings(program), None)` (or use `Trainer.step_fn`, which constrains them).

    As `optax.apply_if_finite`: a non-finite loss or gradient leaves master and optimizer state as they
    were; the step still counts.
    """
    grads, loss, metrics, collections = gradients(
        program, param_blocks(program, state), batch, state.step, state.collections
    )
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply(master: Any, opt_state: Any, _: Any) -> tuple[Any, Any, Any]:
        updates, opt_state = program.optimizer.update(grads, opt_state, master)
        return zero_padding(program, optax.apply_updates(master, updates)), opt_state, collections

    def keep(master: Any, opt_state: Any, old_collections: Any) -> tuple[Any, Any, Any]:
        return master, opt_state, old_collections

    old = (state.master, state.opt_state, state.collections)
    # A select of new against old where XLA writes it in place, else a branch (`backend.selects_in_place`:
    # the form that needs fewer OS-sized temporaries).
    if selects_in_place(program.layout.platform):
        master, opt_state, collections = jax.tree.map(
            lambda new, kept: jnp.where(finite, new, kept), apply(*old), old
        )
    else:
        master, opt_state, collections = jax.lax.cond(finite, apply, keep, *old)
    params = refresh(program, master, state.params)
    new_state = TrainState(state.step + 1, params, master, opt_state, collections)
    return new_state, {**metrics, "loss": loss, "grad_norm": grad_norm}


def eval_loss(program: StepProgram, state: TrainState, batch: Any) -> jax.Array:
    """Mean loss of a global batch (already on the devices) under the state's P, without gradients."""
    return mean_loss(program, param_blocks(program, state), batch, state.step, state.collections)


def tensor_boundaries(program: StepProgram, state: Any, batch: Any) -> tuple[Boundary, ...]:
    """The tensor-parallel boundaries one micro-batch's forward pass crosses, in the order it crosses
    them, from one abstract trace of the step's forward (its micro-batch loop traces the body once);
    shapes suffice for `state` and `batch`."""
    with recording_boundaries() as found:
        jax.eval_shape(functools.partial(eval_loss, program), state, batch)
    first: dict[Any, int] = {}  # a unit's code counted from its first trace (a scan may trace it twice)
    for b in found:
        first.setdefault(b.unit, b.trace)
    return tuple(b for b in found if b.trace == first[b.unit])
