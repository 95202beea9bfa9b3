"""Which layers of a model to gather one at a time, found from one abstract call made the way its
user calls it (`Example`: positional and keyword inputs, as linen's `init(key, *args, **kwargs)`).

`find_layers` traces `model.init` once (shapes only) and records every module call: `LayerStack`s
name themselves, and `find_blocks` picks the blocks among the calls (run by a scan, or sibling
instances of one class); `looked_up_leaves` reads which leaves the forward only indexes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.extend.core as jax_core
from flax import traverse_util

from amsp_jax.core.leaf import Leaf
from amsp_jax.core.tensor import DEFAULT_TENSOR_RULES, Rules, tensor_dim
from amsp_jax.errors import AmspError
from amsp_jax.layers.stack import (
    LayerStack,
    Path,
    _is_lifted,
    is_opaque,
    opaque,
    recording_stacks,
    stack_unused_recorder,
)
from amsp_jax.layers.unused import AbstractCall, _shapes, abstract_call, split_static


@dataclasses.dataclass(frozen=True)
class Example:
    """How the model is called: its positional and keyword inputs (arrays or shapes), as the user's
    loss calls `model.apply(variables, *args, **kwargs)`."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def call(self, fn: Callable[..., Any], *leading: Any) -> Any:
        """`fn(*leading, *args, **kwargs)`."""
        return fn(*leading, *self.args, **self.kwargs)

    def init(self, model: Any, key: jax.Array) -> Any:
        """`model.init(key, *args, **kwargs)` with partitioning metadata (logical axis names) removed:
        the step, the optimizer and checkpoints hold plain arrays."""
        return nn.meta.unbox(self.call(model.init, key))

    def describe(self) -> str:
        """The inputs in words: shapes and dtypes, keywords by name."""

        def shape(x: Any) -> str:
            return f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"

        parts = [jax.tree.map(shape, a) for a in self.args]
        parts += [f"{k}={jax.tree.map(shape, v)}" for k, v in self.kwargs.items()]
        return ", ".join(map(str, parts)) or "no inputs"


def as_example(example: Example | tuple[Any, ...]) -> Example:
    """`example` as an `Example` (a tuple is positional inputs only)."""
    return example if isinstance(example, Example) else Example(tuple(example))


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """One call of a module seen while tracing `init`: its path, class and per-call parameter shapes,
    its first input's shape, and the call as shapes, from which the parameters its backward pass does
    not read are found when asked (`backward_unused`)."""

    path: Path
    cls: type
    shapes: dict[Path, tuple[int, ...]]
    call: AbstractCall | None = None
    input_shape: tuple[int, ...] | None = None
    # Per recording: the answer for calls with equal keys (a loop's blocks, their inner modules).
    known: dict[Any, frozenset[Path]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def backward_unused(self) -> frozenset[Path]:
        """The parameters (per-call paths) the call's backward pass does not read; traced only for the
        calls that become blocks, once per distinct key: a model's 24 equal blocks are traced once."""
        if self.call is None:
            return frozenset()
        key = self.call.key
        if key is None:
            return self.call.backward_unused()
        if key not in self.known:
            self.known[key] = self.call.backward_unused()
        return self.known[key]


def first_shape(inputs: Any) -> tuple[int, ...] | None:
    """The shape of the first array among `inputs` (a block's activation), if any."""
    arrays = [x for x in jax.tree.leaves(inputs) if hasattr(x, "shape")]
    return tuple(arrays[0].shape) if arrays else None


_LOOKUPS = frozenset({"gather", "dynamic_slice"})
_PASS_THROUGH = frozenset({"convert_element_type", "copy", "copy_p", "reshape", "squeeze", "expand_dims"})


def _dependents(jaxpr: jax_core.Jaxpr, seeds: set[Any]) -> set[Any]:
    """The variables of `jaxpr` computed from `seeds` (the model's inputs)."""
    found = set(seeds)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jax_core.Var) and v in found for v in eqn.invars):
            found.update(eqn.outvars)
    return found


