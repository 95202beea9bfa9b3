"""Models written the ordinary way (no LayerStack), for per-layer gathering of any model.

A GPT in four styles with the same block: flax.linen `MultiHeadDotProductAttention`, `LayerNorm`,
learned positions, biases and dropout; a Python loop of blocks, `nn.scan`, an nnx list and an nnx
`vmap`+`scan` stack. And the same GPT built with `amsp_jax.LayerStack`, for memory comparisons.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import amsp_jax as aj
from amsp_jax.layers.nnx import NnxModel

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 64, 32, 4, 4, 8


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each with dropout."""

    width: int = WIDTH
    heads: int = HEADS
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        x = x + nn.Dropout(self.dropout)(h, deterministic=deterministic)
        h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
        h = nn.Dense(self.width)(nn.gelu(h))
        return x + nn.Dropout(self.dropout)(h, deterministic=deterministic)


class ScannedBlock(Block):
    """`Block` with the (carry, output) signature `nn.scan` wants."""

    def __call__(self, x: jax.Array, deterministic: bool = True) -> tuple[jax.Array, None]:
        return super().__call__(x, deterministic), None


class StackedBlock(nn.Module):
    """`Block` as a LayerStack layer (positional arguments only)."""

    width: int = WIDTH
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return Block(self.width, dropout=self.dropout)(x, True)


class GPT(nn.Module):
    """Token and learned position embeddings, `LAYERS` blocks, final norm and a tied-free head."""

    style: str = "loop"  # loop | scan | stack
    layers: int = LAYERS
    dropout: float = 0.0
    width: int = WIDTH

    @nn.compact
    def __call__(self, tokens: jax.Array, deterministic: bool = True) -> jax.Array:
        positions = self.param("positions", nn.initializers.normal(0.02), (SEQ, self.width))
        x = nn.Embed(VOCAB, self.width)(tokens) + positions[: tokens.shape[1]]
        if self.style == "loop":
            for _ in range(self.layers):
                x = Block(self.width, dropout=self.dropout)(x, deterministic)
        elif self.style == "scan":
            stack = nn.scan(
                ScannedBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=nn.broadcast,
                length=self.layers,
            )
            x, _ = stack(self.width, dropout=self.dropout, name="blocks")(x, deterministic)
        else:
            block = StackedBlock(self.width, self.dropout, parent=None)
            x = aj.LayerStack(block, self.layers, name="blocks")(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class NnxBlock(nnx.Module):
    """The same block in nnx."""

    def __init__(self, rngs: nnx.Rngs, width: int = WIDTH) -> None:
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(HEADS, width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm1(x)
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + self.attention(h, h, h, mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NnxGPT(nnx.Module):
    """The GPT in nnx: a list of blocks, or one block stacked with `nnx.vmap` and run by `nnx.scan`."""

    def __init__(
        self, rngs: nnx.Rngs, scanned: bool = False, layers: int = LAYERS, width: int = WIDTH
    ) -> None:
        self.scanned = scanned
        self.embed = nnx.Embed(VOCAB, width, rngs=rngs)
        self.positions = nnx.Param(jax.random.normal(rngs.params(), (SEQ, width)) * 0.02)
        if scanned:

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs: nnx.Rngs) -> NnxBlock:
                return NnxBlock(rngs, width)

            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([NnxBlock(rngs, width) for _ in range(layers)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.positions[...][: tokens.shape[1]]
        if self.scanned:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x: jax.Array, block: NnxBlock) -> jax.Array:
                return block(x)

            x = run(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(self.norm(x))


def model(style: str, **sizes: int) -> Any:
    """One of the styles: `loop`, `scan`, `stack` (linen) or `nnx list`, `nnx scan`."""
    if style.startswith("nnx"):
        return NnxModel(lambda rngs: NnxGPT(rngs, scanned=style == "nnx scan", **sizes))
    return GPT(style, **sizes)
