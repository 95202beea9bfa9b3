"""`amsp-jax profile`: measure collective bandwidths, matmul rate and memory bandwidth; write a cluster YAML.

The measurements are `amsp_jax.cli.rates`'s; the memory passes of the step, fitted on probe models,
`amsp_jax.cli.probe`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from amsp_jax.cli.rates import (
    compute_points,
    group_meshes,
    group_sizes,
    measure_collective,
    measure_compute,
)
from amsp_jax.cost import host_profile
from amsp_jax.cost.hardware import FLAT, KINDS, LEVELS, format_size, load, parse_size

DEFAULT_SIZES = "64KiB,1MiB,16MiB"
# Wall seconds of a profile of 8 simulated devices on a 2-core host, per point measured, per probe step
# compiled (two at a time, one per core) and to start (benchmarks/results/profile_time_cpu2_*): the
# progress bar counts in them, with the probe steps' runs (`probe.run_seconds`), and their sum is the
# time said up front.
SECONDS = {"start": 4.0, "point": 1.0, "compiled": 6.0}
PARTS = ("collective points", "compute points", "probe steps")  # what the profile says it measures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `profile` subcommand's flags."""
    parser.add_argument(
        "--out", default="measured.yaml", help="cluster YAML to write (for --cluster of plan and train)"
    )
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"message sizes per device (default {DEFAULT_SIZES})"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per measurement (the median counts)"
    )
    parser.add_argument(
        "--nodes", type=int, help="nodes of the mesh (default: one per process; 2 on one CPU host)"
    )
    parser.add_argument("--name", default="measured", help="the cluster's name in the YAML")
    parser.add_argument(
        "--no-passes",
        action="store_true",
        help="skip the probe steps that measure the step's memory passes (most of the profile's time)",
    )
    parser.add_argument(
        "--thorough",
        action="store_true",
        help="every matmul width and token count and every probe step (about "
        f"{minutes(estimate_seconds(points(2, 4, True, thorough=True)))} minutes for 8 devices on a 2-core "
        f"host, against {minutes(estimate_seconds(points(2, 4, True)))} by default)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _shape(devices: list, nodes: int | None) -> tuple[int, int]:
    from amsp_jax.core.space import Cluster

    if nodes:
        if len(devices) % nodes:
            raise SystemExit(f"amsp-jax profile: {len(devices)} devices do not split into {nodes} nodes")
        return nodes, len(devices) // nodes
    detected = Cluster.detect(devices)
    if detected.nodes == 1 and devices[0].platform == "cpu" and len(devices) % 2 == 0:
        return 2, len(devices) // 2  # simulated CPU devices stand for two nodes
    return detected.nodes, detected.devices_per_node


def _device_memory(device: object, devices: int) -> tuple[float, str]:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), "the device's bytes_limit (memory_stats)"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total // devices), f"this host's RAM / {devices} devices"


def _matmul_lines(matmuls: dict[str, dict[int, list[tuple[int, float]]]], scale: float = 1.0) -> list[str]:
    """The `matmul_rates` section: the sweep's rates, each divided by `scale` (`Passes.compute_scale`)."""
    scaled = [] if scale == 1.0 else [
        f"                    # divided by {scale:.4g}: the probe steps' matmuls took that many times",
        "                    # what the sweep's rates price (amsp_jax/cli/probe.py)",
    ]  # fmt: skip
    return [
        "  matmul_rates:     # measured: by width W, [tokens, GFLOP/s] of (tokens x W) @ (W x W) and its",
        "                    # backward, every device at once",
        *scaled,
        *(
            line
            for dtype, by_width in matmuls.items()
            for line in (
                f"    {dtype}:",
                *(
                    row
                    for width, rows in by_width.items()
                    for row in (
                        f"      {width}:",
                        *(f"        - [{t}, {r / scale / 1e9:.4g}]" for t, r in rows),
                    )
                ),
            )
        ),
    ]


