"""Models annotated for tensor parallelism the way Flax users write them: logical axis names on every
kernel (`nn.with_logical_partitioning`, MaxText's names), `nn.DenseGeneral` attention with biases,
`LayerNorm`, an `nn.Embed` vocabulary and learned positions, in a Python loop, `nn.scan` or a
`LayerStack` of blocks."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import amsp_jax as aj
from amsp_jax.layers.nnx import NnxModel

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 8
normal = nn.initializers.normal(0.02)


def named(init: Any, *names: str | None) -> Any:
    return nn.with_logical_partitioning(init, names)


class Attention(nn.Module):
    heads: int = HEADS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        width = x.shape[-1]
        head_dim = width // self.heads

        def project(name: str, bias: bool = True) -> jax.Array:
            return nn.DenseGeneral(
                (self.heads, head_dim), kernel_init=named(normal, "embed", "heads", "kv"),
                bias_init=named(nn.initializers.zeros, "heads", "kv"), use_bias=bias, name=name,
            )(x)  # fmt: skip

        q, k, v = project("query"), project("key", bias=False), project("value")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
        causal = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))  # the whole sequence, also under SP
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return nn.DenseGeneral(
            width, axis=(-2, -1), kernel_init=named(normal, "heads", "kv", "embed"),
            bias_init=named(nn.initializers.zeros, "embed"), name="out",
        )(out)  # fmt: skip


class Block(nn.Module):
    """Pre-norm block: attention, then a GELU MLP (column- then row-parallel `nn.Dense`)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + Attention()(nn.LayerNorm(scale_init=named(nn.initializers.ones, "norm"))(x))
        width = x.shape[-1]
        h = nn.LayerNorm(scale_init=named(nn.initializers.ones, "norm"))(x)
        h = nn.Dense(
            4 * width,
            kernel_init=named(normal, "embed", "mlp"),
            bias_init=named(nn.initializers.zeros, "mlp"),
        )(h)
        h = nn.Dense(
            width, kernel_init=named(normal, "mlp", "embed"), bias_init=named(nn.initializers.zeros, "embed")
        )(nn.gelu(h))
        return x + h


class ScannedBlock(Block):
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:  # type: ignore[override]
        return super().__call__(x), None


class AnnotatedGPT(nn.Module):
    """Token embedding split over the vocabulary, learned positions (whole), `LAYERS` blocks, final norm,
    an untied head whose logits are split over the vocabulary."""

    style: str = "loop"  # loop | scan | stack

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, WIDTH, embedding_init=named(normal, "vocab", "embed"))(tokens)
        positions = jnp.arange(tokens.shape[1])[None]
        x = x + nn.Embed(SEQ, WIDTH, embedding_init=named(normal, None, "embed"), name="positions")(positions)
        if self.style == "loop":
            for _ in range(LAYERS):
                x = Block()(x)
        elif self.style == "scan":
            stack = nn.scan(
                ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                length=LAYERS, metadata_params={nn.PARTITION_NAME: "layers"},
            )  # fmt: skip
            x, _ = stack(name="blocks")(x)
        else:
            x = aj.LayerStack(Block(parent=None), LAYERS, name="blocks")(x)
        x = nn.LayerNorm(scale_init=named(nn.initializers.ones, "norm"))(x)
        return nn.Dense(VOCAB, kernel_init=named(normal, "embed", "vocab"), use_bias=False, name="head")(x)


def loss_fn(model: nn.Module) -> Any:
    def loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params}, batch["inputs"])
        labels = jax.nn.one_hot(batch["targets"], VOCAB)
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))

    return loss


def nnx_named(init: Any, *names: str | None) -> Any:
    return nnx.with_partitioning(init, names)


class NnxBlock(nnx.Module):
    """The block in nnx: `nnx.Linear` projections whose heads are found by a reshape to (..., -1,
    head_dim), so a tensor rank's part holds its own heads."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        def linear(n_in: int, n_out: int, names: tuple[str, str]) -> nnx.Linear:
            return nnx.Linear(
                n_in, n_out, kernel_init=nnx_named(normal, *names),
                bias_init=nnx_named(nn.initializers.zeros, names[1]), rngs=rngs,
            )  # fmt: skip

        self.norm1 = nnx.LayerNorm(WIDTH, scale_init=nnx_named(nn.initializers.ones, "norm"), rngs=rngs)
        self.query = linear(WIDTH, WIDTH, ("embed", "heads"))
        self.key = nnx.Linear(
            WIDTH, WIDTH, kernel_init=nnx_named(normal, "embed", "heads"), use_bias=False, rngs=rngs
        )
        self.value = linear(WIDTH, WIDTH, ("embed", "heads"))
        self.out = linear(WIDTH, WIDTH, ("heads", "embed"))
        self.norm2 = nnx.LayerNorm(WIDTH, scale_init=nnx_named(nn.initializers.ones, "norm"), rngs=rngs)
        self.up = linear(WIDTH, 4 * WIDTH, ("embed", "mlp"))
        self.down = linear(4 * WIDTH, WIDTH, ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm1(x)
        head_dim = WIDTH // HEADS
        q, k, v = (p(h) for p in (self.query, self.key, self.value))
        q, k, v = (a.reshape(*a.shape[:2], -1, head_dim) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
        causal = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        x = x + self.out(attended.reshape(*attended.shape[:2], -1))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NnxAnnotatedGPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=nnx_named(normal, "vocab", "embed"), rngs=rngs)
        self.positions = nnx.Embed(SEQ, WIDTH, embedding_init=nnx_named(normal, None, "embed"), rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(WIDTH, scale_init=nnx_named(nn.initializers.ones, "norm"), rngs=rngs)
        self.head = nnx.Linear(
            WIDTH, VOCAB, kernel_init=nnx_named(normal, "embed", "vocab"), use_bias=False, rngs=rngs
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.positions(jnp.arange(tokens.shape[1])[None])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def model(style: str) -> Any:
    """`loop`, `scan`, `stack` (linen) or `nnx`."""
    return NnxModel(NnxAnnotatedGPT) if style == "nnx" else AnnotatedGPT(style)
