"""Weights out and in: `load_params` and `amsp-jax export` on any device count, `--init-from` back."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys

import flax
import jax
import numpy as np
import pytest

import amsp_jax as aj
from amsp_jax.cli import export as export_command
from amsp_jax.models.llama import Llama, LlamaConfig
from amsp_jax.run.checkpoint import CheckpointError, params_metadata
from amsp_jax.run.train import ConfigError, setup, train
from tests.train_helpers import (
    REPO,
    TINY_MODEL,
    child_env,
    reused_compilations,
    small_run_config,
    write_corpus,
)

CHILD_TIMEOUT = 240
TOKENS = np.random.default_rng(3).integers(0, 256, (2, 32)).astype(np.int32)

# Run on one device: export the run, then the logits of the exported file and of `load_params`.
ONE_DEVICE_CHILD = """
import sys
import jax
import numpy as np
import amsp_jax as aj
from amsp_jax.cli import main
from amsp_jax.models.llama import Llama, LlamaConfig

run_dir, out, config, tokens, result = sys.argv[1:]
assert main(["export", run_dir, "--out", out]) == 0
model = Llama(LlamaConfig.from_yaml(config))
inputs = np.load(tokens)
logits = {
    "exported": model.apply({"params": aj.read_params(out)}, inputs),
    "loaded": model.apply({"params": aj.load_params(run_dir)}, inputs),
}
np.savez(result, devices=jax.device_count(), **{k: np.asarray(v) for k, v in logits.items()})
"""


@pytest.fixture(scope="module", autouse=True)
def _reuse_compilations(tmp_path_factory):
    with reused_compilations(tmp_path_factory.getbasetemp() / "xla-cache"):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained_run(corpus, tmp_path_factory):
    """A three-step run on 8 devices under ZeRO-3 (checkpoint at step 3) and its parameters."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    result = train(small_run_config(corpus, run_dir, {"run.steps": 3}), out=io.StringIO())
    return run_dir, result.trainer.full_params(result.state)


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    """The run exported and read back in a fresh one-device process: the file, and the child's logits."""
    run_dir, _ = trained_run
    where = tmp_path_factory.mktemp("exported")
    out, tokens, result = where / "tiny.safetensors", where / "tokens.npy", where / "logits.npz"
    np.save(tokens, TOKENS)
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            ONE_DEVICE_CHILD,
            str(run_dir),
            str(out),
            TINY_MODEL,
            str(tokens),
            str(result),
        ],
        env=child_env(1),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=CHILD_TIMEOUT,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert f"wrote {LlamaConfig.from_yaml(TINY_MODEL).num_params():,} parameters of step 3" in child.stdout
    return out, dict(np.load(result))


def test_export_on_one_device_gives_the_trained_models_logits(trained_run, exported):
    _, params = trained_run
    out, child = exported
    assert int(child["devices"]) == 1
    expected = np.asarray(Llama(LlamaConfig.from_yaml(TINY_MODEL)).apply({"params": params}, TOKENS))
    np.testing.assert_allclose(child["exported"], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(child["loaded"], expected, rtol=1e-6, atol=1e-6)
    # The file holds the fp32 master weights bit for bit, and says what they are.
    assert jax.tree.all(jax.tree.map(np.array_equal, aj.read_params(out), params))
    meta = params_metadata(out)
    assert meta["format"] == "amsp_jax.params/1"
    assert meta["step"] == 3 and meta["strategy"].startswith("p=") and meta["model"]["dim"] == 64


def test_load_params_reads_a_run_or_its_checkpoints(trained_run):
    run_dir, params = trained_run
    for where in (run_dir, run_dir / "checkpoints"):
        loaded = aj.load_params(where, step=3)
        assert jax.tree.all(jax.tree.map(np.array_equal, loaded, params))
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 7 .* it has steps \[3\]"):
        aj.load_params(run_dir, step=7)


def test_init_from_an_exported_file_starts_another_plan_there(corpus, exported, tmp_path):
    out, _ = exported
    config = small_run_config(
        corpus, tmp_path / "run", {"plan.strategy": "p=1x1,g=4x1,os=4x2", "run.init_from": str(out)}
    )
    run = setup(config)
    run.checkpoints.close()
    assert int(run.state.step) == 0
    assert "from the parameters in" in run.origin
    started = run.trainer.full_params(run.state)
    assert jax.tree.all(jax.tree.map(np.array_equal, started, aj.read_params(out)))
    # A fresh optimizer state: Adam's moments are zero.
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(run.state.opt_state) if x.ndim)


def test_init_from_a_file_of_another_model(corpus, exported, tmp_path):
    out, _ = exported
    params = aj.read_params(out)
    params["lm_head"] = params["lm_head"][:, :128]
    del params["norm"]
    other = aj.write_params(params, tmp_path / "other.safetensors")
    config = small_run_config(corpus, tmp_path / "run", {"run.init_from": str(other)})
    with pytest.raises(ConfigError, match=r"do not fit this model: lm_head: \(64, 128\) here \(64, 256\); "
                       r"norm: missing here \(64,\)"):  # fmt: skip
        setup(config)


def test_flax_msgpack_files_are_read_too(trained_run, tmp_path):
    _, params = trained_run
    path = tmp_path / "params.msgpack"
    path.write_bytes(flax.serialization.msgpack_serialize(params))
    assert jax.tree.all(jax.tree.map(np.array_equal, aj.read_params(path), params))


def run_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    export_command.add_arguments(parser)
    return export_command.run(parser.parse_args(argv))


def test_export_errors_name_the_problem(trained_run, tmp_path, capsys):
    run_dir, _ = trained_run
    assert run_export([str(tmp_path / "nowhere"), "--out", str(tmp_path / "p.safetensors")]) == 2
    assert "run directory" in capsys.readouterr().err
    assert run_export([str(run_dir), "--out", str(tmp_path / "p.bin")]) == 2
    assert "name it *.safetensors" in capsys.readouterr().err
    assert run_export([str(run_dir), "--step", "2", "--out", str(tmp_path / "p.safetensors")]) == 2
    assert "no checkpoint of step 2" in capsys.readouterr().err
    assert run_export([str(tmp_path), "--out", str(tmp_path / "p.safetensors")]) == 2
    assert f"no checkpoint in {tmp_path}; give the run directory" in capsys.readouterr().err
    assert not list(tmp_path.glob("p.*"))
    with pytest.raises(CheckpointError, match="does not exist; write one with `amsp-jax export`"):
        aj.read_params(tmp_path / "missing.safetensors")
