"""What the optimizer's update moves: the collectives XLA inserts when optax runs on OS-sharded leaves.

The step runs the optax update under jit on the OS-sharded fp32 master weights, outside shard_map, so
GSPMD partitions it. Element-wise optimizers (Adam, Lion, SGD, `multi_transform` of them) need no
communication; an update that reduces over the split dimension or multiplies whole matrices makes
XLA insert collectives, once per step, flat over their groups, in fp32. The rules below were read
off compiled HLO; `amsp_jax.compiled.audit` checks them against every compiled step. For a leaf of shape S
split along dimension d over an OS group of k devices, replicated R times (R·k devices in all):

Adafactor (`FactoredState`: second moments factored over the two largest dimensions, d0 the largest
and d1 the other):
  - d = d0: the row statistic (mean over d0) is summed over the group: all-reduce of |S|/S[d0];
  - d = d1: the column statistic: all-reduce of |S|/S[d1]; then the mean of the row statistic over
    d1: all-reduce of |S|/(S[d0]·S[d1]) elements (a scalar, not counted, when that is one element);
  - a statistic that lost d but that the state's placement (`amsp_jax.core.optim_state`) splits anyway (equal
    sizes make its shape ambiguous) is all-gathered where it is used: |S|/S[d]/k elements per device;
  - another d: nothing (the means run over whole dimensions).

Muon (`MuonState`, frobenius preconditioning): the momentum is reshaped to X = (batch b, reduction
r, output o) by the leaf's `MuonDimensionNumbers` (a 2-D leaf: reduction 0, output 1), transposed
to rows m ≤ columns n when r > o, divided by its Frobenius norm and put through `steps` Newton–Schulz
iterations A = X·Xᵀ, B = βA + γA·A, X = αX + B·X. Where d lands decides the collectives:
  - d is the first dimension of the batch group: nothing (each device orthogonalises its matrices);
  - d is in a group but not its first dimension: the reshape loses the split, so the whole leaf is
    all-gathered once and the rest runs whole on every device;
  - d is in the columns (contracted by X·Xᵀ): every iteration all-reduces the partial A (b·m²
    elements), and the norm all-reduces b per-matrix sums;
  - d is in the rows, the OS group replicated fewer times than it has devices (R < k, ZeRO-3 and
    any OS over all devices among them): every iteration all-gathers X twice and A once over the
    group (blocks of b·m·n/k and b·m²/k elements per device), and the norm all-reduces b sums;
  - d is in the rows and R ≥ k (e.g. LLaMA-7B's square projections with OS on one node of 128):
    GSPMD also splits each iteration over the R replicas: it sends X twice and A once to another
    device (collective-permutes of b·m·n/R and b·m²/R elements), all-gathers X over the replicas
    (blocks of b·m·n/R) and sums partial products there (all-reduces of b·m²/k and b·m·n/k); the norm
    all-reduces b sums over the group.
The norm of a single matrix (b = 1) is one sum, a scalar reduction like the loss's: not counted.
`benchmarks/optimizer_update.py` checks these rules against the compiled update of every leaf.

The rules read an optimizer's state and, for Muon, its `scale_by_muon` settings (`describe`), so a
`Trainer`'s own optax transformation says what its update moves; the planner describes a named
optimizer the same way (`for_kind`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.tree_util import DictKey
from optax._src.factorized import FactoredState, _factored_dims
from optax.contrib import MuonDimensionNumbers, MuonState

from amsp_jax.core import optim_state
from amsp_jax.core.mesh import AxisPlan, LeafLayout
from amsp_jax.core.schedule import COLLECTIVE_PERMUTE, UPDATE, Op, _Builder

Path = tuple[str, ...]
FP32 = 4
KINDS = ("adam", "adafactor", "muon")


@dataclasses.dataclass(frozen=True)
class MuonLeaf:
    """How Muon reads one leaf: its batch, reduction and output dimensions, and the iterations."""

    batch: tuple[int, ...]
    reduction: tuple[int, ...]
    output: tuple[int, ...]
    steps: int = 5


@dataclasses.dataclass(frozen=True)
class OptimizerUpdate:
    """The parts of an optimizer's update that communicate on sharded leaves, by parameter path.

    `muon`: leaves orthogonalised by Newton–Schulz; `factored`: leaves with Adafactor's factored
    second moments and their (d1, d0) dimensions; `unpriced`: parts of the update whose collectives
    the rules do not know (they are then not counted, and the audit will say so by differing).
    The default is an element-wise optimizer: no collectives.
    """

    name: str = "element-wise"
    muon: tuple[tuple[Path, MuonLeaf], ...] = ()
    factored: tuple[tuple[Path, tuple[int, int]], ...] = ()
    unpriced: tuple[str, ...] = ()

    @functools.cached_property
    def muon_leaves(self) -> dict[Path, MuonLeaf]:
        """`muon` as a dict."""
        return dict(self.muon)

    @functools.cached_property
    def factored_leaves(self) -> dict[Path, tuple[int, int]]:
        """`factored` as a dict."""
        return dict(self.factored)

    def communicates_on(self, path: Path) -> bool:
        """Whether the update's collectives on this leaf depend on how it is split."""
        return path in self.muon_leaves or path in self.factored_leaves


