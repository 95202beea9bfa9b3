"""The sharded step against a single-device reference, for every preset and more strategies."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import amsp_jax as aj
from amsp_jax import trainer as step_module
from amsp_jax.core.schedule import MIN_PREFETCH_LAYERS
from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn
from amsp_jax.step import micro_loss
from tests.helpers import (
    CLUSTER,
    STEPS,
    STRATEGIES,
    TINY,
    batches,
    max_relative_error,
    optimizer,
    reference,
    train_data,
    trained,
)


@pytest.fixture(scope="module")
def model():
    return Llama(TINY)


@pytest.fixture(scope="module")
def data():
    return train_data()


@pytest.fixture(scope="module")
def expected(model, data):
    return reference(model, data, jax.random.key(0))


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp32_step_equals_single_device_reference(model, data, expected, strategy, micro_batches):
    expected_losses, expected_params = expected
    trainer, state, losses = trained(strategy, micro_batches)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert max_relative_error(trainer.full_params(state), expected_params) < 1e-5
    assert int(state.step) == STEPS


@pytest.fixture(scope="module")
def expected_four_layers(data):
    return reference(Llama(dataclasses.replace(TINY, n_layers=4)), data, jax.random.key(0))


@pytest.mark.parametrize("strategy", ["zero3", "p=2x1,g=4x1,os=4x2"])
def test_prefetching_layer_loop_equals_reference(expected_four_layers, strategy):
    # Asked for, four layers and one micro-batch take the explicit-prefetch loop with its own backward.
    assert MIN_PREFETCH_LAYERS == 4  # the smallest model that takes the loop: the four-layer reference
    expected_losses, expected_params = expected_four_layers
    trainer, state, losses = trained(strategy, 1, layers=MIN_PREFETCH_LAYERS, prefetch=True)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert max_relative_error(trainer.full_params(state), expected_params) < 1e-5


@pytest.mark.parametrize("strategy", ["zero3", "p=2x1,g=4x1,os=4x2"])
def test_keeping_the_first_layer_across_micro_batches_equals_reference(expected_four_layers, strategy):
    # The first layer gathered once per step and run outside the layer loop, its gradient summed over
    # 3 micro-batches before one reduce-scatter: the same step.
    expected_losses, expected_params = expected_four_layers
    trainer, state, losses = trained(strategy, 3, layers=4, keep_first_layer=True)
    assert all(leaf.keeps_first_layer for p, leaf in trainer.schedule.leaves.items() if p[0] == "layers")
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert max_relative_error(trainer.full_params(state), expected_params) < 1e-5


def test_keeping_the_first_layer_needs_a_layer_stack():
    plan = aj.Plan(CLUSTER, aj.zero3(CLUSTER), 2, keep_first_layer=True)
    trainer = aj.Trainer(plan, PlainMLP(), optimizer(), lambda params, batch: 0.0)
    with pytest.raises(step_module.TrainerError, match="has no LayerStack; build its layers with amsp_jax"):
        trainer.setup(jax.random.key(0), np.zeros((16, 8), np.float32))


@pytest.mark.parametrize("strategy", ["zero3", "p=2x1,g=4x1,os=4x2", "p=4x2,g=4x1,os=1x1"])
def test_every_state_leaf_has_its_planned_sharding(model, data, strategy):
    trainer, state, _ = trained(strategy, 1)
    layout = trainer.layout
    # Where P and OS share a placement, P is the master cast in the step: nothing stored.
    stored = [("opt_state", state.master)] + ([] if strategy == "zero3" else [("params", state.params)])
    assert (state.params == {}) == (strategy == "zero3")
    for component, tree in stored:
        for path, leaf in trainer.params_layout.leaves.items():
            array = tree
            for key in path:
                array = array[key]
            assert array.sharding.spec == leaf.specs[component], (component, path)
            assert array.sharding.mesh == layout.mesh
            if leaf.dim is not None:
                axes = layout.axes(component)
                expected = P(
                    *[
                        (axes if len(axes) > 1 else axes[0]) if i == leaf.dim and axes else None
                        for i in range(len(leaf.shape))
                    ]
                )
                assert array.sharding.spec == expected
    def canonical(spec: P) -> tuple:  # P() and P(None, None) place a leaf alike
        entries = list(spec)
        while entries and entries[-1] is None:
            entries.pop()
        return tuple(entries)

    for moment in jax.tree.leaves(state.opt_state):
        if moment.ndim:
            assert canonical(moment.sharding.spec) in {
                canonical(leaf.specs["opt_state"]) for leaf in trainer.params_layout.leaves.values()
            }
    if strategy != "zero3":
        assert state.params["layers"]["layer"]["w1"].dtype == np.float32


def test_strategy_axes_follow_the_nested_groups(model, data):
    trainer, _, _ = trained("p=2x1,g=4x1,os=4x2", 1)
    layout = trainer.layout
    assert dict(layout.mesh.shape) == {"inter0": 2, "intra1": 2, "intra0": 2}
    assert layout.axes("params") == ("intra0",)
    assert layout.axes("grads") == ("intra0", "intra1")
    assert layout.axes("opt_state") == ("intra0", "intra1", "inter0")
    # Devices 0-3 are node 0: the intra axes never leave a node.
    grid = np.vectorize(lambda d: d.id)(layout.mesh.devices)
    assert set(grid[0].ravel()) == {0, 1, 2, 3}


# Mixed precision: bf16 weights and bf16 gradient reduction carry ~3 significant digits, so the loss
# (a mean over 24x8 tokens of O(4) values) agrees to ~1e-2 relative, and after 3 AdamW steps of lr 1e-2
# the fp32 master weights differ from the fp32 reference by less than one step's update (lr) in abs.
@pytest.mark.parametrize("strategy", ["zero3", "p=2x1,g=4x1,os=4x2"])
def test_mixed_precision_tracks_the_fp32_reference(model, data, expected, strategy):
    expected_losses, expected_params = expected
    trainer, state, losses = trained(strategy, 3, precision="mixed")
    if strategy != "zero3":  # zero3 stores no P (the master cast in the step)
        assert state.params["layers"]["layer"]["w1"].dtype == jax.numpy.bfloat16
    assert state.master["layers"]["layer"]["w1"].dtype == np.float32
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-2)
    diffs = jax.tree.map(
        lambda a, e: float(np.max(np.abs(a - e))), trainer.full_params(state), expected_params
    )
    assert max(jax.tree.leaves(diffs)) < 1e-2


def _compiled_bytes(trainer, state, batch):
    compiled = trainer.compile(state, trainer.shard_batch(batch))
    memory = compiled.memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + (memory.temp_size_in_bytes)
    )


def test_zero3_step_does_not_keep_gathered_weights():
    config = LlamaConfig(vocab_size=256, dim=256, n_layers=12, n_heads=4, n_kv_heads=4, ffn_dim=512)
    model = Llama(config)
    data = batches(8, 1, vocab=256)
    full_bytes = 4 * config.num_params()
    per_device = {}
    for remat in ["full", "dots", "none"]:
        plan = aj.Plan(CLUSTER, aj.zero3(CLUSTER), 1, precision="fp32", remat=remat)
        trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model))
        trainer.setup(jax.random.key(0), data[0]["inputs"])
        per_device[remat] = _compiled_bytes(trainer, trainer.abstract_state(), data[0])
    # The checkpointed scan (remat full) holds a gathered layer or two at once; well below.
    assert per_device["full"] < full_bytes, per_device
    assert per_device["dots"] < full_bytes, per_device
    # Without remat the backward keeps every layer's gathered weights: the checks above can fail.
    assert per_device["none"] > full_bytes, per_device


def test_cluster_that_does_not_match_the_devices(model):
    plan = aj.Plan(aj.Cluster(4, 4), aj.zero3(aj.Cluster(4, 4)))
    with pytest.raises(ValueError, match="needs 16 devices but JAX has 8"):
        aj.Trainer(plan, model, optimizer(), make_loss_fn(model))


def test_batch_that_does_not_split(model, data):
    plan = aj.Plan(CLUSTER, aj.zero3(CLUSTER), micro_batches=3)
    trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model))
    state = trainer.init(jax.random.key(0), data[0]["inputs"])
    before = trainer.full_params(state)
    bad = {k: v[:16] for k, v in data[0].items()}
    with pytest.raises(ValueError, match="global batch 16 does not split into 8 devices x 3 micro-batches"):
        trainer.step(state, bad)
    np.testing.assert_array_equal(trainer.full_params(state)["embed"], before["embed"])


def test_invalid_strategy_in_a_plan():
    with pytest.raises(aj.StrategyError, match="does not divide"):
        aj.Plan(CLUSTER, aj.Strategy.parse("p=3x1,g=3x1,os=3x1"))


class PlainMLP(nn.Module):
    """A model without LayerStack: amsp_jax gathers its whole tree."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64)(x)
        x = nn.Dense(48)(jax.nn.gelu(x))
        return nn.Dense(3)(jax.nn.gelu(x))  # its (3,) bias is padded to (8,) to split 8 ways


