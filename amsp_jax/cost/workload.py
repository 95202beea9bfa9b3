"""What the cost model knows of a model: its parameter leaves and transformer dimensions, with the
step's batch, precision, remat and implementation choices (`Workload`)."""

from __future__ import annotations

import dataclasses

from amsp_jax.core.leaf import Leaf, looped_blocks
from amsp_jax.core.plan import Precision
from amsp_jax.core.schedule import Implementation
from amsp_jax.cost.optimizer import ELEMENT_WISE, OptimizerUpdate
from amsp_jax.layers.tensor import Boundary

FP32 = 4


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The transformer dimensions that set FLOPs and activation memory, and the attention's kind.

    `attention` is `LlamaConfig.attention`: `xla` materialises the (seq, seq) scores; `auto`,
    `cudnn` and `blockwise` are flash-style (`amsp_jax.models.attention`). The memory model resolves
    `auto` per backend and precision (`amsp_jax.cost.device_memory.attention_kind`).
    """

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    attention: str = "auto"
    attention_block: int = 512

    @property
    def materialises_scores(self) -> bool:
        """Whether the attention holds (seq, seq) scores in memory."""
        return self.attention == "xla"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model's parameter leaves and dimensions, with the step's batch, precision and remat choices."""

    leaves: tuple[Leaf, ...]
    dims: ModelDims
    seq_len: int
    micro_batch_size: int
    micro_batches: int
    precision: Precision = dataclasses.field(default_factory=Precision)
    remat: str = "full"
    opt_state_bytes_per_param: int = 2 * FP32
    # XLA's CPU backend runs 16-bit collectives in fp32 (seen in compiled HLO); 4 models that there.
    min_collective_itemsize: int = 1
    implementation: Implementation = dataclasses.field(default_factory=Implementation)
    # What the optimizer's update communicates (`amsp_jax.cost.optimizer`); default element-wise: nothing.
    optimizer: OptimizerUpdate = ELEMENT_WISE
    # Whether XLA writes the new master and moments over the old (`core.backend.selects_in_place`):
    # a GPU does; XLA:CPU builds the new state beside the old.
    update_in_place: bool = True
    # The backend the step compiles for: which collectives XLA merges (`schedule.launches`).
    platform: str = "gpu"
    # The tensor-parallel boundaries one forward pass crosses (`layers.tensor.Boundary`; their kinds say
    # the matmul form), and whether the activations between them are split along the sequence.
    boundaries: tuple[Boundary, ...] = ()
    sequence_parallel: bool = True
    # The tensor degree the step runs at: each device multiplies with its 1/t slice of every
    # tensor-split leaf, over all its group's tokens.
    tensor: int = 1

    def wire_bytes(self, itemsize: int) -> int:
        """Bytes per element on the wire for a tensor of `itemsize`."""
        return max(itemsize, self.min_collective_itemsize)

    @property
    def num_params(self) -> int:
        """Parameter count."""
        return sum(leaf.size for leaf in self.leaves)

    @property
    def matmul_params(self) -> int:
        """Parameters the step multiplies with: all but the looked-up ones (an untied input embedding)."""
        return sum(leaf.size for leaf in self.leaves if not leaf.looked_up)

    @property
    def looped_blocks(self) -> bool:
        """Whether the layers are blocks called one by one, not a stack (`looped_blocks`)."""
        return looped_blocks(self.leaves)

    def tokens_per_device(self) -> int:
        """Tokens one device processes per step."""
        return self.seq_len * self.micro_batch_size * self.micro_batches

    def flops_per_token(self) -> int:
        """Model FLOPs per token, forward and backward: 6Φ + 12·L·H·Q·T (Megatron/PaLM convention), Φ
        the parameters the step multiplies with (`matmul_params`).

        An untied input embedding is looked up, not multiplied: Megatron-LM's formula counts the
        output projection once and no input embedding, and torchtitan (whose published MFU this
        repository compares with) takes the token embedding out of Φ. A tied one is the output
        projection and counts once. The same for every attention implementation: no causal halving,
        no recomputation (those are `attention_square_fraction`, `attention_recompute_flops_per_token`
        and the time model's remat terms).
        """
        d = self.dims
        return 6 * self.matmul_params + 12 * d.n_layers * d.n_heads * d.head_dim * self.seq_len

    def attention_square_fraction(self) -> float:
        """The fraction of the (seq, seq) score square whose matmuls the attention runs.

        The materialising attention runs all of it and masks the upper triangle. A flash-style kernel
        skips every tile above the diagonal (FlashAttention-2, arXiv 2307.08691 §3.1: the causal kernel
        runs 1.7–1.8× faster than the unmasked one). Counted at the blockwise attention's tiling
        (`attention_block`, padding included), which is exact for it; cuDNN's tiles are smaller, so it
        skips a little more than counted.
        """
        d = self.dims
        if d.materialises_scores:
            return 1.0
        blocks = -(-self.seq_len // d.attention_block)
        block = -(-self.seq_len // blocks)
        return blocks * (blocks + 1) // 2 * block * block / self.seq_len**2

    def attention_recompute_flops_per_token(self) -> int:
        """FLOPs per token a flash-style attention's backward adds: it recomputes the scores Q·Kᵀ.

        Its backward runs five (seq, seq)-sized matmuls (Q·Kᵀ again, dV, dP, dQ, dK) where the
        materialising one runs four, so 2·L·H·Q·T more per token over the whole square; the kernel
        runs `attention_square_fraction` of it.
        """
        return 0 if self.dims.materialises_scores else self.attention_run_flops_per_token(2)

    def attention_run_flops_per_token(self, per_square: int) -> int:
        """FLOPs per token the kernel runs of attention matmuls worth `per_square`·L·H·Q·T over the whole
        (seq, seq) square (12 for a forward and backward): `attention_square_fraction` of them."""
        d = self.dims
        square = per_square * d.n_layers * d.n_heads * d.head_dim * self.seq_len
        return round(square * self.attention_square_fraction())

    def with_(self, **changes: object) -> Workload:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def llama_workload(
    config: object,
    seq_len: int,
    micro_batch_size: int = 1,
    micro_batches: int = 1,
    precision: Precision | str = "mixed",
    remat: str = "full",
) -> Workload:
    """The workload of `amsp_jax.models.llama.Llama(config)` (same leaves as the Flax model)."""
    c = config
    leaves = [Leaf(("embed",), (c.vocab_size, c.dim), False, looked_up=not c.tie_embeddings)]
    leaves += [
        Leaf(("layers", "layer", name), (c.n_layers, *shape), True, unit=("layers",), layer_stack=True)
        for name, shape in c.layer_shapes().items()
    ]
    leaves.append(Leaf(("norm",), (c.dim,), False))
    if not c.tie_embeddings:
        leaves.append(Leaf(("lm_head",), (c.dim, c.vocab_size), False))
    precision = Precision.named(precision) if isinstance(precision, str) else precision
    return Workload(tuple(leaves), llama_dims(c), seq_len, micro_batch_size, micro_batches, precision, remat)


def llama_dims(config: object) -> ModelDims:
    """The `ModelDims` of a `LlamaConfig`."""
    c = config
    return ModelDims(
        c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size,
        c.attention, c.attention_block,
    )  # fmt: skip