Tables = dict[str, dict[str, list[tuple[float, float]]]]


def _collective_tables(
    mesh: Any, devices: list, shape: tuple[int, int], sizes: list[float], repeats: int,
    tick: Callable[[int], object] = lambda n: None,
) -> tuple[Tables, dict[str, str]]:
    """Bus bandwidths {kind: {level or group: [(size, bytes/s)]}} and a note per level on how each was
    got; `tick(1)` after each point."""
    nodes, per_node = shape
    tables: Tables = {}
    notes: dict[str, str] = {}
    groups = group_meshes(devices, nodes, per_node)

    def measure(sub: Any, kind: str, axis: str | tuple[str, ...], size: float) -> float:
        found = measure_collective(sub, kind, axis, size, repeats)
        tick(1)
        return found

    # One device runs no collective: its config gets no bandwidth tables rather than invented ones, and
    # pricing a collective with it says so (`ClusterConfig.busbw`).
    for kind in KINDS if mesh.size > 1 else ():
        for level in LEVELS:
            if mesh.shape[level] > 1:
                rows = [(size, measure(mesh, kind, level, size)) for size in sizes]
                notes[level] = f"measured over {mesh.shape[level]} devices"
            else:
                other = "intra" if level == "inter" else "inter"
                rows = tables.get(kind, {}).get(other) or [(s, 1e9) for s in sizes]
                notes[level] = f"not measured (one device per group): copied from {other}"
            tables.setdefault(kind, {})[level] = rows
        for level, level_groups in groups.items():
            for group, sub in level_groups:
                tables[kind][f"{level}/{group}"] = [(size, measure(sub, kind, level, size)) for size in sizes]
                notes[f"{level}/{group}"] = f"measured over groups of {group} devices, all at once"
        if nodes > 1 and per_node > 1:
            whole = ("inter", "intra")
            tables[kind][FLAT] = [(size, measure(mesh, kind, whole, size)) for size in sizes]
            notes[FLAT] = f"measured over all {nodes * per_node} devices in one ring"
    return tables, notes


@dataclasses.dataclass(frozen=True)
class _Measured:
    """What `amsp-jax profile` measured on this host's devices, laid out as `nodes` × `per_node`."""

    devices: list
    nodes: int
    per_node: int
    repeats: int
    tables: Tables
    notes: dict[str, str]
    flops: float
    hbm: float
    matmuls: dict[str, dict[int, list[tuple[int, float]]]]
    memory_rates: list[tuple[int, float]]
    memory: float
    memory_source: str

    @property
    def platform(self) -> str:
        return self.devices[0].platform


def _device_lines(m: _Measured) -> list[str]:
    """The `device` section of the cluster YAML, the matmul rates (`_matmul_lines`) last."""
    matmul_dtype = "fp32" if m.platform == "cpu" else "bf16"
    return [
        "device:",
        f"  name: {m.devices[0].device_kind}",
        f"  memory_bytes: {int(m.memory)}     # {m.memory_source}",
        "  usable_memory_fraction: 0.9     # assumption: headroom for the runtime and fragmentation",
        f"  peak_flops: {m.flops:.4e}     # measured {matmul_dtype} matmul, every device at once",
        "  compute_efficiency: 1.0     # the measured matmul rate already is what the device sustains",
        f"  hbm_bandwidth: {m.hbm:.4e}     # measured: an elementwise op over "
        f"{format_size(m.memory_rates[-1][0])} per device, all at once",
        "  memory_bandwidths:     # measured: [bytes per device, GB/s] of that op into a fresh buffer of",
        "                         # that size, the launch of a program subtracted",
        *(f"    - [{format_size(nbytes)}, {rate / 1e9:.4g}]" for nbytes, rate in m.memory_rates),
        *_matmul_lines(m.matmuls),
    ]


