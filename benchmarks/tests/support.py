"""The benchmarks' tests' tiny LLaMA, its batches, the amsp_jax step under a preset and a single-device
reference: what the library's own tests build too, kept here so that neither tree imports the other."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
import optax

import amsp_jax as aj
from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn

TINY = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
SEQ = 8
CLUSTER = aj.Cluster(2, 4)
GLOBAL_BATCH = 24
STEPS = 3


def optimizer() -> optax.GradientTransformation:
    """Global-norm clipping then AdamW; eps=1e-3 keeps a gradient that cancels to ~1e-9 from turning
    two summation orders' rounding into an lr-sized difference."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, eps=1e-3, weight_decay=0.1))


@functools.cache
def train_data() -> list[dict[str, np.ndarray]]:
    """`STEPS` random next-token batches of `GLOBAL_BATCH` sequences of `SEQ` tokens."""
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (STEPS, GLOBAL_BATCH, SEQ + 1))
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens.astype(np.int32)]


def reference(model: Llama, data: list[dict[str, np.ndarray]], key: jax.Array) -> tuple[list[float], dict]:
    """Plain `jax.grad` + the same optax chain on one device: losses of each step and final params."""
    loss_fn = make_loss_fn(model)
    device = jax.devices()[0]
    params = jax.device_put(nn.meta.unbox(jax.jit(model.init)(key, data[0]["inputs"]))["params"], device)
    opt = optimizer()
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in data:
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, device))
        losses.append(float(loss))
    return losses, jax.tree.map(np.asarray, params)


def max_relative_error(actual: dict, expected: dict) -> float:
    """Largest per-leaf max|a - e| / max|e|."""
    errors = jax.tree.map(
        lambda a, e: float(np.max(np.abs(np.asarray(a) - e)) / max(np.max(np.abs(e)), 1e-12)),
        actual,
        expected,
    )
    return max(jax.tree.leaves(errors))


def amsp_step(strategy: str, micro_batches: int) -> tuple[aj.Trainer, jax.stages.Compiled]:
    """The set-up fp32 trainer of the tiny model under a preset and its compiled step, for `train_data()`."""
    model = Llama(TINY)
    plan = aj.Plan(CLUSTER, aj.resolve(strategy, CLUSTER), micro_batches, precision="fp32")
    trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model))
    trainer.setup(jax.random.key(0), train_data()[0]["inputs"])
    return trainer, trainer.compile(trainer.abstract_state(), trainer.shard_batch(train_data()[0]))
