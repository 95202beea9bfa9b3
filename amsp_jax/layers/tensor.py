"""Tensor parallelism as a model sees it: the degree it is run at, and the four boundaries of Megatron's
layout, each an identity outside a tensor-parallel step.

Inside a step with a tensor axis (`Strategy.tensor > 1`), each device of a tensor group holds its slice
of every tensor-split weight, and a model's layer runs as
  - column-parallel matmul: `column_input(x)`, then the matmul with the local slice of the kernel
    (output split: local heads, local ffn units, local vocabulary);
  - row-parallel matmul: the matmul with the local slice (contracting dimension split), then
    `row_output(y)`, which sums the partial products over the group;
  - `vocab_lookup(table, tokens)`: an embedding table split by rows;
  - `vocab_gather(logits)`: the whole vocabulary's logits for the loss.
With sequence parallelism the activations between a row output and the next column input (norms,
residuals, dropout) are split along the sequence (dimension 1): `column_input` all-gathers them,
`row_output` reduce-scatters onto them (Korthikanti et al.'s 2 all-gathers and 2 reduce-scatters per
transformer layer in each pass); without it `column_input` is an identity whose gradient is summed over
the group and `row_output` an all-reduce.

Each boundary is a `custom_vjp`, so its backward is Megatron's (the transpose of the forward collective)
whatever the shard_map typing of the values it meets. `column_matmul` and `row_matmul` take the matmul
too and run in the plan's form (`TensorContext.matmul`): `gather`, the collective then the matmul as
above, or `ring`, a collective matmul of t - 1 `ppermute`s interleaved with sequence-block products
(`layers.tensor_ring`). Models that use `nn.Dense`, `nn.DenseGeneral` and `nn.Embed` get these
boundaries from the step; a model with its own parameters calls them itself (the bundled LLaMA does)
and sizes its parameters with `tensor_degree()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp

from amsp_jax.core.tensor import (
    CANNON_DEGREE,
    DEFAULT_TENSOR_RULES,
    TENSOR,
    Rules,
    TensorRuleError,
    tensor_dim,
)
from amsp_jax.layers.tensor_cannon import column_cannon, row_cannon
from amsp_jax.layers.tensor_ring import (
    SEQUENCE_DIM,
    Blocks,
    Matmul,
    gather_matmul,
    matmul_scatter,
    ring_blocks,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TensorContext:
    """The tensor axis the step is tracing under: its degree and whether sequence parallelism is on."""

    degree: int
    sequence_parallel: bool
    rules: Rules = DEFAULT_TENSOR_RULES
    axis: str = TENSOR
    matmul: str = "gather"  # how `column_matmul` and `row_matmul` run: one of `core.tensor.MATMUL_FORMS`


_CONTEXT: contextvars.ContextVar[TensorContext | None] = contextvars.ContextVar("tensor", default=None)

COLUMN, ROW, VOCAB = "column input", "row output", "vocabulary gather"
COLUMN_RING, ROW_RING = "column matmul (ring)", "row matmul (ring)"
COLUMN_CANNON, ROW_CANNON = "column matmul (cannon)", "row matmul (cannon)"


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One boundary a forward pass of the model crossed: its kind, the elements of the whole activation
    on one device (after a gather, before a scatter), their size in bytes, and the stack or block it
    was crossed in (None: outside the layers), whose layers each cross it once."""

    kind: str
    elements: int
    itemsize: int
    unit: tuple | None = None
    trace: int = 0  # which trace of the unit's code recorded it (a scan may trace its body twice)
    # The `cannon` form also moves kernels and outputs: each kernel's whole elements and their size in
    # bytes, and each output's whole elements.
    kernels: tuple[int, ...] = ()
    kernel_itemsize: int = 0
    outputs: tuple[int, ...] = ()
    input_moved: bool = False  # another call of the trace moved the same input (`tensor_cannon.shifts`)


def matmul_form(boundaries: Iterable[Boundary]) -> str:
    """The matmul form (`Plan.tensor_matmul`) in which a forward crossed `boundaries`, from their kinds."""
    kinds = {b.kind for b in boundaries}
    if kinds & {COLUMN_RING, ROW_RING}:
        return "ring"
    return "cannon" if kinds & {COLUMN_CANNON, ROW_CANNON} else "gather"


_RECORDING: contextvars.ContextVar[list[Boundary] | None] = contextvars.ContextVar("boundaries", default=None)
_UNIT: contextvars.ContextVar[tuple[tuple, int] | None] = contextvars.ContextVar("tensor_unit", default=None)
_TRACES = itertools.count(1)


