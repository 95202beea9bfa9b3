"""The temporaries XLA holds at a step's peak, read from its own dumps: a tensor-parallel plan's step
(`benchmarks.tensor_audit.run_case`) compiled for 2 nodes of 8 H100s with `--xla_dump_to`, then per
scheduled instruction the bytes of XLA's one temporary allocation that its live buffers occupy (their
offset ranges united, so buffers sharing an offset count once), where that peaks, and every buffer
live there with its size, live range and the JAX operation that made it.

    python -m benchmarks.xla_buffers [--model wide] [--layers N] [--seq N] [--form gather]
        [--strategy t=4,zero3] [--no-sp] [--micro M] [--remat full] [--vocab N] [--at I | --backward]
        [--out DIR]

writes a dated benchmarks/results/xla_buffers_h100x16-compiled-jaxlib<version>_<date>.md. Read from
`*-buffer-assignment.txt` (each buffer's offset and size in the temporary allocation, loop-carried
`(phi)` values included), `*-live-range.txt` (each buffer's first and last instruction in the
flattened schedule, the layer loops' bodies included) and `*-buffer-assignment-values.txt` (each
buffer's defining instruction). From jaxlib 0.11 the program read is the second compile's (the one
that runs): the train step's module with the highest number.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
from pathlib import Path

if "XLA_FLAGS" not in os.environ:  # the dump must be asked for before jax starts
    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count=8 --xla_dump_to={tempfile.mkdtemp(prefix='xla_buffers_')} "
        "--xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
    )
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import results_file

_MIB = 1 << 20
_LISTED = 64 << 10  # smaller buffers (norm scales, tuples' index tables) are left out of the list
_VALUE = re.compile(r"\s*value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_RANGE = re.compile(r"\s*(\S+):(\d+)-(\d+)$")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One value in the temporary allocation: where it sits, how long it lives, what made it."""

    name: str
    offset: int
    size: int
    shape: str
    start: int = 0
    end: int = 0
    op: str = ""


def _key(name: str) -> str:
    """The live-range dump's name of a value: a non-tuple value carries an empty index `{}` there."""
    return name if name.endswith("}") else name + "{}"


def read_temp(text: str) -> tuple[int, dict[str, Buffer]]:
    """(size of the temporary allocation, its values by live-range name) from a buffer assignment."""
    size, values, inside = 0, {}, False
    for line in text.splitlines():
        if line.startswith("allocation"):
            inside = "preallocated-temp" in line
            size = int(re.search(r"size (\d+)", line).group(1)) if inside else size  # type: ignore[union-attr]
            continue
        m = _VALUE.match(line) if inside else None
        if m:
            name = _key(m.group(1))
            values[name] = Buffer(name, int(m.group(3)), int(m.group(2)), m.group(4))
    return size, values


