"""The step program: everything one train step needs, fixed once from the model and how it is called.

`build_program(plan, model, optimizer, loss, key, example)` traces the model once (shapes only) and
returns a frozen `StepProgram`: the plan and its mesh, every parameter leaf (`core.leaf.Leaf`) with its
split (`ParamLayout`), the schedule of collectives, the optimizer and what its update communicates,
the user's loss (`LossSpec`) and the layers found. The step's pure functions (`amsp_jax.step.functions`)
read nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from amsp_jax.core.leaf import Leaf, Path
from amsp_jax.core.mesh import Layout, LeafLayout, leaf_layout
from amsp_jax.core.plan import Plan
from amsp_jax.core.schedule import Schedule, StepSettings
from amsp_jax.core.schedule import build as build_schedule
from amsp_jax.core.tensor import DEFAULT_TENSOR_RULES, Rules
from amsp_jax.cost import optimizer as optimizer_cost
from amsp_jax.cost.optimizer import OptimizerUpdate
from amsp_jax.errors import AmspError
from amsp_jax.layers.discovery import Example, ExampleError, Layers, find_layers
from amsp_jax.layers.tensor import TensorContext

LossFn = Callable[..., Any]


class TrainerError(AmspError):
    """A `Trainer` used in a way it cannot work: the message says what to do instead."""


def flatten(tree: Any) -> dict[Path, Any]:
    """A nested dict of leaves by path."""
    return traverse_util.flatten_dict(flax.core.unfreeze(tree))


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """The user's loss and how it is called: `fn(params, batch[, rng][, variables=...])` returning the
    mean loss of a micro-batch, with `(loss, metrics)` where `has_aux`, and the updated carried
    `collections` (e.g. `batch_stats`) where any are named."""

    fn: LossFn
    has_aux: bool = False
    rng_seed: int | None = None
    collections: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Every parameter leaf's split, keyed by its path (each `LeafLayout.leaf` is the one `Leaf`
    record); which subtrees are gathered one layer at a time.

    `stacks` are subtrees with a leading layer dimension (a `LayerStack`, or a block run by a scan);
    `blocks` are the modules whose calls the step wraps (blocks of models written without
    `LayerStack`: loops, lists, `nn.scan`, nnx), stacked or not. `split_largest`: the leaves the
    optimizer's update communicates on, split the largest way (`mesh.shard_dims`).
    """

    leaves: dict[Path, LeafLayout]
    stacks: tuple[Path, ...]
    treedef: Any
    blocks: tuple[Path, ...] = ()
    split_largest: frozenset[Path] = frozenset()

    def stack_of(self, path: Path) -> Path | None:
        """The stacked subtree holding `path` (its leaves have a layer dimension), if any."""
        return next((s for s in self.stacks if path[: len(s)] == s), None)

    def block_of(self, path: Path) -> Path | None:
        """The wrapped block holding `path`, if any."""
        return next((b for b in self.blocks if path[: len(b)] == b), None)

    def per_layer(self, path: Path) -> bool:
        """Whether the step gathers `path` one layer at a time (else once per step, kept)."""
        return self.leaves[path].leaf.gathered_per_layer

    @property
    def frozen(self) -> frozenset[Path]:
        """Leaves not trained (`Trainer(frozen=...)`)."""
        return frozenset(p for p, split in self.leaves.items() if split.leaf.frozen)

    @property
    def layer_stacks(self) -> tuple[Path, ...]:
        """The `LayerStack` subtrees (which run their own layer scan)."""
        return tuple(s for s in self.stacks if s not in self.blocks)

    def replicated(self) -> list[Path]:
        """Leaves that no dimension of could be split, so every component keeps them whole."""
        return [p for p, leaf in self.leaves.items() if leaf.dim is None]

    def padding(self) -> str | None:
        """The padded leaves in words (how many, the extra stored elements, the first names), or None."""
        padded = [p for p, leaf in self.leaves.items() if leaf.is_padded]
        if not padded:
            return None
        real = sum(math.prod(leaf.shape) for leaf in self.leaves.values())
        extra = sum(math.prod(self.leaves[p].padded) - math.prod(self.leaves[p].shape) for p in padded)
        names = ", ".join("/".join(map(str, p)) for p in padded[:4])
        more = f" (+{len(padded) - 4} more)" if len(padded) > 4 else ""
        return (
            f"{len(padded)} leaves have no dimension (or pair of dimensions) the group divides and are "
            f"stored padded to split evenly ({extra / real:.2%} more elements): {names}{more}"
        )

    def tree(self, fn: Callable[[Path, LeafLayout], Any]) -> Any:
        """A params-shaped tree of `fn(path, leaf)`."""
        return traverse_util.unflatten_dict({p: fn(p, leaf) for p, leaf in self.leaves.items()})


