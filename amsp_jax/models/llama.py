"""LLaMA in Flax linen: RMSNorm, RoPE, SwiGLU, grouped-query causal attention, layers in a `LayerStack`.

Every parameter carries its logical axis names (`LOGICAL_NAMES`, MaxText's), which decide how a
tensor-parallel step splits it; inside such a step the layers hold their slice of the heads, the ffn
units and the vocabulary (`amsp_jax.layers.tensor`), with Megatron's column- and row-parallel pairs.

Attention (`LlamaConfig.attention`, `amsp_jax.models.attention`): by default cuDNN's fused flash
attention where the step is compiled for CUDA in bf16/fp16, and a blockwise online-softmax attention
(plain JAX, custom VJP) everywhere else; neither holds the (seq, seq) scores. `attention: xla` is the
materialising dot / softmax / dot.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from amsp_jax.core import config_files
from amsp_jax.core.leaf import Leaf
from amsp_jax.core.tensor import tensor_dim
from amsp_jax.cost.trace import ModelSpec
from amsp_jax.cost.workload import llama_workload
from amsp_jax.errors import AmspError, check_field_types
from amsp_jax.layers import tensor
from amsp_jax.layers.stack import LayerStack
from amsp_jax.models import attention as attention_lib


class ModelConfigError(AmspError):
    """A model config with a missing file, a wrong-typed value or shapes that cannot work."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model shape; `head_dim` = dim / heads."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 176
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention: str = "auto"
    """`auto` (cuDNN flash attention on CUDA where it applies, else `blockwise`), `blockwise`, `cudnn`
    or `xla` (materialises the scores); see `amsp_jax.models.attention`."""
    attention_block: int = 512
    """Query and key block size of the blockwise attention."""
    name: str = "llama"

    def __post_init__(self) -> None:
        check_field_types(LlamaConfig, dataclasses.asdict(self), "", ModelConfigError)
        if self.attention not in attention_lib.KINDS:
            raise ModelConfigError(
                f"attention must be one of {', '.join(attention_lib.KINDS)}, got {self.attention!r}"
            )
        keys = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")
        for key in (*keys, "attention_block"):
            if getattr(self, key) < 1:
                raise ModelConfigError(f"{key} must be at least 1, got {getattr(self, key)}")
        for key in ("rope_theta", "norm_eps"):
            if not 0 < getattr(self, key) < math.inf:
                raise ModelConfigError(f"{key} must be a positive number, got {getattr(self, key)}")
        if self.dim % self.n_heads:
            raise ModelConfigError(
                f"dim {self.dim} is not a multiple of n_heads {self.n_heads}; make dim a multiple "
                f"(e.g. {self.n_heads * max(1, round(self.dim / self.n_heads))})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}; use a "
                "divisor of n_heads for n_kv_heads"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter shapes of one transformer layer."""
        d, h, kv, hd, f = self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_dim
        return {
            "attention_norm": (d,),
            "wq": (d, h, hd),
            "wk": (d, kv, hd),
            "wv": (d, kv, hd),
            "wo": (h, hd, d),
            "ffn_norm": (d,),
            "w1": (d, f),
            "w3": (d, f),
            "w2": (f, d),
        }

    def num_params(self) -> int:
        """Total parameter count."""
        per_layer = sum(math.prod(s) for s in self.layer_shapes().values())
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embeddings + self.dim

    @classmethod
    def from_yaml(cls, path: str | Path) -> LlamaConfig:
        """Read a `configs/models/*.yaml` file; a ModelConfigError names the file and the key at fault."""
        path = Path(path)
        if not path.is_file():
            raise ModelConfigError(f"model config {path} does not exist; see configs/models/ for examples")
        what = "model settings (e.g. dim: 64)"
        data = config_files.read_mapping(path, ModelConfigError, what)
        if not data:  # an empty file would silently be the default model
            raise ModelConfigError(f"{path} is not a mapping of {what}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ModelConfigError(
                f"{path}: unknown model keys {sorted(unknown, key=str)}; known: {sorted(known)}"
            )
        try:
            return cls(**data)
        except ModelConfigError as error:
            raise ModelConfigError(f"{path}: {error}") from None


# Logical axis names of every parameter (MaxText's): the tensor rules split `q_heads`, `kv_heads`, `mlp`
# and `vocab` by default.
LOGICAL_NAMES: dict[str, tuple[str, ...]] = {
    "attention_norm": ("norm",),
    "wq": ("embed", "q_heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("q_heads", "head_dim", "embed"),
    "ffn_norm": ("norm",),
    "w1": ("embed", "mlp"),
    "w3": ("embed", "mlp"),
    "w2": ("mlp", "embed"),
    "embed": ("vocab", "embed"),
    "norm": ("norm",),
    "lm_head": ("embed", "vocab"),
}


def _param(module: nn.Module, name: str, init: Any, shape: tuple[int, ...]) -> jax.Array:
    """A parameter with its logical names, of the shape this tensor rank holds (whole outside a
    tensor-parallel step); an error where the tensor rules would leave a split matmul whole."""
    names = LOGICAL_NAMES[name]
    whole = tensor.tensor_degree() > 1 and tensor.split_dim(names) is None
    if whole and name not in ("attention_norm", "ffn_norm", "norm"):
        raise ModelConfigError(
            f"the LLaMA splits {name} ({', '.join(names)}) over the tensor axis, and the tensor rules "
            "keep it whole; map q_heads, kv_heads, mlp and vocab to 'tensor' (the default rules do)"
        )
    local = tensor.local_shape(shape, names, name)
    return module.param(name, nn.with_logical_partitioning(init, names), local)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32, returned in the input dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary embedding, shape (seq_len, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BTHD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (first half, second half) of each head by the position's angle."""
    half = x_BTHD.shape[-1] // 2
    x1, x2 = x_BTHD[..., :half].astype(jnp.float32), x_BTHD[..., half:].astype(jnp.float32)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTHD.dtype)


