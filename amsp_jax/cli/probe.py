"""Memory passes of the step, measured on probe models: what `amsp-jax profile` adds for the time model.

A step's memory-bound kernels (casts, gradient sinks, the optimizer update, the copies around
collectives) read and write each state block a number of times that depends on the backend's fusion, not
on the model. The profile compiles the real step for four probe LLaMA shapes under several placements
(`probe_steps`: 7 steps by default, all 40 with `--thorough`), reads the bytes those kernels touch from
each compiled program (`amsp_jax.compiled.hlo.memory_traffic`), and solves for the bytes per byte of
each block: the stored P block, the G block, the fp32 master, all parameters (the gathered weights and
full-size gradients every placement handles), the activations and, in the steps with two micro-batches,
the fp32 accumulator (the last three passed once per micro-batch). Timing the same steps, in rounds over
all of them, then gives the bandwidth those kernels reach while the step runs (each block at its size's
speed, `ClusterConfig.pass_speed`), a fixed cost per step (dispatch, the loss reduction), what a P
stored apart from the master costs and what a split collective's rounded intermediate results cost
(zero3 is timed flat and split), once collectives are priced with the tables just measured; the fit
weighs each probe by its relative error. Compute is priced with the matmul rates just measured too,
times one factor the fit finds (`Passes.compute_scale`): the sweep times bare matmuls minutes before the
probes run, and on a shared host the steps' matmuls may run well off the sweep's rates; taken as exact,
that error would land in the pass bandwidth. The profile writes the sweep's rates divided by the factor:
what the steps ran at.

The update's passes belong to the optimizer as much as to the backend: the probes run the
examples' AdamW chain (global-norm clipping, then AdamW), fp32 master and moments, bf16 compute.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from amsp_jax.core import backend
from amsp_jax.cost.hardware import PASS_BLOCKS as BLOCKS
from amsp_jax.errors import AmspError

# (placement, split collectives, micro-batches): every placement flat, zero3 split too, so the fit sees
# what a split costs beyond its bytes (`SPLIT_RESULTS`), and a replicated and a sharded G with two
# micro-batches, so it sees the accumulator's passes; neither of those stores P apart from the master,
# whose cost (`STORED_PARAMS`) the fit takes once per step.
PROBE_PLACEMENTS = (
    *((name, False, 1) for name in ("ddp", "zero1", "zero2", "zero3", "mics")),
    ("p=1x1,g=4x1,os=4x1", False, 1),
    ("p=2x1,g=4x2,os=4x2", False, 1),
    ("zero3", True, 1),
    ("ddp", False, 2),
    ("zero3", False, 2),
)

COMPILE_THREADS = 4  # at most: each compile holds a step's program and state in memory

# The default profile's probe steps, per probe model (`_probe_models`): 5 flat steps, about a sixth of
# `--thorough`'s 32 (every step compiles in about as long), chosen on a thorough profile's timings
# (benchmarks/results/profile_time_*) so that each fitted number stays pinned on a busy host: probe-b
# flat and sharded two ways spreads the memory passes far apart over one compute (the bandwidth) and
# tells G from the optimizer state (zero1) and a stored P from none, and with two micro-batches G
# replicated and sharded tells the accumulator from the per-micro-batch passes; probe-c's small step
# gives the fixed cost; probe-a's compute-bound step gives the compute scale. No split step: a split's
# price beyond its bytes keeps its default, which `--thorough` times.
DEFAULT_PROBES: tuple[tuple[tuple[str, bool, int], ...], ...] = (
    (("mics", False, 1),),
    (("ddp", False, 1), ("zero1", False, 1), ("zero3", False, 1), ("ddp", False, 2), ("zero3", False, 2)),
    (("p=1x1,g=4x1,os=4x1", False, 1),),
    (),
)
# Rounds the probe steps are timed in (`_time_probes`): `--thorough` at least this many, or `--repeats`.
ROUNDS = 2
# Wall seconds of one run of a one-micro-batch step of each probe model, on average over its
# placements, on a 2-core host (benchmarks/results/profile_time_*): the profile's estimate and progress
# bar count them, times the micro-batches.
STEP_SECONDS = (0.77, 0.53, 0.06, 2.0)


class ProbeFitError(AmspError):
    """The probe steps' times do not fit the memory-pass form (a machine busy while they ran)."""


