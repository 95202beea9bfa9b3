"""PrimePar's spatial-temporal matmul on a 2 x 2 tensor group (the `cannon` form, t = 4).

The four ranks k = 2r + c of the tensor axis form a square (r, c). A matmul O = I·W is cut into 2 x 2
blocks, I[m, n] and W[n, k], and rank (r, c) owns O[r, c]: it multiplies the blocks I[r, a]·W[a, c],
a = r xor c, then takes I[r, a^1] from its row neighbour (r, c^1) and W[a^1, c] from its column
neighbour (r^1, c) and adds their product (Cannon's algorithm with the (r + c) skew; on a square of two
the next block is the only other one). Nothing is gathered, no block is held by two ranks at once, and
the sum over the contracting blocks is built up over the two steps on the rank that owns it.

The backward pass is the paper's two phases, each two steps of point-to-point shifts:
  - input gradient: rank (r, c) sums dI[r, a^1] = dO[r, c]·W[a^1, c]^T + dO[r, c^1]·W[a^1, c^1]^T,
    with dO from (r, c^1) and W from (r^1, c^1); it ends in the layout of the forward's last input
    block, which the rank still holds;
  - weight gradient: the partial I[r, a^1]^T·dO[r, c^1] travels to (r, c^1), where it meets
    I[r^1, a]^T·dO[r^1, c], computed from blocks shifted from (r^1, c): the sum is dW[a, c], the block
    of W the rank started with. Only the last input and weight blocks are kept from the forward.

Blocks: m halves the sequence (dimension 1). A column-parallel matmul's contracting blocks halve its
first contracting dimension and its output blocks are pairs of the tensor ranks' kernel slices ({c, 2+c}
for column c); a row-parallel matmul's contracting blocks are pairs of slices ({0, 3} and {1, 2}) and its
output blocks halve its first output dimension. So the stored state is the gather form's (each rank's
slice of the split dimension), and entering and leaving the square is one exchange with one neighbour
per operand: the sequence-parallel input (column) or the whole-sequence input slice (row) into its
block, each kernel slice into its block, and the output block back into the gather form's layout
(a whole-sequence output slice for a column matmul, the rank's sequence shard for a row one).
Every transfer is a `ppermute` between two ranks; `shifts` lists them, and `cost.tensor_traffic` counts
them from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from amsp_jax.core.tensor import TensorRuleError

SEQUENCE_DIM = 1
SIDE = 2  # the square is SIDE x SIDE
DEGREE = SIDE * SIDE
Matmul = Callable[[jax.Array, jax.Array], jax.Array]
# Rank k's neighbours on the square: along its row (r, c^1), along its column (r^1, c), across (r^1, c^1).
ROW_NEIGHBOUR, COLUMN_NEIGHBOUR, DIAGONAL = 1, 2, 3


def _swap(x, axis: str, neighbour: int):  # type: ignore[no-untyped-def]
    """`x` (a pytree) exchanged with the rank `k ^ neighbour`."""
    return jax.lax.ppermute(x, axis, [(k, k ^ neighbour) for k in range(DEGREE)])


def _half(x: jax.Array, dim: int, index: jax.Array) -> jax.Array:
    size = x.shape[dim] // SIDE
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)


def _join(mine: jax.Array, other: jax.Array, dim: int, first: jax.Array) -> jax.Array:
    """`mine` and `other` concatenated along `dim`, `mine` first where `first` (a traced bool)."""
    return jnp.where(first, jnp.concatenate([mine, other], dim), jnp.concatenate([other, mine], dim))


def _ordered(mine, other, first: jax.Array):  # type: ignore[no-untyped-def]
    """The pair (mine, other) where `first`, else (other, mine) (pytrees of equal shapes)."""
    pick = lambda a, b: jnp.where(first, a, b)  # noqa: E731
    return jax.tree.map(pick, mine, other), jax.tree.map(pick, other, mine)


def _coordinates(axis: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(r, c, a = r xor c) of this rank."""
    k = jax.lax.axis_index(axis)
    r, c = k // SIDE, k % SIDE
    return r, c, jnp.bitwise_xor(r, c)


