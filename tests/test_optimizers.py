"""Any optax optimizer under any plan: the sharded step against a single-device reference, state
placements derived from the state, its memory, and checkpoints of it onto another plan and device count."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit
from amsp_jax.core import optim_state
from amsp_jax.core.schedule import UPDATE
from amsp_jax.cost import optimizer as optimizer_cost
from amsp_jax.models.llama import Llama, make_loss_fn, muon_dimension_numbers
from amsp_jax.run.checkpoint import Checkpointer
from tests.helpers import CLUSTER, TINY, max_relative_error, train_data

# Warm-up from 0: Adam-like updates divide by sqrt(v), so their first full-size step turns fp32
# rounding of near-zero gradient entries into learning-rate-sized differences between summation orders.
WARMUP = optax.linear_schedule(0.0, 1e-2, 2)
# The learning rates that inject_hyperparams is given by hand before each step.
INJECTED_LRS = (0.0, 4e-3, 1e-2)
# AMSP's choice for LLaMA-7B, scaled to 4 devices per node: only the optimizer state is sharded,
# 4 ways within a node, and replicated across nodes.
MIXED = "p=1x1,g=1x1,os=4x1"


def decay_mask(params):
    """Weight decay on matrices only, as people do (not on norms)."""
    return jax.tree.map(lambda x: x.ndim > 1, params)


def frozen_embedding(params):
    """multi_transform labels: the embedding frozen, every other leaf trained."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if path[0].key == "embed" else "train", params
    )


def muon_dimensions(params):
    """Muon on every matrix, stacked layers as a batch dimension (dimension 0); norms go to AdamW."""
    dims = {
        "w1": optax.contrib.MuonDimensionNumbers(1, 2),
        "w2": optax.contrib.MuonDimensionNumbers(1, 2),
        "w3": optax.contrib.MuonDimensionNumbers(1, 2),
        "wq": optax.contrib.MuonDimensionNumbers(1, (2, 3)),
        "wk": optax.contrib.MuonDimensionNumbers(1, (2, 3)),
        "wv": optax.contrib.MuonDimensionNumbers(1, (2, 3)),
        "wo": optax.contrib.MuonDimensionNumbers((1, 2), 3),
    }
    matrix = optax.contrib.MuonDimensionNumbers(0, 1)
    return {
        "embed": matrix,
        "lm_head": matrix,
        "norm": None,
        "layers": {"layer": {k: dims.get(k) for k in params["layers"]["layer"]}},
    }


OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw_masked": lambda: optax.adamw(WARMUP, weight_decay=0.1, mask=decay_mask),
    "adafactor": lambda: optax.adafactor(WARMUP, min_dim_size_to_factor=8),
    "muon": lambda: optax.contrib.muon(
        WARMUP, weight_decay=0.1, muon_weight_dimension_numbers=muon_dimensions
    ),
    "lion": lambda: optax.lion(optax.linear_schedule(0.0, 1e-3, 2), weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(WARMUP, momentum=0.9, nesterov=True),
    "multi_transform_frozen": lambda: optax.multi_transform(
        {"train": optax.adam(WARMUP), "frozen": optax.set_to_zero()}, frozen_embedding
    ),
    # Its inner Adam steps once in three steps, so no warm-up (it would leave the parameters as they
    # were); eps=1e-3 bounds what a full first step makes of rounding noise (see tests/helpers.py).
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2, eps=1e-3), every_k_schedule=2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=0.1),
}
# Newton-Schulz iterations (matrix products of the whole update) reorder sums more than Adam does.
TOLERANCE = {"muon": 1e-4}


def set_injected_lr(opt_state, step: int):
    """The state with the learning rate of `step` written into inject_hyperparams' hyperparameters."""
    lr = jnp.asarray(INJECTED_LRS[step], jnp.float32)
    return opt_state._replace(hyperparams={**opt_state.hyperparams, "learning_rate": lr})


def before_step(name: str) -> Callable:
    return set_injected_lr if name == "inject_hyperparams" else lambda opt_state, _: opt_state


@functools.cache
def initial_params() -> dict:
    """The tiny model's initial parameters on the host, shared by every run."""
    params = nn.meta.unbox(jax.jit(Llama(TINY).init)(jax.random.key(0), train_data()[0]["inputs"]))["params"]
    return jax.tree.map(np.asarray, params)


@functools.cache
def loss_and_grad() -> Callable:
    """The reference's jitted loss and gradient, compiled once for every optimizer."""
    return jax.jit(jax.value_and_grad(make_loss_fn(Llama(TINY))))


@functools.cache
def reference(name: str) -> tuple[list[float], dict]:
    """Plain `jax.grad` and the optimizer on one device: each step's loss and the final params."""
    device = jax.devices()[0]
    params = jax.device_put(initial_params(), device)
    opt = OPTIMIZERS[name]()
    opt_state = opt.init(params)

    @jax.jit
    def update(grads, opt_state, params):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    losses = []
    for i, batch in enumerate(train_data()):
        opt_state = before_step(name)(opt_state, i)
        loss, grads = loss_and_grad()(params, jax.device_put(batch, device))
        params, opt_state = update(grads, opt_state, params)
        losses.append(float(loss))
    return losses, jax.tree.map(np.asarray, params)