def _inner(eqn: Any) -> jax_core.Jaxpr | None:
    """The sub-program of a call (jit, custom_vjp, checkpoint) whose inputs line up with the call's."""
    for key in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(key)
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jax_core.Jaxpr) and len(sub.invars) == len(eqn.invars):
            return sub
    return None


def _uses(jaxpr: jax_core.Jaxpr, var: Any, data: set[Any]) -> set[str]:
    """How `var` is consumed in `jaxpr`: "lookup" where a gather or slice picks rows of it at positions
    computed from the model's inputs (`data`: the variables that are), "other" for anything else;
    followed through casts, reshapes and the sub-programs of calls."""
    data = _dependents(jaxpr, data)
    found: set[str] = set()
    for eqn in jaxpr.eqns:
        positions = [i for i, v in enumerate(eqn.invars) if v is var]
        if not positions:
            continue
        inner = _inner(eqn)
        by_data = any(isinstance(v, jax_core.Var) and v in data for v in eqn.invars[1:])
        if eqn.primitive.name in _LOOKUPS and positions == [0] and by_data:
            found.add("lookup")
        elif eqn.primitive.name in _PASS_THROUGH:
            for out in eqn.outvars:
                found |= _uses(jaxpr, out, data)
        elif inner is not None:
            pairs = zip(eqn.invars, inner.invars, strict=True)
            inner_data = {w for v, w in pairs if isinstance(v, jax_core.Var) and v in data}
            for i in positions:
                found |= _uses(inner, inner.invars[i], inner_data)
        else:
            found.add("other")
    return found


def looked_up_leaves(model: Any, abstract_params: Any, example: Example | tuple[Any, ...]) -> frozenset[Path]:
    """Paths of the parameters the forward pass only looks up (an untied input embedding): rows picked
    at the inputs' positions, never multiplied, so their FLOPs are not a matmul's. A weight indexed at
    fixed positions (a layer of a stack picked in a loop) is not one. Read off the forward program
    (abstract shapes only)."""
    example = as_example(example)
    arrays, rebuild = split_static((example.args, example.kwargs))

    def forward(params: Any, arrays: list[Any]) -> Any:
        args, kwargs = rebuild(arrays)
        return model.apply({"params": params}, *args, **kwargs)

    try:
        closed = jax.make_jaxpr(forward)(abstract_params, arrays)
    except Exception:  # a forward that needs what an abstract trace lacks (an RNG stream): none
        return frozenset()
    paths = list(_shapes(abstract_params))  # in flattening order, as the program's inputs
    invars = closed.jaxpr.invars
    data = set(invars[len(paths) :])
    return frozenset(
        path for path, var in zip(paths, invars, strict=False) if _uses(closed.jaxpr, var, data) == {"lookup"}
    )


@contextlib.contextmanager
def recording_calls(stack_unused: dict[Path, frozenset] | None = None) -> Iterator[list[BlockCall]]:
    """Collect every linen module call traced inside (for `find_blocks`), and into `stack_unused` each
    LayerStack's layer parameters that its backward pass does not read."""
    calls: list[BlockCall] = []
    stack_unused = {} if stack_unused is None else stack_unused
    known: dict[Any, frozenset[Path]] = {}

    def record(next_fun: Callable[..., Any], args: Any, kwargs: Any, info: Any) -> Any:
        out = next_fun(*args, **kwargs)
        module = info.module
        if (
            not is_opaque()
            and info.method_name == "__call__"
            and module.path
            and not _is_lifted(type(module))
            and not isinstance(module, LayerStack)
        ):
            params = nn.meta.unbox(module.variables.get("params", {}))
            template = module.clone(parent=None)

            def run(weights: Any, inputs: Any, template: nn.Module = template) -> Any:
                with opaque():
                    return template.apply({"params": weights}, *inputs[0], **inputs[1])

            call = abstract_call(run, params, (args, kwargs), template.clone(name=None)) if params else None
            shape = first_shape(args)
            calls.append(BlockCall(tuple(module.path), type(module), _shapes(params), call, shape, known))
        return out

    with stack_unused_recorder(stack_unused), nn.intercept_methods(record):
        yield calls


