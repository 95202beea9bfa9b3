"""The collectives of a compiled module: kind, bytes, device groups, executions per run, scalar reductions."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from amsp_jax.compiled.hlo.loops import execution_counts
from amsp_jax.compiled.hlo.opcodes import COLLECTIVE_OPCODES, START_OPCODES
from amsp_jax.compiled.hlo.replica_groups import expand_replica_groups, explicit_groups
from amsp_jax.compiled.hlo.text import (
    ARRAY,
    DTYPE_BYTES,
    Instruction,
    array_bytes,
    dims_elements,
    elements,
    operand_bytes,
    operand_name,
    parse_module,
    split_top,
)

_OP_NAME = re.compile(r'\bop_name="([^"]*)"')


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
    # Every result is one element (rank 0, or `f32[1]`, as some jaxlibs reduce one matrix's norm): loss
    # and norm reductions, not model-state traffic.
    scalar: bool = False
    op_name: str = ""  # the JAX operation it came from (`metadata`); combined collectives join theirs by `:`


def output_shape(ins: Instruction) -> str:
    """The part of the result shape that holds the collective's output buffers."""
    if ins.opcode not in START_OPCODES:
        return ins.shape
    parts = split_top(ins.shape[1:-1]) if ins.shape.startswith("(") else []
    # A -start result is (operands, outputs, context...), except all-reduce-start's: its outputs alone.
    # An async-start wrapping an all-reduce prints as all-reduce-start too, in the first form.
    if ins.opcode == "all-reduce-start" and not (parts and parts[0].startswith("(")):
        return ins.shape
    if len(parts) < 2:
        raise ValueError(f"{ins.opcode} {ins.name!r} should have a (operands, outputs, ...) tuple shape")
    return parts[1]


def _where(ins: Instruction, comp_name: str) -> str:
    """An instruction's place, for error messages."""
    return f"{ins.opcode} {ins.name!r} in computation {comp_name!r}"


def _op_name(ins: Instruction) -> str:
    """The `op_name` of an instruction's metadata, or ''."""
    found = _OP_NAME.search(ins.attrs.get("metadata", ""))
    return found.group(1) if found else ""


def collective(
    ins: Instruction, comp_name: str, body: Mapping[str, Instruction], trip_count: int, num_devices: int
) -> Collective:
    """The Collective record of one collective instruction of computation `comp_name`."""
    kind = COLLECTIVE_OPCODES[ins.opcode]
    where = _where(ins, comp_name)
    output = output_shape(ins)
    first = ARRAY.search(output)
    permute = kind == "collective-permute"
    pairs = explicit_groups(ins.attrs.get("source_target_pairs", "{}")) if permute else ()
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"{where}: source_target_pairs are not pairs")
    groups = () if permute else expand_replica_groups(ins.attrs.get("replica_groups", "{}"), num_devices)
    return Collective(
        kind=kind,
        name=ins.name,
        computation=comp_name,
        operand_bytes=sum(operand_bytes(op, body, where) for op in ins.operands),
        result_bytes=array_bytes(output),
        replica_groups=groups,
        source_target_pairs=tuple((p[0], p[1]) for p in pairs),
        trip_count=trip_count,
        dtype=first.group(1) if first else "",
        scalar=all(dims_elements(dims) == 1 for _, dims in ARRAY.findall(output))
        or (kind == "all-reduce" and _concatenated_scalars(ins, body)),
        op_name=_op_name(ins),
    )


def _concatenated_scalars(ins: Instruction, body: Mapping[str, Instruction]) -> bool:
    """Whether an all-reduce's one operand is k one-element values joined into k elements: XLA:GPU's
    combiner concatenates scalar all-reduces (loss and norm partial sums) into one vector."""
    if len(ins.operands) != 1:
        return False
    source = body.get(operand_name(ins.operands[0]))
    if source is None or not source.operands or elements(source.shape) != len(source.operands):
        return False
    parts = [body.get(operand_name(op)) for op in source.operands]
    return all(part is not None and elements(part.shape) == 1 for part in parts)


def parse_collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """Every collective of a compiled HLO module, in text order, with its executions per program run."""
    computations, entry = parse_module(hlo_text)
    counts, unknown = execution_counts(computations, entry)
    found = []
    for comp_name, body in computations.items():
        for ins in body.values():
            if ins.opcode not in COLLECTIVE_OPCODES:
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
            found += _split_scalars(collective(ins, comp_name, body, counts[comp_name], num_devices), ins)
    return found


def _split_scalars(c: Collective, ins: Instruction) -> list[Collective]:
    """A combined all-reduce of tensors and scalars (XLA merges the loss into the gradient reduction)
    as two records, so the scalar part is left out of model-state traffic like a lone scalar."""
    if c.kind != "all-reduce" or c.scalar:
        return [c]
    arrays = ARRAY.findall(output_shape(ins))
    scalar_bytes = sum(DTYPE_BYTES[dtype] for dtype, dims in arrays if dims_elements(dims) == 1)
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
