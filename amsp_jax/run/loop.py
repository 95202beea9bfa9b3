"""The training loop: step after step, with every side job a `Hook` (see `amsp_jax.run.hooks`).

Each step's update is dispatched, then every hook's `on_step` sees it (evaluate, save, stop). A step's
loss and gradient norm reach the hooks' `on_metrics` one step late, so that the host never waits on
the step in flight, except where a hook acting on a step asks for its metrics first (`needs_metrics`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from amsp_jax.trainer import Trainer, TrainState


@dataclasses.dataclass
class Step:
    """A step whose update has been dispatched (not necessarily finished)."""

    number: int
    state: TrainState
    last: bool
    """Whether this is the run's final step."""
    preempted: bool = False
    """Set by the preemption hook: save this step and stop; hooks after it in the list see it set."""


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """A finished step's numbers on the host."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    """The step skipped its update (`Trainer.step` does so exactly when loss or norm is not finite)."""
    skipped_total: int
    tokens_per_s: float | None
    """None for the first step this process ran: its time includes compiling."""
    mfu: float | None


class Hook:
    """A side job of the loop with its own state; each method does nothing unless overridden."""

    def needs_metrics(self, step: Step) -> bool:
        """Whether `on_step` acts on `step`, so every metric up to it must be published first."""
        return False

    def on_metrics(self, metrics: StepMetrics) -> None:
        """A step's metrics, in step order, one step after it was dispatched."""

    def on_step(self, step: Step) -> None:
        """After `step`'s update is dispatched."""

    def on_end(self, step: Step | None) -> None:
        """After the last step, or on an error (release files, handlers, bars); `step` the last one run."""


class MetricsReader:
    """Turns a step's device metrics into `StepMetrics`: skip count, throughput and MFU."""

    def __init__(self, start: int, tokens_per_step: int, flops_per_token: float, peak: float | None) -> None:
        """`peak`: the FLOP/s of all devices together, None where unknown (no MFU)."""
        self.start, self.tokens_per_step = start, tokens_per_step
        self.flops_per_token, self.peak = flops_per_token, peak
        self.skipped_total = 0
        self._last_step, self._last_time = start, time.perf_counter()

    def read(self, step: int, metrics: dict[str, jax.Array]) -> StepMetrics:
        """Wait for `step`'s metrics and measure the time since the previous step's."""
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        self.skipped_total += skipped
        now = time.perf_counter()
        rate = None
        if self._last_step > self.start:
            rate = self.tokens_per_step * (step - self._last_step) / (now - self._last_time)
        self._last_step, self._last_time = step, now
        mfu = rate * self.flops_per_token / self.peak if rate and self.peak else None
        return StepMetrics(step, loss, grad_norm, skipped, self.skipped_total, rate, mfu)

    def restart_clock(self) -> None:
        """Start timing the next step from now (the time hooks spent is not step time)."""
        self._last_time = time.perf_counter()


def loop(
    trainer: Trainer,
    state: TrainState,
    steps: range,
    batch_of: Callable[[int], Any],
    reader: MetricsReader,
    hooks: Sequence[Hook],
) -> tuple[TrainState, Step | None]:
    """Run `steps` from `state` on the batches `batch_of(step)`; the final state and the last step run."""
    pending: tuple[int, dict[str, jax.Array]] | None = None
    step = None

    def publish() -> None:
        nonlocal pending
        if pending is not None:
            metrics = reader.read(*pending)
            pending = None
            for hook in hooks:
                hook.on_metrics(metrics)

    try:
        for number in steps:
            state, metrics = trainer.step(state, batch_of(number))
            step = Step(number, state, last=number == steps[-1])
            publish()  # the previous step's, read only now that the next one is queued behind it
            pending = (number, metrics)
            acting = any(hook.needs_metrics(step) for hook in hooks)
            if acting:
                publish()
            for hook in hooks:
                hook.on_step(step)
            if acting:
                reader.restart_clock()
            if step.preempted:
                break
        publish()
    finally:
        for hook in hooks:
            hook.on_end(step)
    return state, step
