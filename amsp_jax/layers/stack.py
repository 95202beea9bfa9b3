"""Per-layer parameter gathering: `LayerStack`, and blocks of models written without it.

A model that builds its repeated blocks with `LayerStack(block, length)` keeps a stacked parameter
subtree (leading layer dimension) and runs the layers with `lax.scan`. Outside amsp_jax it is a plain
scan. Inside an amsp_jax step the stack finds a `LayerContext` for its path and, in the scan body,
gathers only the current layer's parameter shards (and routes their gradient into the G shard),
under the plan's remat policy. The model itself never sees a mesh or a collective.

Models written the ordinary way (a Python loop over block instances, `nn.scan`, nnx lists and
`nnx.scan`) get the same per-layer gathering without an edit: the step hands each block's parameters
in as (P shard, G sink) pairs, and a method interceptor (`nn.intercept_methods`; `amsp_jax.layers.nnx` for
nnx) replaces every call of a block by `gathered_call`: a `jax.custom_vjp` that gathers the block's
weights just before the call, runs the block's own code on them, keeps only its inputs and shards
for the backward pass, and there gathers again, recomputes the block and reduce-scatters the weight
gradient onto G. `find_blocks` picks the blocks from one traced `init`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from amsp_jax.layers import tensor
from amsp_jax.layers.scan import prefetched_scan
from amsp_jax.layers.tensor_modules import tensor_layers
from amsp_jax.layers.unused import backward_unused, split_static

STACK_PARAM = "layer"
# The name scope, under its stack's module path, of a kept first layer's once-per-step collectives
# (`schedule.keeps_first_layer`): the audit tells them apart by it.
FIRST_LAYER_SCOPE = "first_layer"


def first_layer_scope(leaf: tuple[str, ...]) -> str:
    """The name scope of the once-per-step collectives of a kept first layer's `leaf` (its path)."""
    module = leaf[: leaf.index(STACK_PARAM)] if STACK_PARAM in leaf else leaf[:-1]
    return "/".join((*map(str, module), FIRST_LAYER_SCOPE))


Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class StackOps:
    """How a step moves one layer of a stack: trees in, trees out (per-layer parameter structure)."""

    gather_with_sink: Callable[[Any, Any], Any]  # (P shards, G sinks) -> full weights; grads into sinks
    gather: Callable[[Any], Any]  # P shards -> full weights
    reduce: Callable[[Any], Any]  # full weight grads -> fp32 G shards


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What a step hands the stacks while it traces: per stack path, how to move one layer."""

    stacks: dict[tuple[str, ...], StackOps]
    sinks: dict[tuple[str, ...], Any]
    remat_policy: Callable[..., bool] | None
    remat: bool
    prefetch: frozenset[tuple[str, ...]] = frozenset()  # stacks and blocks that prefetch
    blocks: dict[tuple[str, ...], StackOps] = dataclasses.field(default_factory=dict)  # by block path
    chain: Chain | None = None  # one per traced loss: how prefetching blocks pass their anchors on
    # Per stack: its first layer's weights, gathered once per step (`schedule.keeps_first_layer`).
    first: dict[tuple[str, ...], Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Chain:
    """Anchors of prefetching blocks, in call order: block i's gather waits on block i-1's input (so it
    runs during block i-1), and its backward re-gather on block i+1's output cotangent."""

    forward: list[jax.Array] = dataclasses.field(default_factory=list)
    backward: list[jax.Array] = dataclasses.field(default_factory=list)


_CONTEXT: contextvars.ContextVar[LayerContext | None] = contextvars.ContextVar("amsp_layers", default=None)
_RECORDING: contextvars.ContextVar[list[tuple[str, ...]] | None] = contextvars.ContextVar(
    "amsp_layer_paths", default=None
)
# Set while amsp_jax itself runs a block's code (a LayerStack layer, a gathered block): calls inside
# are the block's own and are neither intercepted nor recorded as blocks.
_OPAQUE: contextvars.ContextVar[bool] = contextvars.ContextVar("amsp_opaque", default=False)
# While `recording_calls` runs: each LayerStack's layer parameters its backward pass does not read.
_STACK_UNUSED: contextvars.ContextVar[dict[tuple[str, ...], frozenset] | None] = contextvars.ContextVar(
    "amsp_stack_unused", default=None
)