@dataclasses.dataclass(frozen=True)
class Found:
    """A block to gather one call at a time."""

    stacked: bool  # its parameters carry a leading layer dimension (run by a scan)
    backward_unused: frozenset[Path] = frozenset()  # relative paths the backward does not read
    input_shape: tuple[int, ...] | None = None  # of its first input (the activation), at one call


def find_blocks(
    calls: list[BlockCall],
    stored: dict[Path, tuple[int, ...]],
    classes: tuple[type, ...] | None = None,
    exclude: tuple[Path, ...] = (),
) -> dict[Path, Found]:
    """The blocks to gather one at a time, by module path.

    `stored` maps every parameter path to its shape. With `classes`, every outermost call of those
    classes is a block; otherwise a block is an outermost module either run by a scan (its stored
    parameters carry a layer dimension its calls do not see) or one of several sibling instances of
    one class with equal parameter shapes (a loop or list of blocks). `exclude`: paths handled
    otherwise (LayerStack stacks).
    """

    def stored_under(path: Path) -> dict[Path, tuple[int, ...]]:
        return {p[len(path) :]: s for p, s in stored.items() if p[: len(path)] == path}

    def stacked(call: BlockCall) -> bool:
        full = stored_under(call.path)
        return (
            bool(call.shapes)
            and full.keys() == call.shapes.keys()
            and all(len(full[k]) == len(s) + 1 and full[k][1:] == s for k, s in call.shapes.items())
            and len({full[k][0] for k in full}) == 1
        )

    found: dict[Path, Found] = {}
    siblings: dict[tuple[Path, type, tuple[Any, ...]], dict[Path, Found]] = {}
    for call in calls:
        if not call.shapes or any(call.path[: len(e)] == e for e in exclude) or call.path in found:
            continue
        block = Found(stacked(call), call.backward_unused, call.input_shape)
        if classes is not None:
            if call.cls in classes:
                found[call.path] = block
        elif block.stacked:
            found[call.path] = block
        else:
            key = (call.path[:-1], call.cls, tuple(sorted(call.shapes.items())))
            siblings.setdefault(key, {}).setdefault(call.path, block)  # first call, in call order
    for blocks in siblings.values():
        if len(blocks) > 1:
            found.update(blocks)
    return {p: b for p, b in found.items() if not any(p[: len(q)] == q and q != p for q in found)}


@dataclasses.dataclass(frozen=True)
class Layers:
    """A model's parameter shapes and how its layers are gathered: `LayerStack` stacks and blocks."""

    abstract_params: Any
    stacks: tuple[Path, ...]
    blocks: dict[Path, Found]
    stack_unused: dict[Path, frozenset] = dataclasses.field(default_factory=dict)  # per LayerStack
    looked_up: frozenset[Path] = frozenset()  # leaves the forward only indexes (`looked_up_leaves`)
    names: dict[Path, tuple[str | None, ...]] = dataclasses.field(default_factory=dict)  # logical axes

    @property
    def stacked(self) -> tuple[Path, ...]:
        """Subtrees whose leaves carry a layer dimension: LayerStacks and blocks run by a scan."""
        return (*self.stacks, *(path for path, block in self.blocks.items() if block.stacked))

    @property
    def backward_unused(self) -> frozenset[Path]:
        """Every leaf (full path) of a layer whose backward pass does not read it: not re-gathered."""
        relative = [(p, b.backward_unused) for p, b in self.blocks.items()] + list(self.stack_unused.items())
        return frozenset((*p, *leaf) for p, leaves in relative for leaf in leaves)

    def tensor_dims(self, rules: Rules = DEFAULT_TENSOR_RULES) -> dict[Path, int]:
        """The dimension the tensor axis splits of each leaf that has one, by `rules` over its logical
        names (a stacked leaf's names may leave out its leading layer dimension)."""
        flat = traverse_util.flatten_dict(dict(self.abstract_params))
        dims = {}
        for path, names in self.names.items():
            dim = tensor_dim(names, rules)
            if dim is not None:
                dims[path] = dim + len(flat[path].shape) - len(names)
        return dims

    def leaves(
        self, frozen: Callable[[Path], bool] | None = None, rules: Rules = DEFAULT_TENSOR_RULES
    ) -> tuple[Leaf, ...]:
        """The parameter leaves as the step gathers them (per layer in stacks and blocks); `frozen(path)`
        names those not trained; `rules` which dimension the tensor axis splits."""
        stacks, blocks = self.stacked, tuple(self.blocks)
        unused, layer_stacks = self.backward_unused, tuple(s for s in stacks if s not in blocks)
        tensor_dims = self.tensor_dims(rules)

        def under(path: Path, roots: tuple[Path, ...]) -> Path | None:
            return next((r for r in roots if path[: len(r)] == r), None)

        def leaf(path: Path, shape: tuple[int, ...]) -> Leaf:
            unit = under(path, stacks) or under(path, blocks)
            return Leaf(
                path, shape, under(path, stacks) is not None, per_layer=unit is not None,
                regathered=path not in unused, frozen=frozen is not None and bool(frozen(path)), unit=unit,
                layer_stack=under(path, layer_stacks) is not None, looked_up=path in self.looked_up,
                tensor_dim=tensor_dims.get(path),
            )  # fmt: skip

        flat = traverse_util.flatten_dict(dict(self.abstract_params))
        return tuple(leaf(path, tuple(x.shape)) for path, x in flat.items())


