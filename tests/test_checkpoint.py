"""Checkpoints: whole or absent after SIGKILL, saved on SIGTERM, and clear errors that change nothing."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import jax
import numpy as np
import optax
import pytest

import amsp_jax as aj
from amsp_jax.run.checkpoint import Checkpointer, CheckpointError
from amsp_jax.run.train import train
from tests.train_helpers import (
    REPO,
    child_env,
    file_digests,
    metric_losses,
    reused_compilations,
    run_train_command,
    small_run_config,
    start_child,
    train_command,
    write_config,
    write_corpus,
)

CHILD_TIMEOUT = 240
# A restore of a damaged checkpoint leaves Orbax's reader coroutines and event loop behind; Python
# reports them when they are collected, in whichever test runs then.
pytestmark = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def _reuse_compilations(tmp_path_factory):
    with reused_compilations(tmp_path_factory.getbasetemp() / "xla-cache"):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def saved_run(corpus, tmp_path_factory):
    """A three-step run with its checkpoint at step 3."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    return run_dir, train(small_run_config(corpus, run_dir, {"run.steps": 3}), out=io.StringIO())


def test_sigkill_during_a_save_leaves_the_previous_checkpoint(saved_run, corpus, tmp_path):
    run_dir = tmp_path / "run"
    child = start_child(str(corpus), str(run_dir))
    watchdog = threading.Timer(CHILD_TIMEOUT, child.kill)
    watchdog.start()
    try:
        lines = iter(child.stdout.readline, "")
        assert any(line.strip() == "SAVING" for line in lines), child.stderr.read()[-3000:]
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        watchdog.cancel()
        child.kill()
    assert child.returncode == -signal.SIGKILL
    checkpoints = run_dir / "checkpoints"
    assert list(checkpoints.glob("2.orbax-checkpoint-tmp*")), "the save of step 2 should have been cut short"
    assert Checkpointer(checkpoints).steps() == [1]

    # Step 1 restores and training continues exactly as the uninterrupted three-step run did.
    resumed = train(
        small_run_config(corpus, run_dir, {"run.steps": 3, "run.resume": True}), out=io.StringIO()
    )
    expected = saved_run[1].losses
    np.testing.assert_allclose([resumed.losses[s] for s in (2, 3)], [expected[s] for s in (2, 3)], rtol=1e-6)
    assert Checkpointer(checkpoints).steps() == [1, 3]


def test_sigterm_saves_and_exits_cleanly(corpus, tmp_path):
    run_dir = tmp_path / "run"
    config = small_run_config(
        corpus, run_dir, {"run.steps": 100_000, "run.eval_every": 100_000, "run.checkpoint_every": 100_000}
    )
    command = train_command("--config", str(write_config(tmp_path / "config.yaml", config)))
    # No XLA_FLAGS: the command itself asks for the 8 simulated devices.
    child = subprocess.Popen(
        command, env=child_env(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not ((run_dir / "metrics.jsonl").exists() and len(metric_losses(run_dir)) >= 2):
            assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()[-3000:]
            time.sleep(0.2)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=CHILD_TIMEOUT)
    finally:
        child.kill()
    assert child.returncode == 0, err[-3000:]
    assert "devices     8 x cpu in 1 process(es)" in out
    saved = int(re.search(r"SIGTERM: saved step (\d+)", out).group(1))
    assert Checkpointer(run_dir / "checkpoints").steps() == [saved]
    assert max(metric_losses(run_dir)) == saved


def test_resume_without_a_checkpoint(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = [
        "--data",
        str(corpus),
        "--model",
        small_run_config(corpus, run_dir).model.name,
        "--run-dir",
        str(run_dir),
    ]
    assert run_train_command([*argv, "--resume"]) == 2
    assert (
        f"error: no checkpoint in {run_dir.absolute() / 'checkpoints'}; start without --resume"
        in capsys.readouterr().err
    )
    assert not run_dir.exists()


def resume_fails(run_dir, corpus, capsys, *extra: str) -> str:
    """Resume `run_dir` with the test config and `extra` flags: it must fail and leave every file alone."""
    before = file_digests(run_dir)
    config = small_run_config(corpus, run_dir, {"run.steps": 6})
    assert run_train_command(["--config", str(write_config(run_dir.parent / "c.yaml", config)), *extra]) == 2
    assert file_digests(run_dir) == before
    return capsys.readouterr().err


def test_a_damaged_checkpoint_is_a_clear_error(saved_run, corpus, tmp_path, capsys):
    run_dir = shutil.copytree(saved_run[0], tmp_path / "run")
    for data_file in (run_dir / "checkpoints" / "3" / "state").rglob("d/*"):
        data_file.write_bytes(os.urandom(data_file.stat().st_size))
    err = resume_fails(run_dir, corpus, capsys, "--resume")
    assert f"checkpoint step 3 in {run_dir / 'checkpoints'} is damaged or unreadable" in err
    assert "to start again, or start a new run directory" in err


def test_a_checkpoint_of_another_model_is_a_clear_error(saved_run, corpus, tmp_path, capsys):
    run_dir = shutil.copytree(saved_run[0], tmp_path / "run")
    other = tmp_path / "other.yaml"
    other.write_text((REPO / "configs" / "models" / "tiny.yaml").read_text().replace("dim: 64", "dim: 32"))
    err = resume_fails(run_dir, corpus, capsys, "--resume", "--model", str(other))
    assert "is of another model: saved dim: 64 here 32" in err


def test_starting_over_an_existing_run_is_refused(saved_run, corpus, tmp_path, capsys):
    run_dir = shutil.copytree(saved_run[0], tmp_path / "run")
    assert "already holds checkpoints (steps [3]); pass --resume" in resume_fails(run_dir, corpus, capsys)


def test_checkpoint_errors_name_the_step_and_the_fix(saved_run, tmp_path):
    checkpoints = Checkpointer(shutil.copytree(saved_run[0], tmp_path / "run") / "checkpoints")
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 7 .* it has steps \[3\]"):
        checkpoints.read_meta(7)
    assert checkpoints.read_meta()["data_position"] == 3
    trainer = saved_run[1].trainer
    other = aj.Trainer(trainer.plan, trainer.model, optax.sgd(0.1), trainer.loss_fn)
    other.setup(jax.random.key(0), np.zeros((16, 32), np.int32))
    with pytest.raises(CheckpointError, match=r"another optimizer \(saved: EmptyState, ScaleByAdamState"):
        checkpoints.restore(other)
