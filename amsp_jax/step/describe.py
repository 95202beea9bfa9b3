"""The plan as laid out for a model, in words: mesh axes, component axes, how layers are gathered,
and the leaves that are replicated, frozen, split over two dimensions or padded."""

from __future__ import annotations

import math

import jax

from amsp_jax.core.mesh import AxisPlan
from amsp_jax.core.plan import Plan
from amsp_jax.step.program import ParamLayout, StepProgram


def describe_layout(plan: Plan, layout: AxisPlan) -> list[str]:
    """The plan, its mesh axes and each component's placement over them."""
    lines = [f"plan        {plan.describe()}"]
    mesh = ", ".join(
        f"{name}={size}{' (inter-node)' if layout.is_inter(name) else ''}" for name, size in layout.axis_sizes
    )
    lines.append(f"mesh        {mesh}")
    for component in ("params", "grads", "opt_state"):
        axes = layout.axes(component) or ("replicated",)
        lines.append(f"{component:<11} {getattr(plan.strategy, component)} over {', '.join(axes)}")
    return lines


def _blocks_summary(pl: ParamLayout) -> str:
    """`Block_0 .. Block_11 (12 blocks)`, `layers (scanned, 12 layers)`: the wrapped blocks in words."""
    scanned = [b for b in pl.blocks if b in pl.stacks]
    looped = [b for b in pl.blocks if b not in pl.stacks]
    parts = []
    for block in scanned:
        layers = next(leaf.shape[0] for p, leaf in pl.leaves.items() if p[: len(block)] == block)
        parts.append(f"{'/'.join(map(str, block))} (scanned, {layers} layers)")
    if looped:
        names = ["/".join(map(str, b)) for b in looped]
        parts.append(names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} blocks)")
    return ", ".join(parts)


def _gathering(program: StepProgram) -> list[str]:
    """How the step gathers P: stored or cast from the master, per layer or whole."""
    pl, lines = program.params, []
    if program.schedule.params_from_master:
        lines.append("stored P    none: P and OS share one placement, so the gathers cast the master")
    if pl.layer_stacks:
        stacks = ", ".join("/".join(map(str, s)) for s in pl.layer_stacks)
        lines.append(f"gathering   per layer inside the layer scan of {stacks}")
    if pl.blocks:
        lines.append(f"gathering   per layer: each call of {_blocks_summary(pl)} gathers its own weights")
    if not pl.stacks and not pl.blocks:
        lines.append(
            "gathering   whole tree: no layers found (no LayerStack, scanned block or repeated block "
            "class), so every parameter is gathered once per step and stays gathered (memory of the "
            "full P); name the block classes with Trainer(..., layers=(Block,))"
        )
    return lines


def _leaves(program: StepProgram) -> list[str]:
    """The leaves that are replicated, frozen, carried, split over two dimensions or padded."""
    pl, layout, lines = program.params, program.layout, []
    replicated = pl.replicated()
    if replicated and any(layout.axes(c) for c in ("params", "grads", "opt_state")):
        names = ", ".join("/".join(map(str, p)) for p in replicated)
        lines.append(f"replicated  {len(replicated)} leaves have no dimension to split: {names}")
    if pl.frozen:
        count = sum(math.prod(pl.leaves[p].shape) for p in pl.frozen)
        names = ", ".join(sorted("/".join(map(str, p)) for p in pl.frozen)[:4])
        lines.append(
            f"frozen      {len(pl.frozen)} leaves ({count:,} parameters): gathered, never reduced, "
            f"updated or refreshed; no optimizer state: {names}{' ...' if len(pl.frozen) > 4 else ''}"
        )
    if program.loss.collections:
        count = sum(math.prod(x.shape) for x in jax.tree.leaves(program.collections))
        lines.append(
            f"carried     {', '.join(program.loss.collections)} ({count:,} values): whole on every device, "
            "updated by each micro-batch in turn, averaged over devices each step"
        )
    split = [p for p, leaf in pl.leaves.items() if leaf.tensor_dim is not None]
    if layout.tensor > 1:
        count = sum(math.prod(pl.leaves[p].shape) for p in split)
        total = sum(math.prod(leaf.shape) for leaf in pl.leaves.values())
        form = "sequence-parallel" if program.plan.sequence_parallel else "no sequence parallelism"
        form += f", {program.plan.tensor_matmul} matmuls"
        lines.append(
            f"tensor      t={layout.tensor}, {form}: {len(split)} leaves ({count / total:.0%} of the "
            f"parameters) split over the tensor axis, by their logical names; the rest whole on it"
        )
    two = ["/".join(map(str, p)) for p, leaf in pl.leaves.items() if leaf.minor_dim is not None]
    if two:
        more = f" (+{len(two) - 4} more)" if len(two) > 4 else ""
        lines.append(
            f"two dims    {len(two)} leaves split over two dimensions (no one dimension divides; a "
            f"node's devices split one, the nodes the other): {', '.join(two[:4])}{more}"
        )
    padding = pl.padding()
    if padding:
        lines.append(f"padded      {padding}")
    return lines


def describe(program: StepProgram) -> str:
    """The plan as laid out for the program's model."""
    return "\n".join(
        [*describe_layout(program.plan, program.layout), *_gathering(program), *_leaves(program)]
    )
