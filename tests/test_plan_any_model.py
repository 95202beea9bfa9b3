"""Plan and audit any Flax model: the traced workload, `amsp_jax.choose`, `amsp-jax plan` on entry points."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit
from amsp_jax.cost import trace as workload
from amsp_jax.cost.hardware import load as load_cluster
from tests import model_zoo
from tests.doc_commands import documented
from tests.helpers import optimizer
from tests.test_any_model import CLUSTER, data, loss_of, set_up
from tests.train_helpers import REPO

TOKENS = jnp.zeros((2, model_zoo.SEQ), jnp.int32)


@pytest.mark.parametrize("style", ["loop", "nnx scan", "stack"])
def test_traced_workload_is_what_the_step_runs(style):
    """Same leaves, per-layer flags and re-gathers as the trainer's schedule; dimensions read off."""
    model = model_zoo.model(style)
    spec = workload.trace(model, (TOKENS,))
    trainer = set_up(model)
    schedule = trainer.schedule
    assert {leaf.path: leaf.shape for leaf in spec.leaves} == {
        p: leaf.shape for p, leaf in trainer.params_layout.leaves.items()
    }
    axes = trainer.layout
    w = spec.workload(model_zoo.SEQ, 3, 1, trainer.plan.precision, trainer.plan.remat)
    for leaf in spec.leaves:
        assert cost.schedule_leaf(axes, w, leaf).ops() == schedule.leaves[leaf.path].ops(), leaf.path
    d = spec.dims
    assert (d.n_layers, d.dim, d.n_heads, d.head_dim, d.ffn_dim, d.vocab_size) == (
        model_zoo.LAYERS, model_zoo.WIDTH, model_zoo.HEADS, model_zoo.WIDTH // model_zoo.HEADS,
        4 * model_zoo.WIDTH, model_zoo.VOCAB,
    )  # fmt: skip
    assert spec.prefetchable == (style in ("stack", "loop"))
    assert spec.num_params() == sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0), TOKENS))
    )


def test_choose_plans_a_gpt_and_the_plan_trains():
    """`amsp_jax.choose` on the model itself: a Plan a Trainer runs; the audit needs no dimensions."""
    model = model_zoo.GPT("loop")
    hardware = load_cluster("cpu-sim").with_shape(2)
    plan = aj.choose(model, (TOKENS,), hardware, global_batch=24, precision="fp32")
    assert isinstance(plan, aj.Plan) and plan.cluster.num_devices == CLUSTER.num_devices
    trainer = aj.Trainer(plan, model, optimizer(), loss_of(model))
    batch = data()[0]
    state = trainer.init(jax.random.key(0), batch["inputs"])
    state, metrics = trainer.step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert audit.audit_trainer(trainer, batch).bytes_match


PLAN_ENTRY = "amsp-jax plan --model examples/gpt_entry.py:"


def test_plan_command_takes_a_python_entry_point(tmp_path):
    """`amsp-jax plan --model file.py:function` from another directory: the models guide's command as
    written (the docs test leaves it to this test), a GPT-2-medium-shaped model."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    command = [sys.executable, "-m", "amsp_jax.cli", *documented("docs/guides/models.md", PLAN_ENTRY)]
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]  # exit code 0: the chosen plan fits
    lines = result.stdout.splitlines()
    assert lines[0].startswith("GPT (examples/gpt_entry.py:gpt) ("), lines[0]
    chosen = next(line.split() for line in lines if line.startswith("chosen "))
    assert aj.Strategy.parse(chosen[1])