@contextlib.contextmanager
def recording_boundaries() -> Iterator[list[Boundary]]:
    """Collect the boundaries a trace of the model crosses (each once per trace of its code)."""
    found: list[Boundary] = []
    token = _RECORDING.set(found)
    try:
        yield found
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def in_unit(unit: tuple) -> Iterator[None]:
    """Mark what is traced as the code of one layer of the stack or block `unit`."""
    token = _UNIT.set((unit, next(_TRACES)))
    try:
        yield
    finally:
        _UNIT.reset(token)


def _record(kind: str, shape: tuple[int, ...], dtype: jnp.dtype, **cannon: object) -> None:
    found = _RECORDING.get()
    if found is not None:
        unit, trace = _UNIT.get() or (None, 0)
        found.append(Boundary(kind, math.prod(shape), jnp.dtype(dtype).itemsize, unit, trace, **cannon))  # type: ignore[arg-type]


# Per trace: each activation's column input, so projections of one input (query, key and value) share
# one all-gather forward and one reduce-scatter of their summed gradients backward (a fused QKV).
_COLUMN_INPUTS: contextvars.ContextVar[dict[int, tuple[jax.Array, jax.Array | Blocks]] | None] = (
    contextvars.ContextVar("column_inputs", default=None)
)


@contextlib.contextmanager
def tensor_context(context: TensorContext | None) -> Iterator[None]:
    """Trace the model inside a tensor-parallel step (None: outside, where every boundary is identity)."""
    token = _CONTEXT.set(context if context is not None and context.degree > 1 else None)
    inputs = _COLUMN_INPUTS.set({})
    try:
        yield
    finally:
        _COLUMN_INPUTS.reset(inputs)
        _CONTEXT.reset(token)


def current() -> TensorContext | None:
    """The active tensor context, or None outside a tensor-parallel step."""
    return _CONTEXT.get()


def tensor_degree() -> int:
    """How many ways the tensor axis splits a tensor-split weight where the model runs now (1 outside a
    tensor-parallel step, e.g. at `init`): a model with its own parameters sizes their split dimension
    by it, e.g. `(dim, n_heads // tensor_degree(), head_dim)`."""
    context = _CONTEXT.get()
    return 1 if context is None else context.degree


def local_size(size: int, what: str) -> int:
    """`size // tensor_degree()`, or an error naming `what` when the degree does not divide it."""
    degree = tensor_degree()
    if size % degree:
        raise TensorRuleError(
            f"{what} is {size}, which tensor degree t={degree} does not divide; choose a t that divides it"
        )
    return size // degree


def split_dim(names: tuple[str | None, ...]) -> int | None:
    """The dimension of an array with logical `names` that the active tensor rules split (None outside
    a tensor-parallel step, or where no rule maps one of them to the tensor axis)."""
    context = _CONTEXT.get()
    return None if context is None else tensor_dim(names, context.rules)


def local_shape(shape: tuple[int, ...], names: tuple[str | None, ...], what: str) -> tuple[int, ...]:
    """The part of an array of `shape` with logical `names` that one tensor rank holds (`shape` itself
    outside a tensor-parallel step); an error naming `what` where the degree does not divide it."""
    dim = split_dim(names)
    if dim is None:
        return shape
    local = list(shape)
    local[dim] = local_size(shape[dim], f"dimension {dim} ({names[dim]}) of {what}")
    return tuple(local)


def _sequence_parallel(context: TensorContext, x: jax.Array) -> bool:
    if not context.sequence_parallel:
        return False
    if x.ndim < 2:
        raise TensorRuleError(
            f"sequence parallelism splits activations along dimension {SEQUENCE_DIM} (batch, sequence, "
            f"...), and a tensor-parallel matmul met an input of shape {x.shape}; turn it off with "
            "Plan(..., sequence_parallel=False)"
        )
    return True


def _varying(x: jax.Array, axis: str) -> jax.Array:
    """`x` typed as varying over `axis`, like the activations it meets (no communication)."""
    if axis in jax.typeof(x).manual_axis_type.varying:
        return x
    return jax.lax.pcast(x, (axis,), to="varying")


def _with_backward(
    forward: Callable[[jax.Array], jax.Array], backward: Callable[[jax.Array], jax.Array]
) -> Callable[[jax.Array], jax.Array]:
    """`forward` whose gradient is `backward(cotangent)`."""

    @jax.custom_vjp
    def f(x: jax.Array) -> jax.Array:
        return forward(x)

    f.defvjp(lambda x: (f(x), None), lambda _, ct: (backward(ct),))
    return f


def _sum(axis: str) -> Callable[[jax.Array], jax.Array]:
    return lambda x: _varying(jax.lax.psum(x, axis), axis)