def make_trainer(name: str, strategy: str, micro_batches: int, cluster: aj.Cluster = CLUSTER, devices=None):
    """A trainer of the tiny model with optimizer `name`, set up (shapes known) but without a state."""
    model = Llama(TINY)
    plan = aj.Plan(cluster, aj.resolve(strategy, cluster), micro_batches, precision="fp32")
    trainer = aj.Trainer(plan, model, OPTIMIZERS[name](), make_loss_fn(model), devices=devices)
    trainer.setup(jax.random.key(0), train_data()[0]["inputs"])
    return trainer


def run(trainer: aj.Trainer, name: str, state: aj.TrainState, data: list) -> tuple[aj.TrainState, list]:
    """Step `state` through `data` (the step index counted from the state's step)."""
    losses = []
    for batch in data:
        opt_state = before_step(name)(state.opt_state, int(state.step))
        state, metrics = trainer.step(state.replace(opt_state=opt_state), batch)
        losses.append(float(metrics["loss"]))
    return state, losses


@functools.cache
def trained(name: str, strategy: str, micro_batches: int) -> tuple:
    trainer = make_trainer(name, strategy, micro_batches)
    state, losses = run(trainer, name, trainer.state_from_params(initial_params()), train_data())
    return trainer, state, losses


# Each optimizer under ZeRO-3 (everything split 8 ways) with one micro-batch, and under the mixed plan
# with three; Lion's and SGD's states are trees shaped like the parameters, placed as AdamW's are, so
# the mixed plan of the masked AdamW stands for theirs.
# Element-wise updates: their placement's collectives are the step's (tests/test_step.py checks those).
PLAIN = ("lion", "sgd_momentum", "adamw_masked", "inject_hyperparams")
PLANS = [
    (name, strategy, m)
    for name in OPTIMIZERS
    for strategy, m in [("zero3", 1), (MIXED, 3)]
    if strategy == "zero3" or name not in PLAIN
]


@pytest.mark.parametrize(("name", "strategy", "micro_batches"), PLANS)
def test_optimizer_step_equals_single_device_reference(name, strategy, micro_batches):
    expected_losses, expected_params = reference(name)
    _, state, losses = trained(name, strategy, micro_batches)
    rtol = TOLERANCE.get(name, 1e-5)
    np.testing.assert_allclose(losses, expected_losses, rtol=rtol)
    assert max_relative_error(jax.tree.map(np.asarray, state.master), expected_params) < rtol
    # The updates are not all zero (the reference would then agree with anything that did nothing).
    assert max_relative_error(expected_params, initial_params()) > 1e-4


def spec_of(tree, *keys):
    for key in keys:
        tree = tree[key] if isinstance(tree, dict) else getattr(tree, key)
    return tree.sharding.spec


def test_state_leaves_are_placed_by_their_own_shapes():
    trainer, state, _ = trained("adafactor", "zero3", 1)
    os_axes = trainer.layout.axes("opt_state")
    axes = os_axes if len(os_axes) > 1 else os_axes[0]
    factored = state.opt_state[0]
    # w1 is (layers 2, 32, 64), split on its 64 columns: the column statistics (2, 64) keep that
    # dimension and are split along it; the row statistics (2, 32) lost it and are whole.
    assert trainer.params_layout.leaves[("layers", "layer", "w1")].dim == 2
    assert spec_of(factored.v_col, "layers", "layer", "w1") == P(None, axes)
    assert spec_of(factored.v_row, "layers", "layer", "w1") == P()
    # Unfactored second moments (the (32,) norm) are shaped like their parameter and placed like it.
    assert spec_of(factored.v, "norm") == trainer.params_layout.leaves[("norm",)].specs["opt_state"]
    assert factored.count.sharding.spec == P()

    trainer, state, _ = trained("muon", "zero3", 1)
    muon = state.opt_state.inner_states["muon"].inner_state[0]
    assert (
        spec_of(muon.mu, "layers", "layer", "w1")
        == trainer.params_layout.leaves[("layers", "layer", "w1")].specs["opt_state"]
    )
    assert muon.ns_coeffs.sharding.spec == P()
    assert isinstance(muon.mu["norm"], optax.MaskedNode)  # the norm's state is in the AdamW group

    trainer, state, _ = trained("inject_hyperparams", "zero3", 1)
    assert all(x.sharding.spec == P() for x in state.opt_state.hyperparams.values())


@pytest.mark.parametrize("name", ["adafactor", "muon", "multi_steps"])
def test_state_bytes_per_device_are_what_a_device_holds(name):
    trainer, state, _ = trained(name, "zero3", 1)
    shardings = trainer.state_shardings().opt_state
    predicted = optim_state.bytes_per_device(trainer.abstract_state().opt_state, shardings)
    device = trainer.layout.mesh.devices.flat[0]
    held = sum(
        shard.data.nbytes
        for x in jax.tree.leaves(state.opt_state)
        for shard in x.addressable_shards
        if shard.device == device
    )
    assert predicted == held
    whole = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    assert whole / 8 <= predicted < whole


