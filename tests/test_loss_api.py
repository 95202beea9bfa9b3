"""A loss as users write it: metrics out of the step, an RNG for dropout, frozen parameters, and the
pure step functions.

The dropout reference is plain `jax.grad` on one device over the same micro-batches and keys: the
global batch cut into the devices' slices in order, each slice into micro-batches, and the key of
each from `amsp_jax.rng_for(seed, step, micro_batch, slice)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import amsp_jax as aj
from amsp_jax import audit, cost
from amsp_jax.models.llama import Llama, cross_entropy, make_loss_fn
from amsp_jax.schedule import BACKWARD_GATHER, FORWARD_GATHER, OTHER_GATHER
from tests import model_zoo
from tests.helpers import TINY, optimizer, train_data
from tests.test_any_model import assert_params_close, data

CLUSTER = aj.Cluster(2, 4)
SEED = 5


def dropout_loss(model):
    def loss(params, batch, rng):
        logits = model.apply({"params": params}, batch["inputs"], False, rngs={"dropout": rng})
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["targets"])
        return cross_entropy(logits, batch["targets"]), {"accuracy": accuracy}

    return loss


def reference(model, batches, micro_batches):
    """Mean over (slice, micro-batch) of the loss and its gradient, each with its own key."""
    loss_fn = dropout_loss(model)
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    opt = optimizer()
    opt_state = opt.init(params)
    devices = CLUSTER.num_devices
    history = []
    for step, batch in enumerate(batches):
        size = batch["inputs"].shape[0] // (devices * micro_batches)
        results = []
        for shard in range(devices):
            for micro in range(micro_batches):
                start = (shard * micro_batches + micro) * size
                chunk = jax.tree.map(lambda x, start=start, size=size: x[start : start + size], batch)
                key = aj.rng_for(SEED, step, micro, shard)
                results.append(jax.value_and_grad(loss_fn, has_aux=True)(params, chunk, key))
        (losses, metrics), grads = jax.tree.map(lambda *xs: sum(xs) / len(xs), *results)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        history.append((float(losses), float(metrics["accuracy"])))
    return history, jax.tree.map(np.asarray, params)


@pytest.mark.slow
def test_dropout_and_metrics_equal_the_per_micro_batch_reference():
    model = model_zoo.GPT("loop", dropout=0.3)
    batches = data()
    for strategy, micro_batches in [("p=2x1,g=4x1,os=4x2", 3)]:
        plan = aj.Plan(CLUSTER, aj.resolve(strategy, CLUSTER), micro_batches=micro_batches, precision="fp32")
        trainer = aj.Trainer(
            plan, model, optimizer(), dropout_loss(model), has_aux=True, rng_seed=SEED
        )
        state = trainer.init(jax.random.key(0), batches[0]["inputs"])
        got = []
        for batch in batches:
            state, metrics = trainer.step(state, batch)
            got.append((float(metrics["loss"]), float(metrics["accuracy"])))
        expected, params = reference(model, batches, micro_batches)
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        assert_params_close(trainer.full_params(state), params)


def test_dropout_keys_differ_by_step_micro_batch_and_shard():
    keys = [aj.rng_for(SEED, s, m, d) for s in range(2) for m in range(2) for d in range(2)]
    data_of = {tuple(np.asarray(jax.random.key_data(k)).ravel()) for k in keys}
    assert len(data_of) == len(keys)


def test_pure_step_functions_under_your_own_jit():
    """`init_fn` and `step_fn` in a user's jit and loop give what `Trainer.step` gives."""
    model = model_zoo.GPT("scan")
    batches = data()
    plan = aj.Plan(CLUSTER, aj.zero3(CLUSTER), micro_batches=3, precision="fp32")

    def loss_fn(params, batch):
        return cross_entropy(model.apply({"params": params}, batch["inputs"]), batch["targets"])

    reference_trainer = aj.Trainer(plan, model, optimizer(), loss_fn)
    state = reference_trainer.init(jax.random.key(0), batches[0]["inputs"])
    expected = []
    for batch in batches:
        state, metrics = reference_trainer.step(state, batch)
        expected.append(float(metrics["loss"]))

    trainer = aj.Trainer(plan, model, optimizer(), loss_fn)
    trainer.setup(jax.random.key(0), batches[0]["inputs"])
    init = jax.jit(trainer.init_fn, out_shardings=trainer.state_shardings())

    @jax.jit
    def two_steps(state, first, second):
        state, one = trainer.step_fn(state, first)
        state, two = trainer.step_fn(state, second)
        return state, jnp.stack([one["loss"], two["loss"]])

    own_state, losses = two_steps(init(jax.random.key(0)), *map(trainer.shard_batch, batches[:2]))
    np.testing.assert_allclose(np.asarray(losses), expected, rtol=1e-6)
    assert_params_close(trainer.full_params(own_state), reference_trainer.full_params(state), rtol=1e-6)
    leaf = jax.tree.leaves(own_state.master)[0]
    assert leaf.sharding.is_equivalent_to(jax.tree.leaves(trainer.state_shardings().master)[0], leaf.ndim)


