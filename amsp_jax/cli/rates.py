"""What `amsp-jax profile` measures: collective bus bandwidths, matmul FLOP/s and memory bandwidth.

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

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from amsp_jax.cost.hardware import MATMUL_DTYPES

# Bytes per device of the elementwise ops the memory bandwidth is read from: the step's blocks span them.
PASS_SIZES = (2**18, 2**20, 2**22, 2**24, 2**26)
CHAIN = 5  # collectives in the longer of the two programs a collective's marginal time is read from


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
    times: list[list[float]] = []
    for fn in fns:
        fn()  # compile and warm up
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        calls.append(max(1, int(sample_s / max(elapsed, 1e-9))))
        # A call that lasts a sample by itself is one: calling it again for the first sample costs time.
        times.append([elapsed] if elapsed >= sample_s else [])
    for _ in range(max(1, repeats)):
        for fn, count, samples in zip(fns, calls, times, strict=True):
            if len(samples) >= max(1, repeats):
                continue
            start = time.perf_counter()
            for _ in range(count):
                fn()
            samples.append((time.perf_counter() - start) / count)
    return [statistics.median(samples) for samples in times]


def group_sizes(count: int) -> list[int]:
    """The sizes of the groups smaller than a level of `count` devices that divide it (`group_meshes`)."""
    return [group for group in range(2, count) if count % group == 0]


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
        for group in group_sizes(count):
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


class _LocalSweep:
    """Programs over every local device at once, as in a step (simulated CPU devices share the host's
    cores and memory), each device holding operands of its own; `repeats` timed runs per point."""

    def __init__(self, devices: list, repeats: int) -> None:
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        self.local = [d for d in devices if d.process_index == jax.process_index()]
        self.cpu = self.local[0].platform == "cpu"
        self.mesh = Mesh(np.array(self.local, dtype=object), ("local",))
        self.each = P("local")
        self.sharding = NamedSharding(self.mesh, self.each)
        self.repeats = repeats

    def over_devices(self, fn: Callable[..., Any], args: int, results: int = 1) -> Callable[..., Any]:
        """`fn` jitted as a shard_map whose `args` arguments and `results` results are split by device."""
        import jax

        specs = lambda n: self.each if n == 1 else (self.each,) * n  # noqa: E731
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=specs(args), out_specs=specs(results)))

    def operands(self, rows: int, width: int, dtype: Any) -> tuple[Any, Any]:
        import jax
        import jax.numpy as jnp

        a = jax.device_put(jnp.ones((len(self.local) * rows, width), dtype), self.sharding)
        b = jax.device_put(jnp.ones((len(self.local) * width, width), dtype), self.sharding)
        return a, b

    def random_operands(self, rows: int, width: int, dtype: Any) -> tuple[Any, Any]:
        """Unit-scale values that a chain of products keeps at unit scale: constant inputs can run faster
        than real data on a GPU's matrix units."""
        import jax

        keys = jax.random.split(jax.random.key(0))
        a = jax.random.normal(keys[0], (len(self.local) * rows, width), dtype)
        b = jax.random.normal(keys[1], (len(self.local) * width, width), dtype) / math.sqrt(width)
        return jax.device_put(a, self.sharding), jax.device_put(b, self.sharding)

    def forward_rate(self, rows: int, width: int, dtype: Any) -> float:
        """FLOP/s of one (rows × width)·(width × width) product per device, a program per call."""
        a, b = self.operands(rows, width, dtype)
        matmul = self.over_devices(lambda a, b: a @ b, 2)
        return 2 * rows * width**2 / _median_seconds(lambda: matmul(a, b).block_until_ready(), self.repeats)

    def layer_program(self, rows: int, width: int, dtype: Any) -> Callable[[], object]:
        """A call of one projection's forward and backward products, a program per call: on XLA:CPU every
        op of a step pays a thread-pool launch much like a program's, so a program per call stands for
        the step's op; the CPU mesh's time model is calibrated on this reading."""
        import jax

        a, b = self.operands(rows, width, dtype)
        step = self.over_devices(_forward_and_backward, 2, 2)
        return lambda: jax.block_until_ready(step(a, b))

    def in_program_seconds(self, op: Callable[..., tuple[Any, Any]], operands: tuple) -> float:
        """Seconds one more `op` adds to a program: a step runs its kernels back to back from one
        program, where a program per call also pays the host's launch."""
        import jax

        rows = operands[0].shape[0] // len(self.local)

        def chain(length: int) -> Callable[..., tuple[Any, Any]]:
            def body(a: Any, b: Any) -> tuple[Any, Any]:
                for _ in range(length):
                    # The next product depends on this one; the scales keep the values at unit size.
                    da, db = op(a, b)
                    a, b = da, (db / math.sqrt(rows * b.shape[0])).astype(b.dtype)
                return a, b

            return self.over_devices(body, 2, 2)

        seconds = []
        for length in (1, CHAIN):
            fn = chain(length)
            seconds.append(_median_seconds(lambda fn=fn: jax.block_until_ready(fn(*operands)), self.repeats))
        return max((seconds[1] - seconds[0]) / (CHAIN - 1), seconds[1] / CHAIN / 4)

    def elementwise_seconds(self, scale: Callable[[Any], Any], nbytes: int) -> float:
        """Seconds of `scale` over `nbytes` of fp32 per device, a program per call."""
        import jax
        import jax.numpy as jnp

        v = jax.device_put(jnp.ones((len(self.local) * (nbytes // 4),), jnp.float32), self.sharding)
        return _median_seconds(lambda: scale(v).block_until_ready(), self.repeats)


def _forward_and_backward(a: Any, b: Any) -> tuple[Any, Any]:
    """A projection's backward products: what its forward product's gradient costs."""
    import jax
    import jax.numpy as jnp

    y, backward = jax.vjp(jnp.matmul, a, b)
    return backward(y)


def sweep_points(cpu: bool, widest: int, thorough: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tokens, widths) of the matmul sweep. The time model reads a rate per (tokens, width) between
    rows, time affine in tokens and rate linear in log-width, so by default a few rows span what a
    CPU mesh's small models run (the fixed cost per op at 8 tokens, its fall by 128, the large rate
    at 2,048; the narrowest and widest layers); `thorough` measures the rows in between too."""
    # An accelerator's micro-batches reach tens of thousands of tokens (8 sequences of 2,048).
    tokens = (2, 8, 32, 128, 512, 2048) if thorough else (8, 128, 2048)
    if not cpu:
        return (*tokens, 8192, 16384), (widest // 2,)
    # A CPU's small models have narrow layers, whose products run well below a 512-wide one's rate.
    return tokens, (128, 256, widest // 2) if thorough else (128, widest // 2)


def _matmul_sweep(
    on: _LocalSweep, widest: int, thorough: bool, tick: Callable[[int], object]
) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """{dtype: {width: [(tokens, FLOP/s of a layer's three products of that width over that many
    tokens)]}}."""
    import jax.numpy as jnp

    tokens, widths = sweep_points(on.cpu, widest, thorough)
    points = [(dtype, w, t) for dtype in MATMUL_DTYPES for w in widths for t in tokens]
    if on.cpu:
        programs = [on.layer_program(t, w, jnp.dtype(dtype)) for dtype, w, t in points]
        seconds = _median_seconds_each(programs, on.repeats)
        tick(len(points))
    else:
        seconds = []
        for dtype, w, t in points:
            operands = on.random_operands(t, w, jnp.dtype(dtype))
            seconds.append(on.in_program_seconds(_forward_and_backward, operands))
            tick(1)
    sweep: dict[str, dict[int, list[tuple[int, float]]]] = {d: {w: [] for w in widths} for d in MATMUL_DTYPES}
    for (dtype, w, t), elapsed in zip(points, seconds, strict=True):
        sweep[dtype][w].append((t, 6 * t * w**2 / elapsed))
    return sweep


def compute_points(cpu: bool, thorough: bool) -> int:
    """How many points `measure_compute` measures (its progress bar's share)."""
    tokens, widths = sweep_points(cpu, 1024 if cpu else 8192, thorough)
    return 1 + len(MATMUL_DTYPES) * len(tokens) * len(widths) + len(PASS_SIZES) + (0 if cpu else 2)


def _memory_rates(on: _LocalSweep) -> list[tuple[int, float]]:
    """[(bytes, bandwidth of an elementwise op writing that many bytes per device)], the launch of a
    program subtracted: the launch is the step's, not the pass's (a small pass would otherwise look as
    slow as a program). An accelerator's pass over 64 MiB still shows its launch, so it is swept to 1 GiB."""
    scale = on.over_devices(lambda v: v * 2.0, 1)
    launch = on.elementwise_seconds(scale, 4)
    return [
        (nbytes, 2 * nbytes / max(seconds - launch, seconds / 4))
        for nbytes in PASS_SIZES + (() if on.cpu else (2**28, 2**30))
        for seconds in [on.elementwise_seconds(scale, nbytes)]
    ]


def measure_compute(
    devices: list, repeats: int, thorough: bool = False, tick: Callable[[int], object] = lambda n: None
) -> tuple[float, float, dict[str, dict[int, list[tuple[int, float]]]], list[tuple[int, float]]]:
    """(large-matmul FLOP/s, memory bandwidth bytes/s, {dtype: {width: [(tokens, FLOP/s of a layer's
    matmuls of that width over that many tokens)]}}, [(bytes, bandwidth of an elementwise op writing
    that many bytes)]) per device with every local device busy at once, as in a step: simulated CPU
    devices share the host's cores and memory. The large matmul in bf16 on accelerators, fp32 on the CPU.

    The sweep runs a projection's three matmuls, (tokens × width)·(width × width) forward and both
    products of its backward (the weight gradient contracts over the tokens), in each compute dtype:
    over the few dozen tokens one device runs at once, the tokens and the dtype decide most of a
    CPU's rate (XLA:CPU runs bf16 matmuls well below fp32 ones), and on a CPU the width too: widths
    128 to 512 there, since a narrow model priced at the widest rate is priced too fast
    (`sweep_points`: which; `tick(n)` counts the points done). On an
    accelerator the sweep reaches 16,384 tokens and reads each point as the time one more product adds
    to a program (`_LocalSweep.in_program_seconds`), which is how the step runs its kernels.
    """
    import jax.numpy as jnp

    on = _LocalSweep(devices, repeats)
    n = 1024 if on.cpu else 8192
    flops = on.forward_rate(n, n, jnp.float32 if on.cpu else jnp.bfloat16)
    tick(1)
    sweep = _matmul_sweep(on, n, thorough, tick)
    memory = _memory_rates(on)
    tick(len(memory))
    return flops, memory[-1][1], sweep, memory
