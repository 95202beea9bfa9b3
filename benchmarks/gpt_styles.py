"""One GPT written five ways, and its compiled zero3 step memory (`benchmarks/any_model.py`).

The same model as the test suite's model zoo: flax.linen `MultiHeadDotProductAttention`, `LayerNorm`,
learned positions and biases; a Python loop of blocks, `nn.scan`, `amsp_jax.LayerStack`, an nnx list
and an nnx `vmap`+`scan` stack. Kept here so that the benchmarks do not import the tests.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import amsp_jax as aj
from amsp_jax.layers.nnx import NnxModel
from amsp_jax.models.llama import cross_entropy

VOCAB, HEADS, SEQ = 64, 4, 8
CLUSTER = aj.Cluster(2, 4)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    width: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(h, h, mask=mask)
        h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
        return x + nn.Dense(self.width)(nn.gelu(h))


class ScannedBlock(Block):
    """`Block` with the (carry, output) signature `nn.scan` wants."""

    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:  # type: ignore[override]
        return super().__call__(x), None


class StackedBlock(nn.Module):
    """`Block` as a LayerStack layer."""

    width: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return Block(self.width)(x)


class GPT(nn.Module):
    """Token and learned position embeddings, `layers` blocks, final norm and a head."""

    style: str  # loop | scan | stack
    layers: int
    width: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        positions = self.param("positions", nn.initializers.normal(0.02), (SEQ, self.width))
        x = nn.Embed(VOCAB, self.width)(tokens) + positions[: tokens.shape[1]]
        if self.style == "loop":
            for _ in range(self.layers):
                x = Block(self.width)(x)
        elif self.style == "scan":
            stack = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=self.layers)  # fmt: skip
            x, _ = stack(self.width, name="blocks")(x)
        else:
            x = aj.LayerStack(StackedBlock(self.width, parent=None), self.layers, name="blocks")(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class NnxBlock(nnx.Module):
    """The same block in nnx."""

    def __init__(self, rngs: nnx.Rngs, width: int) -> None:
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

    def __init__(self, rngs: nnx.Rngs, scanned: bool, layers: int, width: int) -> None:
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


def model(style: str, layers: int, width: int) -> Any:
    """One of the styles: `loop`, `scan`, `stack` (linen) or `nnx list`, `nnx scan`."""
    if style.startswith("nnx"):
        return NnxModel(lambda rngs: NnxGPT(rngs, style == "nnx scan", layers, width))
    return GPT(style, layers, width)


def compiled_memory(style: str, layers: tuple[type, ...] | None = None) -> tuple[int, int]:
    """Compiled zero3 step memory per device (arguments + outputs - aliased + temporaries) and the full
    fp32 parameter bytes, for 8 blocks of width 128 (1.6 M parameters: parameters dominate)."""
    gpt = model(style, layers=8, width=128)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (8, SEQ + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return cross_entropy(gpt.apply({"params": params}, batch["inputs"]), batch["targets"])

    adamw = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, eps=1e-3, weight_decay=0.1))
    plan = aj.Plan(CLUSTER, aj.zero3(CLUSTER), precision="fp32")
    trainer = aj.Trainer(plan, gpt, adamw, loss, layers=layers)
    trainer.setup(jax.random.key(0), batch["inputs"])
    stats = trainer.compile(trainer.abstract_state(), batch).memory_analysis()
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    full_params = sum(int(np.prod(leaf.shape)) * 4 for leaf in trainer.params_layout.leaves.values())
    return total + stats.temp_size_in_bytes, full_params
