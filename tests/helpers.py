"""Shared test fixtures' building blocks: a tiny LLaMA, its batches and a single-device reference."""

from __future__ import annotations

import jax
import numpy as np
import optax

from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn

TINY = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
SEQ = 8


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


def reference(model: Llama, data: list[dict[str, np.ndarray]], key: jax.Array) -> tuple[list[float], dict]:
    """Plain `jax.grad` + the same optax chain on one device: losses of each step and final params."""
    loss_fn = make_loss_fn(model)
    device = jax.devices()[0]
    params = jax.device_put(model.init(key, data[0]["inputs"])["params"], device)
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