def _config_lines(name: str, m: _Measured) -> list[str]:
    """The cluster YAML's lines, without the memory passes (`_with_memory_passes`)."""
    lines = [
        f"# Measured by `amsp-jax profile` on {len(m.devices)} {m.platform} device(s) as {m.nodes} nodes x",
        f"# {m.per_node}, median of {m.repeats} run(s) per point, {time.strftime('%Y-%m-%d')}. Bandwidths:",
        "# nccl-tests bus bandwidth in GB/s by the bytes one device sends in one collective",
        "# (see amsp_jax/cost/hardware.py).",
        f"name: {name}",
        "measured_on:     # where and when: these numbers price this host, and `amsp-jax plan` says so",
        f"  host: {json.dumps(socket.gethostname())}",
        f"  cpu: {json.dumps(host_profile.cpu_model())}",
        f"  date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"  jax: {json.dumps(host_profile.jax_version())}",
        f"nodes: {m.nodes}",
        f"devices_per_node: {m.per_node}",
    ]
    if m.platform == "cpu":
        lines.append(
            "collective_min_itemsize: 4     # XLA:CPU runs 16-bit collectives in fp32 "
            "(amsp_jax/cost/hardware.py)"
        )
    lines += [
        *_device_lines(m),
        "overlap:",
        *(
            ["  enabled: false     # XLA:CPU runs collectives as blocking rendezvous on the compute threads"]
            if m.platform == "cpu"
            else []
        ),
        "  reduction_fraction: 0.5     # assumption, as in the shipped cluster configs",
        "  interference: 0.1     # assumption, as in the shipped cluster configs",
        *(["bandwidth:"] if m.tables else []),
    ]
    for kind in m.tables:
        lines.append(f"  {kind}:")
        for level in m.tables[kind]:
            lines.append(f"    {level}:     # {m.notes[level]}")
            lines += [f"      - [{format_size(size)}, {bw / 1e9:.4g}]" for size, bw in m.tables[kind][level]]
    if FLAT in m.notes:
        lines += [
            "flat_ring:     # the ring of the `flat` tables: a flat collective over this many devices on",
            "               # this many nodes is priced from them (amsp_jax/cost/hardware.py)",
            f"  devices: {m.nodes * m.per_node}",
            f"  nodes: {m.nodes}",
        ]
    return lines


def _with_memory_passes(
    lines: list[str], m: _Measured, config: Any, thorough: bool, tick: Callable[[str], object], say: Any
) -> list[str]:
    """`lines` with the probe steps' memory passes added and the matmul rates those steps ran at."""
    from amsp_jax.cli import probe

    say("amsp-jax profile: probe steps for the memory passes")
    found = probe.run_probes(config, m.repeats, say=say, thorough=thorough, tick=tick)
    passes = probe.fit(found, config.pass_speed)
    timed_split = probe.split_cost(found) is not None
    # The rates the probe steps' matmuls ran at replace the sweep's (`Passes.compute_scale`).
    section = _matmul_lines(m.matmuls)
    start = lines.index(section[0])
    lines = [*lines[:start], *_matmul_lines(m.matmuls, passes.compute_scale), *lines[start + len(section) :]]
    lines += [
        "memory_passes:     # the probe steps' memory-bound kernels (amsp_jax/cli/probe.py): bytes",
        "                   # touched per byte of each block, read off the compiled programs, and the",
        "                   # bandwidth and fixed cost per step their timings give",
        f"  bandwidth_gbps: {passes.bandwidth / 1e9:.4g}",
        f"  step_overhead_ms: {passes.step_overhead_s * 1e3:.4g}",
        *(f"  {block}: {count:.4g}" for block, count in passes.per_byte.items()),
        f"  stored_params: {passes.stored_params:.4g}     # per fp32 parameter byte, P stored apart",
        f"  split_results: {passes.split_results:.4g}     # per byte a split's stages hand on"
        + ("" if timed_split else " (no split step timed: the compiled read and write)"),
    ]
    say(f"  memory passes at {passes.bandwidth / 1e9:.3g} GB/s, {passes.step_overhead_s * 1e3:.3g} ms "
          f"per step; bytes per block byte: "
          + ", ".join(f"{b} {c:.3g}" for b, c in passes.per_byte.items())
          + f" (compiled traffic within {passes.traffic_error:.0%}); a stored P "
          + f"{passes.stored_params:.3g} per fp32 parameter byte, a split's rounded results "
          + f"{passes.split_results:.3g} per byte{'' if timed_split else ' (not timed)'}; the steps' "
          + f"matmuls took {passes.compute_scale:.3g}x "
          + "what the sweep's rates price")  # fmt: skip
    return lines


