"""Collective matmuls over the tensor axis (the `ring` form): the sequence blocks of an activation travel
round the tensor group one neighbour per step, t - 1 `ppermute`s, each independent of the block product
beside it, so that XLA runs the transfer behind it.

- all-gather-matmul (column-parallel input): each rank holds a sequence block of x, [b, s/t, d]; the
  blocks are passed on t - 1 times (`ring_blocks`, shared by every kernel that reads x, as query, key
  and value do; from jaxlib 0.11 both ways round, `_both_ways`) and each block multiplied by the rank's
  column slice of a kernel as it arrives, giving `matmul(x_whole, kernel)`, [b, s, f/t], without
  holding x gathered first.
- matmul-reduce-scatter (row-parallel output): each rank holds x whole along the sequence with its
  slice of the contracting dimension; at step k it adds its partial product for one sequence block to
  the running sum it received and passes the sum on, so after t steps it holds its own block summed.

Their gradients are JAX's transposes, which are each other's: the input gradient of an
all-gather-matmul is the chain of shifts transposed, a matmul-reduce-scatter of the output gradient
(each block's partial the sum over the kernels that read it); that of a matmul-reduce-scatter is an
all-gather-matmul of the output gradient, whose blocks also give the weight gradient block by block.
The column form's weight gradient reads the blocks kept from the forward ring (as the gather form keeps
the gathered input), or recomputed with it under remat. Each ring thus moves t - 1 blocks per pass,
forward and backward, and nothing else. Block products that share a kernel and no transfer are ordered
one after another (`_after`, and the column form's custom backward), else XLA merges them into one
product that no transfer can run beside. From jaxlib 0.11 (`_kept_apart`) XLA also merges products
that wait for different transfers, and fuses the add of an arrived sum into the next product: there the
column ring's forward products (from three blocks on) and the row ring's backward products are ordered
as they arrive, and a product added to an arrived sum is a kernel of its own (`_alone`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from amsp_jax.core.backend import ANALYTICAL_ESTIMATOR_BEFORE

SEQUENCE_DIM = 1  # activations are (batch, sequence, ...)
Matmul = Callable[[jax.Array, jax.Array], jax.Array]
Blocks = list[jax.Array]  # in arrival order: the k-th is rank (rank + offsets(t)[k]) % t's sequence block


def _shift(x: jax.Array, axis: str, degree: int) -> jax.Array:
    """`x` sent to the previous rank of the ring: after k shifts rank i holds rank (i + k) % t's."""
    return jax.lax.ppermute(x, axis, [(j, (j - 1) % degree) for j in range(degree)])


def _unshift(x: jax.Array, axis: str, degree: int) -> jax.Array:
    """`x` sent to the next rank of the ring: `_shift`'s transpose."""
    return jax.lax.ppermute(x, axis, [(j, (j + 1) % degree) for j in range(degree)])


def _block(x: jax.Array, index: jax.Array, size: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=SEQUENCE_DIM)


def ring_blocks(x: jax.Array, axis: str, degree: int) -> Blocks:
    """Every rank's sequence block of `x`, this rank's first, the others as they arrive round the ring
    (`offsets`): one way round, or both ways, each block passed on from the neighbour it came from."""
    blocks, ahead, behind = [x], x, x
    for offset in offsets(degree)[1:]:
        if offset > 0:
            ahead = _shift(ahead, axis, degree)
        else:
            behind = _unshift(behind, axis, degree)
        blocks.append(ahead if offset > 0 else behind)
    return blocks