@contextlib.contextmanager
def opaque() -> Iterator[None]:
    """Run code whose module calls are a block's internals (not blocks of the model)."""
    token = _OPAQUE.set(True)
    try:
        yield
    finally:
        _OPAQUE.reset(token)


def is_opaque() -> bool:
    """Whether amsp_jax is running a block's own code (its inner calls are not blocks)."""
    return _OPAQUE.get()


def current_context() -> LayerContext | None:
    """The `LayerContext` of the step being traced, unless amsp_jax is running a block's code itself."""
    return None if _OPAQUE.get() else _CONTEXT.get()


@contextlib.contextmanager
def layer_context(context: LayerContext) -> Iterator[LayerContext]:
    """Make `context` visible to every `LayerStack` traced inside the block."""
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def stack_unused_recorder(into: dict[tuple[str, ...], frozenset]) -> Iterator[None]:
    """Collect into `into` each `LayerStack`'s layer parameters its backward pass does not read."""
    token = _STACK_UNUSED.set({})
    try:
        yield
    finally:
        into.update(_STACK_UNUSED.get() or {})
        _STACK_UNUSED.reset(token)


@contextlib.contextmanager
def recording_stacks() -> Iterator[list[tuple[str, ...]]]:
    """Collect the parameter paths of the stacked subtrees of every `LayerStack` traced inside."""
    paths: list[tuple[str, ...]] = []
    token = _RECORDING.set(paths)
    try:
        yield paths
    finally:
        _RECORDING.reset(token)


class LayerStack(nn.Module):
    """Applies `block` `length` times with `lax.scan`; its parameters are stacked along axis 0.

    `block(x, *args) -> x`; `args` are the same for every layer (positions, masks).
    """

    block: nn.Module
    length: int

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any) -> jax.Array:
        block = self.block
        if self.has_variable("params", STACK_PARAM):
            # Read directly: inside a step the stored leaves are shards, which `self.param`'s shape
            # check would reject.
            stacked = self.get_variable("params", STACK_PARAM)
        else:

            def init(rng: jax.Array) -> Any:
                with opaque():
                    keys = jax.random.split(rng, self.length)
                    return jax.vmap(lambda key: block.init(key, x, *args)["params"])(keys)

            stacked = self.param(STACK_PARAM, init)
        path = (*self.path, STACK_PARAM)
        _record(path, block, stacked, x, args)
        context = _CONTEXT.get()
        if context is None or path not in context.stacks:

            def plain(carry: jax.Array, layer_params: Any) -> tuple[jax.Array, None]:
                return block.apply({"params": layer_params}, carry, *args), None

            with opaque():
                return jax.lax.scan(plain, x, stacked)[0]

        with tensor.in_unit(path):
            return _gathered_scan(block, context, path, x, stacked, args)


def _record(path: tuple[str, ...], block: nn.Module, stacked: Any, x: jax.Array, args: tuple) -> None:
    """Note the stack's path, and the layer parameters its backward does not read, where recorded."""
    recording = _RECORDING.get()
    if recording is not None and path not in recording:
        recording.append(path)
    unused = _STACK_UNUSED.get()
    if unused is not None and path not in unused:

        def run(weights: Any, inputs: Any) -> Any:
            with opaque():
                return block.apply({"params": weights}, inputs[0], *inputs[1])

        layer = jax.tree.map(lambda leaf: leaf[0], stacked)
        unused[path] = backward_unused(run, layer, (x, args))