def _print_summary(out: Path, config: Any, m: _Measured) -> None:
    print(
        f"amsp-jax profile: wrote {out} ({config.name}: {m.nodes} nodes x {m.per_node} {m.platform} devices)"
    )
    for kind in m.tables:
        for level, rows in m.tables[kind].items():
            cells = ", ".join(f"{format_size(s)} {bw / 1e9:.3g}" for s, bw in rows)
            print(f"  {kind:14s} {level:8s} GB/s: {cells}")
    if not m.tables:
        print("  no collective measured (one device): plan a cluster with a config profiled on it")
    print(
        f"  matmul {m.flops / 1e9:.3g} GFLOP/s, memory {m.hbm / 1e9:.3g} GB/s, "
        f"{m.memory / 2**30:.1f} GiB per device"
    )


def _mesh(args: argparse.Namespace) -> tuple[list, int, int, Any]:
    """This host's devices, laid out as nodes × devices per node, and that mesh."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from amsp_jax.core.mesh import ordered_devices

    devices = ordered_devices()
    nodes, per_node = _shape(devices, args.nodes)
    mesh = Mesh(
        np.array(devices, dtype=object).reshape(nodes, per_node),
        ("inter", "intra"),
        axis_types=(AxisType.Auto, AxisType.Auto),
    )
    return devices, nodes, per_node, mesh


def points(
    nodes: int, per_node: int, cpu: bool, sizes: int = 3, passes: bool = True, thorough: bool = False,
    repeats: int = 3,
) -> dict[str, Any]:
    """How many points each part of a profile of `nodes` × `per_node` devices measures, with `sizes`
    message sizes, and how many times it runs its probe steps, each time all of them in about how many
    seconds."""
    from amsp_jax.cli import probe

    tables = 0
    if nodes * per_node > 1:
        tables = sum(count > 1 for count in (nodes, per_node)) + (nodes > 1 and per_node > 1)
        tables += len(group_sizes(nodes)) + len(group_sizes(per_node))
    steps = probe.step_count(thorough, nodes) if passes and nodes * per_node > 1 else 0
    return {
        "collective points": len(KINDS) * tables * sizes,
        "compute points": compute_points(cpu, thorough),
        "probe steps": steps,
        "runs": probe.runs(thorough, repeats) if steps else 0,
        "run seconds": probe.run_seconds(thorough, nodes) if steps else 0,
    }


def estimate_seconds(counts: dict[str, Any]) -> float:
    """The wall seconds of a profile measuring `counts` (`points`) on a quiet 2-core host (`SECONDS`)."""
    return SECONDS["start"] + _work(counts)


def minutes(seconds: float) -> int:
    """`seconds` as the whole minutes said up front: the nearest, at least one."""
    return max(1, round(seconds / 60))


def say_minutes(seconds: float) -> str:
    """`seconds` in whole minutes, as said up front: "1 minute", "3 minutes"."""
    return f"{minutes(seconds)} minute{'s' if minutes(seconds) > 1 else ''}"


def _work(counts: dict[str, Any]) -> float:
    """The progress bar's total, in `SECONDS`: a probe step compiles and runs for far longer than a
    collective's point is measured, so a bar that counted points would finish its first half fast."""
    steps = counts["probe steps"]
    return (
        (counts["collective points"] + counts["compute points"]) * SECONDS["point"]
        + steps * SECONDS["compiled"]
        + counts["runs"] * counts["run seconds"]
    )


