"""A user's own Flax training loop on amsp_jax: their model, their optax chain, their loss, their loop.

amsp_jax only decides where P, G and OS live and runs the step; everything else stays the user's.
The model here is a small character-level language model whose residual MLP blocks sit in a
`LayerStack`, which is all it takes for the step to gather parameters one layer at a time. It learns
to continue a simple arithmetic sequence, so the loss falls within a few dozen steps.

    python examples/flax_loop.py --steps 100

Without an accelerator it runs on 8 simulated CPU devices (one node of 8).
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import amsp_jax as aj
from amsp_jax.run.distributed import simulate_cpu_devices

VOCAB = 32
SEQ = 16


class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 norm(x))."""

    width: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
        return x + nn.Dense(self.width)(nn.gelu(h))


class CharModel(nn.Module):
    """Embedding, a stack of residual MLPs (mixing in the previous token), and a logits head."""

    width: int = 64
    depth: int = 4

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, self.width)(tokens)
        previous = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        x = nn.Dense(self.width)(jnp.concatenate([x, previous], axis=-1))
        x = aj.LayerStack(ResidualMLP(self.width, parent=None), self.depth, name="blocks")(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def sequences(rng: np.random.Generator, count: int) -> dict[str, np.ndarray]:
    """Rows of t_{i+1} = t_i + stride (mod VOCAB), random start and stride: next tokens are learnable."""
    start = rng.integers(0, VOCAB, (count, 1))
    stride = rng.integers(1, 4, (count, 1))
    tokens = ((start + stride * np.arange(SEQ + 1)) % VOCAB).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def main(steps: int = 60, batch_per_device: int = 4, seed: int = 0) -> list[float]:
    """Train for `steps` and return the loss of every step."""
    model = CharModel()

    def loss_fn(params: dict, batch: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, max(steps, 11)), weight_decay=0.01),
    )
    cluster = aj.Cluster.detect()
    # The parameters stay whole on every device (like DDP), gradients are reduce-scattered within a
    # node and the optimizer state is sharded over the whole cluster: ZeRO-2 shaped, one custom point.
    whole_cluster = aj.Placement(cluster.devices_per_node, cluster.nodes)
    strategy = aj.Strategy(aj.Placement(1, 1), aj.Placement(cluster.devices_per_node, 1), whole_cluster)
    trainer = aj.Trainer(aj.Plan(cluster, strategy, micro_batches=2), model, optimizer, loss_fn)

    rng = np.random.default_rng(seed)
    global_batch = batch_per_device * 2 * cluster.num_devices
    state = trainer.init(jax.random.key(seed), sequences(rng, global_batch)["inputs"])
    losses = []
    for step in range(steps):
        state, metrics = trainer.step(state, sequences(rng, global_batch))
        losses.append(float(metrics["loss"]))
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  grad norm {float(metrics['grad_norm']):.3f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    simulate_cpu_devices(8)
    main(parser.parse_args().steps)