ELEMENT_WISE = OptimizerUpdate()


# ---- the rules ----------------------------------------------------------------------------------


def update_ops(
    axes: AxisPlan, path: Sequence[str], split: LeafLayout, optimizer: OptimizerUpdate
) -> list[Op]:
    """The collectives the optimizer's update of one leaf (split as `split`) adds, once per step."""
    path = tuple(path)
    group_axes = axes.axes("opt_state")
    # A leaf split over two dimensions (`sharding.shard_dims`: where one dimension does not divide at
    # thousands of devices) is outside the rules below, which were read for one split dimension: its
    # update's collectives are not modelled (the audit would show them).
    if split.dim is None or split.minor_dim is not None or axes.size(group_axes) == 1:
        return []
    build = _Builder(axes, hierarchical=False)  # GSPMD issues one collective over the whole group
    ops: list[Op] = []
    if path in optimizer.factored_leaves:
        ops += _adafactor_ops(build, group_axes, split, optimizer.factored_leaves[path])
    if path in optimizer.muon_leaves:
        ops += _muon_ops(build, group_axes, split, optimizer.muon_leaves[path])
    return ops


def _adafactor_ops(
    build: _Builder, group_axes: tuple[str, ...], split: LeafLayout, dims: tuple[int, int]
) -> list[Op]:
    shape, d = split.rank_padded, split.dim  # the update runs on the stored (padded) leaf
    d1, d0 = dims
    if d not in (d0, d1):
        return []
    size = math.prod(shape)
    k = build.axes.size(group_axes)
    lost = size // shape[d]  # the statistic that averaged over d: summed over the group
    ops = build.all_reduce(UPDATE, group_axes, lost, FP32, 1)
    if d == d1:
        left = size // (shape[d0] * shape[d1])
        if left > 1:  # the mean of the row statistic over d1; with one element left, a scalar
            ops += build.all_reduce(UPDATE, group_axes, left, FP32, 1)
    reduced_shape = tuple(s for i, s in enumerate(shape) if i != d)
    if optim_state.leaf_spec(split, reduced_shape) != jax.sharding.PartitionSpec():
        # Stored split although it lost d (sizes repeat): gathered again where the update reads it.
        ops += build.all_gather(UPDATE, group_axes, 0, lost // k, FP32, 1)
    return ops


def _muon_ops(build: _Builder, group_axes: tuple[str, ...], split: LeafLayout, leaf: MuonLeaf) -> list[Op]:
    shape, d = split.rank_padded, split.dim  # the update runs on the stored (padded) leaf
    k = build.axes.size(group_axes)
    size = math.prod(shape)
    b = math.prod(shape[i] for i in leaf.batch)
    r = math.prod(shape[i] for i in leaf.reduction)
    o = math.prod(shape[i] for i in leaf.output)
    groups = {"batch": leaf.batch, "reduction": leaf.reduction, "output": leaf.output}
    where = next(name for name, dims in groups.items() if d in dims)
    dims = groups[where]
    # The reshape keeps the split only on the first dimension of a merged group (size-1 ones aside).
    if any(shape[i] > 1 for i in dims[: dims.index(d)]):
        return build.all_gather(UPDATE, group_axes, d, size // k, FP32, 1)
    if where == "batch":
        return []
    m, n = min(r, o), max(r, o)
    rows = "output" if r > o else "reduction"
    # One matrix's norm (b = 1) is one sum: a scalar reduction, left out like the loss's.
    norm = build.all_reduce(UPDATE, group_axes, b, FP32, 1) if b > 1 else []
    steps = leaf.steps
    if where != rows:  # the contracted dimension: partial products of A summed
        return norm + build.all_reduce(UPDATE, group_axes, b * m * m, FP32, steps)
    x, a = b * m * n, b * m * m
    replicas = tuple(ax for ax in build.axes.data_axes if ax not in group_axes)
    copies = build.axes.size(replicas)
    if copies < k:
        return (
            norm
            + build.all_gather(UPDATE, group_axes, 1, x // k, FP32, 2 * steps)
            + build.all_gather(UPDATE, group_axes, 1, a // k, FP32, steps)
        )
    # As many replicas of the OS group as it has devices, or more: GSPMD also splits each iteration's
    # products over the replicas. Every iteration exchanges blocks between the group and its replicas
    # (three point-to-point sends), gathers X over the replicas and sums partial A and B·X there.
    every = build.axes.data_axes
    inter = any(build.axes.is_inter(ax) for ax in every)
    send = functools.partial(
        Op, UPDATE, COLLECTIVE_PERMUTE, every, 2, 2 if inter else 1, "inter" if inter else "intra", None
    )
    return [
        *norm,
        send(x // copies, FP32, 2 * steps),
        send(a // copies, FP32, steps),
        *build.all_gather(UPDATE, replicas, 1, x // copies, FP32, steps),
        *build.all_reduce(UPDATE, replicas, a // k, FP32, steps),
        *build.all_reduce(UPDATE, replicas, x // k, FP32, steps),
    ]


# ---- reading an optax transformation ------------------------------------------------------------


def describe(optimizer: optax.GradientTransformation, abstract_params: Any) -> OptimizerUpdate:
    """What `optimizer`'s update communicates, read from its state for `abstract_params` (shapes suffice).

    Factored Adafactor moments are found by their `FactoredState`; Muon by its `MuonState`, with the
    dimension numbers, iterations and preconditioning of the `scale_by_muon` inside `optimizer`.
    """
    params = _param_shapes(abstract_params)
    state = optim_state.abstract_state(optimizer, abstract_params)
    found = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, (FactoredState, MuonState))
    )[0]
    muon_settings = list(_muon_settings(optimizer))
    muon: dict[Path, MuonLeaf] = {}
    factored: dict[Path, tuple[int, int]] = {}
    unpriced: list[str] = []
    names: list[str] = []
    for _, node in found:
        if isinstance(node, FactoredState):
            names.append("adafactor")
            factored.update(_factored(node, params))
        elif isinstance(node, MuonState):
            names.append("muon")
            settings = muon_settings.pop(0) if muon_settings else {}
            leaves, notes = _muon(node, params, settings)
            muon.update(leaves)
            unpriced += notes
    name = "+".join(dict.fromkeys(names)) or ELEMENT_WISE.name
    return OptimizerUpdate(
        name, tuple(sorted(muon.items())), tuple(sorted(factored.items())), tuple(unpriced)
    )


def for_kind(
    kind: str, leaves: Mapping[Path, tuple[int, ...]], muon_dimensions: Callable | None = None
) -> OptimizerUpdate:
    """The update of a named optimizer (`adam`, `adafactor` with optax's defaults, or `muon`) on
    parameters of the given shapes; `muon_dimensions` is Muon's `muon_weight_dimension_numbers`."""
    if kind not in KINDS:
        raise ValueError(f"unknown optimizer {kind!r}; use one of {KINDS}")
    if kind == "adam":
        return ELEMENT_WISE
    tree: dict[str, Any] = {}
    for path, shape in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jax.ShapeDtypeStruct(tuple(shape), np.float32)
    if kind == "adafactor":
        return describe(optax.adafactor(1e-3), tree)
    return describe(optax.contrib.muon(1e-3, muon_weight_dimension_numbers=muon_dimensions), tree)


def _param_shapes(abstract_params: Any) -> dict[Path, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    return {_path(key_path): tuple(leaf.shape) for key_path, leaf in flat}


def _path(key_path: Sequence[Any]) -> Path:
    return tuple(k.key if isinstance(k, DictKey) else getattr(k, "idx", k) for k in key_path)


def _leaves_of(tree: Any, params: Mapping[Path, tuple[int, ...]]) -> Iterator[tuple[Path, Any]]:
    """(parameter path, leaf) of a state sub-tree that mirrors the parameters."""
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path = optim_state.param_of(key_path, params)
        if path is not None:
            yield path, leaf


def _factored(node: FactoredState, params: Mapping[Path, tuple[int, ...]]) -> dict[Path, tuple[int, int]]:
    """Leaves whose second moment is factored (their unfactored `v` is a (1,) placeholder)."""
    out = {}
    for path, v in _leaves_of(node.v, params):
        shape = params[path]
        if len(shape) >= 2 and tuple(v.shape) == (1,):
            dims = _factored_dims(shape, True, 0)  # optax's own choice of the two dimensions
            assert dims is not None
            out[path] = dims
    return out


def _muon_settings(optimizer: Any) -> Iterator[dict[str, Any]]:
    """The closure variables of every `scale_by_muon` update inside `optimizer`, in nesting order."""
    for fn in _functions(optimizer, set()):
        if fn.__qualname__.endswith("scale_by_muon.<locals>.update_fn"):
            cells = [c.cell_contents for c in fn.__closure__ or ()]
            yield dict(zip(fn.__code__.co_freevars, cells, strict=True))


def _functions(obj: Any, seen: set[int]) -> Iterator[Any]:
    """Every Python function reachable from `obj` through closures, containers and partials."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if inspect.ismethod(obj):
        yield from _functions(obj.__func__, seen)
        yield from _functions(obj.__self__, seen)
    elif isinstance(obj, functools.partial):
        yield from _functions(obj.func, seen)
        for x in (*obj.args, *obj.keywords.values()):
            yield from _functions(x, seen)
    elif callable(obj) and hasattr(obj, "__code__"):
        yield obj
        for cell in obj.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from _functions(contents, seen)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _functions(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _functions(x, seen)
    elif hasattr(obj, "init") and hasattr(obj, "update") and hasattr(obj, "__dict__"):
        yield from _functions(vars(obj), seen)  # a transformation object (optax.MultiSteps): its inner one


def _muon(
    node: MuonState, params: Mapping[Path, tuple[int, ...]], settings: Mapping[str, Any]
) -> tuple[dict[Path, MuonLeaf], list[str]]:
    """Muon's leaves (those with momentum in this state) and how it reshapes each."""
    notes = []
    if not settings:
        notes.append("Muon's settings (no scale_by_muon found in the transformation; 2-D rule assumed)")
    preconditioning = settings.get("preconditioning", "frobenius")
    if preconditioning != "frobenius":
        notes.append(f"Muon's {preconditioning!r} preconditioning")
    coeffs = node.ns_coeffs
    steps = coeffs.shape[0] if len(coeffs.shape) == 2 else int(settings.get("ns_steps", 5))
    numbers = settings.get("weight_dimension_numbers")
    resolved = numbers(node.mu) if callable(numbers) else numbers
    out: dict[Path, MuonLeaf] = {}

    def record(key_path: tuple[Any, ...], _: Any, dn: MuonDimensionNumbers | None) -> None:
        path = optim_state.param_of(key_path, params)
        if path is not None:  # None: the 2-D rule (reduction 0, output 1)
            out[path] = _muon_leaf(params[path], dn or MuonDimensionNumbers(0, 1), steps)

    if resolved is None:
        for path, _ in _leaves_of(node.mu, params):
            out[path] = _muon_leaf(params[path], MuonDimensionNumbers(0, 1), steps)
    else:
        jax.tree_util.tree_map_with_path(
            record, node.mu, resolved, is_leaf=lambda x: isinstance(x, MuonDimensionNumbers)
        )
    return out, notes


def _muon_leaf(shape: tuple[int, ...], dn: MuonDimensionNumbers, steps: int) -> MuonLeaf:
    def axes(a: int | Sequence[int]) -> tuple[int, ...]:
        return tuple(x % len(shape) for x in ((a,) if isinstance(a, int) else a))

    reduction, output = axes(dn.reduction_axis), axes(dn.output_axis)
    batch = tuple(i for i in range(len(shape)) if i not in reduction + output)
    return MuonLeaf(batch, reduction, output, steps)