@contextlib.contextmanager
def _timed(part: str, seconds: dict[str, tuple[float, float]]) -> Iterator[None]:
    """Puts the wall and CPU seconds (every thread of this process) of the block into `seconds[part]`."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    seconds[part] = (time.perf_counter() - wall, time.process_time() - cpu)


def _measure(
    args: argparse.Namespace,
    layout: tuple[list, int, int, Any],
    tick: Callable[[int], object],
    seconds: dict[str, tuple[float, float]],
) -> _Measured:
    """Every table and rate of the cluster YAML, measured on this host's devices (`_mesh`); the wall
    and CPU seconds of each part go into `seconds`."""
    import jax

    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    devices, nodes, per_node, mesh = layout
    with _timed("collectives", seconds):
        tables, notes = _collective_tables(mesh, devices, (nodes, per_node), sizes, args.repeats, tick)
    with _timed("compute", seconds):
        flops, hbm, matmuls, memory_rates = measure_compute(devices, args.repeats, args.thorough, tick)
    memory, memory_source = _device_memory(devices[0], len(devices) // max(1, jax.process_count()))
    return _Measured(devices, nodes, per_node, args.repeats, tables, notes, flops, hbm, matmuls,
                     memory_rates, memory, memory_source)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Measure and write the cluster YAML; then read it back with the planner's reader."""
    from tqdm import tqdm

    sorted(parse_size(s) for s in args.sizes.split(","))  # bad sizes stop here, before the bar starts
    layout = _mesh(args)
    devices, nodes, per_node, _ = layout
    counts = points(nodes, per_node, devices[0].platform == "cpu", len(args.sizes.split(",")),
                    not args.no_passes, args.thorough, args.repeats)  # fmt: skip
    print(
        f"amsp-jax profile: {len(devices)} {devices[0].platform} device(s) as {nodes} x {per_node}: "
        + ", ".join(f"{counts[part]} {part}" for part in PARTS if counts[part])
        + f"; about {say_minutes(estimate_seconds(counts))} for 8 devices on a quiet 2-core host"
        + ("" if args.thorough else " (--thorough measures more)"),
        flush=True,
    )
    bar = tqdm(total=_work(counts), disable=args.no_progress, dynamic_ncols=True,
               bar_format="{l_bar}{bar}| [{elapsed}<{remaining}]")  # fmt: skip
    say = bar.write if not args.no_progress else print
    seconds: dict[str, tuple[float, float]] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    measured = _measure(args, layout, lambda n: bar.update(n * SECONDS["point"]), seconds)
    lines = _config_lines(args.name, measured)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    config = load(out)
    if len(measured.devices) > 1 and not args.no_passes:
        from amsp_jax.cli import probe

        # A probe step timed in a round counts its share of every run's seconds.
        rounds = probe.rounds(args.thorough, args.repeats)
        timed = counts["runs"] * counts["run seconds"] / max(1, counts["probe steps"] * rounds)
        tick = lambda kind: bar.update(SECONDS["compiled"] if kind == "compiled" else timed)  # noqa: E731

        with _timed("probe steps", seconds):
            try:
                lines = _with_memory_passes(lines, measured, config, args.thorough, tick, say)
            except probe.ProbeFitError as error:
                # The rates measured so far still price every collective and matmul: keep them.
                say(f"amsp-jax profile: {error}; wrote the profile without the memory passes")
        out.write_text("\n".join(lines) + "\n")
        config = load(out)
    bar.close()
    _print_summary(out, config, measured)
    parts = "; ".join(f"{part} {wall:.0f} s, {cpu:.0f} CPU-s" for part, (wall, cpu) in seconds.items())
    total = f"{time.perf_counter() - start:.0f} s, {time.process_time() - cpu_start:.0f} CPU-s"
    print(f"  took {total} ({parts})")
    return 0