@pytest.mark.parametrize("name", ["adafactor", "muon", "inject_hyperparams"])
def test_checkpoint_of_the_state_restores_onto_another_plan_and_device_count(name, tmp_path):
    trainer, state, _ = trained(name, "zero3", 1)
    checkpoints = Checkpointer(tmp_path, async_save=False)
    checkpoints.save(trainer, state, jax.random.key(0))
    four = jax.devices()[:4]
    other = make_trainer(name, "p=1x1,g=2x1,os=4x1", 1, aj.Cluster(1, 4), four)
    try:
        restored = checkpoints.restore(other).state
    finally:
        checkpoints.close()
    host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(state.opt_state)
    assert jax.tree.all(jax.tree.map(np.array_equal, host(restored.opt_state), host(state.opt_state)))
    assert jax.tree.all(jax.tree.map(np.array_equal, host(restored.master), host(state.master)))
    targets = jax.tree.leaves(other.state_shardings().opt_state)
    for leaf, target in zip(jax.tree.leaves(restored.opt_state), targets, strict=True):
        assert leaf.sharding == target
        assert set(leaf.devices()) <= set(four)


# The update's collectives under plans that put the Newton–Schulz split in either matrix dimension and
# over OS groups of 8 (zero3 and the mixed plan), 4 (replicated twice) and 2 (replicated four times:
# GSPMD then also splits the iterations over the replicas, with point-to-point sends).
AUDITED = [
    ("muon", "zero3"),
    ("muon", "p=2x1,g=4x1,os=4x2"),
    ("muon", MIXED),
    ("muon", "p=4x2,g=4x1,os=2x1"),
    ("adafactor", "zero3"),
    ("adafactor", "p=2x1,g=4x1,os=4x2"),
]


@pytest.mark.parametrize(("name", "strategy"), AUDITED)
def test_audit_is_exact_with_the_collectives_of_the_optimizer_update(name, strategy):
    # The mixed plan at the numerics test's three micro-batches: the update runs once a step either way.
    micro_batches = 3 if strategy == MIXED else 1
    if (name, strategy, micro_batches) in PLANS:  # compiled for the numerics test already
        trainer = trained(name, strategy, micro_batches)[0]
    else:
        trainer = make_trainer(name, strategy, micro_batches)
    report = audit.audit_trainer(trainer, train_data()[0], cost.llama_dims(TINY))
    assert report.bytes_match, report.table()
    update = [t for t in report.predicted.transfers if t.phase == UPDATE]
    assert sum(t.bytes for t in update) > 0  # the update does communicate here
    if strategy == "p=4x2,g=4x1,os=2x1":
        assert {t.kind for t in update} >= {"collective-permute", "all-gather", "all-reduce"}


def test_the_update_rules_are_read_from_the_optimizer():
    abstract = make_trainer("adamw_masked", "zero3", 1).abstract_state().master
    for name in ("adamw_masked", "lion", "sgd_momentum", "multi_transform_frozen", "multi_steps"):
        assert optimizer_cost.describe(OPTIMIZERS[name](), abstract) == optimizer_cost.ELEMENT_WISE

    muon = optimizer_cost.describe(OPTIMIZERS["muon"](), abstract)
    assert muon.name == "muon" and not muon.unpriced
    leaves = muon.muon_leaves
    assert ("norm",) not in leaves and ("layers", "layer", "attention_norm") not in leaves
    assert leaves[("layers", "layer", "wo")] == optimizer_cost.MuonLeaf((0,), (1, 2), (3,), 5)
    assert leaves[("embed",)] == optimizer_cost.MuonLeaf((), (0,), (1,), 5)
    # The model's own dimension numbers are the fixture's.
    shipped = optax.contrib.muon(WARMUP, muon_weight_dimension_numbers=muon_dimension_numbers)
    assert optimizer_cost.describe(shipped, abstract).muon == muon.muon
    # Iterations and preconditioning come from the transformation itself.
    three = optax.contrib.muon(WARMUP, ns_steps=3, muon_weight_dimension_numbers=muon_dimensions)
    assert {leaf.steps for leaf in optimizer_cost.describe(three, abstract).muon_leaves.values()} == {3}
    aol = optax.contrib.muon(WARMUP, preconditioning="aol", muon_weight_dimension_numbers=muon_dimensions)
    assert optimizer_cost.describe(aol, abstract).unpriced
    # Through wrappers: a chain, gradient accumulation.
    for wrapped in (optax.chain(optax.clip_by_global_norm(1.0), OPTIMIZERS["muon"]()),
                    optax.MultiSteps(OPTIMIZERS["muon"](), every_k_schedule=2)):  # fmt: skip
        assert optimizer_cost.describe(wrapped, abstract) == muon

    factored = optimizer_cost.describe(OPTIMIZERS["adafactor"](), abstract).factored_leaves
    # Factored over the two largest dimensions (d1, d0); the norms' moments are not factored.
    assert factored[("layers", "layer", "w1")] == (1, 2)
    assert ("norm",) not in factored and ("layers", "layer", "ffn_norm") not in factored
