"""HLO text as computations of instructions, and the bytes of the shapes it prints."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from amsp_jax.compiled.hlo.opcodes import CALLING_OPCODES

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "f8e5m2": 1, "f8e5m2fnuz": 1, "f8e4m3": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "token": 0,
}  # fmt: skip

ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_ARRAY_AT_START = re.compile(r"[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")
# An instruction's first line: `[ROOT] [%]name = ` then a tuple shape, an array shape, or (shape omitted,
# as hand-written HLO allows) an opcode; continuation lines (`to_apply=add,`, `replica_groups=mesh[...]`)
# match none.
_INSTRUCTION_START = re.compile(
    r"^\s*(?:ROOT\s+)?%?([A-Za-z_][\w.\-]*)\s*=\s*(?=\(|[a-z][a-z0-9]*\[[\d,<=]*\]|[a-z][\w\-]*\()"
)
_COMPUTATION_START = re.compile(r"^\s*(ENTRY\s+)?%?([A-Za-z_][\w.\-]*)[^=]*\{\s*$")
# XLA prints `/*index=5*/` before every fifth element of long tuples and operand lists.
_COMMENT = re.compile(r"/\*.*?\*/")
_SCHEDULING_NAME = re.compile(r'\bscheduling_name="([^"]+)"')


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its result shape as printed, opcode, operands and `key=value` attributes."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: Mapping[str, str]
    root: bool = False


# A module's computations by name, each its instructions by name in text order.
Computations = Mapping[str, Mapping[str, Instruction]]


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


def split_top(text: str) -> list[str]:
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


def _attributes(text: str) -> dict[str, str]:
    """The `key=value` attributes that follow an instruction's operand list."""
    attrs: dict[str, str] = {}
    key = ""
    for part in split_top(text.lstrip(" \t\n,")):
        if part.startswith("device_ids=") and key == "replica_groups":
            # Mesh replica groups print a top-level comma: `mesh['a'=2,'b'=4], device_ids=(...) {'b'}`.
            attrs[key] += ", " + part
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if sep:
            attrs[key] = value.strip()
    return attrs


def parse_instruction(text: str) -> Instruction:
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
    return Instruction(
        name=head.group(1),
        shape=shape,
        opcode=opcode.group(1),
        operands=tuple(split_top(text[opcode.end() : end - 1])),
        attrs=_attributes(text[end:]),
        root=text.lstrip().startswith("ROOT"),
    )


def parse_module(hlo_text: str) -> tuple[dict[str, dict[str, Instruction]], str]:
    """The computations (name -> instructions by name, in text order) and the ENTRY computation's name."""
    computations: dict[str, dict[str, Instruction]] = {}
    entry = ""
    current: dict[str, Instruction] | None = None
    pending: list[str] = []

    def flush() -> None:
        if pending and current is not None:
            instruction = parse_instruction(" ".join(pending))
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


def scheduling_name(ins: Instruction) -> str:
    """The name XLA's latency-hiding scheduler knew `ins` by: passes after it rename some instructions
    (one that makes a collective with nothing to overlap synchronous replaces its start and done with a
    new instruction) and keep the old name in the metadata's `scheduling_name`."""
    found = _SCHEDULING_NAME.search(ins.attrs.get("metadata", ""))
    return found.group(1) if found else ins.name


def names(value: str) -> list[str]:
    """Computation names in an attribute value: `%f` or `{%a, %b}`."""
    return [n.strip().lstrip("%") for n in value.strip().strip("{}").split(",") if n.strip()]


def called_computations(ins: Instruction) -> list[str]:
    """Every computation an instruction calls (fusions, loop bodies and conditions, branches, wrappers)."""
    found: list[str] = []
    for key in ("calls", "to_apply", "body", "condition", "branch_computations", "true_computation",
                "false_computation"):  # fmt: skip
        if key in ins.attrs and (ins.opcode in CALLING_OPCODES or key != "to_apply"):
            found += names(ins.attrs[key])
    return found


def root(body: Mapping[str, Instruction]) -> str:
    """The name of a computation's ROOT instruction (its last one when none is marked)."""
    return next((ins.name for ins in body.values() if ins.root), next(reversed(body)))


def operand_name(operand: str) -> str:
    """`%x` or `f32[8]{0} %x` as `x`."""
    return operand.rpartition(" ")[2].lstrip("%")


def dims_elements(dims: str) -> int:
    """Elements of an array's printed dims (`4,128`; bounded dynamic dims `<=n` count n)."""
    return math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d)


def array_bytes(shape: str) -> int:
    """Total bytes of every array in a shape (tuples summed); bounded dynamic dims `<=n` count n."""
    total = 0
    for dtype, dims in ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape!r}")
        total += DTYPE_BYTES[dtype] * dims_elements(dims)
    return total


def elements(shape: str) -> int | None:
    """Elements of an array shape (None for a tuple or an unknown shape)."""
    arrays = ARRAY.findall(shape)
    if len(arrays) != 1 or shape.startswith("("):
        return None
    return dims_elements(arrays[0][1])


def dims(shape: str) -> list[int]:
    """The dims of the first array of a shape."""
    found = ARRAY.search(shape)
    return [int(d.strip().lstrip("<=")) for d in found.group(2).split(",") if d.strip()] if found else []


def operand_shape(operand: str, body: Mapping[str, Instruction]) -> str:
    """One operand's shape, printed with it (`f32[8]{0} %x`) or its definition's (`%x`); '' if none."""
    shape, _, name = operand.rpartition(" ")
    if shape.strip():
        return shape
    definition = body.get(name.lstrip("%"))
    return definition.shape if definition else ""


def operand_bytes(operand: str, body: Mapping[str, Instruction], where: str) -> int:
    """Bytes of one operand (`operand_shape`)."""
    shape = operand_shape(operand, body)
    if not shape:
        raise ValueError(f"cannot find the shape of operand {operand!r} of {where}")
    return array_bytes(shape)
