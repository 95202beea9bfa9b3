"""The train step as pure functions over an immutable step program.

`program.build_program` fixes everything one step needs (`StepProgram`); `functions` holds the step:
`init_state`, `train_step`, `eval_loss`. Beside them: `state` (the sharded `TrainState`, its shardings
and conversions), `batch` (checking, placing and splitting batches), `micro_loss` and `gradients` (the
`shard_map` bodies), `collectives` (the schedule's ops as JAX collectives) and `describe` (in words).
"""

from amsp_jax.step.functions import eval_loss, init_state, train_step
from amsp_jax.step.program import LossSpec, StepProgram, TrainerError, build_program
from amsp_jax.step.state import TrainState

__all__ = [
    "LossSpec",
    "StepProgram",
    "TrainState",
    "TrainerError",
    "build_program",
    "eval_loss",
    "init_state",
    "train_step",
]