def _contracting(matmul: Matmul, x: jax.Array, kernel: jax.Array) -> int:
    """How many trailing dimensions of x `matmul` contracts with the leading ones of `kernel`."""
    out = jax.eval_shape(matmul, x, kernel)
    return (x.ndim + kernel.ndim - out.ndim) // 2


def _divides(size: int, parts: int, what: str) -> None:
    if size % parts:
        raise TensorRuleError(
            f"the cannon form splits {what} ({size}) into {parts} blocks, which does not divide it; "
            'use a shape that divides, or Plan(..., tensor_matmul="gather")'
        )


def _square(
    product: Callable, blocks_in, kernels_in, axis: str
):  # type: ignore[no-untyped-def]
    """Cannon's two steps on blocks already in place: returns (output block, the last input block, the
    last kernel blocks), the two saved for the backward."""
    out = product(blocks_in, kernels_in)
    blocks_last = _swap(blocks_in, axis, ROW_NEIGHBOUR)
    kernels_last = _swap(kernels_in, axis, COLUMN_NEIGHBOUR)
    out = jax.tree.map(jnp.add, out, product(blocks_last, kernels_last))
    return out, blocks_last, kernels_last


def _square_backward(product: Callable, blocks_last, kernels_last, d_out, axis: str):  # type: ignore[no-untyped-def]
    """The paper's input-gradient and weight-gradient phases: (dI for the last input block's layout,
    dW for the first kernel blocks' layout)."""
    def d_blocks(blocks, kernels, ct):  # type: ignore[no-untyped-def]
        return jax.vjp(lambda b: product(b, kernels), blocks)[1](ct)[0]

    def d_kernels(blocks, kernels, ct):  # type: ignore[no-untyped-def]
        return jax.vjp(lambda w: product(blocks, w), kernels)[1](ct)[0]

    d_out_row = _swap(d_out, axis, ROW_NEIGHBOUR)  # dO[r, c^1]
    kernels_across = _swap(kernels_last, axis, DIAGONAL)  # W[a^1, c^1]
    d_in = jax.tree.map(
        jnp.add, d_blocks(blocks_last, kernels_last, d_out), d_blocks(blocks_last, kernels_across, d_out_row)
    )
    partial = d_kernels(blocks_last, kernels_across, d_out_row)  # dW[a^1, c^1] over sequence half r
    blocks_below = _swap(blocks_last, axis, COLUMN_NEIGHBOUR)  # I[r^1, a]
    d_out_below = _swap(d_out, axis, COLUMN_NEIGHBOUR)  # dO[r^1, c]
    d_kernel = jax.tree.map(
        jnp.add, d_kernels(blocks_below, kernels_last, d_out_below), _swap(partial, axis, ROW_NEIGHBOUR)
    )
    return d_in, d_kernel


