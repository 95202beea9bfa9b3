"""An nnx decoder called with required keyword-only arguments, as third-party nnx decoders are (gemma's
`Transformer(last_tokens, positions, cache, attention_mask)`, MaxText's `segment_ids=` / `positions=`):
set up the way its user calls it, it trains per layer against its single-device reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import amsp_jax as aj
from amsp_jax.compiled.audit import audit_trainer
from amsp_jax.layers.nnx import NnxModel
from amsp_jax.models.llama import cross_entropy
from amsp_jax.trainer import TrainerError
from tests.helpers import SEQ, max_relative_error, optimizer

CLUSTER = aj.Cluster(2, 4)
VOCAB, LAYERS, STEPS = 64, 4, 3


class Block(nnx.Module):
    """Pre-norm attention and MLP; the attention mask comes by keyword, as the caller builds it."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.RMSNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(width, width, use_bias=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array, *, attention_mask: jax.Array) -> jax.Array:
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(x.shape[-1])
        scores = jnp.where(attention_mask, scores, -1e9)
        x = x + self.out(jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, axis=-1), v))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Decoder(nnx.Module):
    """Tokens by position; `positions` and `segment_ids` (packed sequences) are required keywords."""

    def __init__(self, rngs: nnx.Rngs, width: int = 32, layers: int = LAYERS) -> None:
        self.embed = nnx.Embed(VOCAB, width, rngs=rngs)
        self.position_embed = nnx.Embed(SEQ, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, VOCAB, use_bias=False, rngs=rngs)

    def __call__(
        self, tokens: jax.Array, *, positions: jax.Array, segment_ids: jax.Array, cache: dict | None = None
    ) -> jax.Array:
        assert cache is None, "training runs without a cache"
        x = self.embed(tokens) + self.position_embed(positions)
        causal = positions[:, :, None] >= positions[:, None, :]
        mask = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])
        for block in self.blocks:
            x = block(x, attention_mask=mask)
        return self.head(self.norm(x))


def batches(global_batch: int, steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Random tokens, each row two packed sequences of SEQ / 2 tokens (positions restart at the second)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (steps, global_batch, SEQ + 1)).astype(np.int32)
    half = np.arange(SEQ) % (SEQ // 2)
    positions = np.broadcast_to(half, (global_batch, SEQ)).astype(np.int32)
    segments = np.broadcast_to(np.arange(SEQ) // (SEQ // 2), (global_batch, SEQ)).astype(np.int32)
    return [
        {"inputs": t[:, :-1], "targets": t[:, 1:], "positions": positions, "segment_ids": segments}
        for t in tokens
    ]


def loss_of(apply):
    def loss(params, batch):
        logits = apply(
            {"params": params},
            batch["inputs"],
            positions=batch["positions"],
            segment_ids=batch["segment_ids"],
        )
        return cross_entropy(logits, batch["targets"])

    return loss


def reference(data):
    """Native nnx on one device: `jax.grad` over the Param state, the same optax chain."""
    module = Decoder(nnx.Rngs(jax.random.key(0)))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    opt = optimizer()
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss(p):
            return loss_of(lambda v, *a, **k: nnx.merge(graphdef, p, rest)(*a, **k))(None, batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for batch in data:
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
    return losses, jax.tree.map(np.asarray, nnx.to_pure_dict(params))


def trainer_for(strategy: str, micro_batches: int, model: NnxModel) -> aj.Trainer:
    plan = aj.Plan(CLUSTER, aj.resolve(strategy, CLUSTER), micro_batches=micro_batches, precision="fp32")
    return aj.Trainer(plan, model, optimizer(), loss_of(model.apply))


def example(batch):
    return batch["inputs"], {"positions": batch["positions"], "segment_ids": batch["segment_ids"]}


@pytest.fixture(scope="module")
def data():
    return batches(16, STEPS)


@pytest.mark.parametrize(("strategy", "micro_batches"), [("zero3", 1), ("p=2x1,g=4x1,os=4x2", 2)])
def test_keyword_only_decoder_trains_like_its_reference(data, strategy, micro_batches):
    expected_losses, expected_params = reference(data)
    trainer = trainer_for(strategy, micro_batches, NnxModel(Decoder))
    tokens, keywords = example(data[0])
    state = trainer.init(jax.random.key(0), tokens, **keywords)
    assert trainer.program.params.blocks == tuple(("blocks", i) for i in range(LAYERS))
    losses = []
    for batch in data:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-5)
    assert max_relative_error(trainer.full_params(state), expected_params) < 1e-5


@functools.cache
def compiled_bytes(strategy: str) -> tuple[int, int]:
    """Compiled step memory per device (arguments + outputs - aliased + temporaries) and the full fp32
    parameter bytes, for 8 blocks of width 128 (1.6 M parameters: they dominate)."""
    model = NnxModel(lambda rngs: Decoder(rngs, width=128, layers=8))
    batch = batches(8, 1)[0]
    trainer = trainer_for(strategy, 1, model)
    tokens, keywords = example(batch)
    trainer.setup(jax.random.key(0), tokens, **keywords)
    stats = trainer.compile(trainer.abstract_state(), batch).memory_analysis()
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    full = sum(4 * np.prod(leaf.shape) for leaf in trainer.program.params.leaves.values())
    return total + stats.temp_size_in_bytes, int(full)


def test_zero3_gathers_the_keyword_blocks_per_layer():
    """zero3 holds an eighth of P, G and OS and one or two gathered blocks; the plan with P replicated
    (G and OS split as zero3's) holds all of P, so at least half of the full fp32 parameters more."""
    (zero3, full), (replicated_p, _) = compiled_bytes("zero3"), compiled_bytes("p=1x1,g=4x2,os=4x2")
    assert replicated_p - zero3 > full / 2, (zero3, replicated_p, full)


def test_an_example_that_does_not_fit_the_model_says_so(data):
    trainer = trainer_for("zero3", 1, NnxModel(Decoder))
    with pytest.raises(
        TrainerError, match=r"cannot be called with the example inputs \(int32\[16, 8\]\): .*keyword-only"
    ):
        trainer.setup(jax.random.key(0), data[0]["inputs"])


def test_the_audit_of_a_keyword_model_counts_its_compiled_collectives(data):
    """The audit infers the model's dimensions by calling it as the trainer does (keywords included)."""
    trainer = trainer_for("zero3", 1, NnxModel(Decoder))
    tokens, keywords = example(data[0])
    trainer.setup(jax.random.key(0), tokens, **keywords)
    report = audit_trainer(trainer, data[0])
    assert report.bytes_match, report.table()