class Block(nn.Module):
    """One pre-norm transformer layer."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x_BTD: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        c = self.config
        shapes = c.layer_shapes()
        init = nn.initializers.normal(0.02)
        w = {
            k: _param(self, k, nn.initializers.ones if k.endswith("norm") else init, s)
            for k, s in shapes.items()
        }
        dtype = w["wq"].dtype
        x_BTD = x_BTD.astype(dtype)  # in a sequence-parallel step, this rank's sequence shard

        # One collective (or one ring) carries the normed input to the query, key and value projections.
        h = rms_norm(x_BTD, w["attention_norm"], c.norm_eps)
        q, k, v = tensor.column_matmul(_project, h, w["wq"], w["wk"], w["wv"])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = attention_lib.attention(q, k, v, c.attention, c.attention_block)
        x_BTD = x_BTD + tensor.row_matmul(_merge_heads, attn, w["wo"])

        h = rms_norm(x_BTD, w["ffn_norm"], c.norm_eps)
        gate, up = tensor.column_matmul(jnp.matmul, h, w["w1"], w["w3"])
        return x_BTD + tensor.row_matmul(jnp.matmul, jax.nn.silu(gate) * up, w["w2"])


def _project(x_BTD: jax.Array, w_DHK: jax.Array) -> jax.Array:
    return jnp.einsum("btd,dhk->bthk", x_BTD, w_DHK)


def _merge_heads(x_BTHK: jax.Array, w_HKD: jax.Array) -> jax.Array:
    return jnp.einsum("bthk,hkd->btd", x_BTHK, w_HKD)


class Llama(nn.Module):
    """Decoder-only LLaMA; `tokens` (batch, seq) int → logits (batch, seq, vocab) fp32."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        c = self.config
        embed = _param(self, "embed", nn.initializers.normal(0.02), (c.vocab_size, c.dim))
        x_BTD = tensor.vocab_lookup(embed, tokens_BT, embedding_lookup)
        cos, sin = rope_tables(tokens_BT.shape[1], c.head_dim, c.rope_theta)
        x_BTD = LayerStack(Block(c, parent=None), c.n_layers, name="layers")(x_BTD, cos, sin)
        x_BTD = rms_norm(x_BTD, _param(self, "norm", nn.initializers.ones, (c.dim,)), c.norm_eps)
        head = (
            embed.T
            if c.tie_embeddings
            else _param(self, "lm_head", nn.initializers.normal(0.02), (c.dim, c.vocab_size))
        )
        (logits,) = tensor.column_matmul(jnp.matmul, x_BTD, head)
        return tensor.vocab_gather(logits).astype(jnp.float32)


