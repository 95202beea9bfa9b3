"""Bad input never ends in a traceback, and a diverging run stops cleanly.

The table runs every command in this process (`amsp_jax.cli.main`, so JAX is imported once) on inputs
that are wrong in one way each: every case must exit with code 2, print one line naming the problem,
print no traceback, and change no file of its working directory (inputs and run directory alike).
The Python API's cases must raise the typed error with a message that says what to do. Then a run
whose loss turns NaN: the step is skipped, training goes on, its checkpoints restore, and a run of bad
steps stops with the last good checkpoint untouched.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import amsp_jax as aj
import amsp_jax.run.data
import amsp_jax.run.train
from amsp_jax.cli import main
from amsp_jax.cli.train import abandoned_orbax_read
from amsp_jax.compiled import compile_step
from amsp_jax.core.space import StrategyError
from amsp_jax.models.llama import LlamaConfig, ModelConfigError, make_loss_fn
from amsp_jax.run.checkpoint import Checkpointer
from amsp_jax.run.train import ConfigError, DivergedError, load_config, train
from amsp_jax.trainer import TrainerError
from tests.helpers import TINY, optimizer
from tests.train_helpers import (
    REPO,
    TINY_MODEL,
    child_env,
    file_digests,
    metric_losses,
    reused_compilations,
    small_run_config,
    write_config,
    write_corpus,
)

CPU_SIM = str(REPO / "configs" / "clusters" / "cpu-sim.yaml")
PLAN = ("plan", "--cluster", CPU_SIM, "--seq-len", "64", "--global-batch-tokens", "4096")
AUDIT = ("audit", "--model", TINY_MODEL, "--nodes", "2", "--devices-per-node", "4")
PROFILE = ("profile", "--out", "{dir}/measured.yaml", "--repeats", "1")
TRAIN = (
    "train", "--model", TINY_MODEL, "--data", "{corpus}", "--run-dir", "{dir}/run", "--steps", "1",
    "--strategy", "zero3", "--seq-len", "32", "--global-batch", "16", "--no-progress",
)  # fmt: skip

TINY_YAML = {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 176}
# Input files of the cases, by name: text (written as is) or bytes.
FILES: dict[str, str | bytes] = {
    "unclosed.yaml": "dim: [1, 2\n",
    "negative-dim.yaml": "".join(f"{k}: {v}\n" for k, v in {**TINY_YAML, "dim": -5}.items()),
    "string-dim.yaml": "".join(f"{k}: {v}\n" for k, v in {**TINY_YAML, "dim": '"64"'}.items()),
    "bool-layers.yaml": "".join(f"{k}: {v}\n" for k, v in {**TINY_YAML, "n_layers": "yes"}.items()),
    "list.yaml": "- dim\n- 64\n",
    "unknown-key.yaml": "".join(f"{k}: {v}\n" for k, v in {**TINY_YAML, "d_model": 64}.items()),
    "heads.yaml": "".join(f"{k}: {v}\n" for k, v in {**TINY_YAML, "dim": 60, "n_heads": 8}.items()),
    "kv-heads.yaml": "".join(f"{k}: {v}\n" for k, v in {**TINY_YAML, "n_kv_heads": 3}.items()),
    "cluster-nodes.yaml": Path(CPU_SIM).read_text().replace("nodes: 2", "nodes: many", 1),
    "cluster-device.yaml": "name: x\nnodes: 2\ndevices_per_node: 4\ndevice: 80GB\n",
    "train-unclosed.yaml": "run:\n  steps: {10\n",
    "train-steps.yaml": "run:\n  steps: ten\n",
    "train-lr.yaml": "optimizer:\n  learning_rate: -0.1\n",
    "train-eval.yaml": "run:\n  eval_every: 0\n",
    "train-unknown.yaml": "run:\n  stepz: 3\n",
    "train-flat.yaml": "steps: 3\n",
    "train-section.yaml": "run: 3\n",
    "train-list.yaml": "- steps\n",
    "train-precision.yaml": "plan:\n  precision: bf16\n",
    "train-bad-steps.yaml": "run:\n  stop_after_bad_steps: 0\n",
    "garbage.npy": os.urandom(4096),
    "floats.npy": b"",  # written by numpy below
    "wide.bin": np.arange(200, 4296, dtype=np.uint16).tobytes(),
    "odd.bin": b"\x01\x02\x03",
    "binary.jsonl": bytes(range(128, 256)) * 8,
}


@pytest.fixture(scope="module", autouse=True)
def _reuse_compilations(tmp_path_factory):
    with reused_compilations(tmp_path_factory.getbasetemp() / "xla-cache"):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), files=12)


# ---- the command line ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cli:
    """A command line (`{dir}`: the working directory, `{corpus}`: text data) and the error it gives."""

    name: str
    argv: tuple[str, ...]
    message: str
    """A regular expression the one error line must match."""
    saved_run: bool = False
    """Whether the working directory starts with a finished run (checkpoints) in `{dir}/run`."""


def plan(name: str, *argv: str, message: str, model: str = TINY_MODEL) -> Cli:
    return Cli(name, (*PLAN, "--model", model, *argv), message)


def audit(name: str, *argv: str, message: str) -> Cli:
    return Cli(name, (*AUDIT, *argv), message)


def train_cli(name: str, *argv: str, message: str, saved_run: bool = False) -> Cli:
    return Cli(name, (*TRAIN, *argv), message, saved_run)


CLI_CASES = [
    plan(
        "malformed model YAML",
        model="{dir}/unclosed.yaml",
        message=r"unclosed\.yaml is not valid YAML \(.*line 2",
    ),
    plan(
        "negative dim",
        model="{dir}/negative-dim.yaml",
        message=r"negative-dim\.yaml: dim must be at least 1, got -5",
    ),
    plan(
        "dim as a string",
        model="{dir}/string-dim.yaml",
        message=r"string-dim\.yaml: dim must be an integer, got '64'",
    ),
    plan(
        "boolean layer count",
        model="{dir}/bool-layers.yaml",
        message=r"n_layers must be an integer, got True",
    ),
    plan(
        "model YAML not a mapping",
        model="{dir}/list.yaml",
        message=r"list\.yaml is not a mapping of model settings",
    ),
    plan("unknown model key", model="{dir}/unknown-key.yaml", message=r"unknown model keys \['d_model'\]"),
    plan(
        "dim not a multiple of heads",
        model="{dir}/heads.yaml",
        message=r"dim 60 is not a multiple of n_heads 8",
    ),
    plan(
        "heads not a multiple of kv heads",
        model="{dir}/kv-heads.yaml",
        message=r"not a multiple of n_kv_heads 3",
    ),
    plan(
        "missing model file",
        model="{dir}/nowhere.yaml",
        message=r"model config .*nowhere\.yaml does not exist",
    ),
    plan("zero nodes", "--nodes", "0", message=r"--nodes must be at least 1, got 0"),
    plan("zero seq-len", "--seq-len", "0", message=r"--seq-len must be at least 1, got 0"),
    plan(
        "seq-len not a number",
        "--seq-len",
        "long",
        message=r"--seq-len: invalid int value: 'long'; see amsp-jax plan --help",
    ),
    plan(
        "negative batch",
        "--global-batch-tokens",
        "-4096",
        message=r"--global-batch-tokens must be at least 1",
    ),
    plan(
        "strategy that does not nest",
        "--strategy",
        "p=4x1,g=2x1,os=3x2",
        message=r"intra=3 does not divide the 4 devices per node",
    ),
    plan("strategy of an unknown component", "--strategy", "q=1x1", message=r"unknown component 'q'"),
    plan(
        "missing cluster file",
        "--cluster",
        "{dir}/none.yaml",
        message=r"cluster config .*none\.yaml does not exist",
    ),
    plan(
        "malformed cluster YAML",
        "--cluster",
        "{dir}/unclosed.yaml",
        message=r"unclosed\.yaml is not valid YAML",
    ),
    plan(
        "cluster nodes not a number",
        "--cluster",
        "{dir}/cluster-nodes.yaml",
        message=r"nodes = 'many' is not a number",
    ),
    plan(
        "cluster device not a mapping",
        "--cluster",
        "{dir}/cluster-device.yaml",
        message=r"device must be a mapping",
    ),
    plan("unknown precision", "--precision", "bf16", message=r"argument --precision: invalid choice: 'bf16'"),
    plan("unknown flag", "--frobnicate", message=r"unrecognized arguments: --frobnicate"),
    Cli("unknown command", ("plna",), r"invalid choice: 'plna'"),
    audit(
        "strategy that plan also rejects",
        "--strategy",
        "p=4x1,g=2x1,os=8x2",
        message=r"opt_state placement 8x2: intra=8 does not divide",
    ),
    audit(
        "cluster that does not match the devices",
        "--nodes",
        "4",
        message=r"--nodes 4 x --devices-per-node 4 = 16 devices, but JAX has 8",
    ),
    audit("zero micro-batches", "--micro-batches", "0", message=r"--micro-batches must be at least 1, got 0"),
    audit(
        "zero memory limit",
        "--memory-limit",
        "0",
        message=r"--memory-limit must be a number of GiB above 0, got 0$",
    ),
    audit("malformed model YAML", "--model", "{dir}/unclosed.yaml", message=r"is not valid YAML"),
    audit("unknown remat", "--remat", "some", message=r"argument --remat: invalid choice: 'some'"),
    Cli(
        "profile: sizes that are not sizes",
        (*PROFILE, "--sizes", "1MiB,lots"),
        r"size 'lots' is not a number of bytes",
    ),
    Cli(
        "profile: nodes that do not split the devices",
        (*PROFILE, "--nodes", "3"),
        r"8 devices do not split into 3 nodes",
    ),
    Cli("profile: zero nodes", (*PROFILE, "--nodes", "0"), r"--nodes must be at least 1, got 0"),
    train_cli(
        "malformed train config",
        "--config",
        "{dir}/train-unclosed.yaml",
        message=r"train-unclosed\.yaml is not valid YAML",
    ),
    train_cli(
        "missing train config",
        "--config",
        "{dir}/nowhere.yaml",
        message=r"train config .*nowhere\.yaml does not exist",
    ),
    train_cli(
        "train config value of the wrong type",
        "--config",
        "{dir}/train-steps.yaml",
        message=r"train-steps\.yaml: run\.steps must be an integer, got 'ten'",
    ),
    train_cli(
        "negative learning rate",
        "--config",
        "{dir}/train-lr.yaml",
        message=r"train-lr\.yaml: optimizer\.learning_rate must be a positive number, got -0\.1",
    ),
    train_cli(
        "zero eval interval",
        "--config",
        "{dir}/train-eval.yaml",
        message=r"train-eval\.yaml: run\.eval_every must be at least 1, got 0",
    ),
    train_cli(
        "unknown train setting",
        "--config",
        "{dir}/train-unknown.yaml",
        message=r"unknown train settings \['run\.stepz'\]; known in run: steps, ",
    ),
    train_cli(
        "train setting outside its section",
        "--config",
        "{dir}/train-flat.yaml",
        message=r"train-flat\.yaml: steps is a setting of the run section; write it under run:",
    ),
    train_cli(
        "train section not a mapping",
        "--config",
        "{dir}/train-section.yaml",
        message=r"train-section\.yaml: run must be a mapping of its settings \(e\.g\. run: \{steps: 200\}\)",
    ),
    train_cli(
        "train config not a mapping",
        "--config",
        "{dir}/train-list.yaml",
        message=r"is not a mapping of train settings",
    ),
    train_cli(
        "unknown precision in the config",
        "--config",
        "{dir}/train-precision.yaml",
        message=r"plan\.precision 'bf16' is not one of mixed, fp32",
    ),
    train_cli(
        "zero bad steps allowed",
        "--config",
        "{dir}/train-bad-steps.yaml",
        message=r"run\.stop_after_bad_steps must be at least 1",
    ),
    train_cli("steps not a number", "--steps", "ten", message=r"--steps: invalid int value: 'ten'"),
    train_cli("zero seq-len", "--seq-len", "0", message=r"--seq-len must be at least 1, got 0"),
    train_cli(
        "seq-len beyond the model",
        "--seq-len",
        "4096",
        message=r"seq_len 4096 exceeds the model's max_seq_len 256",
    ),
    train_cli(
        "batch that does not split",
        "--global-batch",
        "12",
        message=r"global batch 12 does not split into 8 devices x 1 micro-batches",
    ),
    train_cli(
        "model with a negative dim",
        "--model",
        "{dir}/negative-dim.yaml",
        message=r"dim must be at least 1, got -5",
    ),
    train_cli(
        "binary file as an .npy token file",
        "--data",
        "{dir}/garbage.npy",
        message=r"garbage\.npy is not a NumPy \.npy array",
    ),
    train_cli(
        "float .npy token file",
        "--data",
        "{dir}/floats.npy",
        message=r"floats\.npy holds float32 .*1-D integers",
    ),
    train_cli(
        "token ids beyond the vocabulary",
        "--data",
        "{dir}/wide.bin",
        message=r"token id 4295, outside the vocabulary of 256",
    ),
    train_cli(
        "token file of odd length",
        "--data",
        "{dir}/odd.bin",
        message=r"odd\.bin has 3 bytes, not a whole number of uint16",
    ),
    train_cli(
        "binary file as JSON lines",
        "--data",
        "{dir}/binary.jsonl",
        message=r"binary\.jsonl is not UTF-8 text",
    ),
    train_cli(
        "unknown token dtype",
        "--data-dtype",
        "float32",
        message=r"data\.dtype 'float32' is not one of uint16, int32",
    ),
    train_cli(
        "cluster shape that does not match the devices",
        "--cluster",
        "2x2",
        message=r"cluster 2x2 has 4 devices but this run has 8",
    ),
    train_cli(
        "strategy for another cluster",
        "--strategy",
        "p=8x1,g=8x1,os=8x1",
        message=r"intra=8 does not divide the 4 devices per node",
    ),
    train_cli(
        "missing cluster config",
        "--cluster",
        "{dir}/none.yaml",
        message=r"cluster config .*none\.yaml does not exist",
    ),
    train_cli(
        "coordinator without a process count",
        "--coordinator",
        "localhost:1234",
        message=r"--coordinator needs --num-processes and --process-id",
    ),
    train_cli(
        "process id out of range",
        "--coordinator",
        "localhost:1234",
        "--num-processes",
        "2",
        "--process-id",
        "2",
        message=r"--process-id 2 is not one of 0 \.\. 1",
    ),
    train_cli(
        "resume without a checkpoint", "--resume", message=r"no checkpoint in .*; start without --resume"
    ),
    train_cli(
        "start over a saved run",
        message=r"already holds checkpoints \(steps \[3, 6\]\); pass --resume",
        saved_run=True,
    ),
    train_cli(
        "resume with another model",
        "--resume",
        "--model",
        "{dir}/kv-heads.yaml",
        message=r"n_kv_heads 3",
        saved_run=True,
    ),
]


def working_dir(tmp_path: Path, saved_run: Path | None) -> Path:
    """The case's inputs (`FILES`), and a copy of a finished run when the case needs one."""
    for name, content in FILES.items():
        if isinstance(content, str):
            (tmp_path / name).write_text(content)
        else:
            (tmp_path / name).write_bytes(content)
    np.save(tmp_path / "floats.npy", np.linspace(0, 1, 64, dtype=np.float32))
    if saved_run is not None:
        shutil.copytree(saved_run, tmp_path / "run")
    return tmp_path


