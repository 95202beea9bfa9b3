"""Find the collectives in compiled XLA HLO text, with their sizes, device groups and loop trip counts."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")

# The start half of an async pair stands for the pair; the -done (and -update) halves are never counted.
_START_OPCODES = {f"{kind}-start": kind for kind in KINDS}
_COLLECTIVE_OPCODES = {kind: kind for kind in KINDS} | _START_OPCODES

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
    scalar: bool = False  # every result is rank 0: loss and norm reductions, not model-state traffic


@dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: Mapping[str, str]


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


def _callees(ins: _Instruction) -> list[tuple[str, int | None]]:
    """The computations `ins` runs, each with how many times per execution of `ins` (None: unknown)."""
    attrs = ins.attrs
    if ins.opcode == "while":
        trip = _TRIP_COUNT.search(attrs.get("backend_config", ""))
        n = int(trip.group(1)) if trip else None
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
    if ins.opcode in ("fusion", "async-start"):
        return [(_names(attrs["calls"])[0], 1)]
    return []


def _execution_counts(
    computations: dict[str, dict[str, _Instruction]], entry: str
) -> tuple[dict[str, int], dict[str, str]]:
    """Executions per run of each computation reached from ENTRY; and those under loops of unknown count."""
    edges = {
        name: [(callee, mult, ins.name) for ins in body.values() for callee, mult in _callees(ins)]
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
            counts[callee] += counts[name] * (mult or 1)
            if name in unknown:
                unknown[callee] = unknown[name]
            elif mult is None:
                unknown[callee] = f"while loop {via!r} in computation {name!r}"
    return counts, unknown


def _array_bytes(shape: str) -> int:
    """Total bytes of every array in a shape (tuples summed); bounded dynamic dims `<=n` count n."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
        total += _DTYPE_BYTES[dtype] * math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d)
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


def _operand_bytes(operand: str, body: Mapping[str, _Instruction], where: str) -> int:
    """Bytes of one operand, printed as `%x` (look up its definition) or with its shape, `f32[8]{0} %x`."""
    shape, _, name = operand.rpartition(" ")
    if shape.strip():
        return _array_bytes(shape)
    definition = body.get(name.lstrip("%"))
    if definition is None or not definition.shape:
        raise ValueError(f"cannot find the shape of operand {operand!r} of {where}")
    return _array_bytes(definition.shape)


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
        scalar=all(not dims.strip() for _, dims in _ARRAY.findall(output)),
    )


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
                raise ValueError(f"{unknown[comp_name]} has no known_trip_count and runs {where}")
            found.append(_collective(ins, comp_name, body, counts[comp_name], num_devices))
    return found


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
