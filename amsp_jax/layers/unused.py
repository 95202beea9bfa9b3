"""Which parameters a block's backward pass never reads, from the shapes of one call.

A bias added just before a residual sum is one: its gradient is the output's, and nothing downstream
multiplies by it. XLA drops the backward re-gather of such a weight as dead code, so the schedule must
not count it. `abstract_call` keeps a call as shapes (with a key equal for calls whose backward
programs are the same), and `AbstractCall.backward_unused` reads the answer off the backward program's
dependencies; nothing runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

Path = tuple[str, ...]


def split_static(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The arrays of `tree` (differentiable or not) and how to put them back among its static leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    dynamic = [isinstance(x, jax.Array | np.ndarray) for x in leaves]

    def rebuild(arrays: list[Any]) -> Any:
        it = iter(arrays)
        return treedef.unflatten([next(it) if d else x for x, d in zip(leaves, dynamic, strict=True)])

    return [x for x, d in zip(leaves, dynamic, strict=True) if d], rebuild


def _live_inputs(jaxpr: jax_core.Jaxpr) -> list[bool]:
    """Which inputs of `jaxpr` its outputs depend on (an equation with effects counts as an output;
    one with a sub-program reads all its inputs)."""
    live = {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if isinstance(v, jax_core.Var))
    return [v in live for v in jaxpr.invars]


def backward_unused(run: Callable[[Any, Any], Any], weights: Any, inputs: Any) -> frozenset[Path]:
    """Paths of `weights` whose values the backward pass of `run(weights, inputs)` never reads.

    A bias added just before a residual sum is one: its gradient is the output's, and nothing
    downstream multiplies by it. XLA drops the backward re-gather of such a weight as dead code, so
    the schedule must not count it. Read off the backward program's dependencies (abstract shapes
    only; nothing runs).
    """
    return abstract_call(run, weights, inputs).backward_unused()


@dataclasses.dataclass(frozen=True)
class AbstractCall:
    """A call `run(weights, inputs)` kept as shapes: what `backward_unused` traces, and a key equal for
    calls whose backward programs are the same (one module class and configuration, the same weight
    and input shapes and the same static inputs), or None where an input cannot be compared."""

    run: Callable[[Any, Any], Any]
    weights: Any
    arrays: list[Any]
    rebuild: Callable[[list[Any]], Any]
    key: Any

    def backward_unused(self) -> frozenset[Path]:
        """See `backward_unused`."""

        def apply(weights: Any, arrays: list[Any]) -> Any:
            return self.run(weights, self.rebuild(arrays))

        try:
            out = jax.eval_shape(apply, self.weights, self.arrays)
            if not all(jnp.issubdtype(o.dtype, jnp.floating) for o in jax.tree.leaves(out)):
                return frozenset()
            backward = lambda w, a, cot: jax.vjp(apply, w, a)[1](cot)  # noqa: E731
            jaxpr = jax.make_jaxpr(backward)(self.weights, self.arrays, out).jaxpr
        except Exception:  # a block that needs what an abstract trace lacks (an RNG stream): count all
            return frozenset()
        paths = list(_shapes(self.weights))  # in flattening order, as the program's inputs
        live = _live_inputs(jaxpr)
        return frozenset(p for p, used in zip(paths, live, strict=False) if not used)


def abstract_call(
    run: Callable[[Any, Any], Any], weights: Any, inputs: Any, config: Any = None
) -> AbstractCall:
    """`run(weights, inputs)` as shapes (tracers of an enclosing trace are not kept); `config`: what
    else decides the program (a linen module without its name), part of the key; without it no key."""
    arrays, rebuild = split_static(inputs)
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)  # noqa: E731
    weights, arrays = abstract(weights), abstract(arrays)
    static = [x for x in jax.tree.leaves(inputs) if not isinstance(x, jax.Array | np.ndarray)]
    key: Any = (
        config,
        jax.tree.structure(inputs),
        tuple((a.shape, a.dtype) for a in arrays),
        tuple(static),
        tuple(_shapes(weights).items()),
        tuple(str(w.dtype) for w in jax.tree.leaves(weights)),
    )
    try:
        hash(key)
    except TypeError:
        key = None
    return AbstractCall(run, weights, arrays, rebuild, None if config is None else key)


def _shapes(tree: Any) -> dict[Path, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(str(getattr(k, "key", k)) for k in keys): tuple(np.shape(v)) for keys, v in flat}
