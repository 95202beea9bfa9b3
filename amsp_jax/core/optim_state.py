"""Placements for any optax state, derived from the state itself.

An optax state is a tree of NamedTuples, dicts and tuples whose array leaves mostly sit under a copy
of the parameter tree (`mu['layers']['w1']`, `v_row['embed']`, `inner_states['adam']...`). Each
state leaf is matched to its parameter by key path (the parameter's path appears as a run of dict
keys in the leaf's path), and then one rule places it:

- shaped like its parameter: the parameter's OS `PartitionSpec`;
- another shape (adafactor's factored moments, a reduced statistic): split along each of the
  parameter's split dimensions that survives in the leaf (same size, same order of the remaining
  dimensions), otherwise whole on every device;
- no parameter (step counters, injected hyper-parameters, Newton-Schulz coefficients): whole.

The state's structure comes from `jax.eval_shape(optimizer.init, abstract_params)`, so label and mask
functions (`multi_transform`, `masked`, Muon's partition) see the real parameter tree.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey

from amsp_jax.core.mesh import LeafLayout

Path = tuple[str, ...]


def abstract_state(optimizer: optax.GradientTransformation, abstract_params: Any) -> Any:
    """Shapes and dtypes of `optimizer.init(params)`, with label/mask functions seeing the real tree."""
    return jax.eval_shape(optimizer.init, abstract_params)


def param_of(key_path: tuple[Any, ...], params: Mapping[Path, Any]) -> Path | None:
    """The parameter path found in a state leaf's key path: the last, then longest, run of dict keys
    equal to a key of `params`; None for leaves that belong to no parameter (counters, scalars)."""
    keys = [k.key if isinstance(k, DictKey) else None for k in key_path]
    lengths = sorted({len(p) for p in params}, reverse=True)
    for end in range(len(keys), 0, -1):
        for length in lengths:
            start = end - length
            if start < 0:
                continue
            run = tuple(k for k in keys[start:end] if k is not None)
            if len(run) == length and run in params:
                return run
    return None


def surviving_dim(param_shape: tuple[int, ...], dim: int, shape: tuple[int, ...]) -> int | None:
    """The dimension of `shape` that is the parameter's dimension `dim`, or None if it did not survive.

    A leaf of another shape is read as the parameter with some dimensions reduced away: its
    dimensions map in order onto parameter dimensions of the same size. Of the ways that fit, the
    first that keeps `dim` is taken.
    """
    if tuple(shape) == tuple(param_shape):
        return dim
    if len(shape) > len(param_shape):
        return None
    for kept in itertools.combinations(range(len(param_shape)), len(shape)):
        if all(param_shape[p] == s for p, s in zip(kept, shape, strict=True)) and dim in kept:
            return kept.index(dim)
    return None


def leaf_spec(param: LeafLayout | None, shape: tuple[int, ...], component: str = "opt_state") -> P:
    """The rule: where a state leaf of `shape` belonging to `param` (or to none) is placed."""
    if param is None or (param.dim is None and param.tensor_dim is None):
        return P()
    spec = param.specs[component]
    entries: list[Any] = [None] * len(shape)
    for dim in (param.dim, param.minor_dim, param.tensor_dim):
        target = None if dim is None or spec[dim] is None else surviving_dim(param.padded, dim, shape)
        if target is not None and entries[target] is None:
            entries[target] = spec[dim]
    return P(*entries) if any(e is not None for e in entries) else P()


def state_specs(abstract: Any, leaves: Mapping[Path, LeafLayout], component: str = "opt_state") -> Any:
    """A tree like `abstract` (an optax state's shapes) of each leaf's `PartitionSpec`."""

    def spec(key_path: tuple[Any, ...], leaf: Any) -> P:
        path = param_of(key_path, leaves)
        return leaf_spec(None if path is None else leaves[path], tuple(leaf.shape), component)

    return jax.tree_util.tree_map_with_path(spec, abstract)


def state_shardings(
    optimizer: optax.GradientTransformation,
    abstract_params: Any,
    leaves: Mapping[Path, LeafLayout],
    mesh: Mesh,
) -> Any:
    """The `NamedSharding` of every leaf of `optimizer`'s state for parameters split as `leaves`."""
    specs = state_specs(abstract_state(optimizer, abstract_params), leaves)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def bytes_per_device(abstract: Any, shardings: Any) -> int:
    """Bytes one device holds of a state with shapes `abstract` placed by `shardings`."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True):
        block = sharding.shard_shape(tuple(leaf.shape))
        total += math.prod(block) * np.dtype(leaf.dtype).itemsize
    return total
