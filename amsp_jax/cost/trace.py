"""What planning needs to know of a model, traced from the model itself.

`trace(model, example_inputs)` reads the parameter leaves and the layers (the same `find_layers` the
step uses, so the plan gathers what the step gathers) from one abstract `init`, and infers the few
dimensions the FLOP and activation model needs: layers, width, heads, MLP width, vocabulary. Each can
be given instead (`dims=`). The LLaMA model writes its own `ModelSpec` (`amsp_jax.models.llama.llama_spec`):
its dimensions are known exactly.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from amsp_jax.core.plan import Precision
from amsp_jax.cost.workload import Leaf, ModelDims, Workload
from amsp_jax.layers.discovery import Example, Layers, as_example, find_layers
from amsp_jax.layers.tensor import Boundary

LeafPath = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it: its leaves (with how each is gathered), dimensions, and how Muon
    reads its matrices; traced from a Flax model (`trace`) or written out (`models.llama.llama_spec`)."""

    name: str
    leaves: tuple[Leaf, ...]
    dims: ModelDims
    prefetchable: bool  # its layers can prefetch (a LayerStack, or a loop of blocks)
    # Muon's `muon_weight_dimension_numbers` for these parameters; None: optax's rule (every 2-D leaf).
    muon_dimensions: Callable[[Any], Any] | None = None
    # The tensor-parallel boundaries one micro-batch's forward crosses (`layers.tensor.Boundary`), given
    # (micro-batch size, sequence length, bytes per activation element, matmul form); None: t > 1 is
    # not planned.
    boundaries: Callable[[int, int, int, str], tuple[Boundary, ...]] | None = None

    def num_params(self) -> int:
        """Parameters of the traced model."""
        return sum(leaf.size for leaf in self.leaves)

    @property
    def n_layers(self) -> int:
        """Layers, as the FLOP and activation model counts them."""
        return self.dims.n_layers

    def workload(
        self,
        seq_len: int,
        micro_batch_size: int,
        micro_batches: int,
        precision: Precision,
        remat: str,
        tensor: int = 1,
        sequence_parallel: bool = True,
        tensor_matmul: str = "gather",
    ) -> Workload:
        """The cost model's workload for one choice of batching, precision, remat and tensor degree."""
        w = Workload(self.leaves, self.dims, seq_len, micro_batch_size, micro_batches, precision, remat)
        if tensor == 1:
            return w
        if self.boundaries is None:
            raise ValueError(f"{self.name} does not describe its tensor-parallel boundaries; plan it at t=1")
        found = self.boundaries(micro_batch_size, seq_len, precision.param_bytes, tensor_matmul)
        return w.with_(
            tensor=tensor, sequence_parallel=sequence_parallel, boundaries=found
        )


def infer_dims(layers: Layers, leaves: tuple[Leaf, ...], vocab: int) -> ModelDims:
    """Layers, width, heads, MLP width and vocabulary read off the traced model.

    Layers: blocks (a scanned block counts its length). Width: the blocks' input width, else the most
    common length of the layers' vectors (norm scales, biases). Heads: from a per-layer (width, heads,
    head size) kernel (Flax attention), else width / 64. MLP width: the largest per-layer matrix
    dimension other than the width, else 4 × width. Attention is counted as materialising its scores
    (as Flax's `MultiHeadDotProductAttention` and `nnx.MultiHeadAttention` do).
    """
    per_layer = [leaf for leaf in leaves if leaf.per_layer]

    def length(root: LeafPath) -> int:
        return next(x.shape[0] for x in leaves if x.path[: len(root)] == root)

    n_layers = sum(length(p) if b.stacked else 1 for p, b in layers.blocks.items())
    n_layers += sum(length(s) for s in layers.stacks)
    shapes = [leaf.shape[1:] if leaf.stacked else leaf.shape for leaf in per_layer]
    shapes = shapes or [x.shape for x in leaves]
    inputs = [b.input_shape[-1] for b in layers.blocks.values() if b.input_shape]
    vectors = collections.Counter(s[0] for s in shapes if len(s) == 1).most_common(1)
    widths = [*inputs, *(width for width, _ in vectors)]
    dim = widths[0] if widths else max(max(s) for s in shapes)
    kernels = [s[1] for s in shapes if len(s) == 3 and s[0] == dim and s[1] * s[2] == dim]
    heads = kernels[0] if kernels else max(1, dim // 64)
    ffn = max((d for s in shapes if len(s) == 2 for d in s if d != dim), default=4 * dim)
    return ModelDims(max(n_layers, 1), dim, heads, heads, dim // heads, ffn, vocab, attention="xla")


def trace(
    model: Any,
    example_inputs: Example | tuple[Any, ...],
    layers: tuple[type, ...] | None = None,
    dims: ModelDims | None = None,
    name: str | None = None,
) -> ModelSpec:
    """The `ModelSpec` of a Flax model (linen, or nnx behind `NnxModel`) called on `example_inputs`
    (positional inputs, or an `Example` with keyword inputs too)."""
    key = jax.random.key(0)
    example = as_example(example_inputs)
    found = find_layers(model, key, example, layers)
    leaves = found.leaves()
    if dims is None:
        out = jax.eval_shape(
            lambda p: example.call(model.apply, {"params": p}), found.abstract_params
        )
        vocab = int(np.shape(jax.tree.leaves(out)[0])[-1])
        dims = infer_dims(found, leaves, vocab)
    prefetchable = bool(found.stacks) or any(not b.stacked for b in found.blocks.values())
    return ModelSpec(name or type(model).__name__, leaves, dims, prefetchable)


def from_entry_point(text: str) -> ModelSpec:
    """The `ModelSpec` a Python entry point makes: `module:function` or `path/to/file.py:function`.

    The function takes no arguments and returns `(model, example_inputs)` (a Flax linen model or an
    `NnxModel`, and the tuple of inputs its `init` takes) or a `ModelSpec`.
    """
    location, _, attribute = text.rpartition(":")
    if not location or not attribute:
        raise ValueError(f"{text!r} is not an entry point; write module:function or file.py:function")
    if location.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(location).stem, location)
        if spec is None or spec.loader is None or not Path(location).is_file():
            raise ValueError(f"entry point {text!r}: no Python file {location}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses (Flax modules) look their module up there
        spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(location)
    made = getattr(module, attribute)()
    if isinstance(made, ModelSpec):
        return made
    model, example_inputs = made
    return trace(model, tuple(example_inputs), name=f"{type(model).__name__} ({text})")
