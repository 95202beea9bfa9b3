"""What XLA scheduled between each collective's start and done: the compute its transfer can hide behind."""

from __future__ import annotations

import re
from dataclasses import dataclass

from amsp_jax.compiled.hlo.opcodes import (
    ASYNC_WRAPPERS,
    CALLING_OPCODES,
    COLLECTIVE_OPCODES,
    DONE_OPCODES,
    MATRIX_OPCODES,
    START_OPCODES,
)
from amsp_jax.compiled.hlo.text import (
    Computations,
    Instruction,
    called_computations,
    names,
    operand_name,
    parse_module,
)

_IS_SYNC = re.compile(r'"is_sync"\s*:\s*true')
_KERNEL_OPCODES = {"fusion", "fusion-start", "copy", "copy-start"}


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


class _MatrixWork:
    """Which instructions of a module run matrix work, themselves or in a computation they call."""

    def __init__(self, computations: Computations) -> None:
        self.computations = computations
        self.holds: dict[str, bool] = {}

    def in_computation(self, comp: str) -> bool:
        if comp not in self.holds:
            self.holds[comp] = False  # a cycle cannot occur in HLO; this only guards the recursion
            self.holds[comp] = any(
                ins.opcode in MATRIX_OPCODES or any(self.in_computation(c) for c in called_computations(ins))
                for ins in self.computations.get(comp, {}).values()
            )
        return self.holds[comp]

    def __call__(self, ins: Instruction) -> bool:
        return ins.opcode in MATRIX_OPCODES or (
            ins.opcode in CALLING_OPCODES and any(self.in_computation(c) for c in called_computations(ins))
        )


def _between(order: list[Instruction], start: Instruction) -> list[Instruction]:
    """The instructions after `start` and before the done that ends its chain (through any updates);
    none when the done is elsewhere (carried through a loop): nothing is known to overlap then."""
    position = order.index(start)
    chain = {start.name}
    for end in range(position + 1, len(order)):
        later = order[end]
        if later.opcode in DONE_OPCODES and operand_name(later.operands[0]) in chain:
            chain.add(later.name)
            if later.opcode != "async-update":
                return order[position + 1 : end]
    return []


def overlaps(hlo_text: str) -> dict[str, Overlap]:
    """For each collective of a scheduled HLO module (by name), the compute between its start and done.

    The text of a scheduled module lists each computation's instructions in execution order, so what lies
    between a `-start` and its `-done` in that list runs while the transfer is in flight.
    """
    computations, _ = parse_module(hlo_text)
    is_matrix_work = _MatrixWork(computations)
    # A collective wrapped in a generic async-start or an async fusion (`calls=%wrapped`) is timed by
    # that wrapper.
    wrapper_of = {
        callee: (comp, ins)
        for comp, body in computations.items()
        for ins in body.values()
        if ins.opcode in ASYNC_WRAPPERS
        for callee in names(ins.attrs.get("calls", ""))
    }
    found: dict[str, Overlap] = {}
    for comp_name, body in computations.items():
        for ins in body.values():
            if ins.opcode not in COLLECTIVE_OPCODES:
                continue
            start, where = ins, comp_name
            if ins.opcode not in START_OPCODES and comp_name in wrapper_of:
                where, start = wrapper_of[comp_name]
            if start.opcode not in START_OPCODES and start.opcode not in ASYNC_WRAPPERS:
                found[ins.name] = Overlap(ins.name, comp_name, False, True, (), 0)
                continue
            between = _between(list(computations[where].values()), start)
            compute = tuple(b.name for b in between if is_matrix_work(b))
            kernels = sum(1 for b in between if b.opcode in _KERNEL_OPCODES and not is_matrix_work(b))
            is_sync = bool(_IS_SYNC.search(start.attrs.get("backend_config", "")))
            found[ins.name] = Overlap(ins.name, comp_name, True, is_sync, compute, kernels)
    return found
