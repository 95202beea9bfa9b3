"""One parameter leaf as every part of the library sees it: the step, the schedule, the cost model and
the audit all read this one record (`Leaf`); how it is split (`mesh.LeafLayout`) and the ops it takes
part in (`schedule.LeafSchedule`) are derived from it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter leaf: its path, full shape, whether it is a layer stack (leading layer axis), and
    how the step gathers, reduces and updates it."""

    path: Path
    shape: tuple[int, ...]
    stacked: bool
    per_layer: bool | None = None  # gathered one layer at a time; None: when stacked
    regathered: bool = True  # gathered again in the backward pass (False: the backward never reads it)
    frozen: bool = False  # not trained: no gradient, no optimizer state, never refreshed
    unit: Path | None = None  # the stack or block a per-layer leaf is gathered with
    layer_stack: bool = False  # a `LayerStack`'s (its own layer loop; may keep its first layer)
    looked_up: bool = False  # only indexed (an untied input embedding): the step runs no matmul with it
    tensor_dim: int | None = None  # the dimension the tensor axis splits (from its logical names), if any

    def local_shape(self, tensor: int) -> tuple[int, ...]:
        """The shape one tensor rank holds under tensor degree `tensor` (the whole leaf at 1)."""
        if tensor == 1 or self.tensor_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.tensor_dim] //= tensor
        return tuple(shape)

    @property
    def size(self) -> int:
        """Elements of the whole leaf."""
        return math.prod(self.shape)

    @property
    def layers(self) -> int:
        """Layers of a stacked leaf (1 otherwise)."""
        return self.shape[0] if self.stacked else 1

    @property
    def gathered_per_layer(self) -> bool:
        """Whether the step gathers this leaf one layer at a time (else once per step, kept)."""
        return self.stacked if self.per_layer is None else self.per_layer

    @property
    def layer_group(self) -> Path | None:
        """What the step gathers this leaf with, one layer at a time: its stack or block (alone where
        none is named); None for a leaf gathered once per step."""
        return (self.unit or self.path) if self.gathered_per_layer else None

    @property
    def name(self) -> str:
        """The path as `a/b/c`."""
        return "/".join(map(str, self.path))


def looped_blocks(leaves: Iterable[Leaf]) -> bool:
    """Whether a model's layers are blocks called one by one (gathered per layer, not stacked)."""
    return any(leaf.per_layer and not leaf.stacked for leaf in leaves)
