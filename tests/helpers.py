"""Shared test fixtures' building blocks: a tiny LLaMA, its batches and a single-device reference."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

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
# Every preset and more, for the step numerics and the audit (one compile per plan, shared).
STRATEGIES = [
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "mics",
    "p=2x1,g=4x1,os=4x2",  # G sharded finer than P
    "p=4x2,g=4x1,os=1x1",  # P sharded finer than OS
    "p=4x1,g=4x2,os=4x1",  # G finer than OS: the reduction ends in an all-gather
    "p=1x1,g=1x1,os=4x1",  # AMSP's LLaMA-7B choice, scaled to 4 devices per node
    "p=2x1,g=2x1,os=4x1",  # AMSP's 13B shape (its 30B shape's step: tests/test_memory_at_shapes.py)
]


def optimizer() -> optax.GradientTransformation:
    """The chain every numerics test uses: global-norm clipping then AdamW.

    eps=1e-3: Adam divides by sqrt(v)+eps, so a gradient entry that cancels to ~1e-9 keeps a large
    relative rounding error, and a small eps turns that into an lr-sized difference between two
    summation orders (seen: 2e-4 relative with eps=1e-6, 2e-7 with plain SGD). eps=1e-3 bounds that
    amplification while keeping the moments, bias correction and weight decay in the comparison.
    """
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, eps=1e-3, weight_decay=0.1))


def batches(global_batch: int, steps: int, seed: int = 0, vocab: int = 64) -> list[dict[str, np.ndarray]]:
    """Random next-token batches of `SEQ` tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (steps, global_batch, SEQ + 1)).astype(np.int32)
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def reference(
    model: Any, data: list[dict[str, np.ndarray]], key: jax.Array, loss_fn: Any = None
) -> tuple[list[float], dict]:
    """Plain `jax.grad` + the same optax chain on one device: losses of each step and final params
    (`loss_fn` default: the LLaMA's)."""
    loss_fn = loss_fn or make_loss_fn(model)
    device = jax.devices()[0]
    # Under jit: an eager init runs the model op by op, compiling each operation on its own.
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


@functools.cache
def train_data() -> list[dict[str, np.ndarray]]:
    """The batches every strategy of the step and audit tests trains on."""
    return batches(GLOBAL_BATCH, STEPS)


@functools.cache
def set_up(
    strategy: str,
    micro_batches: int,
    precision: str = "fp32",
    remat: str = "full",
    layers: int = TINY.n_layers,
    prefetch: bool | None = None,
    keep_first_layer: bool = False,
) -> aj.Trainer:
    """The set-up trainer of the tiny model (with `layers` layers) under a plan; cached, so that the
    step and audit tests of a plan share it and its one compile."""
    model = Llama(dataclasses.replace(TINY, n_layers=layers))
    plan = aj.Plan(
        CLUSTER, aj.resolve(strategy, CLUSTER), micro_batches, precision=precision, remat=remat,
        prefetch=prefetch, keep_first_layer=keep_first_layer,
    )  # fmt: skip
    trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model))
    trainer.setup(jax.random.key(0), train_data()[0]["inputs"])
    return trainer


@functools.cache
def trained(strategy: str, micro_batches: int, **options: Any) -> tuple:
    """(trainer, final state, losses) of `STEPS` steps of the trainer `set_up` gives for the same
    arguments; cached."""
    trainer = set_up(strategy, micro_batches, **options)
    data = train_data()
    # `trainer.init` would set the trainer up again and drop the step its audit test compiled.
    state = jax.jit(trainer.init_fn, out_shardings=trainer.state_shardings())(jax.random.key(0))
    losses = []
    for batch in data:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return trainer, state, losses