def _gather(axis: str, dim: int) -> Callable[[jax.Array], jax.Array]:
    return lambda x: jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def _scatter(axis: str, dim: int) -> Callable[[jax.Array], jax.Array]:
    return lambda x: jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def column_input(x: jax.Array) -> jax.Array:
    """The input of a column-parallel matmul, whole on every tensor rank: with sequence parallelism the
    sequence shards all-gathered (their gradient reduce-scattered back); without, `x` itself, whose
    gradient (each rank's partial from its output slice) is summed over the group."""
    context = _CONTEXT.get()
    if context is None:
        return x
    seen = _COLUMN_INPUTS.get()
    if seen is not None and id(x) in seen and seen[id(x)][0] is x:
        return seen[id(x)][1]
    if _sequence_parallel(context, x):
        whole = list(x.shape)
        whole[SEQUENCE_DIM] *= context.degree
        _record(COLUMN, tuple(whole), x.dtype)
        out = _with_backward(_gather(context.axis, SEQUENCE_DIM), _scatter(context.axis, SEQUENCE_DIM))(x)
    else:
        _record(COLUMN, x.shape, x.dtype)
        out = _with_backward(lambda x: x, _sum(context.axis))(x)
    if seen is not None:
        seen[id(x)] = (x, out)  # `x` kept alive, so its id stays its own for this trace
    return out


def row_output(y: jax.Array) -> jax.Array:
    """The output of a row-parallel matmul (a partial sum on each tensor rank) summed over the group:
    reduce-scattered onto sequence shards with sequence parallelism, else all-reduced."""
    context = _CONTEXT.get()
    if context is None:
        return y
    _record(ROW, y.shape, y.dtype)
    if _sequence_parallel(context, y):
        return _with_backward(_scatter(context.axis, SEQUENCE_DIM), _gather(context.axis, SEQUENCE_DIM))(y)
    return _with_backward(_sum(context.axis), lambda ct: ct)(y)


def _ring(context: TensorContext | None, x: jax.Array) -> bool:
    """Whether a fused matmul runs as a collective matmul here (the `ring` form needs sequence shards)."""
    return context is not None and context.matmul == "ring" and _sequence_parallel(context, x)


def _cannon(context: TensorContext | None, x: jax.Array) -> bool:
    """Whether a fused matmul runs on the 2 x 2 square here (the `cannon` form, t = 4)."""
    if context is None or context.matmul != "cannon" or not _sequence_parallel(context, x):
        return False
    if context.degree != CANNON_DEGREE:
        raise TensorRuleError(
            f'the cannon form runs on a 2 x 2 square (t={CANNON_DEGREE}), not t={context.degree}; use '
            'Plan(..., tensor_matmul="gather") or "ring"'
        )
    return True


def _whole(shape: tuple[int, ...], degree: int) -> int:
    return math.prod(shape) * degree


def column_matmul(
    matmul: Matmul, x: jax.Array, *kernels: jax.Array, cast: Callable[[jax.Array], jax.Array] | None = None
) -> tuple[jax.Array, ...]:
    """`matmul(column_input(x), kernel)` for each column-parallel kernel slice: in the `ring` form an
    all-gather-matmul, each sequence block's product computed while the next block travels
    (`layers.tensor_ring`); else `column_input`, then the matmuls. Calls on one `x` in one trace share
    its collective (query, key and value projections: one all-gather, or one ring, and one gradient
    reduction). `matmul(x, kernel)` contracts x's last dimensions and keeps (batch, sequence) first;
    `cast` (e.g. a module's dtype promotion) is applied to x after the collective."""
    cast = cast if cast is not None else (lambda x: x)
    context = _CONTEXT.get()
    if _cannon(context, x):
        assert context is not None
        x = cast(x)
        outs = column_cannon(x, kernels, matmul, context.axis)
        shape = list(x.shape)
        # Projections of one input in separate calls (linen q, k, v) enter it into the square alike, and
        # XLA keeps one of those identical exchanges and shifts: the first call counts them.
        seen = _COLUMN_INPUTS.get()
        moved = seen is not None and id(x) in seen and seen[id(x)][0] is x
        if seen is not None and not moved:
            seen[id(x)] = (x, x)
        shape[SEQUENCE_DIM] *= context.degree
        whole = functools.partial(_whole, degree=context.degree)
        _record(
            COLUMN_CANNON, tuple(shape), x.dtype, kernels=tuple(whole(k.shape) for k in kernels),
            kernel_itemsize=kernels[0].dtype.itemsize, outputs=tuple(whole(o.shape) for o in outs),
            input_moved=moved,
        )  # fmt: skip
        return outs
    if not _ring(context, x):
        whole = cast(column_input(x))
        return tuple(matmul(whole, kernel) for kernel in kernels)
    assert context is not None
    seen = _COLUMN_INPUTS.get()
    if seen is not None and id(x) in seen and seen[id(x)][0] is x:
        blocks: Blocks = seen[id(x)][1]  # type: ignore[assignment]
    else:
        shape = list(x.shape)
        shape[SEQUENCE_DIM] *= context.degree
        _record(COLUMN_RING, tuple(shape), x.dtype)
        blocks = ring_blocks(x, context.axis, context.degree)
        if seen is not None:
            seen[id(x)] = (x, blocks)  # type: ignore[assignment]
    cast_blocks = [cast(block) for block in blocks]
    axis, degree = context.axis, context.degree
    return tuple(gather_matmul(cast_blocks, kernel, matmul, axis, degree) for kernel in kernels)