def param_layout(layout: Layout, layers: Layers, leaves: list[Leaf], update: OptimizerUpdate) -> ParamLayout:
    """Split every leaf for the layout; those the optimizer's update communicates on the largest way
    (they keep the split its rules were measured on)."""
    largest = frozenset(leaf.path for leaf in leaves if update.communicates_on(leaf.path))
    split = {leaf.path: leaf_layout(layout, leaf, leaf.path not in largest) for leaf in leaves}
    treedef = jax.tree.structure(layers.abstract_params)
    return ParamLayout(split, layers.stacked, treedef, tuple(layers.blocks), largest)


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """One train step, fixed: what `init_state`, `train_step` and `eval_loss` read."""

    plan: Plan
    layout: Layout
    params: ParamLayout
    schedule: Schedule
    optimizer: optax.GradientTransformation  # frozen leaves masked out (`without`)
    update: OptimizerUpdate  # what the optimizer's update communicates (`cost.optimizer.describe`)
    loss: LossSpec
    model: Any
    example: Example
    layers: Layers
    classes: tuple[type, ...] | None = None  # the block classes asked for (`Trainer(layers=...)`)
    collections: dict[str, Any] = dataclasses.field(default_factory=dict)  # carried, abstract
    tensor_rules: Rules = DEFAULT_TENSOR_RULES  # logical name -> tensor axis or None (`core.tensor`)

    def tensor_context(self) -> TensorContext | None:
        """What the model's tensor-parallel layers read while the step traces it (None: t = 1)."""
        if self.layout.tensor == 1:
            return None
        return TensorContext(
            self.layout.tensor, self.plan.sequence_parallel, self.tensor_rules, matmul=self.plan.tensor_matmul
        )


def without(optimizer: optax.GradientTransformation, frozen: Callable[[Path], bool]) -> Any:
    """`optimizer` on the trained leaves only: frozen ones get zero updates and keep no state."""

    def labels(params: Any) -> Any:
        def label(key_path: tuple[Any, ...], _: Any) -> str:
            path = tuple(getattr(k, "key", k) for k in key_path)
            return "frozen" if frozen(path) else "trained"

        return jax.tree_util.tree_map_with_path(label, params)

    return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, labels)


def build_program(
    plan: Plan, layout: Layout, model: Any, optimizer: optax.GradientTransformation, loss: LossSpec,
    key: jax.Array, example: Example, classes: tuple[type, ...] | None = None,
    frozen: Callable[[Path], bool] | None = None, tensor_rules: Rules = DEFAULT_TENSOR_RULES,
) -> StepProgram:  # fmt: skip
    """The step program of `model` called as `example` (shapes suffice) under `plan` on `layout`."""
    try:
        found = find_layers(model, key, example, classes)
    except ExampleError as error:
        raise TrainerError(str(error)) from None
    _check_params(found)
    if plan.keep_first_layer and plan.micro_batches > 1 and not found.stacks:
        raise TrainerError(
            "keep_first_layer keeps a LayerStack's first layer gathered across micro-batches, and "
            "this model has no LayerStack; build its layers with amsp_jax.LayerStack, or leave "
            "keep_first_layer off"
        )
    optimizer = optimizer if frozen is None else without(optimizer, frozen)
    update = optimizer_cost.describe(optimizer, found.abstract_params)
    leaves = found.leaves(frozen, tensor_rules)
    _check_tensor(layout, leaves)
    params = param_layout(layout, found, leaves, update)
    precision = plan.precision
    settings = StepSettings(
        plan.micro_batches, plan.remat, precision.param_bytes, precision.reduce_bytes, plan.implementation
    )
    schedule = build_schedule(layout, leaves, settings, params.split_largest)
    collections = _carried(model, key, example, found, loss.collections)
    return StepProgram(
        plan, layout, params, schedule, optimizer, update, loss, model, example, found, classes, collections,
        tensor_rules,
    )  # fmt: skip


def _check_tensor(layout: Layout, leaves: tuple[Leaf, ...]) -> None:
    """An error for a tensor degree over a model that names no dimension the tensor axis splits."""
    if layout.tensor > 1 and not any(leaf.tensor_dim is not None for leaf in leaves):
        raise TrainerError(
            f"t={layout.tensor} splits the weights that carry a tensor-split logical axis name, and this "
            "model's parameters carry none; annotate its kernels (linen nn.with_logical_partitioning, "
            "nnx nnx.with_partitioning) with e.g. ('embed', 'mlp'), or pass tensor_rules that map its names"
        )


def _check_params(found: Layers) -> None:
    """An error for a parameter the step cannot train (not floating point)."""
    for path, leaf in flatten(found.abstract_params).items():
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TrainerError(
                f"parameter {'/'.join(map(str, path))} is {leaf.dtype}: every parameter is trained "
                "from an fp32 master copy by its gradient; keep integer state out of the 'params' "
                "collection (e.g. in a flax variable of another collection, or a constant)"
            )


def _carried(
    model: Any, key: jax.Array, example: Example, found: Layers, names: tuple[str, ...]
) -> dict[str, Any]:
    """Shapes of the carried collections; an error when one is missing or lives in a gathered block."""
    if not names:
        return {}
    variables = jax.eval_shape(lambda k: example.init(model, k), key)
    missing = [c for c in names if c not in variables]
    if missing:
        raise TrainerError(
            f"the model's init makes no {', '.join(missing)} collection (it has: "
            f"{', '.join(sorted(variables))}); pass collections it has, e.g. collections=('batch_stats',)"
        )
    for name in names:
        for path in flatten(variables[name]):
            block = next((b for b in (*found.stacks, *found.blocks) if path[: len(b)] == b), None)
            if block is not None:
                raise TrainerError(
                    f"{name}/{'/'.join(map(str, path))} lives in {'/'.join(map(str, block))}, a block "
                    "gathered one layer at a time, which cannot update a collection; gather the whole "
                    "tree with Trainer(..., layers=())"
                )
    return {name: variables[name] for name in names}
