"""`amsp-jax train` end to end (the command, the plan it prints, metrics, exact resume across plans), the
config's sections, and the loop with its hooks on a trainer without JAX."""

from __future__ import annotations

import io
import json
import shutil
import signal
import sys

import jax
import numpy as np
import pytest

from amsp_jax.run import hooks
from amsp_jax.run.checkpoint import Checkpointer
from amsp_jax.run.config import (
    ConfigError,
    DataSection,
    OptimizerSection,
    RunSection,
    TrainConfig,
    load_config,
)
from amsp_jax.run.loop import Hook, MetricsReader, loop
from amsp_jax.run.train import train
from tests.train_helpers import (
    REPO,
    TINY_MODEL,
    metric_losses,
    reused_compilations,
    run_train_command,
    small_run_config,
    write_config,
    write_corpus,
)


@pytest.fixture(scope="module", autouse=True)
def _reuse_compilations(tmp_path_factory):
    with reused_compilations(tmp_path_factory.getbasetemp() / "xla-cache"):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """Six steps in one go through the command, saving every step (keeping the last two)."""
    root = tmp_path_factory.mktemp("straight")
    config = small_run_config(corpus, root / "run", {"run.checkpoint_every": 1})
    output = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdout", output)
        assert run_train_command(["--config", str(write_config(root / "config.yaml", config))]) == 0
    return root / "run", output.getvalue()


@pytest.fixture(scope="module")
def first_half(corpus, tmp_path_factory):
    """The same run stopped after three steps (a checkpoint at step 3)."""
    run_dir = tmp_path_factory.mktemp("half") / "run"
    result = train(small_run_config(corpus, run_dir, {"run.steps": 3}), out=io.StringIO())
    assert Checkpointer(run_dir / "checkpoints").steps() == [3]
    return run_dir, result


def copy_run(run_dir, tmp_path):
    return shutil.copytree(run_dir, tmp_path / "run")


def test_command_prints_the_plan_and_writes_metrics(straight):
    run_dir, output = straight
    for expected in [
        "devices     8 x cpu in 1 process(es); cluster 2 nodes x 4 (cpu-sim)",
        "model       llama " + TINY_MODEL + ": 125,248 parameters, dim 64, 2 layers",
        "plan        p=4x2,g=4x2,os=4x2 on 2x4 (cpu-sim), M=1, fp32, remat=full  [zero3]",
        "mesh        inter0=2 (inter-node), intra0=4",
        "gathering   per layer inside the layer scan of layers/layer",
        "MFU         against cpu-sim's peak",
    ]:
        assert expected in output, expected
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[0]["tokens_per_s"] is None and steps[-1]["tokens_per_s"] > 0 and steps[-1]["mfu"] > 0
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert "loss        first" in output and "(step 6)" in output
    assert Checkpointer(run_dir / "checkpoints").steps() == [5, 6]


def test_resume_gives_the_same_losses_as_training_straight(straight, first_half, corpus, tmp_path):
    expected = metric_losses(straight[0])
    half_dir, half = first_half
    run_dir = copy_run(half_dir, tmp_path)
    resumed = train(
        small_run_config(corpus, run_dir, {"run.steps": 6, "run.resume": True}), out=io.StringIO()
    )
    losses = {**half.losses, **resumed.losses}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    steps = range(1, 7)
    np.testing.assert_allclose([losses[s] for s in steps], [expected[s] for s in steps], rtol=1e-6)
    assert metric_losses(run_dir) == pytest.approx(expected, rel=1e-6)
    assert int(resumed.state.step) == 6


