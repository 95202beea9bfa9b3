"""Flax nnx and linen models through the same Trainer, each against its own single-device reference."""

from __future__ import annotations

import importlib.util
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import amsp_jax as aj
from amsp_jax.layers.nnx import NnxModel
from amsp_jax.models.llama import cross_entropy
from tests.helpers import batches, max_relative_error, optimizer
from tests.train_helpers import REPO

CLUSTER = aj.Cluster(2, 4)
VOCAB, WIDTH, HIDDEN = 64, 32, 64
STEPS = 3


class NnxLM(nnx.Module):
    """Embedding, a ReLU MLP and a logits head; a dropout layer that is off (non-parameter state)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.hidden = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, deterministic=True, rngs=rngs)
        self.head = nnx.Linear(HIDDEN, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.hidden(self.norm(self.embed(tokens))))
        return self.head(self.dropout(x))


class LinenLM(nn.Module):
    """The same shape in linen, without a LayerStack: the whole-tree gathering path."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(HIDDEN)(nn.LayerNorm()(nn.Embed(VOCAB, WIDTH)(tokens))))
        return nn.Dense(VOCAB)(x)


def loss_of(apply):
    def loss(params, batch):
        return cross_entropy(apply({"params": params}, batch["inputs"]), batch["targets"])

    return loss


def sharded_run(model, data, strategy):
    plan = aj.Plan(CLUSTER, aj.resolve(strategy, CLUSTER), micro_batches=2, precision="fp32")
    trainer = aj.Trainer(plan, model, optimizer(), loss_of(model.apply))
    state = trainer.init(jax.random.key(0), data[0]["inputs"])
    losses = []
    for batch in data:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return trainer, losses, trainer.full_params(state)


def nnx_reference(data):
    """Native nnx on one device: split, `jax.grad` over the Param state, the same optax chain."""
    module = NnxLM(nnx.Rngs(jax.random.key(0)))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    opt = optimizer()
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss(p):
            return cross_entropy(nnx.merge(graphdef, p, rest)(batch["inputs"]), batch["targets"])

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for batch in data:
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
    return losses, jax.tree.map(np.asarray, nnx.to_pure_dict(params))


@pytest.fixture(scope="module")
def data():
    return batches(16, STEPS, vocab=VOCAB)


@pytest.mark.parametrize("strategy", ["p=2x1,g=4x1,os=4x2"])
def test_nnx_model_matches_its_single_device_reference(data, strategy):
    expected_losses, expected_params = nnx_reference(data)
    trainer, losses, params = sharded_run(NnxModel(NnxLM), data, strategy)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert max_relative_error(params, expected_params) < 1e-5
    assert trainer.params_layout.stacks == ()
    assert any(line.startswith("gathering   whole tree") for line in trainer.describe().splitlines())


def test_linen_model_matches_its_single_device_reference(data):
    model = LinenLM()
    loss = loss_of(model.apply)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), data[0]["inputs"]))["params"]
    opt = optimizer()
    opt_state = opt.init(params)

    @jax.jit  # one compile of the reference step, not one per operation
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    expected = []
    for batch in data:
        params, opt_state, value = step(params, opt_state, batch)
        expected.append(float(value))
    _, losses, sharded_params = sharded_run(model, data, "zero3")
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert max_relative_error(sharded_params, jax.tree.map(np.asarray, params)) < 1e-5


def test_nnx_adapter_round_trips_parameters():
    model = NnxModel(NnxLM)
    params = jax.jit(model.init)(jax.random.key(3), jnp.zeros((2, 4), jnp.int32))["params"]
    module = model.module(params)
    np.testing.assert_array_equal(module.hidden.kernel[...], params["hidden"]["kernel"])
    tokens = jnp.arange(8).reshape(2, 4)
    np.testing.assert_allclose(model.apply({"params": params}, tokens), module(tokens), rtol=1e-6)


def test_users_own_flax_loop_example_trains(monkeypatch):
    spec = importlib.util.spec_from_file_location("flax_loop", REPO / "examples" / "flax_loop.py")
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "flax_loop", example)  # linen modules are dataclasses: they look it up
    spec.loader.exec_module(example)
    losses = example.main(steps=12)
    assert len(losses) == 12 and losses[-1] < 0.5 * losses[0]