def column_cannon(
    x: jax.Array, kernels: Sequence[jax.Array], matmul: Matmul, axis: str
) -> tuple[jax.Array, ...]:
    """`matmul(x_whole, kernel)` for each column kernel slice, from this rank's sequence shard of x, as
    the gather form lays it out: the whole sequence of this rank's output slice."""
    n = _contracting(matmul, x, kernels[0])
    dim = x.ndim - n  # x's first contracting dimension, the kernels' dimension 0
    _divides(x.shape[dim], SIDE, f"dimension {dim} of a column matmul's input")
    for kernel in kernels:
        _divides(kernel.shape[0], SIDE, f"dimension 0 of a column kernel {kernel.shape}")

    def product(block, kernel_pairs):  # type: ignore[no-untyped-def]
        return tuple(tuple(matmul(block, k) for k in pair) for pair in kernel_pairs)

    def forward(x, kernels):  # type: ignore[no-untyped-def]
        r, c, a = _coordinates(axis)
        # The row neighbour holds the other quarter of sequence half r: its half a of the contraction.
        sent = _swap(_half(x, dim, a ^ 1), axis, ROW_NEIGHBOUR)
        block = _join(_half(x, dim, a), sent, SEQUENCE_DIM, c == 0)
        # Output block c pairs the slices of ranks (0, c) and (1, c); both bring their half a.
        pairs = tuple(
            _ordered(_half(k, 0, a), _swap(_half(k, 0, a ^ 1), axis, COLUMN_NEIGHBOUR), r == 0)
            for k in kernels
        )
        out, block_last, pairs_last = _square(product, block, pairs, axis)
        # Out of the square: this rank's slice (pair element r) over the whole sequence.
        whole = []
        for pair in out:
            mine, theirs = _ordered(pair[0], pair[1], r == 0)
            whole.append(_join(mine, _swap(theirs, axis, COLUMN_NEIGHBOUR), SEQUENCE_DIM, r == 0))
        return tuple(whole), (block_last, pairs_last)

    @jax.custom_vjp
    def cannon(x, kernels):  # type: ignore[no-untyped-def]
        return forward(x, kernels)[0]

    def backward(saved, d_whole):  # type: ignore[no-untyped-def]
        block_last, pairs_last = saved
        r, c, a = _coordinates(axis)
        d_out = []
        for d in d_whole:
            mine = _half(d, SEQUENCE_DIM, r)
            theirs = _swap(_half(d, SEQUENCE_DIM, r ^ 1), axis, COLUMN_NEIGHBOUR)
            d_out.append(_ordered(mine, theirs, r == 0))
        d_block, d_pairs = _square_backward(product, block_last, pairs_last, tuple(d_out), axis)
        # dI[r, a^1] holds this rank's quarter at half a^1; the row neighbour's holds its half a.
        mine = _half(d_block, SEQUENCE_DIM, c)
        theirs = _swap(_half(d_block, SEQUENCE_DIM, c ^ 1), axis, ROW_NEIGHBOUR)
        d_x = _join(theirs, mine, dim, a == 0)
        d_kernels = []
        for first, second in d_pairs:  # dW[a, c]: this rank's slice at half a, the other half below
            mine, theirs = _ordered(first, second, r == 0)
            d_kernels.append(_join(mine, _swap(theirs, axis, COLUMN_NEIGHBOUR), 0, a == 0))
        return d_x, tuple(d_kernels)

    cannon.defvjp(forward, backward)
    return cannon(x, tuple(kernels))


def row_cannon(x: jax.Array, kernel: jax.Array, matmul: Matmul, axis: str) -> jax.Array:
    """This rank's sequence shard of `matmul(x, kernel)` summed over the group, from the whole sequence
    of this rank's input slice and kernel slice (the gather form's layouts)."""
    n = _contracting(matmul, x, kernel)
    out_dim = x.ndim - n  # the output's first kernel dimension: halved into the output blocks
    _divides(x.shape[SEQUENCE_DIM], DEGREE, "the sequence of a row matmul's input")
    _divides(kernel.shape[n], SIDE, f"dimension {n} of a row kernel {kernel.shape}")

    def product(pair, kernel_pair):  # type: ignore[no-untyped-def]
        return matmul(pair[0], kernel_pair[0]) + matmul(pair[1], kernel_pair[1])

    def forward(x, kernel):  # type: ignore[no-untyped-def]
        r, c, _ = _coordinates(axis)
        # Contracting block a pairs this rank's slice with the rank across (lower rank first).
        theirs = _swap(_half(x, SEQUENCE_DIM, r ^ 1), axis, DIAGONAL)
        block = _ordered(_half(x, SEQUENCE_DIM, r), theirs, r == 0)
        pair = _ordered(_half(kernel, n, c), _swap(_half(kernel, n, c ^ 1), axis, DIAGONAL), r == 0)
        out, block_last, pair_last = _square(product, block, pair, axis)
        # O[r, c]: sequence half r, output half c; this rank's quarter of the sequence takes the row
        # neighbour's output half.
        mine = _half(out, SEQUENCE_DIM, c)
        theirs = _swap(_half(out, SEQUENCE_DIM, c ^ 1), axis, ROW_NEIGHBOUR)
        return _join(mine, theirs, out_dim, c == 0), (block_last, pair_last)

    @jax.custom_vjp
    def cannon(x, kernel):  # type: ignore[no-untyped-def]
        return forward(x, kernel)[0]

    def backward(saved, d_shard):  # type: ignore[no-untyped-def]
        block_last, pair_last = saved
        r, c, _ = _coordinates(axis)
        # dO[r, c]: half c of this rank's quarter, and of the row neighbour's quarter from it.
        mine = _half(d_shard, out_dim, c)
        theirs = _swap(_half(d_shard, out_dim, c ^ 1), axis, ROW_NEIGHBOUR)
        d_out = _join(mine, theirs, SEQUENCE_DIM, c == 0)
        d_block, d_pair = _square_backward(product, block_last, pair_last, d_out, axis)
        # dI[r, a^1] pairs the slices of the row and column neighbours: each returns this rank's
        # slice, for its own sequence half.
        # Of the pair {k^1, k^2}, the row neighbour's slice is the lower iff r == 0.
        from_row = _swap(_ordered(d_block[0], d_block[1], r == 0)[0], axis, ROW_NEIGHBOUR)
        for_column = _ordered(d_block[0], d_block[1], r == 1)[0]
        from_column = _swap(for_column, axis, COLUMN_NEIGHBOUR)
        d_x = _join(from_row, from_column, SEQUENCE_DIM, r == 0)
        # dW[a, c]: this rank's slice at half c; the rank across returns the other half.
        mine, theirs = _ordered(d_pair[0], d_pair[1], r == 0)
        d_kernel = _join(mine, _swap(theirs, axis, DIAGONAL), n, c == 0)
        return d_x, d_kernel

    cannon.defvjp(forward, backward)
    return cannon(x, kernel)