@pytest.mark.parametrize("case", CLI_CASES, ids=[f"{c.argv[0]}: {c.name}" for c in CLI_CASES])
def test_the_command_line_reports_bad_input_in_one_line(case, corpus, nan_run, tmp_path, capsys):
    directory = working_dir(tmp_path, nan_run.run_dir if case.saved_run else None)
    argv = [a.format(dir=directory, corpus=corpus) for a in case.argv]
    before = file_digests(directory)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    command = argv[0] if argv[0] in ("plan", "audit", "profile", "train") else None
    assert lines[0].startswith(f"amsp-jax {command}: error: " if command else "amsp-jax: error: "), err
    assert re.search(case.message, lines[0]), lines[0]
    assert "Traceback" not in out + err
    assert file_digests(directory) == before


# ---- the Python API ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Api:
    """The NaN run's trainer (its step compiled), a state, a state a step consumed, and a batch."""

    trainer: aj.Trainer
    state: Any
    consumed: Any
    batch: dict[str, np.ndarray]


ONE = aj.Cluster(1, 1)


def one_device_trainer(loss_fn: Callable[[Any, Any], jax.Array], model: Any) -> aj.Trainer:
    plan = aj.Plan(ONE, aj.zero3(ONE), precision="fp32", remat="none")
    return aj.Trainer(plan, model, optimizer(), loss_fn, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def api(nan_run, corpus) -> Api:
    trainer, config = nan_run.result.trainer, nan_run.config
    tokens = amsp_jax.run.data.load_corpus([str(corpus)]).train
    batch = amsp_jax.run.data.train_batch(tokens, 0, config.data.global_batch, config.data.seq_len, [1])
    first = Checkpointer(nan_run.run_dir / "checkpoints").restore(trainer, 6).state
    state, _ = trainer.step(first, batch)
    return Api(trainer, state, first, batch)


def not_a_scalar_loss(api: Api) -> aj.Trainer:
    """A trainer like the NaN run's whose loss function forgot to take the mean."""
    like = api.trainer
    trainer = aj.Trainer(
        like.plan,
        like.model,
        like.optimizer,
        lambda p, b: like.loss_fn(p, b) * jnp.ones(3),
        jax.devices()[:1],
    )
    trainer.setup(jax.random.key(0), api.batch["inputs"])
    return trainer


def integer_param_model() -> Any:
    class WithCounter(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array) -> jax.Array:
            self.param("count", lambda _, shape: jnp.zeros(shape, jnp.int32), (4,))
            return nn.Embed(TINY.vocab_size, 8)(tokens)

    return WithCounter()


API_CASES: list[tuple[str, Callable[[Api], object], type[Exception], str]] = [
    (
        "step before init",
        lambda a: one_device_trainer(a.trainer.loss_fn, a.trainer.model).step(a.state, a.batch),
        TrainerError,
        r"call trainer\.init\(key, example_inputs\) before step\(\)",
    ),
    (
        "a state the step consumed",
        lambda a: a.trainer.step(a.consumed, a.batch),
        TrainerError,
        r"consumed by an earlier step\(\).*use the state it returned",
    ),
    (
        "a loss that is not a scalar",
        lambda a: not_a_scalar_loss(a).step(a.state, a.batch),
        TrainerError,
        r"loss_fn must return a scalar.*shape: \(3,\).*jnp\.mean",
    ),
    (
        "integer parameters",
        lambda a: one_device_trainer(lambda p, b: 0.0, integer_param_model()).init(
            jax.random.key(0), a.batch["inputs"]
        ),
        TrainerError,
        r"parameter count is int32.*keep integer state out of the 'params'",
    ),
    (
        "a batch that is not arrays",
        lambda a: a.trainer.step(a.state, [1, 2, 3]),
        TrainerError,
        r"a batch is a tree of arrays",
    ),
    (
        "batch leaves of different sizes",
        lambda a: a.trainer.step(a.state, {**a.batch, "targets": a.batch["targets"][:3]}),
        TrainerError,
        r"same leading batch dimension",
    ),
    (
        "not a TrainState",
        lambda a: a.trainer.step({"params": 1}, a.batch),
        TrainerError,
        r"needs the TrainState init\(\) returned, got dict",
    ),
    (
        "a model config with dim -5",
        lambda a: LlamaConfig(dim=-5),
        ModelConfigError,
        r"dim must be at least 1",
    ),
    (
        "a strategy that does not fit",
        lambda a: aj.Plan(aj.Cluster(2, 4), "p=3x1,g=1x1,os=1x1"),
        StrategyError,
        r"intra=3",
    ),
    (
        "a train setting out of range",
        lambda a: load_config(None, {"run.keep_checkpoints": 0}),
        ConfigError,
        r"run\.keep_checkpoints must be at least 1, got 0",
    ),
]


@pytest.mark.parametrize("case", API_CASES, ids=[c[0] for c in API_CASES])
def test_the_api_raises_typed_errors_that_say_what_to_do(case, api):
    _, call, kind, message = case
    with pytest.raises(kind, match=message):
        call(api)


def test_a_step_the_device_cannot_hold_is_refused_before_it_runs(api, monkeypatch):
    """Where the device's allocator says less than the compiled step needs, the step is refused in one
    line before it runs, and the state it was given is still whole (nothing donated)."""
    like = api.trainer
    trainer = aj.Trainer(
        like.plan, like.model, like.optimizer, like.loss_fn, list(like.layout.mesh.devices.flat)
    )
    trainer.setup(jax.random.key(0), api.batch["inputs"])
    state = jax.tree.map(jnp.copy, api.state)
    monkeypatch.setattr(compile_step, "device_bytes_limit", lambda device: 2**20)
    with pytest.raises(
        TrainerError, match=r"^the compiled step needs \d+\.\d+ GiB per device, more than the 0\.00 GiB"
    ):
        trainer.step(state, api.batch)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_a_non_finite_step_is_skipped(api):
    """The step with a NaN loss leaves master, optimizer state and P exactly as they were."""
    trainer, state, step = api.trainer, api.state, int(api.state.step)
    before = jax.tree.map(np.asarray, (state.params, state.master, state.opt_state))
    bad = {k: v.copy() for k, v in api.batch.items()}
    bad["inputs"][0, 0] = -1  # the NaN run's loss is NaN for a negative token id
    skipped, metrics = trainer.step(state, bad)
    assert math.isnan(float(metrics["loss"])) and int(skipped.step) == step + 1
    after = jax.tree.map(np.asarray, (skipped.params, skipped.master, skipped.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    moved, metrics = trainer.step(skipped, api.batch)
    assert math.isfinite(float(metrics["loss"]))
    assert not np.array_equal(np.asarray(moved.master["embed"]), before[1]["embed"])


# ---- a run whose loss turns NaN --------------------------------------------------------------------------


@dataclasses.dataclass
class NanRun:
    """Six steps on one device whose step 2 had a NaN loss; checkpoints at steps 3 and 6."""

    run_dir: Path
    result: amsp_jax.run.train.TrainResult
    config: amsp_jax.run.train.TrainConfig


def poisoned(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """Make the loss NaN at `steps`: their batches get a token id -1, which the loss turns into NaN."""
    draw = amsp_jax.run.data.train_batch

    def train_batch(tokens, index, *args, **kwargs):
        batch = draw(tokens, index, *args, **kwargs)
        if index + 1 in steps:  # the batch of step i is batch number i - 1
            batch["inputs"][0, 0] = -1
        return batch

    def loss_fn(model):
        loss = make_loss_fn(model)
        return lambda params, batch: (
            loss(params, batch) + jnp.where(jnp.any(batch["inputs"] < 0), jnp.nan, 0.0)
        )

    monkeypatch.setattr(amsp_jax.run.data, "train_batch", train_batch)
    monkeypatch.setattr(amsp_jax.run.train, "make_loss_fn", loss_fn)


def one_device_config(corpus: Path, run_dir: Path) -> amsp_jax.run.train.TrainConfig:
    return small_run_config(corpus, run_dir, {"plan.cluster": "1x1"})


@pytest.fixture(scope="module")
def nan_run(corpus, tmp_path_factory) -> NanRun:
    run_dir = tmp_path_factory.mktemp("nan") / "run"
    config = one_device_config(corpus, run_dir)
    with pytest.MonkeyPatch.context() as patch:
        poisoned(patch, {2})
        result = train(config, devices=jax.devices()[:1], out=io.StringIO())
    return NanRun(run_dir, result, config)


def test_a_nan_loss_skips_its_step_and_training_goes_on(nan_run):
    records = [json.loads(line) for line in (nan_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "skipped" in r}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert steps[2]["skipped"] and steps[2]["loss"] is None
    assert [steps[s]["skipped_total"] for s in range(1, 7)] == [0, 1, 1, 1, 1, 1]
    assert all(math.isfinite(steps[s]["loss"]) for s in (1, 3, 4, 5, 6))
    assert int(nan_run.result.state.step) == 6
    assert Checkpointer(nan_run.run_dir / "checkpoints").steps() == [3, 6]
    for step in (3, 6):
        restored = Checkpointer(nan_run.run_dir / "checkpoints").restore(nan_run.result.trainer, step)
        assert int(restored.state.step) == step
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.state.master))


def test_a_run_resumed_after_a_skipped_step_trains_as_it_did(nan_run, corpus, tmp_path, monkeypatch):
    run_dir = shutil.copytree(nan_run.run_dir, tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / "6")
    poisoned(monkeypatch, set())  # the same loss function, so the same program (compiled once)
    resumed = train(
        nan_run.config.override({"run.dir": str(run_dir), "run.resume": True}),
        devices=jax.devices()[:1],
        out=io.StringIO(),
    )
    expected = metric_losses(nan_run.run_dir)
    # Same device, plan and batches: the resumed steps repeat the first run's arithmetic exactly.
    assert [resumed.losses[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]


def test_bad_steps_in_a_row_stop_the_run_and_keep_the_last_checkpoint(nan_run, corpus, tmp_path, monkeypatch):
    run_dir = shutil.copytree(nan_run.run_dir, tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / "6")
    saved = file_digests(run_dir / "checkpoints")
    config = nan_run.config.override(
        {"run.dir": str(run_dir), "run.resume": True, "run.stop_after_bad_steps": 2}
    )
    poisoned(monkeypatch, {4, 5})
    output = io.StringIO()
    with pytest.raises(DivergedError, match=r"not finite for 2 steps in a row \(steps 4-5\)") as error:
        train(config, devices=jax.devices()[:1], out=output)
    assert f"newest checkpoint (step 3 in {run_dir / 'checkpoints'})" in str(error.value)
    assert "step 4: loss nan" in output.getvalue()
    assert file_digests(run_dir / "checkpoints") == saved
    restored = Checkpointer(run_dir / "checkpoints").restore(nan_run.result.trainer)
    assert int(restored.state.step) == 3


def test_the_command_reports_a_stopped_run_in_one_line(monkeypatch, capsys, corpus, tmp_path):
    def diverge(config, *args, **kwargs):
        raise DivergedError("the loss or gradient norm was not finite for 5 steps in a row")

    monkeypatch.setattr(amsp_jax.run.train, "train", diverge)
    argv = [a.format(dir=tmp_path, corpus=corpus) for a in TRAIN]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "amsp-jax train: stopped: the loss or gradient norm was not finite for 5 steps in a row"
    )


def test_resuming_a_damaged_checkpoint_prints_one_line_and_exits_cleanly(nan_run, tmp_path):
    """In a process of its own: Orbax's reader threads used to print tracebacks at interpreter exit."""
    run_dir = shutil.copytree(nan_run.run_dir, tmp_path / "run")
    for data_file in (run_dir / "checkpoints" / "6" / "state").rglob("d/*"):
        data_file.write_bytes(os.urandom(data_file.stat().st_size))
    before = file_digests(run_dir)
    config = write_config(tmp_path / "config.yaml", nan_run.config.override({"run.dir": str(run_dir)}))
    child = subprocess.run(
        [sys.executable, "-m", "amsp_jax.cli", "train", "--config", str(config), "--resume"],
        env=child_env(1),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert child.returncode == 2, child.stderr[-3000:]
    ours = [line for line in child.stderr.splitlines() if line.startswith("amsp-jax")]
    assert len(ours) == 1 and "checkpoint step 6" in ours[0] and "is damaged or unreadable" in ours[0]
    assert "Traceback" not in child.stderr and "Event loop is closed" not in child.stderr, child.stderr[
        -3000:
    ]
    assert file_digests(run_dir) == before


def _never_retrieved(message: str, raised_in: str) -> logging.LogRecord:
    """asyncio's report of an exception raised in code from the file `raised_in`."""
    try:
        exec(compile("raise ValueError('DATA_LOSS: Error reading byte range')", raised_in, "exec"))
    except ValueError:
        exc_info = sys.exc_info()
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, exc_info)


def test_only_orbax_reads_abandoned_by_a_failed_restore_are_quieted():
    # Under load the report was about the `gather` of Orbax's reads, a future whose repr names only
    # the error, with Orbax in the traceback: the damaged-checkpoint command printed it.
    orbax_file = "/site-packages/orbax/checkpoint/_src/serialization/jax_array_handlers.py"
    gathered = "_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished>"
    task = f"Task exception was never retrieved\nfuture: <Task coro=<_async_deserialize() {orbax_file}>>"
    assert abandoned_orbax_read(_never_retrieved(gathered, orbax_file))
    assert abandoned_orbax_read(_never_retrieved(task, "<string>"))
    assert not abandoned_orbax_read(_never_retrieved(gathered, "/home/user/my_loader.py"))
    assert not abandoned_orbax_read(_never_retrieved("Executing <Task> took 0.2 seconds", orbax_file))


def test_the_table_is_large_enough():
    assert len(CLI_CASES) + len(API_CASES) >= 40