def _gathered_scan(
    block: nn.Module, context: LayerContext, path: tuple[str, ...], x: jax.Array, stacked: Any, args: tuple
) -> jax.Array:
    """The stack's layers inside a step: each layer's P shards gathered in the scan body (or the
    explicit-prefetch loop), its gradient routed into the G sinks, under the plan's remat."""
    ops = context.stacks[path]
    sinks = context.sinks[path]
    if path in context.prefetch:
        with opaque():
            return prefetched_scan(
                lambda h, weights, args: block.apply({"params": weights}, h, *args),
                ops.gather,
                ops.reduce,
                x,
                stacked,
                sinks,
                args,
            )

    def rematted(fn: Callable[..., jax.Array], in_scan: bool = True) -> Callable[..., jax.Array]:
        # No CSE barrier in the scan: its loops already keep the backward's re-gather and
        # recomputation apart from the forward's (JAX's documented case for prevent_cse=False), and
        # the barrier kept XLA's collective pipeliner from moving the re-gather into the previous
        # iteration, so it ran synchronous (LLaMA-7B zero3 at 1,024 A100s: 32 % of per-layer bytes
        # with compute between start and done with it, 92 % without). Outside a scan it stays.
        if not context.remat:
            return fn
        return jax.checkpoint(fn, policy=context.remat_policy, prevent_cse=not in_scan)

    def apply_layer(carry: jax.Array, layer_params: Any, layer_sink: Any) -> jax.Array:
        return block.apply({"params": ops.gather_with_sink(layer_params, layer_sink)}, carry, *args)

    layer = rematted(apply_layer)

    def body(carry: jax.Array, xs: tuple[Any, Any]) -> tuple[jax.Array, None]:
        return layer(carry, *xs), None

    if path not in context.first:
        with opaque():
            return jax.lax.scan(body, x, (stacked, sinks))[0]

    # The first layer runs on weights gathered once per step; the loop runs the others, so it starts
    # and ends beside this layer's compute instead of with a gather and a reduce-scatter nothing can
    # hide. The loop indexes the whole stack (its slice would be a copy of the P blocks).
    @functools.partial(rematted, in_scan=False)
    def first_layer(carry: jax.Array, weights: Any) -> jax.Array:
        return block.apply({"params": weights}, carry, *args)

    @rematted
    def indexed_layer(carry: jax.Array, stacked: Any, index: jax.Array, layer_sink: Any) -> jax.Array:
        return apply_layer(carry, _layer(stacked, index), layer_sink)

    def rest(carry: jax.Array, xs: tuple[jax.Array, Any]) -> tuple[jax.Array, None]:
        return indexed_layer(carry, stacked, *xs), None

    length = jax.tree.leaves(stacked)[0].shape[0]
    with opaque():
        x = first_layer(x, context.first[path])
        later = (jnp.arange(1, length), jax.tree.map(lambda sink: sink[1:], sinks))
        return jax.lax.scan(rest, x, later)[0]


def _layer(tree: Any, index: jax.Array) -> Any:
    """Layer `index` of a stacked tree."""
    return jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), tree)


# ---- blocks of models written without LayerStack ------------------------------------------------


def is_pair(x: Any) -> bool:
    """Whether `x` is a (P shard, G sink) pair the step hands a block in place of a weight."""
    return isinstance(x, tuple) and len(x) == 2 and all(hasattr(v, "shape") for v in x)


def split_pairs(tree: Any) -> tuple[Any, Any]:
    """(P shards, G sinks) of a tree of pairs."""
    shards = jax.tree.map(lambda p: p[0], tree, is_leaf=is_pair)
    sinks = jax.tree.map(lambda p: p[1], tree, is_leaf=is_pair)
    return shards, sinks


def _anchor(values: Any) -> jax.Array | None:
    """One element of the first floating array of `values` (a block's input or output cotangent)."""
    floating = [v for v in jax.tree.leaves(values) if jnp.issubdtype(v.dtype, jnp.floating) and v.size]
    return jax.lax.stop_gradient(floating[0].ravel()[0]) if floating else None


def _after(shards: Any, anchor: jax.Array | None) -> Any:
    """`shards` made to depend on `anchor` (see `_anchor`).

    Without a data dependence XLA issues every block's gather at the start of the step and keeps all
    the weights live. An optimization barrier is not enough on the CPU backend (it is removed before
    common-subexpression elimination, which then merges the backward gathers into the forward ones),
    so the dependence is arithmetic: + 0 × one element (an Inf there makes the step non-finite anyway).
    """
    if anchor is None:
        return shards
    zero = anchor * 0
    return jax.tree.map(lambda s: s + zero.astype(s.dtype), shards)


