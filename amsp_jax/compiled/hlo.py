"""Find the collectives in compiled XLA HLO text, with their sizes, device groups and loop trip counts."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")

# The start half of an async pair stands for the pair; the -done (and -update) halves are never counted.
_START_OPCODES = {f"{kind}-start": kind for kind in KINDS}
_COLLECTIVE_OPCODES = {kind: kind for kind in KINDS} | _START_OPCODES
# Instructions that start their callee and return before it ends: a generic async-start, and the async
# fusions (fusion-start / fusion-done) jaxlib 0.11 emits, a scalar all-reduce's among them.
_ASYNC_WRAPPERS = {"async-start", "fusion-start"}
_WRAPPER_OPCODES = {"fusion", *_ASYNC_WRAPPERS}

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "f8e5m2": 1, "f8e5m2fnuz": 1, "f8e4m3": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "token": 0,
}  # fmt: skip

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_ARRAY_AT_START = re.compile(r"[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")
# An instruction's first line: `[ROOT] [%]name = ` then a tuple shape, an array shape, or (shape omitted,
# as hand-written HLO allows) an opcode; continuation lines (`to_apply=add,`, `replica_groups=mesh[...]`)
# match none.
_INSTRUCTION_START = re.compile(
    r"^\s*(?:ROOT\s+)?%?([A-Za-z_][\w.\-]*)\s*=\s*(?=\(|[a-z][a-z0-9]*\[[\d,<=]*\]|[a-z][\w\-]*\()"
)
_COMPUTATION_START = re.compile(r"^\s*(ENTRY\s+)?%?([A-Za-z_][\w.\-]*)[^=]*\{\s*$")
_TRIP_COUNT = re.compile(r"known_trip_count\W*n\W*(\d+)")
_IOTA_GROUPS = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")
# device_ids lists the mesh's devices, or gives them as an iota `[2,4]T(1,0)` (iota(8) reshaped, transposed).
_MESH_GROUPS = re.compile(
    r"^mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]*)\))?\s*\{([^}]*)\}$"
)
_IOTA_DEVICES = re.compile(r"^\[([\d,]+)\](?:T\(([\d,]+)\))?$")
_MESH_AXIS = re.compile(r"'([^']*)'\s*=\s*(\d+)")
_AXIS_REF = re.compile(r"'([^']*)'(?::\((\d+)\)(\d+))?")
# XLA prints `/*index=5*/` before every fifth element of long tuples and operand lists.
_COMMENT = re.compile(r"/\*.*?\*/")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_IS_SYNC = re.compile(r'"is_sync"\s*:\s*true')


@dataclass(frozen=True)
class Collective:
    """A collective of a compiled program and its executions per run; device ids are its logical ids."""

    kind: str
    name: str
    computation: str
    operand_bytes: int
    result_bytes: int
    replica_groups: tuple[tuple[int, ...], ...]
    source_target_pairs: tuple[tuple[int, int], ...]
    trip_count: int
    dtype: str
    # Every result is one element (rank 0, or `f32[1]`: one matrix's Frobenius norm, which jaxlib 0.10
    # reduces as `f32[1]` and 0.12 bitcasts from rank 0 first): loss and norm reductions, not model-state
    # traffic.
    scalar: bool = False
    op_name: str = ""  # the JAX operation it came from (`metadata`); combined collectives join theirs by `:`


@dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: Mapping[str, str]
    root: bool = False


def _end_of_group(text: str, start: int) -> int:
    """Index just past the bracket that closes the one opening at `start`."""
    depth, quoted, i = 0, False, start
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced brackets in HLO text: {text[start : start + 200]!r}")


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets and quoted strings."""
    parts: list[str] = []
    depth, quoted, escaped, begin = 0, False, False, 0
    for i, ch in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[begin:i].strip())
            begin = i + 1
    parts.append(text[begin:].strip())
    return [p for p in parts if p]


def _parse_instruction(text: str) -> _Instruction:
    """One instruction from its (possibly multi-line, joined) text."""
    head = _INSTRUCTION_START.match(text)
    if head is None:
        raise ValueError(f"not an HLO instruction: {text[:200]!r}")
    pos = head.end()
    shape = ""
    if text[pos] == "(":
        end = _end_of_group(text, pos)
        shape, pos = text[pos:end], end
    elif array := _ARRAY_AT_START.match(text, pos):
        shape, pos = array.group(0), array.end()
    while text[pos : pos + 1].isspace():
        pos += 1
    opcode = _OPCODE.match(text, pos)
    if opcode is None:
        raise ValueError(f"no opcode in HLO instruction: {text[:200]!r}")
    end = _end_of_group(text, opcode.end() - 1)
    attrs: dict[str, str] = {}
    key = ""
    for part in _split_top(text[end:].lstrip(" \t\n,")):
        if part.startswith("device_ids=") and key == "replica_groups":
            # Mesh replica groups print a top-level comma: `mesh['a'=2,'b'=4], device_ids=(...) {'b'}`.
            attrs[key] += ", " + part
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if sep:
            attrs[key] = value.strip()
    return _Instruction(
        name=head.group(1),
        shape=shape,
        opcode=opcode.group(1),
        operands=tuple(_split_top(text[opcode.end() : end - 1])),
        attrs=attrs,
        root=text.lstrip().startswith("ROOT"),
    )


