"""Seconds of every instruction of a compiled module by a roofline: the profile XLA's scheduler can read."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

from amsp_jax.compiled.hlo.collectives import Collective, collective
from amsp_jax.compiled.hlo.loops import callee_runs
from amsp_jax.compiled.hlo.opcodes import COLLECTIVE_OPCODES, DONE_OPCODES
from amsp_jax.compiled.hlo.text import (
    Computations,
    Instruction,
    array_bytes,
    called_computations,
    dims,
    operand_shape,
    parse_module,
    scheduling_name,
)

# Instructions that launch no kernel: they name, slice or join buffers, or end an async pair.
_FREE_OPCODES = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
    "replica-id", "opt-barrier", "add-dependency", "domain", "copy-done", *DONE_OPCODES,
}  # fmt: skip
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')


def matmul_flops(ins: Instruction, body: Mapping[str, Instruction]) -> float:
    """FLOPs of one dot, cuBLAS gemm or cuDNN attention instruction (0 for anything else)."""
    target = ins.attrs.get("custom_call_target", "")
    if ins.opcode == "dot" or (ins.opcode == "custom-call" and ("gemm" in target or "matmul" in target)):
        contracting = ins.attrs.get("lhs_contracting_dims", "")
        if ins.opcode == "custom-call":
            found = _CONTRACTING.search(ins.attrs.get("backend_config", ""))
            contracting = found.group(1) if found else ""
        lhs = dims(operand_shape(ins.operands[0], body)) if ins.operands else []
        k = math.prod(lhs[int(i)] for i in re.findall(r"\d+", contracting) if int(i) < len(lhs))
        return 2 * math.prod(dims(ins.shape)) * k
    if ins.opcode == "custom-call" and "fmha" in target:
        # Q·Kᵀ and P·V over the (seq, seq) square: 4·B·H·S·S·D, the first output being (B, H, S, D)
        # (its longest dim the sequence); causal masks skip half; the backward runs 2.5 forwards.
        out = dims(ins.shape)
        causal = 0.5 if '"CAUSAL"' in ins.attrs.get("backend_config", "") else 1.0
        return 4 * math.prod(out) * max(out, default=0) * causal * (2.5 if "Backward" in target else 1.0)
    return 0.0


class _Pricer:
    """The seconds of each instruction, memoised per computation: see `instruction_seconds`."""

    def __init__(
        self,
        computations: Computations,
        collectives: Mapping[str, Collective],
        collective_seconds: Callable[[Collective], float],
        rates: tuple[float, float, float],
    ) -> None:
        self.computations = computations
        self.collectives = collectives
        self.collective_seconds = collective_seconds
        self.flop_rate, self.memory_rate, self.launch_seconds = rates
        self.flops: dict[str, float] = {}
        self.totals: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def fused_flops(self, comp: str) -> float:
        if comp not in self.flops:
            body = self.computations.get(comp, {})
            self.flops[comp] = sum(
                matmul_flops(ins, body)
                + sum(self.fused_flops(c) for c in called_computations(ins) if ins.opcode == "fusion")
                for ins in body.values()
            )
        return self.flops[comp]

    def kernel(self, ins: Instruction, body: Mapping[str, Instruction]) -> float:
        work = matmul_flops(ins, body)
        if ins.opcode in ("fusion", "fusion-start"):
            work += sum(self.fused_flops(c) for c in called_computations(ins))
        shapes = [ins.shape, *(operand_shape(op, body) for op in ins.operands)]
        moved = sum(array_bytes(s) for s in shapes if s)
        return self.launch_seconds + max(work / self.flop_rate, moved / self.memory_rate)

    def total(self, comp: str) -> float:
        if comp not in self.totals:
            self.totals[comp] = 0.0  # HLO has no recursion; this only guards the memo
            self.totals[comp] = sum(self.price(ins, comp) for ins in self.computations.get(comp, {}).values())
        return self.totals[comp]

    def price(self, ins: Instruction, comp: str) -> float:
        if ins.opcode in _FREE_OPCODES:
            spent = 0.0
        elif ins.name in self.collectives:
            spent = self.collective_seconds(self.collectives[ins.name])
        elif ins.opcode in ("while", "call", "conditional", "async-start"):
            spent = sum(self.total(c) * (n or 1) for c, n in callee_runs(ins, comp, self.computations))
        else:
            spent = self.kernel(ins, self.computations[comp])
        self.seconds[scheduling_name(ins)] = spent
        return spent


def instruction_seconds(
    hlo_text: str,
    num_devices: int,
    collective_seconds: Callable[[Collective], float],
    flop_rate: float,
    memory_rate: float,
    launch_seconds: float,
) -> dict[str, float]:
    """Seconds of every instruction of a compiled module, by the name XLA's latency-hiding scheduler knew it
    by (`text.scheduling_name`): what that scheduler reads from a profile of a later compile of the same
    program (`amsp_jax.compiled.xla.scheduling_profile`).

    A collective (one execution): `collective_seconds` of it. A loop: its body's seconds times its trip
    count; a call, a branch or an async wrapper: the seconds of what it runs. Any other kernel: a launch
    plus the longer of its matrix FLOPs (dots, cuBLAS gemms and cuDNN attention, inside it if a fusion)
    at `flop_rate` and its operand and result bytes at `memory_rate` (a roofline; an in-place update
    counts its whole buffer). Buffer plumbing (tuples, bitcasts, the -done halves) takes none.
    """
    computations, entry = parse_module(hlo_text)
    collectives = {
        ins.name: collective(ins, name, body, 1, num_devices)
        for name, body in computations.items()
        for ins in body.values()
        if ins.opcode in COLLECTIVE_OPCODES
    }
    pricer = _Pricer(computations, collectives, collective_seconds, (flop_rate, memory_rate, launch_seconds))
    pricer.total(entry)
    return pricer.seconds