def test_model_without_layer_stack_gathers_the_whole_tree_and_matches():
    model = PlainMLP()
    rng = np.random.default_rng(1)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    data = [{"x": normal(16, 8), "y": normal(16, 3)} for _ in range(3)]

    def loss_fn(params, batch):
        return jax.numpy.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    params = jax.jit(model.init)(jax.random.key(0), data[0]["x"])["params"]
    opt = optimizer()
    opt_state = opt.init(params)

    @jax.jit  # one compile of the reference step, not one per operation
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    expected = []
    for batch in data:
        params, opt_state, loss = step(params, opt_state, batch)
        expected.append(float(loss))

    plan = aj.Plan(CLUSTER, aj.zero3(CLUSTER), micro_batches=2, precision="fp32")
    trainer = aj.Trainer(plan, model, optimizer(), loss_fn)
    state = trainer.init(jax.random.key(0), data[0]["x"])
    losses = []
    for batch in data:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert max_relative_error(trainer.full_params(state), jax.tree.map(np.asarray, params)) < 1e-5
    description = trainer.describe()
    assert trainer.params_layout.stacks == ()
    assert "whole tree" in description
    assert trainer.params_layout.replicated() == []
    padded = {p: leaf.padded for p, leaf in trainer.params_layout.leaves.items() if leaf.is_padded}
    assert padded == {("Dense_2", "bias"): (8,)}
    assert "padded      1 leaves" in description and "Dense_2/bias" in description