def _parse_module(hlo_text: str) -> tuple[dict[str, dict[str, _Instruction]], str]:
    """The computations (name -> instructions by name, in text order) and the ENTRY computation's name."""
    computations: dict[str, dict[str, _Instruction]] = {}
    entry = ""
    current: dict[str, _Instruction] | None = None
    pending: list[str] = []

    def flush() -> None:
        if pending and current is not None:
            instruction = _parse_instruction(" ".join(pending))
            current[instruction.name] = instruction
        pending.clear()

    for line in _COMMENT.sub("", hlo_text).splitlines():
        if current is None:
            header = _COMPUTATION_START.match(line)
            if header and not line.lstrip().startswith("HloModule"):
                current = computations.setdefault(header.group(2), {})
                if header.group(1):
                    entry = header.group(2)
        elif line.lstrip().startswith("}"):
            flush()
            current = None
        elif _INSTRUCTION_START.match(line):
            flush()
            pending.append(line.strip())
        elif pending and line.strip():
            pending.append(line.strip())
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _names(value: str) -> list[str]:
    """Computation names in an attribute value: `%f` or `{%a, %b}`."""
    return [n.strip().lstrip("%") for n in value.strip().strip("{}").split(",") if n.strip()]


def _callees(
    ins: _Instruction, caller: str, computations: Mapping[str, Mapping[str, _Instruction]]
) -> list[tuple[str, int | None]]:
    """The computations `ins` runs, each with how many times per execution of `ins` (None: unknown)."""
    attrs = ins.attrs
    if ins.opcode == "while":
        trip = _TRIP_COUNT.search(attrs.get("backend_config", ""))
        n = int(trip.group(1)) if trip else _simulated_trip_count(ins, caller, computations)
        return [(_names(attrs["body"])[0], n), (_names(attrs["condition"])[0], n)]
    if ins.opcode == "call":
        return [(_names(attrs["to_apply"])[0], 1)]
    if ins.opcode == "conditional":
        branches = attrs.get("branch_computations") or ",".join(
            attrs[k] for k in ("true_computation", "false_computation")
        )
        # Only one branch runs, but which one is data dependent: count every branch as run (an upper bound).
        return [(name, 1) for name in _names(branches)]
    # async-done repeats the async-start's calls= in some XLA versions; following only the start counts once.
    if ins.opcode in _WRAPPER_OPCODES:
        return [(_names(attrs["calls"])[0], 1)]
    return []


# Loops XLA's GPU passes peel or double-buffer lose `known_trip_count`; their count is then found the way
# XLA's ComputeWhileLoopTripCount finds it when pattern matching fails: run the induction variable
# (init from the while operand, update from the body, test from the condition) until the test fails.
_MAX_SIMULATED_TRIPS = 100_000
_INDUCTION_VARIABLE = re.compile(r"known_induction_variable\W*tuple_index\W*(\d+)")
_SCALAR_SHAPE = re.compile(r"^(pred|[su](8|16|32|64))\[\]")
_COMPARE = {
    "LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
    "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b,
}  # fmt: skip
_BINARY = {
    "add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b,
    "minimum": min, "maximum": max, "and": lambda a, b: a & b, "or": lambda a, b: a | b,
}  # fmt: skip
_PASS_THROUGH = {"copy", "bitcast", "convert", "reshape"}
# An evaluated value: a scalar, a {tuple index: value} map (a tuple, known only in part), or None (unknown).
_Value = int | bool | dict[int, "_Value"] | None


def _root(body: Mapping[str, _Instruction]) -> str:
    """The name of a computation's ROOT instruction (its last one when none is marked)."""
    return next((ins.name for ins in body.values() if ins.root), next(reversed(body)))


def _operand_name(operand: str) -> str:
    """`%x` or `f32[8]{0} %x` as `x`."""
    return operand.rpartition(" ")[2].lstrip("%")