@jax.custom_vjp
def embedding_lookup(table_VD: jax.Array, tokens_BT: jax.Array) -> jax.Array:
    """The rows of `table_VD` at `tokens_BT`; its gradient's zero buffer (vocab x dim) is made only once
    the cotangent exists.

    The gradient of a plain `jnp.take` is a scatter-add into zeros that XLA's schedulers create at the
    start of the step, so a vocab x dim buffer is held through the whole forward (the 100M benchmark
    model's zero3 step on CPU: 48 MiB of it at the step's peak, with the gathered embedding and output
    projection). Here the zero is computed from the cotangent's first element (`isnan(x) * 0`, exactly
    0 whatever x is), so no scheduler can create the buffer before the backward reaches the lookup; an
    optimisation barrier would not do it, since XLA:CPU removes barriers before it schedules.
    """
    return jnp.take(table_VD, tokens_BT, axis=0)


def _embedding_lookup_forward(table_VD: jax.Array, tokens_BT: jax.Array) -> tuple[jax.Array, Any]:
    empty_V = jnp.zeros((table_VD.shape[0], 0), table_VD.dtype)  # carries the vocabulary size
    return jnp.take(table_VD, tokens_BT, axis=0), (tokens_BT, empty_V)


def _embedding_lookup_backward(residuals: Any, cotangent_BTD: jax.Array) -> tuple[jax.Array, None]:
    tokens_BT, empty_V = residuals
    first = cotangent_BTD.reshape(-1)[0]
    zero = jnp.isnan(first).astype(empty_V.dtype) * 0  # exactly 0, yet only once the cotangent exists
    zeros_VD = jnp.broadcast_to(zero, (empty_V.shape[0], cotangent_BTD.shape[-1]))
    return zeros_VD.at[tokens_BT].add(cotangent_BTD.astype(empty_V.dtype)), None


embedding_lookup.defvjp(_embedding_lookup_forward, _embedding_lookup_backward)


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in fp32: log-sum-exp of the logits less the target's logit.

    The target's logit is picked by a comparison with the vocabulary's indices, not by an indexed
    gather: the gather's gradient is a scatter into a zero buffer the size of the fp32 logits, which
    XLA allocates at the start of the step (LLaMA-7B at 1,024 A100s: 0.5 GiB held through the whole
    forward). The comparison fuses into the loss and its gradient into the softmax's.
    """
    logits_BTV = logits_BTV.astype(jnp.float32)
    vocabulary = jnp.arange(logits_BTV.shape[-1])
    target_BT = jnp.sum(jnp.where(targets_BT[..., None] == vocabulary, logits_BTV, 0.0), axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits_BTV, axis=-1) - target_BT)


def make_loss_fn(model: Llama) -> Any:
    """`loss(params, batch)` for batches `{"inputs": (B, T), "targets": (B, T)}` of token ids."""

    def loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return cross_entropy(model.apply({"params": params}, batch["inputs"]), batch["targets"])

    return loss


def muon_dimension_numbers(params: Any) -> Any:
    """Muon's `muon_weight_dimension_numbers` for this model: every matrix, heads merged into the output
    (queries, keys, values) or the input (output projection), a layer stack's first dimension as a batch
    of matrices; the norms go to Muon's AdamW."""
    from optax.contrib import MuonDimensionNumbers

    per_layer = {
        "w1": MuonDimensionNumbers(1, 2),
        "w2": MuonDimensionNumbers(1, 2),
        "w3": MuonDimensionNumbers(1, 2),
        "wq": MuonDimensionNumbers(1, (2, 3)),
        "wk": MuonDimensionNumbers(1, (2, 3)),
        "wv": MuonDimensionNumbers(1, (2, 3)),
        "wo": MuonDimensionNumbers((1, 2), 3),
    }
    matrix = MuonDimensionNumbers(0, 1)
    numbers: dict[str, Any] = {"embed": matrix, "norm": None}
    if "lm_head" in params:
        numbers["lm_head"] = matrix
    numbers["layers"] = {"layer": {name: per_layer.get(name) for name in params["layers"]["layer"]}}
    return numbers