@pytest.mark.parametrize("strategy", ["zero3", "p=2x1,g=4x1,os=4x2"])
def test_evaluate_is_the_forward_loss_of_the_current_params(model, data, strategy):
    trainer, state, _ = trained(strategy, 3)
    params = trainer.full_params(state)
    expected = float(make_loss_fn(model)(params, data[0]))
    assert float(trainer.evaluate(state, data[0])) == pytest.approx(expected, rel=1e-5)


def test_one_micro_batch_holds_g_in_the_reduce_dtype_at_no_cost_in_accuracy(monkeypatch):
    # Mixed precision reduces gradients in bf16, so with one micro-batch (nothing accumulates) an fp32
    # G holds a bf16 sum in a wider copy: the bf16 G trains bit for bit the same. (Its memory saving
    # is a GPU fact: XLA:CPU's peak of this step is in the update, where the optimizer's fp32 gradient
    # is live either way; the GPU-compiled audits count G in bf16.)
    data = train_data()

    def run():
        plan = aj.Plan(CLUSTER, aj.ddp(CLUSTER), 1, precision="mixed")
        trainer = aj.Trainer(plan, Llama(TINY), optimizer(), make_loss_fn(Llama(TINY)))
        state = trainer.init(jax.random.key(0), data[0]["inputs"])
        for batch in data:
            state, _ = trainer.step(state, batch)
        return trainer.full_params(state)

    bf16_params = run()
    monkeypatch.setattr(micro_loss, "grad_dtype", lambda micro_batches, reduce_dtype: "float32")
    fp32_params = run()
    assert jax.tree.all(jax.tree.map(np.array_equal, bf16_params, fp32_params))