class _ScalarEvaluator:
    """Integer and boolean scalars of a module's instructions, given some elements of the parameters."""

    def __init__(self, computations: Mapping[str, Mapping[str, _Instruction]]) -> None:
        self.computations = computations

    def value(self, comp: str, name: str, params: Mapping[int, _Value]) -> _Value:
        ins = self.computations[comp].get(name)
        if ins is None:
            return None
        operands = [_operand_name(op) for op in ins.operands]
        if ins.opcode == "parameter":
            return params.get(int(operands[0]))
        if ins.opcode == "get-tuple-element":
            return self.element(comp, operands[0], int(ins.attrs["index"]), params)
        if ins.opcode in ("fusion", "call"):
            callee = _names(ins.attrs["calls" if ins.opcode == "fusion" else "to_apply"])[0]
            inner = {i: self.value(comp, op, params) for i, op in enumerate(operands)}
            return self.value(callee, _root(self.computations[callee]), inner)
        if not _SCALAR_SHAPE.match(ins.shape):
            return None
        if ins.opcode == "constant":
            text = operands[0]
            return text == "true" if text in ("true", "false") else int(text)
        args = [self.value(comp, op, params) for op in operands]
        if any(not isinstance(a, int) for a in args):  # bools are ints
            return None
        if ins.opcode in _PASS_THROUGH:
            return args[0]
        if ins.opcode == "compare":
            return _COMPARE[ins.attrs["direction"]](*args)
        if ins.opcode in _BINARY:
            return _BINARY[ins.opcode](*args)
        if ins.opcode == "not":
            return not args[0]
        if ins.opcode == "negate":
            return -args[0]
        if ins.opcode == "select":
            return args[1] if args[0] else args[2]
        return None

    def element(self, comp: str, name: str, index: int, params: Mapping[int, _Value]) -> _Value:
        """Element `index` of tuple `name`: only that element is evaluated."""
        ins = self.computations[comp].get(name)
        if ins is not None and ins.opcode == "tuple":
            return self.value(comp, _operand_name(ins.operands[index]), params)
        whole = self.value(comp, name, params)
        return whole.get(index) if isinstance(whole, dict) else None


def _simulated_trip_count(
    ins: _Instruction, caller: str, computations: Mapping[str, Mapping[str, _Instruction]]
) -> int | None:
    """Trips of a while loop from its induction variable; None when it cannot be evaluated."""
    found = _INDUCTION_VARIABLE.search(ins.attrs.get("backend_config", ""))
    index = int(found.group(1)) if found else 0
    body, condition = _names(ins.attrs["body"])[0], _names(ins.attrs["condition"])[0]
    if body not in computations or condition not in computations:
        return None
    evaluator = _ScalarEvaluator(computations)
    body_root, condition_root = _root(computations[body]), _root(computations[condition])
    value = evaluator.element(caller, _operand_name(ins.operands[0]), index, {})
    for trips in range(_MAX_SIMULATED_TRIPS + 1):
        test = evaluator.value(condition, condition_root, {0: {index: value}})
        if not isinstance(test, bool) or not isinstance(value, int):
            return None
        if not test:
            return trips
        following = evaluator.element(body, body_root, index, {0: {index: value}})
        if following == value:
            return None
        value = following
    return None


def _execution_counts(
    computations: dict[str, dict[str, _Instruction]], entry: str
) -> tuple[dict[str, int], dict[str, str]]:
    """Executions per run of each computation reached from ENTRY; and those under loops of unknown count."""
    edges = {
        name: [
            (callee, mult, ins.name)
            for ins in body.values()
            for callee, mult in _callees(ins, name, computations)
        ]
        for name, body in computations.items()
    }
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        if name not in computations:
            raise ValueError(f"HLO text calls computation {name!r}, which it does not define")
        for callee, _, _ in edges[name]:
            visit(callee)
        order.append(name)

    visit(entry)
    counts = dict.fromkeys(order, 0)
    counts[entry] = 1
    unknown: dict[str, str] = {}
    # Reverse post-order is topological: every caller is final before its callees get its count.
    for name in reversed(order):
        for callee, mult, via in edges[name]:
            counts[callee] += counts[name] * (1 if mult is None else mult)
            if name in unknown:
                unknown[callee] = unknown[name]
            elif mult is None:
                unknown[callee] = f"while loop {via!r} in computation {name!r}"
    return counts, unknown


def _dims_elements(dims: str) -> int:
    """Elements of an array's printed dims (`4,128`; bounded dynamic dims `<=n` count n)."""
    return math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d)


def _array_bytes(shape: str) -> int:
    """Total bytes of every array in a shape (tuples summed); bounded dynamic dims `<=n` count n."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
        total += _DTYPE_BYTES[dtype] * _dims_elements(dims)
    return total


def _output_shape(ins: _Instruction) -> str:
    """The part of the result shape that holds the collective's output buffers."""
    if ins.opcode not in _START_OPCODES:
        return ins.shape
    elements = _split_top(ins.shape[1:-1]) if ins.shape.startswith("(") else []
    # A -start result is (operands, outputs, context...), except all-reduce-start's: its outputs alone.
    # An async-start wrapping an all-reduce prints as all-reduce-start too, in the first form.
    if ins.opcode == "all-reduce-start" and not (elements and elements[0].startswith("(")):
        return ins.shape
    if len(elements) < 2:
        raise ValueError(f"{ins.opcode} {ins.name!r} should have a (operands, outputs, ...) tuple shape")
    return elements[1]


