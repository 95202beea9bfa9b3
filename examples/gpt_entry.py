"""A Flax GPT written the ordinary way, as a planner entry point.

    amsp-jax plan --model examples/gpt_entry.py:gpt --cluster a800-8x-ib800 --seq-len 1024 ...


The function returns the model and the inputs its `init` takes; the planner traces it (leaves, blocks,
dimensions) and plans it like a LLaMA config.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
        return x + nn.Dense(self.width)(nn.gelu(h))


class GPT(nn.Module):
    """GPT-2 medium's shape: 24 blocks of width 1024, 16 heads, learned positions, 50,257 tokens."""

    vocab: int = 50257
    width: int = 1024
    heads: int = 16
    layers: int = 24
    max_len: int = 1024

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        positions = self.param("positions", nn.initializers.normal(0.02), (self.max_len, self.width))
        x = nn.Embed(self.vocab, self.width)(tokens) + positions[: tokens.shape[1]]
        for _ in range(self.layers):
            x = Block(self.width, self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def gpt() -> tuple[nn.Module, tuple[jax.Array]]:
    """The model and an example batch of token ids (shapes only matter)."""
    return GPT(), (jnp.zeros((1, 1024), jnp.int32),)