def offsets(degree: int) -> list[int]:
    """Which rank's block, relative to this one, `ring_blocks` brings at each step: 0, 1, 2, ... one way
    round, or 0, 1, -1, 2, -2, ... both ways (`_both_ways`)."""
    if not _both_ways(degree):
        return list(range(degree))
    return [0] + [(k + 1) // 2 if k % 2 else -(k // 2) for k in range(1, degree)]


def _both_ways(degree: int) -> bool:
    """Whether a column ring passes its blocks both ways round: from jaxlib 0.11 (`_kept_apart`), with
    three blocks or more. Each block is then at most t/2 transfers from the rank that needs it, so more
    block products are free to run beside each transfer, and XLA's scheduler (priced by the step's
    profile, `compiled.xla.scheduling_profile`) puts one beside more of them: one way round it gives a
    later transfer every product it may and leaves the first without one. The bytes are the same (t - 1
    blocks of whole/t in, one per transfer). On jaxlib 0.10 (its analytical estimator, the permutes
    alone priced by the profile: `compiled.xla.compile_scheduled`) one way round hides more at t = 8."""
    return degree > 2 and _kept_apart()


def _after(x: jax.Array, other: jax.Array) -> jax.Array:
    """`x`, available only once `other` is: keeps XLA from merging a ring's block products into one
    (they share the kernel), which would leave no product to run beside the next transfer."""
    return jax.lax.optimization_barrier((x, other))[0]


def _kept_apart() -> bool:
    """Whether this XLA needs a ring's block products kept apart (`_after`, `_alone`): from jaxlib 0.11
    it merges a column ring's products into one and fuses a row ring's adds into its gemms."""
    # jaxlib < 0.11: XLA does neither, and its analytical estimator (`ANALYTICAL_ESTIMATOR_BEFORE`) hides
    # fewer transfers with the barriers that keep them apart.
    return tuple(jax.__version_info__[:2]) >= ANALYTICAL_ESTIMATOR_BEFORE


def _alone(product: jax.Array) -> jax.Array:
    """`product`, computed by a kernel of its own: keeps XLA from fusing the add of a transfer's result
    into the gemm as its epilogue, which would make the gemm wait for that transfer instead of running
    beside it."""
    return jax.lax.optimization_barrier(product)


def gather_matmul(blocks: Blocks, kernel: jax.Array, matmul: Matmul, axis: str, degree: int) -> jax.Array:
    """`matmul(x_whole, kernel)` from the ring's blocks of x: each block's product put in its place.
    Backward, each block's input gradient is computed after the next block's, whose sum over the
    kernels the transposed ring is then passing on."""
    def indices() -> list[jax.Array]:  # each rank's, traced where used (a custom_vjp closes over none)
        rank = jax.lax.axis_index(axis)
        return [(rank + offset) % degree for offset in offsets(degree)]

    def place(products: list[jax.Array]) -> jax.Array:
        shape = list(products[0].shape)
        shape[SEQUENCE_DIM] *= degree
        out = jax.lax.full_like(products[0], 0, shape=tuple(shape))
        for index, y in zip(indices(), products, strict=True):
            start = index * y.shape[SEQUENCE_DIM]
            out = jax.lax.dynamic_update_slice_in_dim(out, y, start, axis=SEQUENCE_DIM)
        return out

    @jax.custom_vjp
    def ring(arrays: list[jax.Array], kernel: jax.Array) -> jax.Array:
        # Two blocks have one transfer, which the barrier would leave XLA's scheduler putting before
        # block 0's product rather than beside it.
        if not apart or degree < 3:
            return place([matmul(block, kernel) for block in arrays])
        products = [matmul(arrays[0], kernel)]
        for block in arrays[1:]:  # in arrival order: else XLA merges them into one that waits for the last
            products.append(matmul(_after(block, products[-1]), kernel))
        return place(products)

    def backward(saved, ct):  # type: ignore[no-untyped-def]
        arrays, kernel = saved
        size, index = arrays[0].shape[SEQUENCE_DIM], indices()
        grads: list[jax.Array] = [None] * degree  # type: ignore[list-item]
        dk = jax.lax.full_like(kernel, 0)
        for step in reversed(range(degree)):
            ct_block = jax.lax.dynamic_slice_in_dim(ct, index[step] * size, size, axis=SEQUENCE_DIM)
            if step < degree - 1:
                ct_block = _after(ct_block, grads[step + 1])
            _, pull = jax.vjp(matmul, arrays[step], kernel)
            grad, dk_step = pull(ct_block)
            grads[step] = _alone(grad) if apart else grad  # added to the transposed ring's sum on arrival
            dk = dk + dk_step
        return grads, dk

    apart = _kept_apart()
    ring.defvjp(lambda arrays, kernel: (ring(arrays, kernel), (arrays, kernel)), backward)
    return ring(blocks, kernel)


def matmul_scatter(x: jax.Array, kernel: jax.Array, matmul: Matmul, axis: str, degree: int) -> jax.Array:
    """This rank's sequence block of `matmul(x, kernel)` summed over the group: at step k a rank adds its
    partial product for block (rank + k + 1) % t to the running sum it received and passes it on.
    Backward, the output gradient travels the ring the other way, and each block's gradients are
    computed after the previous arrival's (else XLA merges them into one product that waits for the
    last transfer)."""
    size = x.shape[SEQUENCE_DIM] // degree
    apart = _kept_apart()

    def index(step: int) -> jax.Array:  # the block a rank multiplies at `step`, traced where used
        return (jax.lax.axis_index(axis) + step + 1) % degree

    def scatter(x: jax.Array, kernel: jax.Array) -> jax.Array:
        total = matmul(_block(x, index(0), size), kernel)
        for step in range(1, degree):
            block = _after(_block(x, index(step), size), total)
            product = matmul(block, kernel)
            total = _shift(total, axis, degree) + (_alone(product) if apart else product)
        return total

    def backward(saved, ct):  # type: ignore[no-untyped-def]
        x, kernel = saved
        dx, dk = jax.lax.full_like(x, 0), jax.lax.full_like(kernel, 0)
        previous = None
        for step in reversed(range(degree)):
            if step < degree - 1:
                ct = _unshift(ct, axis, degree)
            arrived = ct if previous is None else _after(ct, previous)
            _, pull = jax.vjp(matmul, _block(x, index(step), size), kernel)
            previous, dk_step = pull(arrived)
            dx = jax.lax.dynamic_update_slice_in_dim(dx, previous, index(step) * size, axis=SEQUENCE_DIM)
            dk = dk + dk_step
        return dx, dk

    if not apart:
        return scatter(x, kernel)
    ring = jax.custom_vjp(scatter)
    ring.defvjp(lambda x, kernel: (ring(x, kernel), (x, kernel)), backward)
    return ring(x, kernel)
