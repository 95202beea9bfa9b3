"""A loss as users write it: metrics out of the step, an RNG for dropout, frozen parameters, carried
collections (BatchNorm's statistics), and the pure step functions.

The dropout reference is plain `jax.grad` on one device over the same micro-batches and keys: the
global batch cut into the devices' slices in order, each slice into micro-batches, and the key of
each from `amsp_jax.rng_for(seed, step, micro_batch, slice)`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit
from amsp_jax.core.schedule import BACKWARD_GATHER, FORWARD_GATHER, OTHER_GATHER
from amsp_jax.models import llama
from amsp_jax.models.llama import Llama, LlamaConfig, cross_entropy, embedding_lookup, make_loss_fn
from amsp_jax.run.checkpoint import Checkpointer
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
    grad_fn = jax.jit(jax.value_and_grad(dropout_loss(model), has_aux=True))
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batches[0]["inputs"]))["params"]
    opt = optimizer()
    opt_state = opt.init(params)
    devices = CLUSTER.num_devices

    @jax.jit  # one compile of the update, not one per operation
    def update(grads, opt_state, params):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    history = []
    for step, batch in enumerate(batches):
        size = batch["inputs"].shape[0] // (devices * micro_batches)
        results = []
        for shard in range(devices):
            for micro in range(micro_batches):
                start = (shard * micro_batches + micro) * size
                chunk = jax.tree.map(lambda x, start=start, size=size: x[start : start + size], batch)
                key = aj.rng_for(SEED, step, micro, shard)
                results.append(grad_fn(params, chunk, key))
        (losses, metrics), grads = jax.tree.map(lambda *xs: sum(xs) / len(xs), *results)
        params, opt_state = update(grads, opt_state, params)
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


@pytest.mark.parametrize(("strategy", "micro_batches"), [("p=2x1,g=4x1,os=4x2", 3)])
def test_frozen_parameters_train_like_optax_multi_transform_and_move_no_gradient(strategy, micro_batches):
    model, batches = Llama(TINY), train_data()
    loss_fn = make_loss_fn(model)
    # The reference: plain jax.grad on one device, frozen leaves given zero updates by optax itself.
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batches[0]["inputs"]))["params"]
    initial = jax.tree.map(np.asarray, params)
    labels = jax.tree_util.tree_map_with_path(
        lambda kp, _: "frozen" if _is_frozen(tuple(k.key for k in kp)) else "trained", params
    )
    opt = optax.multi_transform({"trained": optimizer(), "frozen": optax.set_to_zero()}, labels)
    opt_state = opt.init(params)

    @jax.jit  # one compile of the step, not one per operation
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    expected = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
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


class BatchNormMLP(nn.Module):
    """A model with a `batch_stats` collection (BatchNorm's running mean and variance).

    No bias before the norm (as usual): its true gradient is zero, so its computed one is rounding noise
    that Adam turns into lr-sized steps, different in every summation order.
    """

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(32, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        return nn.Dense(4)(jax.nn.relu(x))


def batch_norm_loss(model):
    def loss(params, batch, variables):
        out, updated = model.apply(
            {"params": params, **variables}, batch["x"], True, mutable=["batch_stats"]
        )
        return jnp.mean((out - batch["y"]) ** 2), updated

    return loss


@pytest.mark.parametrize(("strategy", "micro_batches"), [("zero3", 3), ("p=2x1,g=4x1,os=4x2", 1)])
def test_batch_stats_are_carried_and_averaged_like_the_per_device_reference(
    strategy, micro_batches, tmp_path
):
    model, devices = BatchNormMLP(), CLUSTER.num_devices
    loss_fn = batch_norm_loss(model)
    rng = np.random.default_rng(3)
    # 16 rows per micro-batch: BatchNorm's gradient over a handful of rows is ill-conditioned enough to
    # turn fp32 rounding of another summation order into 1e-5 differences.
    batches = [
        {"x": rng.normal(size=(384, 8)).astype(np.float32), "y": rng.normal(size=(384, 4)).astype(np.float32)}
        for _ in range(3)
    ]
    # Reference on one device: every device runs its micro-batches in turn from the step's statistics;
    # the step's new statistics are the devices' mean, its gradient the mean over all micro-batches.
    variables = jax.jit(model.init, static_argnums=2)(jax.random.key(0), batches[0]["x"], True)
    params, stats = variables["params"], {"batch_stats": variables["batch_stats"]}
    opt = optimizer()
    opt_state = opt.init(params)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))  # one compile, not one per operation

    @jax.jit
    def update(grads, opt_state, params):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    expected = []
    for batch in batches:
        size = batch["x"].shape[0] // (devices * micro_batches)
        results, ends = [], []
        for shard in range(devices):
            own = stats
            for micro in range(micro_batches):
                start = (shard * micro_batches + micro) * size
                chunk = jax.tree.map(lambda x, start=start, size=size: x[start : start + size], batch)
                (loss, own), grads = grad_fn(params, chunk, own)
                results.append((loss, grads))
            ends.append(own)
        loss, grads = jax.tree.map(lambda *xs: sum(xs) / len(xs), *results)
        stats = jax.tree.map(lambda *xs: sum(xs) / len(xs), *ends)
        params, opt_state = update(grads, opt_state, params)
        expected.append(float(loss))

    plan = aj.Plan(CLUSTER, aj.resolve(strategy, CLUSTER), micro_batches, precision="fp32")
    trainer = aj.Trainer(plan, model, optimizer(), loss_fn, collections=("batch_stats",))
    state = trainer.init(jax.random.key(0), batches[0]["x"], True)
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert_params_close(trainer.full_params(state), jax.tree.map(np.asarray, params))
    carried = jax.tree.map(np.asarray, state.collections)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6), carried, stats)
    assert "carried     batch_stats (64 values)" in trainer.describe()
    # The statistics are part of the checkpoint and come back onto another plan.
    checkpoints = Checkpointer(tmp_path, async_save=False)
    checkpoints.save(trainer, state, jax.random.key(0))
    other_plan = aj.Plan(CLUSTER, aj.zero1(CLUSTER), 1, precision="fp32")
    other = aj.Trainer(other_plan, model, optimizer(), loss_fn, collections=("batch_stats",))
    other.setup(jax.random.key(0), batches[0]["x"], True)
    try:
        restored = checkpoints.restore(other).state
    finally:
        checkpoints.close()
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.collections), carried)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_llama_cross_entropy_equals_optax_in_value_and_gradient(dtype):
    # `cross_entropy` picks the target's logit by comparison (its gradient fuses into the softmax's);
    # optax's integer-label cross-entropy indexes it. Same loss, same gradient.
    logits = jax.random.normal(jax.random.key(1), (3, 5, 37), jnp.float32).astype(dtype) * 4
    targets = jax.random.randint(jax.random.key(2), (3, 5), 0, 37)

    def by_optax(x):
        return optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), targets).mean()

    ours, ours_grad = jax.value_and_grad(lambda x: cross_entropy(x, targets))(logits)
    theirs, theirs_grad = jax.value_and_grad(by_optax)(logits)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(ours_grad, np.float32), np.asarray(theirs_grad, np.float32), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_llama_embedding_lookup_equals_take_in_value_and_gradient(dtype):
    # Repeated tokens (their rows' gradients add up) and a non-finite cotangent (it stays in its row).
    table = jax.random.normal(jax.random.key(3), (37, 8), jnp.float32).astype(dtype)
    tokens = jnp.array([[1, 5, 5, 36], [0, 1, 1, 1]])
    cotangent = jax.random.normal(jax.random.key(4), (2, 4, 8), jnp.float32).astype(dtype)
    broken = [cotangent.at[i].set(bad) for i in ((0, 0, 0), (1, 3, 2)) for bad in (jnp.inf, jnp.nan)]
    for probe in (cotangent, *broken):
        ours, ours_vjp = jax.vjp(lambda t: embedding_lookup(t, tokens), table)
        theirs, theirs_vjp = jax.vjp(lambda t: jnp.take(t, tokens, axis=0), table)
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
        (ours_grad,), (theirs_grad,) = ours_vjp(probe), theirs_vjp(probe)
        assert ours_grad.dtype == theirs_grad.dtype == dtype
        np.testing.assert_array_equal(np.asarray(ours_grad, np.float32), np.asarray(theirs_grad, np.float32))


def test_llama_embedding_gradient_buffer_is_not_held_through_the_forward(monkeypatch):
    # A zero3 step of a model whose vocab x dim table dominates: with a plain `jnp.take` XLA creates
    # the gradient's zero buffer at the step's start, beside the gathered weights of the forward. Measured:
    # jaxlib 0.10.2 holds it in fp32 (1 MiB more temporary memory than ours), 0.11.2 and 0.12.0.1 in
    # bf16 (512 KiB more).
    config = LlamaConfig(vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (8, 33), np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def temp_bytes() -> int:
        model = Llama(config)
        plan = aj.Plan(CLUSTER, aj.resolve("zero3", CLUSTER), 1, precision="mixed", remat="full")
        trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model))
        trainer.setup(jax.random.key(0), batch["inputs"])
        compiled = trainer.compile(trainer.abstract_state(), trainer.shard_batch(batch))
        return compiled.memory_analysis().temp_size_in_bytes

    ours = temp_bytes()
    monkeypatch.setattr(llama, "embedding_lookup", lambda table, ids: jnp.take(table, ids, axis=0))
    with_take = temp_bytes()
    itemsize = 4 if tuple(jax.__version_info__[:2]) < (0, 11) else 2
    assert with_take - ours >= config.vocab_size * config.dim * itemsize