@dataclasses.dataclass(frozen=True)
class Probe:
    """One compiled probe step: its state blocks (bytes per device), traffic and timing."""

    label: str
    blocks: tuple[float, ...]  # bytes per device of each block, in BLOCKS order
    traffic: int
    predicted_other_s: float  # compute and collectives by the time model, the rounding passes left out
    measured_s: float
    rounded: float = 0.0  # bytes of split collectives' rounded results, at scale (`cost.rounded_bytes`)
    twin: str = ""  # a split probe's flat form, by label
    compute_s: float = 0.0  # the compute in `predicted_other_s` (0: not told apart, taken as exact)
    executions: tuple[int, ...] = ()  # passes over each block per step (`timing.pass_executions`; (): 1)

    def runs(self) -> tuple[int, ...]:
        """Passes over each block per step."""
        return self.executions or (1,) * len(self.blocks)


def _probe_models() -> list[tuple[Any, int]]:
    from amsp_jax.models.llama import LlamaConfig

    # Shapes with different tokens per parameter, so the activation and parameter terms separate, and
    # one small enough that a step's fixed cost is a good share of it, so the fit can see that cost.
    return [
        (LlamaConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=688,
                     max_seq_len=128, name="probe-a"), 128),
        (LlamaConfig(vocab_size=4096, dim=320, n_layers=3, n_heads=5, n_kv_heads=5, ffn_dim=864,
                     max_seq_len=32, name="probe-b"), 16),
        (LlamaConfig(vocab_size=512, dim=96, n_layers=3, n_heads=3, n_kv_heads=1, ffn_dim=256,
                     max_seq_len=32, name="probe-c"), 32),
        # One whose stored weights outgrow the host's cache (18M parameters), where a stored P costs
        # time its bytes do not show (`stored_params`), which the three smaller ones cannot tell apart.
        (LlamaConfig(vocab_size=6144, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1376,
                     max_seq_len=16, name="probe-d"), 16),
    ]  # fmt: skip


def _compiled_probe(
    cluster_config: Any, model: Any, config: Any, batch: dict, name: str, split: bool, micro_batches: int
) -> dict[str, Any] | None:
    """One probe step compiled and read on this host's devices: its blocks, traffic and priced time, and
    what timing it needs; None for a preset this mesh cannot hold (e.g. one device)."""
    import jax
    import optax

    import amsp_jax as aj
    from amsp_jax import cost
    from amsp_jax.compiled import audit, hlo
    from amsp_jax.cost import timing
    from amsp_jax.models.llama import make_loss_fn

    cluster = cluster_config.cluster()
    try:
        strategy = aj.resolve(name, cluster)
    except ValueError:
        return None
    plan = aj.Plan(cluster, strategy, micro_batches, precision="mixed", remat="full", hierarchical=split,
                   prefetch=False)  # fmt: skip
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))
    trainer = aj.Trainer(plan, model, optimizer, make_loss_fn(model))
    trainer.setup(jax.random.key(0), batch["inputs"])
    sharded = trainer.shard_batch(batch)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), sharded)
    step = trainer.compile(trainer.abstract_state(), abstract)
    workload = audit.workload_of(trainer, batch, cost.llama_dims(config))
    estimate = timing.estimate(trainer.layout, workload, cluster_config)
    transfers = [t for group in timing.traffic(trainer.layout, workload).values() for t in group]
    rounding = sum(timing.rounding_time(t, cluster_config) for t in transfers)
    rounded = sum(timing.rounded_at_scale(t, cluster_config) for t in transfers)
    label = f"{config.name} {name}" + (f" M={micro_batches}" if micro_batches > 1 else "")
    return {
        "label": f"{label} split" if split else label,
        "twin": label if split else "",
        "blocks": tuple(timing.pass_blocks(estimate.prediction.memory, workload)[b] for b in BLOCKS),
        "executions": tuple(timing.pass_executions(micro_batches)[b] for b in BLOCKS),
        # The rounding passes are priced apart (`rounded`): the blocks' counts leave them out.
        "traffic": hlo.memory_traffic(step.as_text()) - 2 * sum(t.rounded for t in transfers),
        "other": estimate.time.compute_s + sum(estimate.time.exposed_s.values()) - rounding,
        "compute": estimate.time.compute_s,
        "rounded": rounded,
        "step": step, "sharded": sharded, "state": _filled_state(trainer.abstract_state()),
        "times": [],
    }  # fmt: skip


