"""Bytes the memory-bound kernels of a compiled program read and write per run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from amsp_jax.compiled.hlo.loops import execution_counts
from amsp_jax.compiled.hlo.opcodes import COLLECTIVE_OPCODES, DONE_OPCODES, MATRIX_OPCODES
from amsp_jax.compiled.hlo.text import (
    Computations,
    Instruction,
    array_bytes,
    names,
    operand_bytes,
    operand_name,
    parse_module,
    root,
    split_top,
)

# Kernels that neither move memory of their own nor compute: structure, aliases and scalars.
_NO_TRAFFIC = {
    "parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "call", "conditional",
    "after-all", "partition-id", "replica-id", "iota", "opt-barrier", "add-dependency", "domain",
}  # fmt: skip
_SLICING_OPCODES = {"dynamic-slice", "slice"}


def _in_place_update(ins: Instruction, computations: Computations) -> int:
    """Bytes a dynamic-update-slice kernel does not touch: it writes its update into its operand's buffer
    in place, so the rest of that buffer is neither read nor written, and the slot it writes is not read
    either where nothing else in the kernel reads that buffer (0 for any other kernel)."""
    if ins.opcode == "dynamic-update-slice":
        body, update = None, ins
    elif ins.opcode == "fusion":
        body = computations.get(names(ins.attrs.get("calls", ""))[0], {})
        update = body.get(root(body)) if body else None
        if update is None or update.opcode != "dynamic-update-slice":
            return 0
    else:
        return 0
    try:
        written = operand_bytes(update.operands[1], body or {}, update.name)
    except ValueError:
        return 0
    buffer = operand_name(update.operands[0])
    read_elsewhere = body is not None and any(
        buffer in map(operand_name, other.operands) for other in body.values() if other is not update
    )
    return 2 * (array_bytes(ins.shape) - written) + (0 if read_elsewhere else written)


def _read_bytes(
    ins: Instruction, index: int, body: Mapping[str, Instruction], computations: Computations
) -> int:
    """Bytes a kernel reads of its operand `index`: the whole operand, or only the slices it takes where
    every use of the operand slices it (a layer loop reads one layer of a stacked buffer per trip)."""
    whole = operand_bytes(ins.operands[index], body, ins.name)
    if ins.opcode in _SLICING_OPCODES and index == 0:
        return array_bytes(ins.shape)
    if ins.opcode != "fusion":
        return whole
    fused = computations.get(names(ins.attrs.get("calls", ""))[0], {})
    parameter = next(
        (f.name for f in fused.values() if f.opcode == "parameter" and f.operands == (str(index),)), None
    )
    uses = [f for f in fused.values() if any(operand_name(o) == parameter for o in f.operands)]
    if parameter is None or not uses:
        return whole
    if all(u.opcode in _SLICING_OPCODES and operand_name(u.operands[0]) == parameter for u in uses):
        return sum(array_bytes(u.shape) for u in uses)
    return whole


def _inlined(computations: Computations) -> set[str]:
    """Bodies of fusions and wrappers, and reductions' `to_apply`: they run inside their caller's kernel
    (a `call`'s `to_apply` runs as instructions of its own)."""
    return {
        callee
        for body in computations.values()
        for ins in body.values()
        for key in ("calls", "to_apply")
        if not (ins.opcode == "call" and key == "to_apply")
        for callee in names(ins.attrs.get(key, ""))
    }


def memory_traffic(hlo_text: str) -> int:
    """Bytes per run that the memory-bound kernels of a compiled program read and write.

    Every kernel that runs — a fusion without a dot or convolution, a copy, convert, broadcast or other
    elementwise op — counts its operands and its result once per execution (loop trip counts applied);
    of an operand it only slices, only the slices (`_read_bytes`); a dynamic-update-slice counts only
    its update written and what it is computed from, since it writes in place without reading the slot
    it overwrites. Matrix work, collectives
    and bookkeeping (tuples, parameters, bitcasts) are left out: the time model prices them apart.
    It is what a device's memory passes cost on a backend that runs each kernel from memory (XLA:CPU).
    """
    computations, entry = parse_module(hlo_text)
    counts, _ = execution_counts(computations, entry)
    inlined = _inlined(computations)
    matrix = {
        name for name, body in computations.items() if any(i.opcode in MATRIX_OPCODES for i in body.values())
    }
    total = 0
    for name, body in computations.items():
        if name in inlined or not counts.get(name):
            continue
        for ins in body.values():
            if ins.opcode == "fusion-start":
                # An async fusion is the fusion it starts; its result is (operands, output, context).
                ins = replace(ins, opcode="fusion", shape=split_top(ins.shape[1:-1])[1])
            if (
                ins.opcode in _NO_TRAFFIC
                or ins.opcode in MATRIX_OPCODES
                or ins.opcode in COLLECTIVE_OPCODES
                or ins.opcode in DONE_OPCODES
                or (ins.opcode == "fusion" and names(ins.attrs.get("calls", ""))[0] in matrix)
            ):
                continue
            read = sum(_read_bytes(ins, k, body, computations) for k in range(len(ins.operands)))
            touched = array_bytes(ins.shape) + read
            total += counts[name] * (touched - _in_place_update(ins, computations))
    return total