def find_layers(
    model: Any, key: jax.Array, example: Example | tuple[Any, ...], classes: tuple[type, ...] | None = None
) -> Layers:
    """Trace `model.init(key, *example.args, **example.kwargs)` once (shapes only) and find its layers:
    `LayerStack`s and blocks.

    A model with its own `find_blocks(abstract_params, example, classes)` (an nnx model behind
    `amsp_jax.layers.nnx.NnxModel`) finds its blocks itself; for linen, `find_blocks` reads the traced
    calls. A model that cannot be called with `example` raises `ExampleError`, naming the inputs.
    """
    example = as_example(example)
    own = getattr(model, "find_blocks", None)
    unused: dict[Path, frozenset] = {}
    with recording_stacks() as stacks, recording_calls(unused) as calls, _naming(model, example):
        boxed = jax.eval_shape(lambda k: example.call(model.init, k)["params"], key)
        abstract = nn.meta.unbox(boxed)
        blocks = own(abstract, example, classes) if own is not None else None
    looked_up = looked_up_leaves(model, abstract, example)
    if blocks is None:
        blocks = find_blocks(calls, _shapes(abstract), classes, exclude=tuple(stacks))
    own_names = getattr(model, "logical_names", None)
    names = own_names() if own_names is not None else logical_names(boxed)
    return Layers(abstract, tuple(stacks), blocks, unused, looked_up, names)


def logical_names(boxed_params: Any) -> dict[Path, tuple[str | None, ...]]:
    """The logical axis names of every parameter that has them (linen `nn.with_logical_partitioning`,
    nnx `sharding` metadata), by path."""
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(boxed_params, is_leaf=is_box)[0]
    names = {}
    for key_path, leaf in flat:
        found = getattr(leaf, "names", None)
        if is_box(leaf) and found is not None:
            names[tuple(str(getattr(k, "key", k)) for k in key_path)] = tuple(found)
    return names


class ExampleError(AmspError):
    """The example inputs do not match how the model is called."""


@contextlib.contextmanager
def _naming(model: Any, example: Example) -> Iterator[None]:
    """Turn a call that does not fit the model's signature into one line naming the inputs given."""
    try:
        yield
    except TypeError as error:
        text = str(error)
        if "argument" not in text:
            raise
        raise ExampleError(
            f"{type(model).__name__} cannot be called with the example inputs ({example.describe()}): "
            f"{text.splitlines()[0]}; pass them as the model's own call takes them, e.g. "
            "trainer.init(key, tokens, positions=positions) for a keyword-only `positions`"
        ) from None