def _filled_state(abstract: Any) -> Any:
    """A state of the step's shapes and shardings, every float 0.01 and every integer 0, put on the
    devices from the host: the values do not change what a step costs, and compiling the state's
    initialiser would cost as much as compiling the step."""
    import jax
    import jax.numpy as jnp

    def filled(leaf: Any) -> Any:
        value = 0.01 if jnp.issubdtype(leaf.dtype, jnp.floating) else 0
        return jax.device_put(np.full(leaf.shape, value, leaf.dtype), leaf.sharding)

    return jax.tree.map(filled, abstract)


def _time_probes(compiled: list[dict[str, Any]], rounds: int, tick: Any = lambda kind: None) -> None:
    """Each probe's step times, in `rounds` rounds over all of them, so that a slow spell of the machine
    falls on all of them alike: each round runs every probe twice, timed; the first round runs each
    once more before, untimed (a step's first run pays for the first touches of its buffers)."""
    import jax

    for round_ in range(rounds):
        for probe in compiled:
            for timed in (*((False,) if round_ == 0 else ()), True, True):
                start = time.perf_counter()
                probe["state"], metrics = probe["step"](probe["state"], probe["sharded"])
                jax.block_until_ready((probe["state"], metrics))
                if timed:
                    probe["times"].append(time.perf_counter() - start)
            tick("timed")


def _chosen(thorough: bool, nodes: int) -> list[tuple[int, str, bool, int]]:
    """(probe model's index, placement, split, micro-batches) of each probe step (`probe_steps`)."""
    if thorough:
        chosen = [(i, *step) for i in range(len(DEFAULT_PROBES)) for step in PROBE_PLACEMENTS]
    else:
        chosen = [(i, *step) for i, steps in enumerate(DEFAULT_PROBES) for step in steps]
    return [step for step in chosen if not (step[2] and nodes == 1)]  # one node: nothing to split


def step_count(thorough: bool, nodes: int) -> int:
    """How many probe steps a profile of `nodes` nodes compiles and times."""
    return len(_chosen(thorough, nodes))


def run_seconds(thorough: bool, nodes: int) -> float:
    """About how long one run of every probe step takes (`STEP_SECONDS`)."""
    return sum(STEP_SECONDS[model] * micro_batches for model, _, _, micro_batches in _chosen(thorough, nodes))


def rounds(thorough: bool, repeats: int) -> int:
    """Rounds the probe steps are timed in (`_time_probes`)."""
    return max(ROUNDS, repeats) if thorough else ROUNDS


def runs(thorough: bool, repeats: int) -> int:
    """How many times `_time_probes` runs each probe step: twice a round, and once to warm up."""
    return 2 * rounds(thorough, repeats) + 1


def probe_steps(thorough: bool, nodes: int) -> list[tuple[Any, int, str, bool, int]]:
    """(model, sequence length, placement, split, micro-batches) of each probe step: every placement of
    every probe model where `thorough`, else the fewest that still tell each fitted number apart (module
    docstring; benchmarks/results/profile_time_*)."""
    models = _probe_models()
    return [(*models[i], *step) for i, *step in _chosen(thorough, nodes)]