def gathered_call(
    ops: StackOps,
    run: Callable[[Any, Any], Any],
    shards: Any,
    sinks: Any,
    inputs: Any,
    remat: bool,
    chain: Chain | None = None,
    unit: tuple | None = None,
) -> Any:
    """`run(full weights, inputs)` with the weights gathered from `shards` just before the call.

    The weight gradient is reduce-scattered into `sinks` (on G). With `remat` the forward pass keeps
    only `inputs` and the shards, and the backward pass gathers again and recomputes the block (the
    whole block: a selective remat policy does not apply here); without it the gathered weights are
    kept for the backward pass, as `jax.grad` would. `inputs` may hold static leaves (flags, None).
    With a `chain` the gathers are issued one block early (prefetch), else they wait on this block's
    own input and output cotangent. `unit`: the block's path, under which the tensor-parallel boundaries
    it crosses are counted.
    """
    arrays, rebuild = split_static(inputs)
    own = _anchor(arrays)
    anchor = chain.forward[-1] if chain is not None and chain.forward else own
    if chain is not None and own is not None:
        chain.forward.append(own)

    tensor_now = tensor.current()  # the backward pass reruns the block after the step's context closed

    def apply(weights: Any, arrays: list[Any]) -> Any:
        layers = tensor_layers() if tensor_now else contextlib.nullcontext()
        in_unit = tensor.in_unit(unit) if unit is not None else contextlib.nullcontext()
        with tensor.tensor_context(tensor_now), layers, in_unit:
            return run(weights, rebuild(arrays))

    if not remat:
        return apply(ops.gather_with_sink(_after(shards, anchor), sinks), arrays)

    @jax.custom_vjp
    def call(shards: Any, sinks: Any, arrays: list[Any], anchor: jax.Array | None) -> Any:
        del sinks
        return apply(ops.gather(_after(shards, anchor)), arrays)

    def forward(shards: Any, sinks: Any, arrays: list[Any], anchor: jax.Array | None) -> tuple[Any, Any]:
        return call(shards, sinks, arrays, anchor), (shards, arrays)

    def backward(saved: Any, cotangent: Any) -> tuple[None, Any, Any, None]:
        shards, arrays = saved
        own = _anchor(cotangent)
        # The backward pass meets the blocks in reverse: the later block's cotangent came first.
        anchor = chain.backward[-1] if chain is not None and chain.backward else own
        if chain is not None and own is not None:
            chain.backward.append(own)
        _, vjp = jax.vjp(apply, ops.gather(_after(shards, anchor)), arrays)
        weight_grads, input_grads = vjp(cotangent)
        return None, ops.reduce(weight_grads), input_grads, None

    call.defvjp(forward, backward)
    return call(shards, sinks, arrays, anchor)


def _copy_counters(counters: dict[Any, Any]) -> dict[Any, Any]:
    # Keys include flax's child sentinel object, which must stay the same object (no deepcopy).
    return {k: _copy_counters(v) if isinstance(v, dict) else v for k, v in counters.items()}


def _is_lifted(cls: type) -> bool:
    """Classes flax makes for `nn.scan`, `nn.remat`, ...: their calls wrap the block's own calls."""
    return cls.__module__ == "flax.linen.transforms"


def _linen_block_call(next_fun: Callable[..., Any], args: Any, kwargs: Any, info: Any) -> Any:
    """`nn.intercept_methods` hook: a block's call becomes a `gathered_call` of its own code."""
    context = current_context()
    module = info.module
    if (
        context is None
        or info.method_name != "__call__"
        or _is_lifted(type(module))
        or module.path not in context.blocks
    ):
        return next_fun(*args, **kwargs)
    scope = module.scope
    shards, sinks = split_pairs(dict(module.variables["params"]))
    others = {name: value for name, value in module.variables.items() if name != "params"}
    # The block's own RNG streams and counters, so dropout draws exactly what it would unwrapped; each
    # run (forward, backward recompute) starts from the same counters.
    lazy_rngs = dict(scope.rngs)
    start = _copy_counters(scope.rng_counters)
    used: list[dict[Any, Any]] = []
    template = module.clone(parent=None)

    def run(weights: Any, inputs: Any) -> Any:
        args, kwargs, rngs = inputs
        bound = template.bind({"params": weights, **others}, rngs={k: r.rng for k, r in rngs.items()})
        bound.scope.rngs = dict(rngs)
        bound.scope.rng_counters = _copy_counters(start)
        used.append(bound.scope.rng_counters)
        with opaque():
            return bound(*args, **kwargs)

    ops = context.blocks[module.path]
    chain = context.chain if module.path in context.prefetch else None
    out = gathered_call(ops, run, shards, sinks, (args, kwargs, lazy_rngs), context.remat, chain, module.path)
    scope.rng_counters.update(used[0])
    return out


@contextlib.contextmanager
def linen_blocks() -> Iterator[None]:
    """Route calls of the blocks named in the active `LayerContext` through `gathered_call`."""
    with nn.intercept_methods(_linen_block_call):
        yield
