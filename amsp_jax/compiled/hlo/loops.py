"""How many times each computation of a module runs per program run: calls, branches and loop trip counts."""

from __future__ import annotations

import re
from collections.abc import Mapping

from amsp_jax.compiled.hlo.opcodes import WRAPPER_OPCODES
from amsp_jax.compiled.hlo.text import Computations, Instruction, names, operand_name, root

_TRIP_COUNT = re.compile(r"known_trip_count\W*n\W*(\d+)")
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


def callee_runs(ins: Instruction, caller: str, computations: Computations) -> list[tuple[str, int | None]]:
    """The computations `ins` runs, each with how many times per execution of `ins` (None: unknown)."""
    attrs = ins.attrs
    if ins.opcode == "while":
        trip = _TRIP_COUNT.search(attrs.get("backend_config", ""))
        n = int(trip.group(1)) if trip else simulated_trip_count(ins, caller, computations)
        return [(names(attrs["body"])[0], n), (names(attrs["condition"])[0], n)]
    if ins.opcode == "call":
        return [(names(attrs["to_apply"])[0], 1)]
    if ins.opcode == "conditional":
        branches = attrs.get("branch_computations") or ",".join(
            attrs[k] for k in ("true_computation", "false_computation")
        )
        # Only one branch runs, but which one is data dependent: count every branch as run (an upper bound).
        return [(name, 1) for name in names(branches)]
    # async-done repeats the async-start's calls= in some XLA versions; following only the start counts once.
    if ins.opcode in WRAPPER_OPCODES:
        return [(names(attrs["calls"])[0], 1)]
    return []


class _ScalarEvaluator:
    """Integer and boolean scalars of a module's instructions, given some elements of the parameters."""

    def __init__(self, computations: Computations) -> None:
        self.computations = computations

    def value(self, comp: str, name: str, params: Mapping[int, _Value]) -> _Value:
        ins = self.computations[comp].get(name)
        if ins is None:
            return None
        operands = [operand_name(op) for op in ins.operands]
        if ins.opcode == "parameter":
            return params.get(int(operands[0]))
        if ins.opcode == "get-tuple-element":
            return self.element(comp, operands[0], int(ins.attrs["index"]), params)
        if ins.opcode in ("fusion", "call"):
            callee = names(ins.attrs["calls" if ins.opcode == "fusion" else "to_apply"])[0]
            inner = {i: self.value(comp, op, params) for i, op in enumerate(operands)}
            return self.value(callee, root(self.computations[callee]), inner)
        if not _SCALAR_SHAPE.match(ins.shape):
            return None
        if ins.opcode == "constant":
            text = operands[0]
            return text == "true" if text in ("true", "false") else int(text)
        args = [self.value(comp, op, params) for op in operands]
        if any(not isinstance(a, int) for a in args):  # bools are ints
            return None
        return _apply(ins, args)

    def element(self, comp: str, name: str, index: int, params: Mapping[int, _Value]) -> _Value:
        """Element `index` of tuple `name`: only that element is evaluated."""
        ins = self.computations[comp].get(name)
        if ins is not None and ins.opcode == "tuple":
            return self.value(comp, operand_name(ins.operands[index]), params)
        if ins is not None and ins.opcode == "opt-barrier":  # passes its tuple through unchanged
            return self.element(comp, operand_name(ins.operands[0]), index, params)
        whole = self.value(comp, name, params)
        return whole.get(index) if isinstance(whole, dict) else None


def _apply(ins: Instruction, args: list[int]) -> _Value:
    """A scalar instruction's value from its operands' values (None for an opcode it does not know)."""
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


def simulated_trip_count(ins: Instruction, caller: str, computations: Computations) -> int | None:
    """Trips of a while loop from its induction variable; None when it cannot be evaluated.

    Loops XLA's GPU passes peel or double-buffer lose `known_trip_count`; their count is then found the
    way XLA's ComputeWhileLoopTripCount finds it when pattern matching fails: run the induction variable
    (init from the while operand, update from the body, test from the condition) until the test fails.
    """
    found = _INDUCTION_VARIABLE.search(ins.attrs.get("backend_config", ""))
    index = int(found.group(1)) if found else 0
    body, condition = names(ins.attrs["body"])[0], names(ins.attrs["condition"])[0]
    if body not in computations or condition not in computations:
        return None
    evaluator = _ScalarEvaluator(computations)
    body_root, condition_root = root(computations[body]), root(computations[condition])
    # The induction variable, and the other scalars the loop carries (a bound the program computes
    # rather than a constant XLA could read, such as the micro-batch loop's).
    init = operand_name(ins.operands[0])
    tupled = computations[caller].get(init)
    indices = range(len(tupled.operands)) if tupled is not None and tupled.opcode == "tuple" else [index]
    state = {i: evaluator.element(caller, init, i, {}) for i in indices}
    state = {i: v for i, v in state.items() if isinstance(v, int)}
    for trips in range(_MAX_SIMULATED_TRIPS + 1):
        test = evaluator.value(condition, condition_root, {0: state})
        if not isinstance(test, bool) or index not in state:
            return None
        if not test:
            return trips
        following = {i: evaluator.element(body, body_root, i, {0: state}) for i in state}
        if following[index] == state[index]:
            return None
        state = {i: v for i, v in following.items() if isinstance(v, int)}
    return None


def execution_counts(computations: Computations, entry: str) -> tuple[dict[str, int], dict[str, str]]:
    """Executions per run of each computation reached from ENTRY; and those under loops of unknown count."""
    edges = {
        name: [
            (callee, mult, ins.name)
            for ins in body.values()
            for callee, mult in callee_runs(ins, name, computations)
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
