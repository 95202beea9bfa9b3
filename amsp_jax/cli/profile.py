"""`amsp-jax profile`: measure collective bandwidths, matmul rate and memory bandwidth; write a cluster YAML.

Each collective runs in a `jax.shard_map` over a 2-axis mesh (nodes × devices per node): over the
`intra` axis for the intra-node table and over the `inter` axis for the inter-node one, all groups
at once, as in the step; over every smaller group that divides a level (`intra/2`: pairs inside a
node, whose ring is shorter); with several nodes of several devices, also over both axes as one ring
(the `flat` table: a flat collective across nodes, which the step issues where the plan says so). A
message size is the bytes one device sends in one collective (the x-axis of
`amsp_jax.cost.hardware`), so the buffer of an all-gather or reduce-scatter over n devices is
size·n/(n−1) and that of an all-reduce size·n/(2(n−1)); the bus bandwidth is size / time, the
time being what one more collective adds to a program (`measure_collective`): a step launches once
and runs hundreds of collectives.

Memory bandwidth is read per buffer size (`memory_bandwidths`), the launch subtracted: a pass into a
small fresh buffer runs several times faster than one into a large one, and the time model prices each
of the step's blocks at its size's speed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amsp_jax.cost.hardware import FLAT, KINDS, LEVELS, MATMUL_DTYPES, format_size, load, parse_size

DEFAULT_SIZES = "64KiB,1MiB,16MiB"
# Bytes per device of the elementwise ops the memory bandwidth is read from: the step's blocks span them.
PASS_SIZES = (2**18, 2**20, 2**22, 2**24, 2**26)
CHAIN = 5  # collectives in the longer of the two programs a collective's marginal time is read from


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
        help="skip the probe steps that measure the step's memory passes (about two minutes on a CPU host)",
    )


def _median_seconds(fn: Callable[[], object], repeats: int, sample_s: float = 0.05) -> float:
    """Median seconds of one call: each sample averages enough calls to last about `sample_s`, since a
    single sub-millisecond call on a busy host is mostly scheduling noise."""
    return _median_seconds_each([fn], repeats, sample_s)[0]


def _median_seconds_each(
    fns: list[Callable[[], object]], repeats: int, sample_s: float = 0.05
) -> list[float]:
    """`_median_seconds` of each of `fns`, sampled in rounds over all of them: a slow spell of a busy
    host then falls on every one alike rather than on the few measured during it, which would price
    every step that uses their rates too high."""
    calls = []
    for fn in fns:
        fn()  # compile and warm up
        start = time.perf_counter()
        fn()
        calls.append(max(1, int(sample_s / max(time.perf_counter() - start, 1e-9))))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(max(1, repeats)):
        for fn, count, samples in zip(fns, calls, times, strict=True):
            start = time.perf_counter()
            for _ in range(count):
                fn()
            samples.append((time.perf_counter() - start) / count)
    return [statistics.median(samples) for samples in times]


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


def group_meshes(devices: list, nodes: int, per_node: int) -> dict[str, list[tuple[int, object]]]:
    """For each level, (group size, mesh) for every group smaller than the level's own that divides it:
    the mesh's axis of that level's name spans one group, its other axes the rest of the devices.

    A plan's collectives run over groups of every such size (`p=2x1` gathers over pairs inside a
    node), and a ring's cost grows with its length.
    """
    import numpy as np
    from jax.sharding import AxisType, Mesh

    grid = np.array(devices, dtype=object)
    meshes: dict[str, list[tuple[int, object]]] = {"intra": [], "inter": []}
    for level, count in (("intra", per_node), ("inter", nodes)):
        for group in range(2, count):
            if count % group:
                continue
            if level == "intra":
                shape, names = (nodes, per_node // group, group), ("inter", "rest", "intra")
            else:
                shape, names = (nodes // group, group, per_node), ("rest", "inter", "intra")
            mesh = Mesh(grid.reshape(shape), names, axis_types=(AxisType.Auto,) * 3)
            meshes[level].append((group, mesh))
    return meshes


def measure_collective(
    mesh: object, kind: str, axis: str | tuple[str, ...], size: float, repeats: int
) -> float:
    """Bus bandwidth (bytes/s) of `kind` over mesh axis `axis` (or several, as one group) when each
    device sends `size` bytes, from the time one more collective adds to a program.

    A program of one collective also pays the program's launch (on the CPU mesh as much as a small
    collective), which a step pays once, not per collective: the time is read as the
    difference between a chain of `CHAIN` dependent collectives and a chain of one, over `CHAIN` − 1.
    Each collective's input depends on the last one's output through an in-place update of one
    element (so XLA neither merges nor simplifies them) and costs no pass over the buffer.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axes = (axis,) if isinstance(axis, str) else axis
    n = math.prod(mesh.shape[a] for a in axes)
    buffer = size * n / (2 * (n - 1) if kind == "all-reduce" else (n - 1))
    elements = max(n, int(buffer // 4) // n * n)
    per_device = elements // n if kind == "all-gather" else elements
    sent = elements * 4 * (n - 1) / n * (2 if kind == "all-reduce" else 1)

    def collective(x: jax.Array) -> jax.Array:
        if kind == "all-gather":
            return jax.lax.all_gather(x, axis, tiled=True)
        if kind == "reduce-scatter":
            return jax.lax.psum_scatter(x, axis, tiled=True)
        return jax.lax.psum(x, axis)

    def chain(length: int) -> Callable[[jax.Array], jax.Array]:
        def body(x: jax.Array) -> jax.Array:
            for _ in range(length):
                y = collective(x)
                # The next input differs by device and depends on this output in one element.
                mark = y[0] + jax.lax.axis_index(axes).astype(y.dtype)
                x = x.at[0].set(mark) if kind != "all-reduce" else y.at[0].set(mark)
            return x

        return body

    everything = P(mesh.axis_names)
    x = jax.device_put(jnp.ones((mesh.size * per_device,), jnp.float32), NamedSharding(mesh, everything))
    seconds = []
    for length in (1, CHAIN):
        fn = jax.jit(jax.shard_map(chain(length), mesh=mesh, in_specs=everything, out_specs=everything))
        seconds.append(_median_seconds(lambda fn=fn: fn(x).block_until_ready(), repeats))
    # Two noisy medians can differ by less than one collective takes: the floor, a quarter of the
    # longer chain's time per collective, keeps noise from making a collective free.
    marginal = max((seconds[1] - seconds[0]) / (CHAIN - 1), seconds[1] / CHAIN / 4)
    return sent / marginal


def measure_compute(
    devices: list, repeats: int
) -> tuple[float, float, dict[str, dict[int, list[tuple[int, float]]]], list[tuple[int, float]]]:
    """(large-matmul FLOP/s, memory bandwidth bytes/s, {dtype: {width: [(tokens, FLOP/s of a layer's
    matmuls of that width over that many tokens)]}}, [(bytes, bandwidth of an elementwise op writing
    that many bytes)]) per device with every local device busy at once, as in a step: simulated CPU
    devices share the host's cores and memory. The large matmul in bf16 on accelerators, fp32 on the CPU.

    The sweep runs a projection's three matmuls, (tokens × width)·(width × width) forward and both
    products of its backward (the weight gradient contracts over the tokens), in each compute dtype:
    over the few dozen tokens one device runs at once, the tokens and the dtype decide most of a
    CPU's rate (XLA:CPU runs bf16 matmuls well below fp32 ones), and on a CPU the width too: widths
    128, 256 and 512 there, since a narrow model priced at the widest rate is priced too fast. On an
    accelerator the sweep reaches 16,384 tokens and reads each point as the time one more product adds
    to a program (`in_program_seconds`), which is how the step runs its kernels.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    local = [d for d in devices if d.process_index == jax.process_index()]
    cpu = local[0].platform == "cpu"
    mesh = Mesh(np.array(local, dtype=object), ("local",))
    each = P("local")

    def operands(rows: int, width: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
        a = jax.device_put(jnp.ones((len(local) * rows, width), dtype), NamedSharding(mesh, each))
        b = jax.device_put(jnp.ones((len(local) * width, width), dtype), NamedSharding(mesh, each))
        return a, b

    def forward_rate(rows: int, width: int, dtype: Any) -> float:
        a, b = operands(rows, width, dtype)
        matmul = jax.jit(jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(each, each), out_specs=each))
        return 2 * rows * width**2 / _median_seconds(lambda: matmul(a, b).block_until_ready(), repeats)

    def forward_and_backward(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, backward = jax.vjp(jnp.matmul, a, b)
        return backward(y)

    def layer_program(rows: int, width: int, dtype: Any) -> Callable[[], object]:
        # On XLA:CPU every op of a step pays a thread-pool launch much like a program's, so a program
        # per call stands for the step's op; the CPU mesh's time model is calibrated on this reading.
        a, b = operands(rows, width, dtype)
        step = jax.jit(
            jax.shard_map(forward_and_backward, mesh=mesh, in_specs=(each, each), out_specs=(each, each))
        )
        return lambda: jax.block_until_ready(step(a, b))

    def random_operands(rows: int, width: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
        # Unit-scale values that a chain of products keeps at unit scale: constant inputs can run
        # faster than real data on a GPU's matrix units.
        keys = jax.random.split(jax.random.key(0))
        a = jax.random.normal(keys[0], (len(local) * rows, width), dtype)
        b = jax.random.normal(keys[1], (len(local) * width, width), dtype) / math.sqrt(width)
        sharding = NamedSharding(mesh, each)
        return jax.device_put(a, sharding), jax.device_put(b, sharding)

    def in_program_seconds(op: Callable[..., tuple[jax.Array, jax.Array]], operands: tuple) -> float:
        """Seconds one more `op` adds to a program: a step runs its kernels back to back from one
        program, where a program per call also pays the host's launch."""
        rows = operands[0].shape[0] // len(local)

        def chain(length: int) -> Callable[..., tuple[jax.Array, jax.Array]]:
            def body(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
                for _ in range(length):
                    # The next product depends on this one; the scales keep the values at unit size.
                    da, db = op(a, b)
                    a, b = da, (db / math.sqrt(rows * b.shape[0])).astype(b.dtype)
                return a, b

            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(each, each), out_specs=(each, each)))

        seconds = []
        for length in (1, CHAIN):
            fn = chain(length)
            seconds.append(_median_seconds(lambda fn=fn: jax.block_until_ready(fn(*operands)), repeats))
        return max((seconds[1] - seconds[0]) / (CHAIN - 1), seconds[1] / CHAIN / 4)

    n = 1024 if cpu else 8192
    flops = forward_rate(n, n, jnp.float32 if cpu else jnp.bfloat16)
    # An accelerator's micro-batches reach tens of thousands of tokens (8 sequences of 2,048).
    tokens = (2, 8, 32, 128, 512, 2048) + (() if cpu else (8192, 16384))
    # A CPU's small models have narrow layers, whose products run well below a 512-wide one's rate.
    widths = (128, 256, n // 2) if cpu else (n // 2,)
    points = [(dtype, w, t) for dtype in MATMUL_DTYPES for w in widths for t in tokens]
    if cpu:
        programs = [layer_program(t, w, jnp.dtype(dtype)) for dtype, w, t in points]
        seconds = _median_seconds_each(programs, repeats)
    else:
        seconds = [
            in_program_seconds(forward_and_backward, random_operands(t, w, jnp.dtype(dtype)))
            for dtype, w, t in points
        ]
    sweep: dict[str, dict[int, list[tuple[int, float]]]] = {d: {w: [] for w in widths} for d in MATMUL_DTYPES}
    for (dtype, w, t), elapsed in zip(points, seconds, strict=True):
        sweep[dtype][w].append((t, 6 * t * w**2 / elapsed))
    scale = jax.jit(jax.shard_map(lambda v: v * 2.0, mesh=mesh, in_specs=each, out_specs=each))

    def elementwise_seconds(nbytes: int) -> float:
        v = jax.device_put(jnp.ones((len(local) * (nbytes // 4),), jnp.float32), NamedSharding(mesh, each))
        return _median_seconds(lambda: scale(v).block_until_ready(), repeats)

    launch = elementwise_seconds(4)
    # Read and write per device; the launch is the step's, not the pass's (a small pass would
    # otherwise look as slow as a program). An accelerator's pass over 64 MiB still shows its launch,
    # so it is swept to 1 GiB.
    memory = [
        (nbytes, 2 * nbytes / max(seconds - launch, seconds / 4))
        for nbytes in PASS_SIZES + (() if cpu else (2**28, 2**30))
        for seconds in [elementwise_seconds(nbytes)]
    ]
    return flops, memory[-1][1], sweep, memory


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


def run(args: argparse.Namespace) -> int:
    """Measure and write the cluster YAML; then read it back with the planner's reader."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from amsp_jax.core.mesh import ordered_devices

    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    devices = ordered_devices()
    nodes, per_node = _shape(devices, args.nodes)
    mesh = Mesh(
        np.array(devices, dtype=object).reshape(nodes, per_node),
        ("inter", "intra"),
        axis_types=(AxisType.Auto, AxisType.Auto),
    )
    tables: dict[str, dict[str, list[tuple[float, float]]]] = {}
    notes: dict[str, str] = {}
    groups = group_meshes(devices, nodes, per_node)
    # One device runs no collective: its config gets no bandwidth tables rather than invented ones, and
    # pricing a collective with it says so (`ClusterConfig.busbw`).
    for kind in KINDS if mesh.size > 1 else ():
        for level in LEVELS:
            if mesh.shape[level] > 1:
                rows = [(size, measure_collective(mesh, kind, level, size, args.repeats)) for size in sizes]
                notes[level] = f"measured over {mesh.shape[level]} devices"
            else:
                other = "intra" if level == "inter" else "inter"
                rows = tables.get(kind, {}).get(other) or [(s, 1e9) for s in sizes]
                notes[level] = f"not measured (one device per group): copied from {other}"
            tables.setdefault(kind, {})[level] = rows
        for level, level_groups in groups.items():
            for group, sub in level_groups:
                tables[kind][f"{level}/{group}"] = [
                    (size, measure_collective(sub, kind, level, size, args.repeats)) for size in sizes
                ]
                notes[f"{level}/{group}"] = f"measured over groups of {group} devices, all at once"
        if nodes > 1 and per_node > 1:
            whole = ("inter", "intra")
            tables[kind][FLAT] = [
                (size, measure_collective(mesh, kind, whole, size, args.repeats)) for size in sizes
            ]
            notes[FLAT] = f"measured over all {nodes * per_node} devices in one ring"
    flops, hbm, matmuls, memory_rates = measure_compute(devices, args.repeats)
    memory, memory_source = _device_memory(devices[0], len(devices) // max(1, jax.process_count()))
    platform = devices[0].platform

    matmul_dtype = "fp32" if platform == "cpu" else "bf16"
    lines = [
        f"# Measured by `amsp-jax profile` on {len(devices)} {platform} device(s) as {nodes} nodes x",
        f"# {per_node}, median of {args.repeats} run(s) per point, {time.strftime('%Y-%m-%d')}. Bandwidths:",
        "# nccl-tests bus bandwidth in GB/s by the bytes one device sends in one collective",
        "# (see amsp_jax/cost/hardware.py).",
        f"name: {args.name}",
        f"nodes: {nodes}",
        f"devices_per_node: {per_node}",
    ]
    if platform == "cpu":
        lines.append(
            "collective_min_itemsize: 4     # XLA:CPU runs 16-bit collectives in fp32 "
            "(amsp_jax/cost/hardware.py)"
        )
    lines += [
        "device:",
        f"  name: {devices[0].device_kind}",
        f"  memory_bytes: {int(memory)}     # {memory_source}",
        "  usable_memory_fraction: 0.9     # assumption: headroom for the runtime and fragmentation",
        f"  peak_flops: {flops:.4e}     # measured {matmul_dtype} matmul, every device at once",
        "  compute_efficiency: 1.0     # the measured matmul rate already is what the device sustains",
        f"  hbm_bandwidth: {hbm:.4e}     # measured: an elementwise op over "
        f"{format_size(memory_rates[-1][0])} per device, all at once",
        "  memory_bandwidths:     # measured: [bytes per device, GB/s] of that op into a fresh buffer of",
        "                         # that size, the launch of a program subtracted",
        *(f"    - [{format_size(nbytes)}, {rate / 1e9:.4g}]" for nbytes, rate in memory_rates),
        *(matmul_section := _matmul_lines(matmuls)),
        "overlap:",
        *(
            ["  enabled: false     # XLA:CPU runs collectives as blocking rendezvous on the compute threads"]
            if platform == "cpu"
            else []
        ),
        "  reduction_fraction: 0.5     # assumption, as in the shipped cluster configs",
        "  interference: 0.1     # assumption, as in the shipped cluster configs",
        *(["bandwidth:"] if tables else []),
    ]
    for kind in tables:
        lines.append(f"  {kind}:")
        for level in tables[kind]:
            lines.append(f"    {level}:     # {notes[level]}")
            lines += [f"      - [{format_size(size)}, {bw / 1e9:.4g}]" for size, bw in tables[kind][level]]
    if FLAT in notes:
        lines += [
            "flat_ring:     # the ring of the `flat` tables: a flat collective over this many devices on",
            "               # this many nodes is priced from them (amsp_jax/cost/hardware.py)",
            f"  devices: {nodes * per_node}",
            f"  nodes: {nodes}",
        ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    config = load(out)
    if len(devices) > 1 and not args.no_passes:
        from amsp_jax.cli import probe

        print("amsp-jax profile: probe steps for the memory passes", flush=True)
        passes = probe.fit(probe.run_probes(config, args.repeats), config.pass_speed)
        # The rates the probe steps' matmuls ran at replace the sweep's (`Passes.compute_scale`).
        start = lines.index(matmul_section[0])
        lines[start : start + len(matmul_section)] = _matmul_lines(matmuls, passes.compute_scale)
        lines += [
            "memory_passes:     # the probe steps' memory-bound kernels (amsp_jax/cli/probe.py): bytes",
            "                   # touched per byte of each block, read off the compiled programs, and the",
            "                   # bandwidth and fixed cost per step their timings give",
            f"  bandwidth_gbps: {passes.bandwidth / 1e9:.4g}",
            f"  step_overhead_ms: {passes.step_overhead_s * 1e3:.4g}",
            *(f"  {block}: {count:.4g}" for block, count in passes.per_byte.items()),
            f"  stored_params: {passes.stored_params:.4g}     # per fp32 parameter byte, P stored apart",
            f"  split_results: {passes.split_results:.4g}     # per byte a split's stages hand on",
        ]
        out.write_text("\n".join(lines) + "\n")
        config = load(out)
        print(f"  memory passes at {passes.bandwidth / 1e9:.3g} GB/s, {passes.step_overhead_s * 1e3:.3g} ms "
              f"per step; bytes per block byte: "
              + ", ".join(f"{b} {c:.3g}" for b, c in passes.per_byte.items())
              + f" (compiled traffic within {passes.traffic_error:.0%}); a stored P "
              + f"{passes.stored_params:.3g} per fp32 parameter byte, a split's rounded results "
              + f"{passes.split_results:.3g} per byte; the steps' matmuls took {passes.compute_scale:.3g}x "
              + "what the sweep's rates price")  # fmt: skip
    print(f"amsp-jax profile: wrote {out} ({config.name}: {nodes} nodes x {per_node} {platform} devices)")
    for kind in tables:
        for level, rows in tables[kind].items():
            cells = ", ".join(f"{format_size(s)} {bw / 1e9:.3g}" for s, bw in rows)
            print(f"  {kind:14s} {level:8s} GB/s: {cells}")
    if not tables:
        print("  no collective measured (one device): plan a cluster with a config profiled on it")
    print(
        f"  matmul {flops / 1e9:.3g} GFLOP/s, memory {hbm / 1e9:.3g} GB/s, "
        f"{memory / 2**30:.1f} GiB per device"
    )
    return 0