def read_live_ranges(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """(the flattened instruction sequence, each value's first and last instruction) from a live-range
    dump."""
    sequence: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    mode = ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(("InstructionSequence", "BufferLiveRange", "Live ranges at")):
            mode = s.split(":")[0].split()[0]
            continue
        if mode == "InstructionSequence" and (m := re.match(r"(\d+):(\S+)", s)):
            sequence.append(m.group(2))
        elif mode == "BufferLiveRange" and (m := _RANGE.match(s)):
            ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return sequence, ranges


def read_ops(text: str) -> dict[str, str]:
    """Each value's JAX operation (its defining instruction's `op_name`) from the values dump."""
    ops, current = {}, ""
    for line in text.splitlines():
        if m := re.match(r"<\d+ (\S+)(?: \(phi\))? @\d+>", line):
            current = _key(m.group(1))
        elif line.startswith(" from instruction:") and current:
            op = re.search(r'op_name="([^"]*)"', line)
            ops[current] = op.group(1).replace("jit(train_step)/shard_map/", "") if op else ""
    return ops


def occupied(buffers: list[Buffer]) -> int:
    """Bytes the buffers' offset ranges cover, overlaps counted once."""
    total, lo, hi = 0, -1, -1
    for b in sorted(buffers, key=lambda b: b.offset):
        if b.offset > hi:
            total, lo, hi = total + hi - lo, b.offset, b.offset + b.size
        else:
            hi = max(hi, b.offset + b.size)
    return total + hi - lo


def live_buffers(dump: Path, module: str) -> tuple[int, list[str], list[Buffer]]:
    """(temporary allocation size, instruction sequence, its values with live ranges and ops) of one
    compiled module's dumps (`module`: the file name up to `-buffer-assignment.txt`)."""
    size, values = read_temp((dump / f"{module}-buffer-assignment.txt").read_text())
    sequence, ranges = read_live_ranges((dump / f"{module}-live-range.txt").read_text())
    ops = read_ops((dump / f"{module}-buffer-assignment-values.txt").read_text())
    buffers = [
        dataclasses.replace(b, start=ranges[n][0], end=ranges[n][1], op=ops.get(n, ""))
        for n, b in values.items() if n in ranges
    ]  # fmt: skip
    return size, sequence, buffers


def profile(sequence: list[str], buffers: list[Buffer]) -> list[int]:
    """Occupied bytes of the temporary allocation at each instruction."""
    at: list[list[Buffer]] = [[] for _ in sequence]
    for b in buffers:
        for i in range(b.start, min(b.end, len(sequence) - 1) + 1):
            at[i].append(b)
    return [occupied(bs) if bs else 0 for bs in at]


def _train_step_module(dump: Path) -> str:
    """The running train step's module: from jaxlib 0.11 the second compile's, the highest number."""
    found = sorted(dump.glob("*jit_train_step*after_optimizations-buffer-assignment.txt"))
    return max(found, key=lambda p: int(p.name.split(".")[0].split("_")[1])).name.removesuffix(
        "-buffer-assignment.txt"
    )


def backward_span(buffers: list[Buffer]) -> tuple[int, int]:
    """The first and last instruction that starts a buffer of the layers' backward proper (a layer's
    gradient computation, not its recomputed forward)."""
    starts = [
        b.start for b in buffers
        if b.op.startswith("transpose(") and "/layers/" in b.op and "checkpoint/block/" in b.op
        and "rematted" not in b.op
    ]  # fmt: skip
    return min(starts), max(starts)


def report(dump: Path, at: int | None, backward: bool = False) -> list[str]:
    """Markdown lines: the allocation, the occupied peak, and every buffer live at it (or at `at`, or
    at the occupied peak inside the layers' backward)."""
    module = _train_step_module(dump)
    size, sequence, buffers = live_buffers(dump, module)
    used = profile(sequence, buffers)
    peak = max(range(len(used)), key=used.__getitem__)
    where = peak if at is None else at
    if backward:
        first, last = backward_span(buffers)
        where = max(range(first, last + 1), key=used.__getitem__)
    live = sorted((b for b in buffers if b.start <= where <= b.end), key=lambda b: (-b.size, b.name))
    listed = [b for b in live if b.size >= _LISTED]
    lines = [
        f"Module `{module}`: {len(sequence):,} scheduled instructions, temporary allocation {size:,} B "
        f"({size / _MIB:.2f} MiB). Occupied at most {used[peak] / _MIB:.2f} MiB, at instruction {peak} "
        f"(`{sequence[peak]}`): the allocation is {size / used[peak]:.3f}x that (XLA's packing).",
        "",
        f"Buffers live at instruction {where} (`{sequence[where]}`), {used[where] / _MIB:.2f} MiB occupied; "
        f"the {len(listed)} of {_LISTED >> 10} KiB or more ({sum(b.size for b in listed) / _MIB:.2f} MiB), "
        "largest first (a loop-carried value, `(phi)` in the dump, has no operation of its own):",
        "",
        "| MiB | offset MiB | live | value | shape | JAX operation |",
        "|---:|---:|---|---|---|---|",
    ]
    for b in listed:
        op = b.op if len(b.op) <= 90 else "..." + b.op[-87:]
        cells = [f"{b.size / _MIB:.2f}", f"{b.offset / _MIB:.2f}", f"{b.start}-{b.end}", f"`{b.name}`"]
        lines.append("| " + " | ".join([*cells, f"`{b.shape}`", op]) + " |")
    return lines


def _dump_dir() -> Path:
    """Where XLA dumps this process's programs (`--xla_dump_to` in XLA_FLAGS)."""
    m = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    if not m:
        raise SystemExit("XLA_FLAGS has no --xla_dump_to: leave XLA_FLAGS unset, or add it")
    return Path(m.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wide", help="`wide` or a shipped model (`llama-1b`)")
    parser.add_argument("--layers", type=int, default=0, help="the model's depth (default its own)")
    parser.add_argument("--seq", type=int, default=0, help="tokens per sequence (default the model's)")
    parser.add_argument("--form", default="gather", choices=("gather", "ring", "cannon"))
    parser.add_argument("--strategy", default="t=4,zero3", help="sequence parallel with a tensor axis")
    parser.add_argument("--remat", default="full", choices=("full", "dots", "none"))
    parser.add_argument(
        "--vocab", type=int, default=0, help="the `wide` model's vocabulary (default its own)"
    )
    parser.add_argument("--micro", type=int, default=1, help="micro-batches")
    parser.add_argument("--no-sp", action="store_true", help="no sequence parallelism on the tensor axis")
    parser.add_argument("--at", type=int, default=None, help="list the buffers live at this instruction")
    parser.add_argument("--backward", action="store_true", help="list them at the layers' backward's peak")
    parser.add_argument("--out", default=str(results_file.RESULTS))
    args = parser.parse_args(argv)
    import jaxlib

    from benchmarks import tensor_audit

    if args.vocab:
        tensor_audit.WIDE = dataclasses.replace(tensor_audit.WIDE, vocab_size=args.vocab)
    strategy, sp = args.strategy, args.strategy.startswith("t=") and not args.no_sp
    case = ("h100-sxm", args.model, strategy, sp, args.micro, args.remat, "mixed", args.form)
    _, audit_report = tensor_audit.run_case(*case, seq=args.seq, layers=args.layers)
    compiled, predicted = audit_report.measured.memory_bytes, audit_report.predicted.memory
    c = tensor_audit.model_config(args.model)
    seq = args.seq or c.max_seq_len
    shape = f"{c.dim:,} wide, {args.layers or c.n_layers} layers, seq {seq:,}, vocabulary {c.vocab_size:,}"
    lines = [
        results_file.header("XLA's temporaries at a step's peak, from its buffer assignment and live ranges"),
        f"`{args.model}` ({shape}), {strategy}, {args.form} form, "
        f"{'SP' if sp else 'no SP'}, "
        f"M = {args.micro}, remat {args.remat}, mixed, compiled for 2 x 8 H100s. Compiled {compiled:,} B, "
        "predicted "
        f"{predicted.total:,} B at the {predicted.peak_name} peak (ratio {audit_report.memory_ratio:.3f}).",
        "",
        *report(_dump_dir(), args.at, args.backward),
    ]
    hardware = f"h100x16-compiled-jaxlib{jaxlib.__version__}"
    stem = results_file.dated_stem(args.out, "xla_buffers", hardware)
    path = stem.parent / f"{stem.name}.md"  # the version's dots are no suffix
    path.write_text("\n".join(lines) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