def _operand_shape(operand: str, body: Mapping[str, _Instruction]) -> str:
    """One operand's shape, printed with it (`f32[8]{0} %x`) or its definition's (`%x`); '' if none."""
    shape, _, name = operand.rpartition(" ")
    if shape.strip():
        return shape
    definition = body.get(name.lstrip("%"))
    return definition.shape if definition else ""


def _operand_bytes(operand: str, body: Mapping[str, _Instruction], where: str) -> int:
    """Bytes of one operand (`_operand_shape`)."""
    shape = _operand_shape(operand, body)
    if not shape:
        raise ValueError(f"cannot find the shape of operand {operand!r} of {where}")
    return _array_bytes(shape)


def _explicit_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """`{{0,1},{2,3}}` as ((0, 1), (2, 3)); `{}` as ()."""
    inner = text.strip()[1:-1]
    return tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", inner))


def _ints(text: str) -> list[int]:
    """Comma-separated integers as a list; blank text gives none."""
    return [int(d) for d in text.split(",") if d.strip()]


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...] | None:
    """Groups of `mesh['a'=2,'b'=4] {'b'}` (sub-axes `'a':(pre)size`), as XLA's MeshAxesReplicaGroupList."""
    mesh = _MESH_GROUPS.match(text)
    if mesh is None:
        return None
    axes = [(name, int(size)) for name, size in _MESH_AXIS.findall(mesh.group(1))]
    index = {name: i for i, (name, _) in enumerate(axes)}
    sizes = [size for _, size in axes]
    devices = np.arange(math.prod(sizes))
    if iota := _IOTA_DEVICES.match(mesh.group(2) or ""):
        devices = devices.reshape(_ints(iota.group(1))).transpose(_ints(iota.group(2) or "") or None).ravel()
    elif mesh.group(2):
        devices = np.array(_ints(mesh.group(2)))
    refs = [
        (index[name], int(pre or 1), int(size or sizes[index[name]]))
        for name, pre, size in _AXIS_REF.findall(mesh.group(3))
    ]
    # Split every mesh axis into the sub-axes the groups use (plus the pieces between them), then move the
    # grouped pieces last: each row of what remains, flattened, is one group.
    dims: list[int] = []
    grouped: list[int] = []
    for axis, full in enumerate(sizes):
        own = [(pre, size) for a, pre, size in refs if a == axis]
        position: dict[int, int] = {}
        prefix = 1
        for pre, size in sorted(own):
            if pre != prefix:
                dims.append(pre // prefix)
            position[pre] = len(dims)
            dims.append(size)
            prefix = pre * size
        if prefix != full:
            dims.append(full // prefix)
        grouped += [position[pre] for pre, _ in own]
    rest = [d for d in range(len(dims)) if d not in grouped]
    group_size = math.prod(dims[d] for d in grouped)
    ids = devices.reshape(dims).transpose(rest + grouped).reshape(-1, group_size)
    return tuple(tuple(int(d) for d in row) for row in ids)


def expand_replica_groups(text: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Explicit device groups of replica_groups `{{0,1},{2,3}}`, `{}` (all devices), iota or mesh form."""
    text = text.strip()
    if text.startswith("{"):
        return _explicit_groups(text) or (tuple(range(num_devices)),)
    mesh = _mesh_groups(text)
    if mesh is not None:
        return mesh
    iota = _IOTA_GROUPS.match(text)
    if iota is None:
        raise ValueError(f"unrecognised replica_groups {text!r}")
    group_dims, reshape_dims = _ints(iota.group(1)), _ints(iota.group(2))
    if math.prod(group_dims) != math.prod(reshape_dims):
        raise ValueError(f"replica_groups {text!r}: group dims and device dims hold different counts")
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
    if iota.group(3):
        ids = ids.transpose(_ints(iota.group(3)))
    # With more than two group dims the last is the group size and the others together count the groups.
    return tuple(tuple(int(d) for d in row) for row in ids.reshape(-1, group_dims[-1]))


def _where(ins: _Instruction, comp_name: str) -> str:
    """An instruction's place, for error messages."""
    return f"{ins.opcode} {ins.name!r} in computation {comp_name!r}"


def _collective(
    ins: _Instruction, comp_name: str, body: Mapping[str, _Instruction], trip_count: int, num_devices: int
) -> Collective:
    """The Collective record of one collective instruction of computation `comp_name`."""
    kind = _COLLECTIVE_OPCODES[ins.opcode]
    where = _where(ins, comp_name)
    output = _output_shape(ins)
    first = _ARRAY.search(output)
    permute = kind == "collective-permute"
    pairs = _explicit_groups(ins.attrs.get("source_target_pairs", "{}")) if permute else ()
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"{where}: source_target_pairs are not pairs")
    groups = () if permute else expand_replica_groups(ins.attrs.get("replica_groups", "{}"), num_devices)
    return Collective(
        kind=kind,
        name=ins.name,
        computation=comp_name,
        operand_bytes=sum(_operand_bytes(op, body, where) for op in ins.operands),
        result_bytes=_array_bytes(output),
        replica_groups=groups,
        source_target_pairs=tuple((p[0], p[1]) for p in pairs),
        trip_count=trip_count,
        dtype=first.group(1) if first else "",
        scalar=all(_dims_elements(dims) == 1 for _, dims in _ARRAY.findall(output))
        or (kind == "all-reduce" and _concatenated_scalars(ins, body)),
        op_name=_op_name(ins),
    )


def _elements(shape: str) -> int | None:
    """Elements of an array shape (None for a tuple or an unknown shape)."""
    arrays = _ARRAY.findall(shape)
    if len(arrays) != 1 or shape.startswith("("):
        return None
    return _dims_elements(arrays[0][1])


def _concatenated_scalars(ins: _Instruction, body: Mapping[str, _Instruction]) -> bool:
    """Whether an all-reduce's one operand is k one-element values joined into k elements: XLA:GPU's
    combiner concatenates scalar all-reduces (loss and norm partial sums) into one vector."""
    if len(ins.operands) != 1:
        return False
    source = body.get(_operand_name(ins.operands[0]))
    if source is None or not source.operands or _elements(source.shape) != len(source.operands):
        return False
    parts = [body.get(_operand_name(op)) for op in source.operands]
    return all(part is not None and _elements(part.shape) == 1 for part in parts)


def parse_collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """Every collective of a compiled HLO module, in text order, with its executions per program run."""
    computations, entry = _parse_module(hlo_text)
    counts, unknown = _execution_counts(computations, entry)
    found = []
    for comp_name, body in computations.items():
        for ins in body.values():
            if ins.opcode not in _COLLECTIVE_OPCODES:
                continue
            where = _where(ins, comp_name)
            # Skipping it would undercount: something we do not follow (a custom-call, say) may run it.
            if comp_name not in counts:
                raise ValueError(f"{where} is not reached from ENTRY by while/call/conditional/fusion/async")
            if comp_name in unknown:
                raise ValueError(
                    f"{unknown[comp_name]} has no known_trip_count, its induction variable could not be "
                    f"run to a count, and it runs {where}"
                )
            found += _split_scalars(_collective(ins, comp_name, body, counts[comp_name], num_devices), ins)
    return found


def _split_scalars(c: Collective, ins: _Instruction) -> list[Collective]:
    """A combined all-reduce of tensors and scalars (XLA merges the loss into the gradient reduction)
    as two records, so the scalar part is left out of model-state traffic like a lone scalar."""
    if c.kind != "all-reduce" or c.scalar:
        return [c]
    arrays = _ARRAY.findall(_output_shape(ins))
    scalar_bytes = sum(_DTYPE_BYTES[dtype] for dtype, dims in arrays if _dims_elements(dims) == 1)
    if not scalar_bytes:
        return [c]
    tensors = replace(
        c, operand_bytes=c.operand_bytes - scalar_bytes, result_bytes=c.result_bytes - scalar_bytes
    )
    scalars = replace(
        c, name=f"{c.name}.scalars", operand_bytes=scalar_bytes, result_bytes=scalar_bytes, scalar=True
    )
    return [tensors, scalars]


def bytes_per_device(c: Collective) -> int:
    """Bytes one device sends for `c` with ring algorithms (nccl-tests convention), times its trip count."""
    if c.kind == "collective-permute":
        # A device sends its whole buffer once when it is the source of a pair; self-pairs stay local.
        sends = any(src != dst for src, dst in c.source_target_pairs)
        return c.result_bytes * c.trip_count if sends else 0
    # Groups are equal in SPMD programs; taking the largest bounds the busiest device otherwise.
    n = max(len(g) for g in c.replica_groups)
    factor, size = {
        "all-gather": (1, c.result_bytes),
        "reduce-scatter": (1, c.operand_bytes),
        "all-reduce": (2, c.result_bytes),
        "all-to-all": (1, c.result_bytes),
    }[c.kind]
    # Round up: a scalar over 3 devices still moves whole elements.
    return -(-factor * (n - 1) * size // n) * c.trip_count


def crosses(c: Collective, node_of_device: Sequence[int]) -> bool:
    """Whether `c` links devices of two different nodes (in one replica group or one permute pair)."""
    return any(len({node_of_device[d] for d in g}) > 1 for g in c.replica_groups + c.source_target_pairs)


def _op_name(ins: _Instruction) -> str:
    """The `op_name` of an instruction's metadata, or ''."""
    found = _OP_NAME.search(ins.attrs.get("metadata", ""))
    return found.group(1) if found else ""


@dataclass(frozen=True)
class Overlap:
    """What XLA scheduled between a collective's start and done: the compute its transfer can hide behind.

    `compute` names the instructions between the two that run matrix work: dot/convolution fusions (cuBLAS
    or Triton gemms), custom calls, and loops or calls that contain them. A synchronous collective (no
    start/done pair, or a pair XLA marked `is_sync` because it found nothing to overlap) has none.
    """

    name: str
    computation: str
    asynchronous: bool
    is_sync: bool
    compute: tuple[str, ...]
    other_kernels: int  # other fusions and copies between start and done (elementwise work)

    @property
    def hidden(self) -> bool:
        """Whether the transfer runs while matrix compute runs."""
        return self.asynchronous and not self.is_sync and bool(self.compute)


_DONE_OPCODES = {f"{kind}-done" for kind in KINDS} | {"async-done", "async-update", "fusion-done"}
_MATRIX_OPCODES = {"dot", "convolution", "custom-call"}
_CALLING_OPCODES = {"fusion", "call", "while", "conditional", *_ASYNC_WRAPPERS}
_KERNEL_OPCODES = {"fusion", "fusion-start", "copy", "copy-start"}


def _called(ins: _Instruction) -> list[str]:
    """Every computation an instruction calls (fusions, loop bodies and conditions, branches, wrappers)."""
    names: list[str] = []
    for key in ("calls", "to_apply", "body", "condition", "branch_computations", "true_computation",
                "false_computation"):  # fmt: skip
        if key in ins.attrs and (ins.opcode in _CALLING_OPCODES or key != "to_apply"):
            names += _names(ins.attrs[key])
    return names


def overlaps(hlo_text: str) -> dict[str, Overlap]:
    """For each collective of a scheduled HLO module (by name), the compute between its start and done.

    The text of a scheduled module lists each computation's instructions in execution order, so what lies
    between a `-start` and its `-done` in that list runs while the transfer is in flight.
    """
    computations, _ = _parse_module(hlo_text)
    holds: dict[str, bool] = {}

    def holds_matrix_work(comp: str) -> bool:
        if comp not in holds:
            holds[comp] = False  # a cycle cannot occur in HLO; this only guards the recursion
            holds[comp] = any(
                ins.opcode in _MATRIX_OPCODES or any(holds_matrix_work(c) for c in _called(ins))
                for ins in computations.get(comp, {}).values()
            )
        return holds[comp]

    def is_matrix_work(ins: _Instruction) -> bool:
        return ins.opcode in _MATRIX_OPCODES or (
            ins.opcode in _CALLING_OPCODES and any(holds_matrix_work(c) for c in _called(ins))
        )

    # A collective wrapped in a generic async-start or an async fusion (`calls=%wrapped`) is timed by
    # that wrapper.
    wrapper_of = {
        callee: (comp, ins)
        for comp, body in computations.items()
        for ins in body.values()
        if ins.opcode in _ASYNC_WRAPPERS
        for callee in _names(ins.attrs.get("calls", ""))
    }
    found: dict[str, Overlap] = {}
    for comp_name, body in computations.items():
        for ins in body.values():
            if ins.opcode not in _COLLECTIVE_OPCODES:
                continue
            start, where = ins, comp_name
            if ins.opcode not in _START_OPCODES and comp_name in wrapper_of:
                where, start = wrapper_of[comp_name]
            if start.opcode not in _START_OPCODES and start.opcode not in _ASYNC_WRAPPERS:
                found[ins.name] = Overlap(ins.name, comp_name, False, True, (), 0)
                continue
            order = list(computations[where].values())
            position = order.index(start)
            chain = {start.name}
            end = position
            for later in order[position + 1 :]:
                end += 1
                if later.opcode in _DONE_OPCODES and _operand_name(later.operands[0]) in chain:
                    chain.add(later.name)
                    if later.opcode != "async-update":
                        break
            else:
                end = position  # the done is elsewhere (carried through a loop): nothing known to overlap
            between = order[position + 1 : end]
            compute = tuple(b.name for b in between if is_matrix_work(b))
            kernels = sum(1 for b in between if b.opcode in _KERNEL_OPCODES and not is_matrix_work(b))
            is_sync = bool(_IS_SYNC.search(start.attrs.get("backend_config", "")))
            found[ins.name] = Overlap(ins.name, comp_name, True, is_sync, compute, kernels)
    return found


# Kernels that neither move memory of their own nor compute: structure, aliases and scalars.
_NO_TRAFFIC = {
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "call", "conditional",
    "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency", "domain",
}  # fmt: skip


def _in_place_update(ins: _Instruction, computations: Mapping[str, Mapping[str, _Instruction]]) -> int:
    """Bytes a dynamic-update-slice kernel does not touch: it writes its update into its operand's buffer
    in place, so the rest of that buffer is neither read nor written (0 for any other kernel)."""
    if ins.opcode == "dynamic-update-slice":
        body, update = None, ins
    elif ins.opcode == "fusion":
        body = computations.get(_names(ins.attrs.get("calls", ""))[0], {})
        update = body.get(_root(body)) if body else None
        if update is None or update.opcode != "dynamic-update-slice":
            return 0
    else:
        return 0
    try:
        written = _operand_bytes(update.operands[1], body or {}, update.name)
    except ValueError:
        return 0
    return 2 * (_array_bytes(ins.shape) - written)


def memory_traffic(hlo_text: str) -> int:
    """Bytes per run that the memory-bound kernels of a compiled program read and write.

    Every kernel that runs — a fusion without a dot or convolution, a copy, convert, broadcast or other
    elementwise op — counts its operands and its result once per execution (loop trip counts applied);
    of an operand it only slices, only the slices (`_read_bytes`); a dynamic-update-slice counts only
    its update, since it writes in place. Matrix work, collectives
    and bookkeeping (tuples, parameters, bitcasts) are left out: the time model prices them apart.
    It is what a device's memory passes cost on a backend that runs each kernel from memory (XLA:CPU).
    """
    computations, entry = _parse_module(hlo_text)
    counts, _ = _execution_counts(computations, entry)
    # Bodies of fusions and wrappers, and reductions' `to_apply`, run inside their caller's kernel; a
    # `call`'s `to_apply` runs as instructions of its own.
    inlined = {
        callee
        for body in computations.values()
        for ins in body.values()
        for key in ("calls", "to_apply")
        if not (ins.opcode == "call" and key == "to_apply")
        for callee in _names(ins.attrs.get(key, ""))
    }
    matrix = {
        name for name, body in computations.items() if any(i.opcode in _MATRIX_OPCODES for i in body.values())
    }
    total = 0
    for name, body in computations.items():
        if name in inlined or not counts.get(name):
            continue
        for ins in body.values():
            if ins.opcode == "fusion-start":
                # An async fusion is the fusion it starts; its result is (operands, output, context).
                ins = replace(ins, opcode="fusion", shape=_split_top(ins.shape[1:-1])[1])
            if (
                ins.opcode in _NO_TRAFFIC
                or ins.opcode in _MATRIX_OPCODES
                or ins.opcode in _COLLECTIVE_OPCODES
                or ins.opcode in _DONE_OPCODES
                or (ins.opcode == "fusion" and _names(ins.attrs.get("calls", ""))[0] in matrix)
            ):
                continue
            read = sum(_read_bytes(ins, k, body, computations) for k in range(len(ins.operands)))
            touched = _array_bytes(ins.shape) + read
            total += counts[name] * (touched - _in_place_update(ins, computations))
    return total


_SLICING_OPCODES = {"dynamic-slice", "slice"}


def _read_bytes(
    ins: _Instruction,
    index: int,
    body: Mapping[str, _Instruction],
    computations: Mapping[str, Mapping[str, _Instruction]],
) -> int:
    """Bytes a kernel reads of its operand `index`: the whole operand, or only the slices it takes where
    every use of the operand slices it (a layer loop reads one layer of a stacked buffer per trip; counted
    whole, a 1.1B LLaMA's step on an H100 touched 1.6 TB instead of 0.36)."""
    whole = _operand_bytes(ins.operands[index], body, ins.name)
    if ins.opcode in _SLICING_OPCODES and index == 0:
        return _array_bytes(ins.shape)
    if ins.opcode != "fusion":
        return whole
    fused = computations.get(_names(ins.attrs.get("calls", ""))[0], {})
    parameter = next(
        (f.name for f in fused.values() if f.opcode == "parameter" and f.operands == (str(index),)), None
    )
    uses = [f for f in fused.values() if any(_operand_name(o) == parameter for o in f.operands)]
    if parameter is None or not uses:
        return whole
    if all(u.opcode in _SLICING_OPCODES and _operand_name(u.operands[0]) == parameter for u in uses):
        return sum(_array_bytes(u.shape) for u in uses)
    return whole


# Instructions that launch no kernel: they name, slice or join buffers, or end an async pair.
_FREE_OPCODES = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
    "replica-id", "opt-barrier", "add-dependency", "domain", "copy-done", *_DONE_OPCODES,
}  # fmt: skip
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')


def _dims(shape: str) -> list[int]:
    """The dims of the first array of a shape."""
    found = _ARRAY.search(shape)
    return [int(d.strip().lstrip("<=")) for d in found.group(2).split(",") if d.strip()] if found else []


def _matmul_flops(ins: _Instruction, body: Mapping[str, _Instruction]) -> float:
    """FLOPs of one dot, cuBLAS gemm or cuDNN attention instruction (0 for anything else)."""
    target = ins.attrs.get("custom_call_target", "")
    if ins.opcode == "dot" or (ins.opcode == "custom-call" and ("gemm" in target or "matmul" in target)):
        contracting = ins.attrs.get("lhs_contracting_dims", "")
        if ins.opcode == "custom-call":
            found = _CONTRACTING.search(ins.attrs.get("backend_config", ""))
            contracting = found.group(1) if found else ""
        lhs = _dims(_operand_shape(ins.operands[0], body)) if ins.operands else []
        k = math.prod(lhs[int(i)] for i in re.findall(r"\d+", contracting) if int(i) < len(lhs))
        return 2 * math.prod(_dims(ins.shape)) * k
    if ins.opcode == "custom-call" and "fmha" in target:
        # Q·Kᵀ and P·V over the (seq, seq) square: 4·B·H·S·S·D, the first output being (B, H, S, D)
        # (its longest dim the sequence); causal masks skip half; the backward runs 2.5 forwards.
        out = _dims(ins.shape)
        causal = 0.5 if '"CAUSAL"' in ins.attrs.get("backend_config", "") else 1.0
        return 4 * math.prod(out) * max(out, default=0) * causal * (2.5 if "Backward" in target else 1.0)
    return 0.0


def instruction_seconds(
    hlo_text: str,
    num_devices: int,
    collective_seconds: Callable[[Collective], float],
    flop_rate: float,
    memory_rate: float,
    launch_seconds: float,
) -> dict[str, float]:
    """Seconds of every instruction of a compiled module, by name: what XLA's latency-hiding scheduler
    reads from a profile (`amsp_jax.compiled.xla.scheduling_profile`).

    A collective (one execution): `collective_seconds` of it. A loop: its body's seconds times its trip
    count; a call, a branch or an async wrapper: the seconds of what it runs. Any other kernel: a launch
    plus the longer of its matrix FLOPs (dots, cuBLAS gemms and cuDNN attention, inside it if a fusion)
    at `flop_rate` and its operand and result bytes at `memory_rate` (a roofline; an in-place update
    counts its whole buffer). Buffer plumbing (tuples, bitcasts, the -done halves) takes none.
    """
    computations, entry = _parse_module(hlo_text)
    collectives = {
        ins.name: _collective(ins, name, body, 1, num_devices)
        for name, body in computations.items()
        for ins in body.values()
        if ins.opcode in _COLLECTIVE_OPCODES
    }
    flops: dict[str, float] = {}
    totals: dict[str, float] = {}
    seconds: dict[str, float] = {}

    def fused_flops(comp: str) -> float:
        if comp not in flops:
            body = computations.get(comp, {})
            flops[comp] = sum(
                _matmul_flops(ins, body) + sum(fused_flops(c) for c in _called(ins) if ins.opcode == "fusion")
                for ins in body.values()
            )
        return flops[comp]

    def kernel(ins: _Instruction, body: Mapping[str, _Instruction]) -> float:
        work = _matmul_flops(ins, body)
        if ins.opcode in ("fusion", "fusion-start"):
            work += sum(fused_flops(c) for c in _called(ins))
        shapes = [ins.shape, *(_operand_shape(op, body) for op in ins.operands)]
        moved = sum(_array_bytes(s) for s in shapes if s)
        return launch_seconds + max(work / flop_rate, moved / memory_rate)

    def total(comp: str) -> float:
        if comp not in totals:
            totals[comp] = 0.0  # HLO has no recursion; this only guards the memo
            totals[comp] = sum(price(ins, comp) for ins in computations.get(comp, {}).values())
        return totals[comp]

    def price(ins: _Instruction, comp: str) -> float:
        if ins.opcode in _FREE_OPCODES:
            spent = 0.0
        elif ins.name in collectives:
            spent = collective_seconds(collectives[ins.name])
        elif ins.opcode in ("while", "call", "conditional", "async-start"):
            spent = sum(total(c) * (n or 1) for c, n in _callees(ins, comp, computations))
        else:
            spent = kernel(ins, computations[comp])
        seconds[ins.name] = spent
        return spent

    total(entry)
    return seconds
