"""Flax's dense and embedding layers in a tensor-parallel step: linen `nn.Dense`, `nn.DenseGeneral`,
`nn.Embed` and nnx `nnx.Linear`, `nnx.Embed`.

Inside the step each device holds its slice of a tensor-split kernel, which linen's own `param` calls
would reject (their shape check compares with the whole shape) and nnx's would multiply without the
collectives. `tensor_layers()` intercepts those modules and runs them on the slices, as Megatron's
layers do: a kernel whose output dimension the
tensor axis splits is column-parallel, one whose contracting dimension it splits row-parallel (its
bias is added once, after the sum), an embedding table split by rows looks up its own tokens. Which
dimension is split comes from the logical axis names of the module's initializer (linen
`nn.with_logical_partitioning`, nnx `nnx.with_partitioning`) and the step's rules. A column-parallel
output named `vocab` (the logits) is gathered whole for the loss. Modules with nothing split run
unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from amsp_jax.core.tensor import TensorRuleError, tensor_dim
from amsp_jax.layers import tensor


def _names(init: Callable[..., Any], shape: tuple[int, ...]) -> tuple[str | None, ...] | None:
    """The logical axis names an initializer attaches (None without partitioning metadata)."""
    box = jax.eval_shape(lambda: init(jax.random.key(0), shape, jnp.float32))
    return tuple(box.names) if isinstance(box, nn.meta.AxisMetadata) and hasattr(box, "names") else None


def _split(init: Callable[..., Any], shape: tuple[int, ...]) -> tuple[int | None, tuple | None]:
    """(the dimension the active rules split, the names) of a parameter made by `init`."""
    context = tensor.current()
    names = _names(init, shape)
    if context is None or names is None:
        return None, names
    return tensor_dim(names, context.rules), names


def parallel_matmul(
    inputs: jax.Array, kernel: jax.Array, bias: jax.Array | None, axis: tuple[int, ...], dim: int,
    names: tuple[str | None, ...], promote: Callable[..., Any], precision: Any = None,
) -> jax.Array:  # fmt: skip
    """`inputs` contracted over `axis` with this rank's slice of a kernel split on `dim`: column-parallel
    (an output dimension) or row-parallel (a contracting one), the bias added once; logits (an output
    named `vocab`) gathered whole. `promote(x, kernel, bias)` is the module's dtype promotion."""
    column = dim >= len(axis)
    if column and bias is not None and bias.shape != kernel.shape[len(axis) :]:
        raise TensorRuleError(
            f"a column-parallel kernel {names} has a bias of shape {bias.shape}, whole on every tensor "
            f"rank while its output is split to {kernel.shape[len(axis) :]}; give the bias the kernel's "
            f"output names (e.g. bias_init=nn.with_logical_partitioning(init, {names[len(axis):]}))"
        )
    _, kernel, bias = promote(inputs, kernel, bias)
    contract = tuple(a % inputs.ndim for a in axis)
    dims = ((contract, tuple(range(len(axis)))), ((), ()))
    matmul = lambda x, k: jax.lax.dot_general(x, k, dims, precision=precision)  # noqa: E731
    if column:
        cast = lambda x: promote(x, kernel, bias)[0]  # noqa: E731
        (out,) = tensor.column_matmul(matmul, inputs, kernel, cast=cast)
    else:
        out = tensor.row_matmul(matmul, promote(inputs, kernel, bias)[0], kernel)
    if bias is not None:
        out = out + bias
    if column and names[dim] == "vocab":
        out = tensor.vocab_gather(out)
    return out


def _dense(module: nn.DenseGeneral | nn.Dense, inputs: jax.Array, axis: tuple[int, ...]) -> Any:
    """The module's matmul on this rank's kernel slice, with Megatron's boundaries; None when its kernel
    is whole (the module then runs as it is)."""
    kernel = module.get_variable("params", "kernel")
    flat = (int(np.prod(kernel.shape[: len(axis)])), int(np.prod(kernel.shape[len(axis) :])))
    dim, names = _split(module.kernel_init, flat)
    if dim is None or names is None:
        return None
    if getattr(module, "batch_dims", ()):
        raise TensorRuleError(
            f"{type(module).__name__} {module.name}: tensor parallelism does not split a kernel with "
            "batch_dims; keep it whole (map its names to None in tensor_rules)"
        )
    bias = module.get_variable("params", "bias") if module.use_bias else None
    promote = lambda *xs: module.promote_dtype(*xs, dtype=module.dtype)  # noqa: E731
    return parallel_matmul(inputs, kernel, bias, axis, dim, names, promote, module.precision)


