"""Which dimension of each parameter the tensor axis splits, from the model's logical axis names.

A model names its parameters' dimensions (Flax logical partitioning: linen
`nn.with_logical_partitioning`, nnx `nnx.with_partitioning`); rules map each name to the tensor axis
or to nothing. The defaults are MaxText's: `mlp`, `heads`, `q_heads`, `kv_heads` and `vocab` on the
tensor axis, `embed` and the rest whole on it (`embed` is what the data-parallel placements split).

Rules follow linen's semantics (`nn.logical_to_mesh_axes`): for each dimension the first rule naming
its logical axis wins, and a mesh axis splits at most one dimension of an array, so a later dimension
whose rule names an axis already used falls through to its next rule, else stays whole. (nnx's
`from_sharding_rules` builds a dict, so there the last duplicate would win; one semantics is kept.)

A kernel's role follows from which of its dimensions the tensor axis splits: an output dimension makes it
column-parallel (its input is whole on every tensor rank, its output split), a contracting one
row-parallel (input split, output a partial sum over the tensor ranks), the vocabulary dimension of an
embedding table vocabulary-parallel.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence

from amsp_jax.errors import AmspError

TENSOR = "tensor"
# How a tensor-parallel matmul meets its collective (`Plan.tensor_matmul`).
MATMUL_FORMS = ("gather", "ring", "cannon")
CANNON_DEGREE = 4  # the `cannon` form's 2 x 2 square (`layers.tensor_cannon`)
Rules = tuple[tuple[str, str | None], ...]
# MaxText's logical names on its `tensor` axis (its base config's `logical_axis_rules`).
DEFAULT_TENSOR_RULES: Rules = (
    ("mlp", TENSOR),
    ("heads", TENSOR),
    ("q_heads", TENSOR),
    ("kv_heads", TENSOR),
    ("vocab", TENSOR),
)


class TensorRuleError(AmspError):
    """Tensor-parallel rules that cannot apply to a model: the message names the leaf and the fix."""


class Role(enum.Enum):
    """How a tensor-parallel leaf takes part in its matmul."""

    COLUMN = "column"  # an output dimension split: whole input, split output
    ROW = "row"  # a contracting dimension split: split input, partial-sum output
    VOCAB = "vocab"  # an embedding table's rows split: each rank looks up its own tokens
    WHOLE = "whole"  # not split on the tensor axis (norms, biases of row-parallel kernels, ...)


def normalize_rules(rules: Iterable[Sequence[object]]) -> Rules:
    """`rules` as (logical name, `"tensor"` or None) pairs; a TensorRuleError for anything else."""
    normalized = []
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise TensorRuleError(
                f"tensor rule {rule!r} is not a (logical name, mesh axis) pair; write e.g. ('mlp', 'tensor')"
            )
        name, axis = str(rule[0]), rule[1]
        if axis is not None and axis != TENSOR:
            raise TensorRuleError(
                f"tensor rule {rule!r} maps {name!r} to {axis!r}; map logical names to {TENSOR!r} or None "
                "(the data-parallel axes are the planner's)"
            )
        normalized.append((name, axis))
    return tuple(normalized)


def tensor_dim(names: Sequence[str | None], rules: Rules = DEFAULT_TENSOR_RULES) -> int | None:
    """The dimension the tensor axis splits for an array with logical `names` (one per dimension), by
    first-match rules with each mesh axis used at most once; None when no dimension maps to it."""
    used: set[str] = set()
    found = None
    for dim, name in enumerate(names):
        if name is None:
            continue
        for rule_name, axis in rules:
            if rule_name != name:
                continue
            if axis is None:
                break  # the first matching rule keeps this dimension whole
            if axis in used:
                continue
            used.add(axis)
            found = dim if found is None else found
            break
    return found


def resolve(
    named: Mapping[tuple[str, ...], Sequence[str | None]], rules: Rules = DEFAULT_TENSOR_RULES
) -> dict[tuple[str, ...], int | None]:
    """The tensor-split dimension of every named leaf (path → its logical names)."""
    return {path: tensor_dim(names, rules) for path, names in named.items()}