def run_probes(
    cluster_config: Any, repeats: int, say: Any = print, thorough: bool = False, tick: Any = lambda kind: None
) -> list[Probe]:
    """Compile and read the probe steps (`probe_steps`) on this host's devices, then time them all in
    rounds (`rounds`, `_time_probes`); a probe's time is its median step. `tick("compiled")` after each
    step compiled, `tick("timed")` after each step timed in a round."""
    from amsp_jax.models.llama import Llama

    cluster = cluster_config.cluster()

    def compile_one(step: tuple[Any, int, str, bool, int]) -> dict[str, Any] | None:
        config, seq_len, name, split, micro_batches = step
        rows = cluster.num_devices * micro_batches
        tokens = np.random.default_rng(0).integers(0, config.vocab_size, (rows, seq_len + 1))
        batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
        found = _compiled_probe(cluster_config, Llama(config), config, batch, name, split, micro_batches)
        tick("compiled")
        return found

    # XLA compiles a program on one core: the steps compile side by side, one per core.
    with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, COMPILE_THREADS))) as pool:
        compiled = [found for found in pool.map(compile_one, probe_steps(thorough, cluster.nodes)) if found]
    say(f"  compiled {len(compiled)} probe steps; timing them in {rounds(thorough, repeats)} rounds")
    _time_probes(compiled, rounds(thorough, repeats), tick)
    probes = []
    for found in compiled:
        probes.append(Probe(found["label"], found["blocks"], found["traffic"], found["other"],
                            statistics.median(found["times"]), found["rounded"], found["twin"],
                            found["compute"], found["executions"]))  # fmt: skip
        say(f"  probe {found['label']}: {found['traffic'] / 1e6:.0f} MB of memory passes, "
            f"{probes[-1].measured_s * 1e3:.0f} ms per step")  # fmt: skip
    return probes


@dataclasses.dataclass(frozen=True)
class Passes:
    """Bytes touched per byte of each block, the bandwidth those passes reach, a fixed cost per step."""

    per_byte: dict[str, float]
    bandwidth: float
    step_overhead_s: float
    traffic_error: float  # largest |predicted / compiled − 1| of the probes' traffic
    stored_params: float = 0.0  # bytes per fp32 parameter byte a stored P adds (`STORED_PARAMS`)
    split_results: float = 2.0  # bytes per byte of a split's rounded results (`SPLIT_RESULTS`)
    compute_scale: float = 1.0  # the probe steps' compute over what the time model priced it at