def _embed(module: nn.Embed, inputs: jax.Array) -> jax.Array:
    table = module.get_variable("params", "embedding")
    dim, _ = _split(module.embedding_init, (module.num_embeddings, module.features))
    if dim not in (None, 0):
        raise TensorRuleError(
            f"nn.Embed {module.name}: the tensor rules split its feature dimension; split its rows "
            "(logical name 'vocab') or keep it whole"
        )
    (table,) = module.promote_dtype(table, dtype=module.dtype, inexact=False)
    if dim == 0:
        return tensor.vocab_lookup(table, inputs)
    out = jnp.take(table, inputs, axis=0)
    context = tensor.current()
    if context is not None and context.sequence_parallel:
        if out.ndim < 3:
            raise TensorRuleError(
                f"nn.Embed {module.name} is whole on every tensor rank and its output {out.shape} has no "
                "(batch, sequence) dimensions to split for sequence parallelism; index it with (batch or "
                "1, sequence) ids, or pass Plan(..., sequence_parallel=False)"
            )
        out = tensor.sequence_shard(out)
    return out


def _attend(module: nn.Embed, query: jax.Array) -> jax.Array:
    table = module.get_variable("params", "embedding")
    dim, _ = _split(module.embedding_init, (module.num_embeddings, module.features))
    query, table = module.promote_dtype(query, table, dtype=module.dtype)
    if dim != 0:
        return jnp.dot(query, table.T)
    return tensor.vocab_gather(jnp.dot(tensor.column_input(query), table.T))


def _intercept(next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: Any) -> Any:
    module, method = context.module, context.method_name
    if tensor.current() is None or not isinstance(module, nn.Dense | nn.DenseGeneral | nn.Embed):
        return next_fun(*args, **kwargs)
    if isinstance(module, nn.Embed):
        if method == "setup":  # its `param` check would reject a row slice; the table is read directly
            return None
        if method == "__call__":
            return _embed(module, *args, **kwargs)
        if method == "attend":
            return _attend(module, *args, **kwargs)
        return next_fun(*args, **kwargs)
    if method != "__call__" or not module.has_variable("params", "kernel"):
        return next_fun(*args, **kwargs)
    if isinstance(module, nn.Dense):
        axis: tuple[int, ...] = (-1,)
    else:
        axis = tuple(module.axis) if isinstance(module.axis, tuple | list) else (module.axis,)
    out = _dense(module, *args, axis=axis, **kwargs)
    return next_fun(*args, **kwargs) if out is None else out


def _nnx_names(variable: Any) -> tuple[str | None, ...] | None:
    """The logical axis names of an nnx variable (`nnx.with_partitioning`), if any."""
    metadata = variable.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):  # flax 0.12, 0.11, 0.10 spellings
        names = metadata.get(key)
        if names is not None and not isinstance(names, jax.sharding.Sharding):
            return tuple(names)
    return None


def _nnx_split(variable: Any) -> tuple[int | None, tuple | None]:
    context, names = tensor.current(), _nnx_names(variable)
    if context is None or names is None:
        return None, names
    return tensor_dim(names, context.rules), names


def _nnx_linear(original: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: nnx.Linear, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        dim, names = _nnx_split(self.kernel)
        if dim is None or names is None:
            return original(self, inputs, out_sharding)
        bias = self.bias[...] if self.bias is not None else None
        promote = lambda *xs: self.promote_dtype(xs, dtype=self.dtype)  # noqa: E731
        return parallel_matmul(inputs, self.kernel[...], bias, (-1,), dim, names, promote, self.precision)

    return call


def _nnx_embed(original: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: nnx.Embed, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        dim, _ = _nnx_split(self.embedding)
        if dim is None:
            out = original(self, inputs, out_sharding)
            return tensor.sequence_shard(out) if out.ndim >= 3 else out
        (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        return tensor.vocab_lookup(table, inputs)

    return call


def _nnx_attend(original: Callable[..., Any]) -> Callable[..., Any]:
    def attend(self: nnx.Embed, query: jax.Array, out_sharding: Any = None) -> jax.Array:
        dim, _ = _nnx_split(self.embedding)
        if dim is None:
            return original(self, query, out_sharding)
        query, table = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        return tensor.vocab_gather(jnp.dot(tensor.column_input(query), table.T))

    return attend


_NNX_METHODS = (
    (nnx.Linear, "__call__", _nnx_linear),
    (nnx.Embed, "__call__", _nnx_embed),
    (nnx.Embed, "attend", _nnx_attend),
)


@contextlib.contextmanager
def tensor_layers() -> Iterator[None]:
    """Run linen `Dense`, `DenseGeneral`, `Embed` and nnx `Linear`, `Embed` on their tensor slices where a
    tensor context is active (`tensor.tensor_context`); unchanged elsewhere. nnx has no method
    interception, so its methods are replaced for the duration (a trace runs in one thread)."""
    originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in _NNX_METHODS]
    try:
        for (cls, name, wrap), (_, _, original) in zip(_NNX_METHODS, originals, strict=True):
            setattr(cls, name, wrap(original))
        with nn.intercept_methods(_intercept):
            yield
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)