def row_matmul(matmul: Matmul, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """`row_output(matmul(x, kernel))` for a row-parallel kernel slice: in the `ring` form a
    matmul-reduce-scatter, each sequence block's partial product added to the running sum that travels
    round the group; else the matmul, then `row_output`."""
    context = _CONTEXT.get()
    if _cannon(context, x):
        assert context is not None
        out = row_cannon(x, kernel, matmul, context.axis)
        _record(
            ROW_CANNON, (*x.shape[:-1], x.shape[-1] * context.degree), x.dtype,
            kernels=(_whole(kernel.shape, context.degree),), kernel_itemsize=kernel.dtype.itemsize,
            outputs=(_whole(out.shape, context.degree),),
        )  # fmt: skip
        return out
    if not _ring(context, x):
        return row_output(matmul(x, kernel))
    assert context is not None
    if x.shape[SEQUENCE_DIM] % context.degree:
        raise TensorRuleError(
            f"the ring form splits the sequence ({x.shape[SEQUENCE_DIM]} positions) over t={context.degree} "
            "ranks, which does not divide it; use a sequence length that divides, or "
            'Plan(..., tensor_matmul="gather")'
        )
    out = jax.eval_shape(matmul, x, kernel)
    _record(ROW_RING, out.shape, out.dtype)
    return matmul_scatter(x, kernel, matmul, context.axis, context.degree)


def sequence_shard(x: jax.Array) -> jax.Array:
    """This rank's sequence shard of an activation that is whole on every rank (e.g. an embedding not
    split over the vocabulary) where sequence parallelism is on; `x` itself otherwise."""
    context = _CONTEXT.get()
    if context is None or not _sequence_parallel(context, x):
        return x
    size = x.shape[SEQUENCE_DIM]
    if size % context.degree:
        raise TensorRuleError(
            f"sequence parallelism splits the sequence ({size} positions) over t={context.degree} ranks, "
            "which does not divide it; use a sequence length that divides, or Plan(..., "
            "sequence_parallel=False)"
        )
    block = size // context.degree
    index = jax.lax.axis_index(context.axis) * block
    return jax.lax.dynamic_slice_in_dim(x, index, block, axis=SEQUENCE_DIM)


def vocab_lookup(table_local: jax.Array, tokens: jax.Array, lookup=None) -> jax.Array:  # type: ignore[no-untyped-def]
    """Rows of an embedding table split by rows over the group: each rank looks up the tokens in its
    range (zero elsewhere) and `row_output` sums (or reduce-scatters) them. `lookup(table, ids)` is the
    model's own lookup (default `jnp.take`)."""
    lookup = lookup if lookup is not None else (lambda table, ids: jnp.take(table, ids, axis=0))
    context = _CONTEXT.get()
    if context is None:
        return lookup(table_local, tokens)
    rows = table_local.shape[0]
    local = tokens - jax.lax.axis_index(context.axis) * rows
    inside = (local >= 0) & (local < rows)
    found = lookup(table_local, jnp.where(inside, local, 0))
    return row_output(jnp.where(inside[..., None], found, jnp.zeros((), found.dtype)))


def vocab_gather(logits_local: jax.Array) -> jax.Array:
    """Logits over the whole vocabulary from each rank's slice (last dimension), for a loss computed
    alike on every rank: the gradient keeps each rank's own slice (a transpose would sum the ranks'
    equal copies)."""
    context = _CONTEXT.get()
    if context is None:
        return logits_local
    axis, dim = context.axis, logits_local.ndim - 1
    whole = list(logits_local.shape)
    whole[dim] *= context.degree
    _record(VOCAB, tuple(whole), logits_local.dtype)

    def own_slice(ct: jax.Array) -> jax.Array:
        size = ct.shape[dim] // context.degree
        return jax.lax.dynamic_slice_in_dim(ct, jax.lax.axis_index(axis) * size, size, axis=dim)

    return _with_backward(_gather(axis, dim), own_slice)(logits_local)