def fit(probes: list[Probe], speed: Callable[[float], float] = lambda nbytes: 1.0) -> Passes:
    """Least-squares pass counts from the compiled traffic, then bandwidth, overhead and the scale of
    the priced compute (where the probes tell it apart) from the times; `speed(nbytes)`: how much
    faster a pass over a block of that size runs than one at scale (`ClusterConfig.pass_speed`). A
    split probe (`twin`: its flat form's label) enters only the split's price: what it ran beyond its
    twin, per byte of its rounded results."""
    flat = [p for p in probes if not p.twin]
    blocks = np.array([p.blocks for p in flat])
    passed = blocks * np.array([p.runs() for p in flat])  # bytes a step passes of each block, once
    traffic = np.array([p.traffic for p in flat], dtype=float)
    # Nonnegative by construction: a block the fit would give a negative count gets none, and the rest refit.
    active = list(range(len(BLOCKS)))
    while True:
        counts, *_ = np.linalg.lstsq(passed[:, active], traffic, rcond=None)
        if (counts >= 0).all():
            break
        active.pop(int(np.argmin(counts)))
    per_byte = dict.fromkeys(BLOCKS, 0.0)
    for i, c in zip(active, counts, strict=True):
        per_byte[BLOCKS[i]] = float(c)
    touched = passed * np.array([per_byte[b] for b in BLOCKS])
    modelled = touched.sum(axis=1)
    # The bytes the passes would touch at scale (a small block's run faster): what the times fit.
    at_scale = (touched / np.vectorize(speed)(blocks)).sum(axis=1)
    compute = np.array([p.compute_s for p in flat])
    # What the probes ran beyond their priced collectives; where `compute_s` does not tell the compute
    # apart (zero), beyond their priced compute too.
    rest = np.array([p.measured_s - p.predicted_other_s for p in flat]) + compute
    # Relative errors count: unweighted, the slowest probes' noise would set the fixed cost, which is
    # most of what the smallest steps have left.
    weight = 1 / np.array([p.measured_s for p in flat])
    # A probe with a P block stores P apart from the master: all its parameters, in fp32 bytes at scale,
    # are what that costs beyond the block's own passes (`STORED_PARAMS`).
    model = blocks[:, BLOCKS.index("model")]
    stored = (blocks[:, BLOCKS.index("params")] > 0) * model / np.vectorize(speed)(model)
    # Columns: fixed cost, passes, stored P, compute. A step has no negative fixed cost and a stored P
    # no negative one: a column the fit would give a negative coefficient is dropped and the rest refit
    # (keeping the free fit's slope with the intercept dropped would price every step too high by it).
    columns = [weight, weight * at_scale, weight * stored, weight * compute]
    # Only probes with and without a stored P tell its cost from the passes', and only where XLA:CPU
    # converts a stored 16-bit weight to fp32 at each use (`backend.widens_16bit_dots`) is there a cost
    # to tell: elsewhere the column would take up whatever noise tells the P-storing probes apart.
    tells = stored.any() and not stored.all() and backend.widens_16bit_dots("cpu")
    active = [0, 1, 2] if tells else [0, 1]
    if compute.any():
        active.append(3)
    while True:
        found, *_ = np.linalg.lstsq(np.stack([columns[i] for i in active], axis=1), weight * rest, rcond=None)
        negative = [i for i, c in zip(active, found, strict=True) if c < 0 and i in (0, 2)]
        if not negative:
            break
        active.remove(negative[0])
    coefficient = dict.fromkeys(range(3), 0.0) | {3: 1.0} | dict(zip(active, map(float, found), strict=True))
    overhead, seconds_per_byte = coefficient[0], coefficient[1]
    if seconds_per_byte <= 0 or coefficient[3] <= 0:
        grows = "memory passes" if seconds_per_byte <= 0 else "compute"
        raise ProbeFitError(
            f"the probe steps' times do not grow with their {grows} (a busy machine?); run "
            "`amsp-jax profile` again on an idle one, or with --thorough (more probe steps)"
        )
    return Passes(
        per_byte,
        float(1 / seconds_per_byte),
        max(0.0, float(overhead)),
        float(np.max(np.abs(modelled / traffic - 1))),
        coefficient[2] / seconds_per_byte,
        2.0 if (split := split_cost(probes)) is None else split / seconds_per_byte,
        coefficient[3],
    )


def split_cost(probes: list[Probe]) -> float | None:
    """Seconds per byte at scale of a split's rounded results, beyond its priced collectives: each
    split probe's time over its flat twin's, less what the tables price between the two, fitted
    through zero (relative errors weighted), never below zero; None where no pair was timed."""
    by_label = {p.label: p for p in probes}
    pairs = [(p, by_label[p.twin]) for p in probes if p.twin in by_label and p.rounded > 0]
    if not pairs:
        return None
    weight = np.array([1 / flat.measured_s for _, flat in pairs])
    rest = lambda p: p.measured_s - p.predicted_other_s  # noqa: E731
    extra = np.array([rest(split) - rest(flat) for split, flat in pairs])
    rounded = np.array([split.rounded for split, _ in pairs])
    return max(0.0, float(np.sum(weight**2 * extra * rounded) / np.sum((weight * rounded) ** 2)))
