"""Per-layer gathering for models written without LayerStack: a linen loop, `nn.scan`, nnx list, nnx scan.

Each style trains against plain `jax.grad` on one device; its zero3 step's compiled memory is checked
against the same model gathered whole and the same model built with `LayerStack`; the audit's bytes
equal the compiled program's.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import traverse_util

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit
from amsp_jax.layers.stack import LayerContext, StackOps, layer_context, linen_blocks
from amsp_jax.models.llama import cross_entropy
from tests import model_zoo
from tests.helpers import optimizer
from tests.model_zoo import GPT, SEQ, VOCAB

CLUSTER = aj.Cluster(2, 4)
STEPS = 2
DIMS = cost.ModelDims(model_zoo.LAYERS, model_zoo.WIDTH, model_zoo.HEADS, model_zoo.HEADS,
                      model_zoo.WIDTH // model_zoo.HEADS, 4 * model_zoo.WIDTH, VOCAB)  # fmt: skip


STYLES = ("loop", "scan", "nnx list", "nnx scan")


def data(global_batch: int = 24, steps: int = STEPS) -> list[dict[str, np.ndarray]]:
    tokens = np.random.default_rng(0).integers(0, VOCAB, (steps, global_batch, SEQ + 1)).astype(np.int32)
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def loss_of(model):
    def loss(params, batch):
        return cross_entropy(model.apply({"params": params}, batch["inputs"]), batch["targets"])

    return loss


@functools.cache
def reference(style: str) -> tuple[list[float], dict]:
    """Plain `jax.grad` and the same optax chain on one device, for `data()`; one per style (the
    strategies share it)."""
    model = model_zoo.model(style)
    batches = data()
    loss_fn = loss_of(model)
    device = jax.devices()[0]
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batches[0]["inputs"]))["params"]
    params = jax.device_put(params, device)
    opt = optimizer()
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, device))
        losses.append(float(loss))
    return losses, jax.tree.map(np.asarray, params)


def assert_params_close(actual, expected, rtol=1e-5):
    """Per leaf max|a - e| <= rtol * max(max|e|, 10% of the largest |e| of any leaf).

    The floor: attention's key bias has an exactly zero gradient (softmax ignores a per-query shift),
    so its trained value is rounding noise (~1e-8) whose relative error means nothing; and Adam turns
    the rounding of a small gradient (a LayerNorm bias) into an lr/eps-amplified difference. A wrong
    gradient moves a leaf by about lr = 1e-2, four orders above the bound.
    """
    flat_a, flat_e = traverse_util.flatten_dict(actual), traverse_util.flatten_dict(expected)
    assert flat_a.keys() == flat_e.keys()
    floor = 0.1 * max(float(np.max(np.abs(e))) for e in flat_e.values())
    for path, e in flat_e.items():
        error = float(np.max(np.abs(flat_a[path] - e)))
        assert error <= rtol * max(float(np.max(np.abs(e))), floor), (path, error)


@functools.cache
def plan_trainer(style: str, strategy: str, micro_batches: int) -> aj.Trainer:
    """The set-up trainer of a style's model under a plan; cached, so that the plan's training test and
    its audit test share it and its one compiled step."""
    model = model_zoo.model(style)
    plan = aj.Plan(CLUSTER, aj.resolve(strategy, CLUSTER), micro_batches=micro_batches, precision="fp32")
    trainer = aj.Trainer(plan, model, optimizer(), loss_of(model))
    trainer.setup(jax.random.key(0), data()[0]["inputs"])
    return trainer


def train(trainer, batches):
    # `trainer.init` would set the trainer up again and drop the step its audit test compiled.
    state = jax.jit(trainer.init_fn, out_shardings=trainer.state_shardings())(jax.random.key(0))
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


# zero3 for every style; two other placements with micro-batches, one on unstacked blocks (linen) and
# one on stacked ones (nnx).
STYLE_PLANS = [("zero3", 1, style) for style in STYLES] + [("p=2x1,g=4x1,os=4x2", 3, "nnx scan")]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "micro_batches", "style"), STYLE_PLANS)
def test_style_trains_like_the_single_device_reference(style, strategy, micro_batches):
    expected_losses, expected_params = reference(style)
    trainer = plan_trainer(style, strategy, micro_batches)
    state, losses = train(trainer, data())
    assert trainer.params_layout.blocks, "the blocks were not found"
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert_params_close(trainer.full_params(state), expected_params)


def set_up(model, layers=None):
    plan = aj.Plan(CLUSTER, aj.zero3(CLUSTER))
    trainer = aj.Trainer(plan, model, optimizer(), loss_of(model), layers=layers)
    trainer.setup(jax.random.key(0), data()[0]["inputs"])
    return trainer


def test_blocks_found_and_described():
    loop = set_up(GPT("loop"))
    assert list(loop.params_layout.blocks) == [(f"Block_{i}",) for i in range(model_zoo.LAYERS)]
    assert loop.params_layout.stacks == ()
    scan = set_up(GPT("scan"))
    assert scan.params_layout.blocks == scan.params_layout.stacks == (("blocks",),)
    nnx_list = set_up(model_zoo.model("nnx list"))
    assert list(nnx_list.params_layout.blocks) == [("blocks", i) for i in range(model_zoo.LAYERS)]
    nnx_scan = set_up(model_zoo.model("nnx scan"))
    assert nnx_scan.params_layout.blocks == nnx_scan.params_layout.stacks == (("blocks",),)
    for trainer in (loop, scan, nnx_list, nnx_scan):
        assert "gathering   per layer: each call of" in trainer.describe()
    # Naming the classes finds the same blocks; naming none gathers the whole tree.
    assert len(set_up(GPT("loop"), layers=(model_zoo.Block,)).params_layout.blocks) == model_zoo.LAYERS
    whole = set_up(GPT("loop"), layers=())
    assert whole.params_layout.blocks == () and "whole tree" in whole.describe()


@functools.cache
def compiled_memory(style: str, layers: tuple[type, ...] | None = None) -> tuple[int, int]:
    """Compiled zero3 step memory per device (arguments + outputs - aliased + temporaries) and the full
    fp32 parameter bytes, for 8 blocks of width 128 (1.6 M parameters: parameters dominate)."""
    model = model_zoo.model(style, layers=8, width=128)
    batch = data(8, 1)[0]
    trainer = aj.Trainer(aj.Plan(CLUSTER, aj.zero3(CLUSTER), precision="fp32"), model, optimizer(),
                         loss_of(model), layers=layers)  # fmt: skip
    trainer.setup(jax.random.key(0), batch["inputs"])
    stats = trainer.compile(trainer.abstract_state(), batch).memory_analysis()
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    full_params = sum(int(np.prod(leaf.shape)) * 4 for leaf in trainer.params_layout.leaves.values())
    return total + stats.temp_size_in_bytes, full_params


@pytest.mark.slow
@pytest.mark.parametrize("style", [s for s in STYLES if s != "nnx list"])  # an nnx list: test_keyword_model
def test_zero3_memory_is_per_layer(style):
    """Below the full parameters, and at most two gathered blocks above the same model built with
    LayerStack (its checkpointed scan holds one layer's weights; a loop of blocks gathers the next
    block's while it runs one)."""
    memory, full = compiled_memory(style)
    stacked, _ = compiled_memory("stack")
    block = full / 8  # the embeddings are a small share at this width: every block counts as 1/8
    assert memory < full, (memory, full)
    assert memory <= stacked + 2 * block, (memory, stacked, block)


def test_whole_tree_gathering_keeps_every_block():
    """The same model with no blocks named (`layers=()`) holds every gathered block: the difference is
    at least 6 of the 8 blocks' full weights."""
    per_layer, full = compiled_memory("loop")
    whole, _ = compiled_memory("loop", layers=())
    assert whole - per_layer > 6 / 8 * 0.9 * full, (whole, per_layer, full)


@pytest.mark.parametrize(
    ("style", "strategy", "micro_batches"),
    [(style, "zero3", 1) for style in (*STYLES, "stack")] + [("nnx scan", "p=2x1,g=4x1,os=4x2", 3)],
)
def test_audit_bytes_are_exact(style, strategy, micro_batches):
    # A plan of `STYLE_PLANS` is audited in the program its training test compiled.
    report = audit.audit_trainer(plan_trainer(style, strategy, micro_batches), data()[0], DIMS)
    predicted, measured = report.predicted, report.measured
    assert report.bytes_match, (predicted.bytes_by_kind_and_level(), measured.bytes_by_kind_and_level())
    # Blocks, scans and stacks alike: the collectives the compiled program issues are those counted.
    assert measured.launches_by_kind_and_level() == {
        kind: levels for kind, levels in report.predicted_launches().items() if any(levels.values())
    }


@pytest.mark.parametrize("style", ["loop", "scan"])
def test_wrapped_blocks_draw_the_same_dropout_masks(style):
    """Through the interceptor (weights as (shard, sink) pairs, no mesh) dropout, loss and gradients
    equal the model applied plainly: the block's own RNG streams and counters are used."""
    model = GPT(style, dropout=0.5)
    tokens = data()[0]["inputs"]
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), tokens))["params"]
    rngs = {"dropout": jax.random.key(7)}

    def plain(params):
        return model.apply({"params": params}, tokens, False, rngs=rngs).sum()

    trainer = aj.Trainer(aj.Plan(CLUSTER, aj.zero3(CLUSTER)), model, optimizer(), loss_of(model))
    trainer.setup(jax.random.key(0), tokens)
    blocks = trainer.params_layout.blocks
    identity = StackOps(gather_with_sink=lambda p, s: p, gather=lambda p: p, reduce=lambda g: g)
    flat = traverse_util.flatten_dict(params)

    def wrapped(shards, sinks):
        tree = traverse_util.unflatten_dict(
            {p: (shards[p], sinks[p]) if any(p[: len(b)] == b for b in blocks) else shards[p] for p in flat}
        )
        context = LayerContext({}, {}, None, True, blocks=dict.fromkeys(blocks, identity))
        with layer_context(context), linen_blocks():
            return model.apply({"params": tree}, tokens, False, rngs=rngs).sum()

    # Both under jit: eagerly each operation of the forward and backward would compile on its own.
    loss, grads = jax.jit(jax.value_and_grad(plain))(params)
    sinks = jax.tree.map(np.zeros_like, flat)
    wrapped_grad = jax.jit(jax.value_and_grad(wrapped, argnums=(0, 1)))
    wrapped_loss, (shard_grads, sink_grads) = wrapped_grad(flat, sinks)
    assert float(wrapped_loss) == pytest.approx(float(loss), rel=1e-6)
    routed = {p: (sink_grads if any(p[: len(b)] == b for b in blocks) else shard_grads)[p] for p in flat}
    # Other masks would change the gradients by O(1); summation order changes them by ~1e-6.
    assert_params_close(traverse_util.unflatten_dict(routed), grads)