# Each ppermute: (elements, bytes per element, whether it moves a kernel block alone, which XLA hoists
# out of a micro-batch loop where the kernel is the same for every micro-batch).
Sizes = list[tuple[int, int, bool]]


@dataclasses.dataclass(frozen=True)
class Shifts:
    """What each `ppermute` of one cannon matmul sends from one rank: the exchanges into and out of the
    square (on the critical path) and the shifts on it (each beside a block product), per pass. The
    forward's exchanges out only feed the output, so a recomputed forward whose output nothing reads
    drops them."""

    into: Sizes
    square: Sizes
    out: Sizes
    back_square: Sizes
    back_exchanges: Sizes


def shifts(
    column: bool, inputs: int, kernels: Sequence[int], outputs: Sequence[int], itemsize: int,
    kernel_itemsize: int, input_moved: bool = False,
) -> Shifts:  # fmt: skip
    """`Shifts` of one matmul from the whole elements of its input, kernels and outputs, as
    `column_cannon` and `row_cannon` issue them; a pair of blocks (two ranks' slices) travels as two
    transfers of an eighth each. `input_moved`: a column matmul whose input another call already
    entered into the square (linen's separate q, k, v), whose identical exchange and shifts XLA keeps
    once."""
    eighth, quarter = 2 * DEGREE, DEGREE

    def x(n: int, part: int) -> tuple[int, int, bool]:
        return n // part, itemsize, False

    def w(n: int, part: int, alone: bool = True) -> tuple[int, int, bool]:
        return n // part, kernel_itemsize, alone

    def per_kernel(o: int, k: int) -> Sizes:  # dO's two shifts (pairs), W's across, the partial sum's
        return [x(o, eighth)] * 4 + [w(k, eighth)] * 2 + [w(k, eighth, False)] * 2

    if column:  # the input's exchange, its block's shift and the kept block's shift serve every kernel
        both = list(zip(outputs, kernels, strict=True))
        entered = [] if input_moved else [x(inputs, quarter)]
        return Shifts(
            into=([] if input_moved else [x(inputs, eighth)]) + [w(k, eighth) for k in kernels],
            square=entered + [w(k, eighth) for k in kernels for _ in "ab"],
            out=[x(o, eighth) for o in outputs],
            back_square=entered + [n for o, k in both for n in per_kernel(o, k)],
            # The input gradient out of the square; per kernel the output gradient in, the kernel's out.
            back_exchanges=[
                x(inputs, eighth), *(n for o, k in both for n in (x(o, eighth), w(k, eighth, False)))
            ],
        )  # fmt: skip
    (k,), (o,) = kernels, outputs
    return Shifts(
        into=[x(inputs, eighth), w(k, eighth)],
        square=[x(inputs, eighth), x(inputs, eighth), w(k, eighth), w(k, eighth)],
        out=[x(o, eighth)],
        back_square=[x(o, quarter), x(o, quarter), *per_kernel(0, k)[4:], *[x(inputs, eighth)] * 2],
        back_exchanges=[x(o, eighth), w(k, eighth, False), x(inputs, eighth), x(inputs, eighth)],
    )
