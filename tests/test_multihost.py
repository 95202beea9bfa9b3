"""Several processes through `jax.distributed`: 2 processes x 4 CPU devices train like 1 x 8, with a
tensor axis inside each process."""

from __future__ import annotations

import io
import os
import socket
import subprocess

import numpy as np
import pytest

from amsp_jax.run import distributed
from amsp_jax.run.checkpoint import Checkpointer
from amsp_jax.run.train import train
from tests.helpers import max_relative_error
from tests.train_helpers import (
    REPO,
    child_env,
    metric_losses,
    reused_compilations,
    small_run_config,
    train_command,
    write_config,
    write_corpus,
)

CHILD_TIMEOUT = 300
# Every component sharded over both processes' data-parallel ranks, so every data-parallel collective
# crosses them; a tensor group of 2 inside each process (a group never spans processes).
STRATEGY = "t=2,zero3"


@pytest.fixture(scope="module", autouse=True)
def _reuse_compilations(tmp_path_factory):
    with reused_compilations(tmp_path_factory.getbasetemp() / "xla-cache"):
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_of_four_devices_match_one_of_eight(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    config = small_run_config(
        corpus,
        tmp_path / "two",
        {"run.steps": 4, "plan.strategy": STRATEGY, "run.eval_every": 4, "run.checkpoint_every": 4},
    )
    flags = ["--config", str(write_config(tmp_path / "config.yaml", config))]
    coordinator = f"localhost:{free_port()}"
    children = [
        subprocess.Popen(
            train_command(
                *flags, "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)
            ),
            env=child_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for i in range(2)
    ]
    try:
        outputs = [child.communicate(timeout=CHILD_TIMEOUT) for child in children]
    finally:
        for child in children:
            child.kill()
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err[-3000:]
    assert "devices     8 x cpu in 2 process(es); cluster 2 nodes x 4 (detected-cpu)" in outputs[0][0]
    assert "amsp-jax train" not in outputs[1][0], "only process 0 prints the plan"

    single = train(
        small_run_config(corpus, tmp_path / "one", {"run.steps": 4, "plan.strategy": STRATEGY}),
        out=io.StringIO(),
    )
    two = metric_losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3, 4]
    # The same program over the same 8-device mesh; gloo sums across processes in its own order,
    # which can move the last bit of an fp32 sum.
    np.testing.assert_allclose(
        [two[s] for s in range(1, 5)], [single.losses[s] for s in range(1, 5)], rtol=1e-6
    )

    # The checkpoint both processes wrote together restores in one process.
    checkpoints = Checkpointer(tmp_path / "two" / "checkpoints")
    assert checkpoints.read_meta()["cluster"] == "2x4"
    restored = checkpoints.restore(single.trainer)
    restored_params = single.trainer.full_params(restored.state)
    assert max_relative_error(restored_params, single.trainer.full_params(single.state)) < 1e-5


def test_distributed_flags_need_each_other():
    with pytest.raises(ValueError, match="--coordinator needs --num-processes and --process-id"):
        distributed.initialize("localhost:1234")
    with pytest.raises(ValueError, match="need --coordinator"):
        distributed.initialize(num_processes=2, process_id=0)
    assert distributed.initialize() is False  # neither flags nor a SLURM / Open MPI launch: one process


def test_launchers_count_inside_their_job_steps_only(monkeypatch):
    for name in [n for n in os.environ if n.startswith(("SLURM_", "OMPI_"))]:
        monkeypatch.delenv(name)
    assert distributed.launcher() is None
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert distributed.launcher() is None, "a batch script sees the job's tasks but is one process"
    for name, value in [
        ("SLURM_STEP_NODELIST", "gpu[001-016]"),
        ("SLURM_STEP_NUM_TASKS", "16"),
        ("SLURM_STEP_NUM_NODES", "16"),
        ("SLURM_GPUS_ON_NODE", "8"),
    ]:
        monkeypatch.setenv(name, value)
    assert distributed.launcher() == "slurm"
    assert distributed.node_devices("slurm") == list(range(8)), "one process per node drives all 8 GPUs"
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "128")
    assert distributed.node_devices("slurm") is None, "one process per GPU: JAX's own choice"