def test_resume_onto_another_strategy_and_device_count(straight, first_half, corpus, tmp_path):
    expected = metric_losses(straight[0])
    run_dir = copy_run(first_half[0], tmp_path)
    config = small_run_config(
        corpus,
        run_dir,
        {"run.steps": 6, "run.resume": True, "plan.strategy": "p=2x1,g=2x1,os=2x2", "plan.cluster": "2x2"},
    )
    output = io.StringIO()
    resumed = train(config, devices=jax.devices()[:4], out=output)
    assert "resumed at step 3, saved under p=4x2,g=4x2,os=4x2 on 2x4" in output.getvalue()
    assert resumed.trainer.layout.mesh.devices.size == 4
    # Same global batch and math; only the order of fp32 sums differs, by a few fp32 ulp
    # (benchmarks/results/run_notes_cpu_20261127-1700.md), which AdamW's eps=1e-3 keeps from growing.
    np.testing.assert_allclose(
        [resumed.losses[s] for s in (4, 5, 6)], [expected[s] for s in (4, 5, 6)], rtol=1e-6
    )


def test_a_data_path_that_does_not_exist(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["--data", str(tmp_path / "nowhere"), "--run-dir", str(run_dir), "--steps", "1"]
    assert run_train_command(argv) == 2
    assert f"error: data path does not exist: {tmp_path / 'nowhere'}" in capsys.readouterr().err
    assert not run_dir.exists()


def test_config_files_and_overrides():
    demo = load_config(REPO / "configs" / "train" / "demo.yaml")
    assert demo.data.paths == () and demo.plan.strategy == "auto" and demo.model.name == "small"
    assert (demo.run.steps, demo.run.keep_checkpoints, demo.run.dir) == (300, 2, "runs/demo-{time}")
    assert demo.optimizer.weight_decay == 0.1, "a key the file leaves out keeps its default"
    changed = load_config(REPO / "configs" / "train" / "demo.yaml", {"run.steps": 5, "data.paths": "x.txt"})
    assert (changed.run.steps, changed.data.paths, changed.model.name) == (5, ("x.txt",), "small")
    assert load_config(None, {"run.steps": None}).run.steps == 200, "None changes nothing"
    with pytest.raises(ValueError, match=r"unknown train settings \['run\.stepz'\]; known in run: steps"):
        load_config(None, {"run.stepz": 3})
    with pytest.raises(ValueError, match=r"unknown train settings \['steps'\]; .* did you mean run\.steps"):
        load_config(None, {"steps": 3})
    with pytest.raises(ValueError, match=r"unknown train section 'trainer'; the sections are model, data"):
        load_config(None, {"trainer.steps": 3})
    with pytest.raises(ValueError, match=r"train config nowhere\.yaml does not exist"):
        load_config("nowhere.yaml")
    assert load_config(None, {"plan.keep_first_layer": True}).plan.keep_first_layer
    with pytest.raises(ValueError, match=r"plan\.keep_first_layer must be true or false, got 'yes'"):
        load_config(None, {"plan.keep_first_layer": "yes"})


def test_sections_check_themselves_when_built():
    with pytest.raises(ConfigError, match=r"^run\.steps must be at least 1, got 0$"):
        RunSection(steps=0)
    with pytest.raises(ConfigError, match=r"^optimizer\.weight_decay must be zero or positive, got -1$"):
        OptimizerSection(weight_decay=-1)
    with pytest.raises(ConfigError, match=r"^data\.seq_len must be an integer, got 1\.5$"):
        DataSection(seq_len=1.5)
    assert DataSection(paths="a.txt").paths == ("a.txt",)
    config = TrainConfig(run=RunSection(steps=7))
    assert TrainConfig.from_dict(config.to_dict()) == config


# ---- the loop and its hooks, on a trainer that only counts ----------------------------------------------


class CountingTrainer:
    """Steps that record when they are dispatched and when their metrics are read; no JAX."""

    def __init__(self, trace: list[str], losses: dict[int, float], on_step=None) -> None:
        self.trace, self.losses, self.on_step = trace, losses, on_step

    def step(self, state, batch):
        number = state + 1
        self.trace.append(f"dispatch {number}")
        if self.on_step:
            self.on_step(number)
        return number, {"loss": Lazy(self.trace, number, self.losses.get(number, 1.0)), "grad_norm": 1.0}

    def evaluate(self, state, batch):
        return 0.5


class Lazy:
    """A device scalar stand-in: converting it to a float is the host waiting for the step."""

    def __init__(self, trace: list[str], step: int, value: float) -> None:
        self.trace, self.step, self.value = trace, step, value

    def __float__(self) -> float:
        self.trace.append(f"read {self.step}")
        return self.value


class Recorder(Hook):
    def __init__(self, trace: list[str], acts_at: set[int] = frozenset()) -> None:
        self.trace, self.acts_at = trace, acts_at

    def needs_metrics(self, step):
        return step.number in self.acts_at

    def on_metrics(self, metrics):
        self.trace.append(f"metrics {metrics.step}")

    def on_step(self, step):
        self.trace.append(f"step {step.number}")

    def on_end(self, step):
        self.trace.append(f"end {step.number}")


class FakeCheckpointer:
    directory = "ckpt"

    def __init__(self) -> None:
        self.saved: list[int] = []

    def save(self, trainer, state, rng, meta):
        self.saved.append(state)

    def wait(self):
        pass

    def steps(self):
        return self.saved


def run_loop(trainer, hooks, steps=4):
    reader = MetricsReader(0, tokens_per_step=8, flops_per_token=1.0, peak=None)
    return loop(trainer, 0, range(1, steps + 1), lambda step: None, reader, hooks)


def test_metrics_are_read_one_step_late_except_where_a_hook_acts():
    trace: list[str] = []
    state, last = run_loop(CountingTrainer(trace, {}), [Recorder(trace, acts_at={3})])
    assert (state, last.number) == (4, 4)
    assert trace == [
        "dispatch 1", "step 1",
        "dispatch 2", "read 1", "metrics 1", "step 2",
        "dispatch 3", "read 2", "metrics 2", "read 3", "metrics 3", "step 3",
        "dispatch 4", "step 4",
        "read 4", "metrics 4", "end 4",
    ]  # fmt: skip


def test_sigterm_saves_that_step_and_stops(capsys):
    trace: list[str] = []
    checkpointer = FakeCheckpointer()
    say = hooks.printer(sys.stdout, primary=True)
    before = signal.getsignal(signal.SIGTERM)
    side_jobs = [
        hooks.Preemption(),
        hooks.Checkpoints(checkpointer, None, np.zeros(2), lambda step: {}, every=100, say=say),
        Recorder(trace),
    ]
    sigterm_at_2 = CountingTrainer(
        trace, {}, on_step=lambda n: n == 2 and signal.raise_signal(signal.SIGTERM)
    )
    state, last = run_loop(sigterm_at_2, side_jobs, steps=10)
    assert (state, last.number, last.preempted) == (2, 2, True)
    assert checkpointer.saved == [2]
    assert "SIGTERM: saved step 2 to ckpt; stopping" in capsys.readouterr().out
    assert trace[-3:] == ["read 2", "metrics 2", "end 2"], "the last step's metrics are still published"
    assert signal.getsignal(signal.SIGTERM) == before


def test_bad_steps_in_a_row_stop_the_loop_and_close_the_log(tmp_path, capsys):
    nan = float("nan")
    trainer = CountingTrainer([], {2: nan, 4: nan, 5: nan})
    checkpointer = FakeCheckpointer()
    say = hooks.printer(sys.stdout, primary=True)
    log = hooks.MetricsLog(tmp_path / "metrics.jsonl")
    side_jobs = [log, hooks.DivergenceGuard(2, checkpointer, say)]
    with pytest.raises(hooks.DivergedError, match=r"not finite for 2 steps in a row \(steps 4-5\)"):
        run_loop(trainer, side_jobs, steps=8)
    assert log.file.closed
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["skipped_total"]) for r in records] == [
        (1, 1.0, 0), (2, None, 1), (3, 1.0, 1), (4, None, 2), (5, None, 3),
    ]  # fmt: skip
    out = capsys.readouterr().out
    assert "step 2: loss nan" in out and "(1 in a row, stop at 2)" in out and "(2 in a row, stop at 2)" in out
