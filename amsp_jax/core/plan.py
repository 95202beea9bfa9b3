"""A plan: the cluster, the strategy and the knobs of one step (micro-batches, precision, remat)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from amsp_jax.core.schedule import Implementation
from amsp_jax.core.space import Cluster, Strategy
from amsp_jax.core.tensor import CANNON_DEGREE, MATMUL_FORMS
from amsp_jax.errors import AmspError

REMAT_POLICIES = ("none", "dots", "full")


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtypes of the compute params (P) and of gradient communication; master and moments are fp32."""

    param_dtype: str = "bfloat16"
    reduce_dtype: str = "bfloat16"

    @classmethod
    def named(cls, name: str) -> Precision:
        """`mixed` (bf16 P and gradient reduction, fp32 master/state/accumulation) or `fp32`."""
        if name == "mixed":
            return cls("bfloat16", "bfloat16")
        if name == "fp32":
            return cls("float32", "float32")
        raise AmspError(f"unknown precision {name!r}; use 'mixed' or 'fp32'")

    @property
    def param_bytes(self) -> int:
        """Bytes per element of P."""
        return jnp.dtype(self.param_dtype).itemsize

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of gradients on the wire."""
        return jnp.dtype(self.reduce_dtype).itemsize

    @property
    def name(self) -> str:
        """`mixed`, `fp32`, or the two dtypes."""
        if (self.param_dtype, self.reduce_dtype) == ("bfloat16", "bfloat16"):
            return "mixed"
        if (self.param_dtype, self.reduce_dtype) == ("float32", "float32"):
            return "fp32"
        return f"{self.param_dtype}/{self.reduce_dtype}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything that decides how one training step is sharded and run."""

    cluster: Cluster
    strategy: Strategy
    micro_batches: int = 1
    precision: Precision = dataclasses.field(default_factory=Precision)
    remat: str = "full"
    allow_partial_nodes: bool = False
    hierarchical: bool = True
    prefetch: bool | None = None
    # With micro-batches: gather each LayerStack's first layer once per step, sum its gradient over the
    # micro-batches and reduce-scatter it once (`amsp_jax.core.schedule.keeps_first_layer`).
    keep_first_layer: bool = False
    # Bytes per device the step may use (the planner's budget). On GPU XLA's scheduler is given the same
    # budget; without one it plans for about 76% of the device and, above that, stops overlapping
    # collectives with compute (`amsp_jax.compiled.xla.scheduler_slop_factor`).
    memory_limit: float | None = None
    # With a tensor axis (t > 1): norms, residuals and dropout on sequence shards, column-parallel inputs
    # all-gathered over the sequence and row-parallel outputs reduce-scattered onto it (Megatron-SP);
    # off: every tensor rank holds whole activations and row-parallel outputs are all-reduced.
    sequence_parallel: bool = True
    # How a tensor-parallel matmul meets its collective: "gather" (the collective, then the matmul, or the
    # matmul, then the reduce-scatter) or "ring" (collective matmul: t - 1 ppermutes interleaved with
    # block products, `amsp_jax.layers.tensor_ring`; needs sequence parallelism) or "cannon" (PrimePar's
    # spatial-temporal matmul on a 2 x 2 group, t = 4: only point-to-point shifts inside the group,
    # `amsp_jax.layers.tensor_cannon`; needs sequence parallelism).
    tensor_matmul: str = "gather"

    @property
    def fused_matmul(self) -> bool:
        """Whether tensor-parallel matmuls run fused with their transfers (`ring` or `cannon`)."""
        return self.tensor_matmul != "gather"

    @property
    def implementation(self) -> Implementation:
        """How the step issues its collectives: split at node boundaries or flat; gathering ahead; the
        first layer kept across micro-batches."""
        return Implementation(self.hierarchical, self.prefetch, self.keep_first_layer)

    def __post_init__(self) -> None:
        if isinstance(self.precision, str):
            object.__setattr__(self, "precision", Precision.named(self.precision))
        if isinstance(self.strategy, str):
            object.__setattr__(self, "strategy", Strategy.parse(self.strategy))
        if self.micro_batches < 1:
            raise AmspError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.remat not in REMAT_POLICIES:
            raise AmspError(f"unknown remat policy {self.remat!r}; use one of {REMAT_POLICIES}")
        if self.memory_limit is not None and self.memory_limit <= 0:
            raise AmspError(f"memory_limit is bytes per device, so positive; got {self.memory_limit}")
        if self.tensor_matmul not in MATMUL_FORMS:
            raise AmspError(f"unknown tensor_matmul {self.tensor_matmul!r}; use one of {MATMUL_FORMS}")
        if self.tensor_matmul != "gather" and not self.sequence_parallel:
            raise AmspError(
                f'tensor_matmul="{self.tensor_matmul}" passes sequence blocks round the tensor group, so it '
                'needs sequence parallelism; drop sequence_parallel=False or use tensor_matmul="gather"'
            )
        if self.tensor_matmul == "cannon" and self.strategy.tensor not in (1, CANNON_DEGREE):
            raise AmspError(
                f'tensor_matmul="cannon" runs on a 2 x 2 square of devices, so it needs t={CANNON_DEGREE}, '
                f"not t={self.strategy.tensor} (the next square, 4 x 4, needs 16 devices in a node); use "
                'tensor_matmul="gather" or "ring" for this degree'
            )
        self.strategy.validate(self.cluster, self.allow_partial_nodes)

    def remat_policy(self) -> tuple[bool, object]:
        """(whether to rematerialise each layer, the `jax.checkpoint` policy)."""
        if self.remat == "none":
            return False, None
        if self.remat == "dots":
            return True, jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        return True, jax.checkpoint_policies.nothing_saveable

    def describe(self) -> str:
        """One line: strategy, micro-batches, precision, remat, collectives."""
        return (
            f"{self.strategy} on {self.cluster.nodes}x{self.cluster.devices_per_node} "
            f"({self.cluster.name}), M={self.micro_batches}, {self.precision.name}, remat={self.remat}"
            f"{'' if self.hierarchical else ', flat collectives'}"
            f"{', explicit-prefetch loop' if self.prefetch else ''}"
            f"{', no gathering ahead' if self.prefetch is False else ''}"
            f"{', first layer kept' if self.keep_first_layer and self.micro_batches > 1 else ''}"
            f"{'' if self.strategy.tensor == 1 or self.sequence_parallel else ', no sequence parallelism'}"
            f"{f', {self.tensor_matmul} matmuls' if self.strategy.tensor > 1 and self.fused_matmul else ''}"
        )