def llama_spec(model: LlamaConfig | str | Path) -> ModelSpec:
    """What the planner needs of this model (`amsp_jax.cost.trace.ModelSpec`), from its config, a model
    YAML or a shipped model's name: its leaves, exact dimensions and Muon's dimension numbers."""
    if not isinstance(model, LlamaConfig):
        model = LlamaConfig.from_yaml(config_files.find("models", model, ModelConfigError))
    workload = llama_workload(model, seq_len=1)
    leaves = tuple(_with_tensor_dim(leaf) for leaf in workload.leaves)
    return ModelSpec(
        model.name, leaves, workload.dims, True, muon_dimension_numbers,
        functools.partial(llama_boundaries, model),
    )  # fmt: skip


def _with_tensor_dim(leaf: Leaf) -> Leaf:
    """`leaf` with the dimension the default tensor rules split, from its logical names."""
    names = LOGICAL_NAMES[leaf.path[-1]]
    dim = tensor_dim(names)
    return leaf if dim is None else dataclasses.replace(leaf, tensor_dim=dim + (1 if leaf.stacked else 0))


def llama_boundaries(
    config: LlamaConfig, micro_batch_size: int, seq_len: int, itemsize: int, matmul: str = "gather"
) -> tuple[tensor.Boundary, ...]:
    """The tensor-parallel boundaries one micro-batch's forward of this model crosses, in order: the
    vocabulary-split embedding's sum; per layer the attention's column input (queries, keys and values
    share it), its output projection's row output, the MLP's column input (gate and up) and its down
    projection's row output; the head's column input and the vocabulary gather of the logits. In the
    `ring` and `cannon` forms (`Plan.tensor_matmul`) the projections' boundaries are fused matmuls, the
    cannon's with the kernels and outputs it also moves."""
    tokens = micro_batch_size * seq_len
    act, unit = tokens * config.dim, ("layers",)
    if matmul == "cannon":
        return _cannon_boundaries(config, tokens, itemsize)
    column, row = (tensor.COLUMN_RING, tensor.ROW_RING) if matmul == "ring" else (tensor.COLUMN, tensor.ROW)
    return (
        tensor.Boundary(tensor.ROW, act, itemsize),
        *(tensor.Boundary(kind, act, itemsize, unit, 1) for kind in (column, row, column, row)),
        tensor.Boundary(column, act, itemsize),
        tensor.Boundary(tensor.VOCAB, tokens * config.vocab_size, itemsize),
    )


def _cannon_boundaries(config: LlamaConfig, tokens: int, itemsize: int) -> tuple[tensor.Boundary, ...]:
    """`llama_boundaries` in the `cannon` form: each projection call with its kernels and outputs."""
    shapes, act, unit = config.layer_shapes(), tokens * config.dim, ("layers",)

    def matmul(kind: str, inputs: int, names: tuple[str, ...], where: tuple | None) -> tensor.Boundary:
        kernels = tuple(math.prod(shapes.get(n, (config.dim, config.vocab_size))) for n in names)
        outputs = tuple(tokens * (k // config.dim) if kind == tensor.COLUMN_CANNON else act for k in kernels)
        return tensor.Boundary(
            kind, inputs, itemsize, where, 1 if where else 0, kernels=kernels, kernel_itemsize=itemsize,
            outputs=outputs,
        )  # fmt: skip

    column, row = tensor.COLUMN_CANNON, tensor.ROW_CANNON
    heads = tokens * config.n_heads * config.head_dim
    return (
        tensor.Boundary(tensor.ROW, act, itemsize),
        matmul(column, act, ("wq", "wk", "wv"), unit),
        matmul(row, heads, ("wo",), unit),
        matmul(column, act, ("w1", "w3"), unit),
        matmul(row, tokens * config.ffn_dim, ("w2",), unit),
        matmul(column, act, ("lm_head",), None),
        tensor.Boundary(tensor.VOCAB, tokens * config.vocab_size, itemsize),
    )
