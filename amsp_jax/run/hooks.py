"""The side jobs of the training loop, one `Hook` each: metrics log, progress bar, held-out evaluation,
checkpoints, divergence guard and preemption. Only process 0 prints and writes `metrics.jsonl`; every
process evaluates, saves (Orbax's saves are collective) and agrees on preemption."""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from amsp_jax.run.checkpoint import Checkpointer
from amsp_jax.run.loop import Hook, Step, StepMetrics
from amsp_jax.trainer import Trainer

Say = Callable[[str], None]


class DivergedError(RuntimeError):
    """Training stopped: the loss or gradient norm stayed non-finite for too many steps in a row."""


def printer(out: TextIO, primary: bool) -> Say:
    """A function printing a line on process 0 above the progress bar (tqdm's write moves the bar)."""

    def say(text: str) -> None:
        if primary:
            tqdm.write(text, file=out)

    return say


def _finite_or_none(x: float) -> float | None:
    # JSON has no NaN or infinity: a non-finite value is written as null.
    return x if math.isfinite(x) else None


class MetricsLog(Hook):
    """Every step's metrics as a JSON line of `path` (None: write nothing); keeps the losses by step."""

    def __init__(self, path: Path | None) -> None:
        """Appends, so that a resumed run continues the same file."""
        self.file = path.open("a") if path is not None else None
        self.losses: dict[int, float] = {}

    def write(self, record: dict[str, Any]) -> None:
        """One JSON line, flushed so that a killed run keeps what it wrote."""
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def on_metrics(self, metrics: StepMetrics) -> None:
        """Record the step."""
        self.losses[metrics.step] = metrics.loss
        self.write(
            {
                "step": metrics.step,
                "loss": _finite_or_none(metrics.loss),
                "grad_norm": _finite_or_none(metrics.grad_norm),
                "skipped": metrics.skipped,
                "skipped_total": metrics.skipped_total,
                "tokens_per_s": metrics.tokens_per_s,
                "mfu": metrics.mfu,
                "time": time.time(),
            }
        )

    def on_end(self, step: Step | None) -> None:
        """Close the file."""
        if self.file is not None:
            self.file.close()


class ProgressBar(Hook):
    """A tqdm bar of steps with the loss, tokens/s, MFU and skipped steps."""

    def __init__(self, start: int, total: int, show: bool) -> None:
        """Starts at `start` (a resumed run's step) out of `total`."""
        self.bar = tqdm(total=total, initial=start, disable=not show, dynamic_ncols=True)

    def on_metrics(self, metrics: StepMetrics) -> None:
        """Move to the step and show its numbers."""
        speed = f"{metrics.tokens_per_s:,.0f} tok/s" if metrics.tokens_per_s else "compiling"
        mfu = f"{metrics.mfu:.1%}" if metrics.mfu else "n/a"
        skips = f", {metrics.skipped_total} skipped" if metrics.skipped_total else ""
        self.bar.set_postfix_str(f"loss {metrics.loss:.4f}, {speed}, MFU {mfu}{skips}", refresh=False)
        self.bar.update(metrics.step - self.bar.n)

    def on_end(self, step: Step | None) -> None:
        """Close the bar."""
        self.bar.close()


class HeldOutEval(Hook):
    """The mean loss over the held-out batches every `every` steps and at the last step."""

    def __init__(self, trainer: Trainer, batches: list[Any], every: int, log: MetricsLog, say: Say) -> None:
        """`log` gets the held-out losses beside the step records."""
        self.trainer, self.batches, self.every = trainer, batches, every
        self.log, self.say = log, say
        self.losses: dict[int, float] = {}

    def needs_metrics(self, step: Step) -> bool:
        """The evaluation steps (so that their time is not counted as step time)."""
        return step.number % self.every == 0 or step.last

    def on_step(self, step: Step) -> None:
        """Evaluate on an evaluation step."""
        if not self.needs_metrics(step):
            return
        loss = float(np.mean([float(self.trainer.evaluate(step.state, b)) for b in self.batches]))
        self.losses[step.number] = loss
        self.log.write({"step": step.number, "eval_loss": loss})
        self.say(f"step {step.number}: held-out loss {loss:.4f}")


class Checkpoints(Hook):
    """Start an asynchronous save every `every` steps, at the last step and when preempted."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        trainer: Trainer,
        rng: np.ndarray,
        meta: Callable[[int], dict[str, Any]],
        every: int,
        say: Say,
    ) -> None:
        """`rng`: the data seed saved with each state; `meta(step)`: what the checkpoint records beside."""
        self.checkpointer, self.trainer, self.rng, self.meta = checkpointer, trainer, rng, meta
        self.every, self.say = every, say

    def on_step(self, step: Step) -> None:
        """Save when due; say so when the save is the preemption's."""
        if step.number % self.every == 0 or step.last or step.preempted:
            self.checkpointer.save(self.trainer, step.state, self.rng, self.meta(step.number))
        if step.preempted:
            self.say(f"SIGTERM: saved step {step.number} to {self.checkpointer.directory}; stopping")


class DivergenceGuard(Hook):
    """Stop the run after `limit` skipped (non-finite) steps in a row, the newest checkpoint untouched."""

    def __init__(self, limit: int, checkpointer: Checkpointer, say: Say) -> None:
        """Counts the skipped steps in a row."""
        self.limit, self.checkpointer, self.say = limit, checkpointer, say
        self.in_a_row = 0

    def on_metrics(self, metrics: StepMetrics) -> None:
        """Count a skipped step, warn, and raise DivergedError at the limit."""
        if not metrics.skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        step = metrics.step
        self.say(
            f"step {step}: loss {metrics.loss} / gradient norm {metrics.grad_norm} not finite; update "
            f"skipped ({self.in_a_row} in a row, stop at {self.limit})"
        )
        if self.in_a_row < self.limit:
            return
        self.checkpointer.wait()
        saved = self.checkpointer.steps()
        newest = f"step {saved[-1]} in {self.checkpointer.directory}" if saved else "none saved yet"
        raise DivergedError(
            f"the loss or gradient norm was not finite for {self.in_a_row} steps in a row (steps "
            f"{step - self.in_a_row + 1}-{step}), each skipped, so training stopped; the newest "
            f"checkpoint ({newest}) holds the last good state: resume from it with a lower "
            "learning_rate or grad_clip, or check the data of those steps"
        )


class Preemption(Hook):
    """SIGTERM as a request to save and stop; every process stops at the same step.

    One process: a Python handler sets a flag. Several processes: JAX's preemption service (started by
    `jax.distributed.initialize`) already catches SIGTERM and agrees on a step with the others.
    """

    def __init__(self) -> None:
        """Install the handler (one process only; `on_end` puts the previous one back)."""
        self.requested = False
        self.multiprocess = jax.process_count() > 1
        self._previous: Any = None
        # Python handlers can only be installed from the main thread.
        if not self.multiprocess and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True

    def on_step(self, step: Step) -> None:
        """Mark the step preempted once SIGTERM came (on every process at the same step)."""
        if self.multiprocess:
            self.requested = self.requested or multihost_utils.reached_preemption_sync_point(step.number)
        step.preempted = self.requested

    def on_end(self, step: Step | None) -> None:
        """Put back the SIGTERM handler that was there before."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