def _is_frozen(path):
    """The embedding and every layer's query projection (a top leaf and a stacked LayerStack leaf)."""
    return path[0] == "embed" or path[-1] == "wq"


@pytest.mark.parametrize(("strategy", "micro_batches"), [("zero3", 1), ("p=2x1,g=4x1,os=4x2", 3)])
def test_frozen_parameters_train_like_optax_multi_transform_and_move_no_gradient(strategy, micro_batches):
    model, batches = Llama(TINY), train_data()
    loss_fn = make_loss_fn(model)
    # The reference: plain jax.grad on one device, frozen leaves given zero updates by optax itself.
    params = model.init(jax.random.key(0), batches[0]["inputs"])["params"]
    initial = jax.tree.map(np.asarray, params)
    labels = jax.tree_util.tree_map_with_path(
        lambda kp, _: "frozen" if _is_frozen(tuple(k.key for k in kp)) else "trained", params
    )
    opt = optax.multi_transform({"trained": optimizer(), "frozen": optax.set_to_zero()}, labels)
    opt_state = opt.init(params)
    expected = []
    for batch in batches:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        expected.append(float(loss))

    plan = aj.Plan(CLUSTER, aj.resolve(strategy, CLUSTER), micro_batches, precision="fp32")
    trainer = aj.Trainer(plan, model, optimizer(), loss_fn, frozen=_is_frozen)
    state = trainer.init(jax.random.key(0), batches[0]["inputs"])
    start = trainer.full_params(state)
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    trained = trainer.full_params(state)
    assert_params_close(trained, jax.tree.map(np.asarray, params))
    assert np.array_equal(trained["embed"], start["embed"])
    assert np.array_equal(trained["layers"]["layer"]["wq"], start["layers"]["layer"]["wq"])
    # No optimizer state for frozen leaves: AdamW keeps two moments of every trained parameter only.
    frozen_count = initial["embed"].size + initial["layers"]["layer"]["wq"].size
    trained_count = sum(x.size for x in jax.tree.leaves(initial)) - frozen_count
    moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if np.ndim(x))
    assert moments == 2 * trained_count
    # The compiled step moves exactly the schedule's bytes, which has no gradient collective, reduction
    # or refresh for the frozen leaves.
    report = audit.audit_trainer(trainer, batches[0], cost.llama_dims(TINY))
    assert report.bytes_match, report.table()
    frozen_ops = [op for path in trainer.params_layout.frozen for op in trainer.schedule.leaves[path].ops()]
    assert frozen_ops and {op.phase for op in frozen_ops} <= {FORWARD_GATHER, BACKWARD_GATHER, OTHER_GATHER}
    assert "frozen      2 leaves" in trainer.describe()
