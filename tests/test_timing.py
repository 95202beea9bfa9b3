"""The time model and the cluster configs it reads."""

import dataclasses
import functools
import itertools
import math
from collections import Counter
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit, hlo
from amsp_jax.core.mesh import plan_axes
from amsp_jax.core.space import Cluster, Strategy
from amsp_jax.cost import llama_workload, predict, timing
from amsp_jax.cost.hardware import (
    KINDS,
    LEVELS,
    PASS_BLOCKS,
    BandwidthTable,
    ClusterConfigError,
    MatmulRates,
    from_dict,
    load,
    parse_size,
)
from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn

MODEL = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176)
CLUSTER = Cluster(2, 4)


def test_bandwidth_between_measured_sizes_follows_a_latency_bandwidth_line():
    # A link with 20 us of latency and 5 GB/s, measured (as nccl-tests reports it) at three sizes.
    latency, rate = 20e-6, 5e9
    sizes = (2.0**12, 2.0**16, 2.0**20)
    table = BandwidthTable(sizes, tuple(s / (latency + s / rate) for s in sizes))
    for size in (6e3, 2.0**14, 2.3e5, 7e5):
        assert size / table.at(size) == pytest.approx(latency + size / rate, rel=1e-12)
    assert table.at(2**30) == table.busbw[-1]  # flat above the table
    assert 2**9 / table.at(2**9) == pytest.approx(2**10 / table.at(2**10))  # same time as the smallest


def test_sizes_parse_with_binary_units():
    assert parse_size("64KiB") == 65536 and parse_size("1.5GiB") == 1.5 * 2**30 and parse_size(4096) == 4096


@pytest.mark.parametrize("name", ["a800-8x-ib800", "h100-dgx", "cpu-sim"])
def test_shipped_cluster_configs_load_with_every_table(name):
    config = load(f"configs/clusters/{name}.yaml")
    assert config.memory_limit < config.memory_bytes and config.peak_flops > 0
    for kind in KINDS:
        for level in LEVELS:
            assert config.busbw(kind, level, 2**20) > 0
    if name != "cpu-sim":  # NVLink is faster than the per-device share of the NICs
        assert config.busbw("all-gather", "intra", 2**28) > 5 * config.busbw("all-gather", "inter", 2**28)


def test_collective_time_is_per_device_bytes_over_bus_bandwidth():
    config = load("configs/clusters/a800-8x-ib800.yaml")
    # Three all-reduces of 256 MiB per device across nodes. The YAML's inter rows bracketing 256 MiB are
    # [28MiB, 10 GB/s] and [448MiB, 11.5 GB/s], so one op's time lies on the line through
    #   28 * 2**20 / 10e9   = 2.9360128e-3 s  and  448 * 2**20 / 11.5e9 = 40.848874e-3 s
    # at (256 - 28) / (448 - 28) = 228/420 of the way: 2.9360128e-3 + 228/420 * 37.912861e-3 = 23.517280e-3 s.
    size, executions = 3 * 2**28, 3
    assert config.collective_time("all-reduce", "inter", size, executions) == pytest.approx(70.551840e-3)
    # Over a ring of 2 devices on 2 nodes, NCCL's latency adds per op 8.4 us + 2 walks x 1 network hop
    # x 14 us = 36.4 us: 3 x 36.4e-6 = 0.1092e-3 s more.
    ring = config.collective_time("all-reduce", "inter", size, executions, 2, 2)
    assert ring == pytest.approx(70.661040e-3)


def test_a_measured_flat_ring_prices_flat_collectives_of_its_shape_only():
    values = yaml.safe_load(Path("configs/clusters/cpu-sim.yaml").read_text())
    values.pop("flat_ring", None)
    for kind in KINDS:
        values["bandwidth"][kind].pop("flat", None)
    formula = from_dict(values)  # the intra and inter tables alone
    slow = [[4096, 0.001], [2**24, 0.01]]  # far below the intra and inter tables
    for kind in KINDS:
        values["bandwidth"][kind]["flat"] = slow
    with pytest.raises(ClusterConfigError, match="flat_ring"):
        from_dict(values)
    values["flat_ring"] = {"devices": 8, "nodes": 2}
    config = from_dict(values)
    size = 2**25  # above the table: its last bandwidth
    for kind in KINDS:
        measured = config.collective_time(kind, "inter", size, 1, 8, 2)
        assert measured == pytest.approx(size / (0.01 * 1e9)) and measured > formula.collective_time(
            kind, "inter", size, 1, 8, 2
        )
        # Other shapes, and collectives within one level, keep the tables of their levels.
        for args in (("inter", size, 1, 16, 2), ("inter", size, 1, 2, 2), ("intra", size, 1, 4, 1)):
            assert config.collective_time(kind, *args) == formula.collective_time(kind, *args)


def test_a_group_smaller_than_its_level_is_priced_from_its_own_table():
    values = yaml.safe_load(Path("configs/clusters/cpu-sim.yaml").read_text())
    plain = from_dict(values)
    pairs = [[4096, 0.5], [2**24, 5.0]]  # far above the intra tables
    for kind in KINDS:
        values["bandwidth"][kind]["intra/2"] = pairs
    config = from_dict(values)
    size = 2**25  # above the tables: their last bandwidth
    for kind in KINDS:
        assert config.collective_time(kind, "intra", size, 1, 2, 1) == pytest.approx(size / 5e9)
        # The whole node's group, the other level and merged groups (0) keep the level's tables.
        for args in (("intra", size, 1, 4, 1), ("inter", size, 1, 2, 2), ("intra", size, 1, 0, 0)):
            assert config.collective_time(kind, *args) == plain.collective_time(kind, *args)
    # A ring over 2 nodes with 2 devices on each runs its hops inside a node as a pair does: with pairs
    # slower than the NICs, they set its pace.
    for kind in KINDS:
        values["bandwidth"][kind]["intra/2"] = [[4096, 0.0001], [2**24, 0.001]]
    crawling = from_dict(values)
    for kind in KINDS:
        nic = size * 2 / 4
        inside = crawling.collective_time(kind, "inter", size, 1, 4, 2)
        assert inside == pytest.approx((size - nic) / 1e6)
        assert inside > 100 * plain.collective_time(kind, "inter", size, 1, 4, 2)
    for level, why in (("intra/1", "needs 2 devices"), ("intra-2", "intra/N, inter/N")):
        values["bandwidth"]["all-gather"] = {**values["bandwidth"]["all-gather"], level: pairs}
        with pytest.raises(ClusterConfigError, match=why):
            from_dict(values)
        values["bandwidth"]["all-gather"].pop(level)


def test_the_planner_prices_a_plan_over_pairs_from_the_pairs_table():
    values = yaml.safe_load(Path("configs/clusters/cpu-sim.yaml").read_text())
    plain = from_dict(values)
    for kind in KINDS:
        values["bandwidth"][kind]["intra/2"] = [[4096, 0.0001], [2**24, 0.001]]  # pairs crawl
    slow_pairs = from_dict(values)
    workload = llama_workload(MODEL, 32, 2, 1, remat="full")
    for strategy, over_pairs in (("p=2x1,g=2x1,os=2x1", True), ("p=4x1,g=4x1,os=4x1", False)):
        axes = plan_axes(CLUSTER, Strategy.parse(strategy))
        before = timing.estimate(axes, workload, plain).time.step_s
        after = timing.estimate(axes, workload, slow_pairs).time.step_s
        assert (after > 10 * before) if over_pairs else after == before


def test_traffic_regroups_exactly_the_cost_models_bytes():
    workload = llama_workload(MODEL, 32, 2, 3, remat="full")
    axes = plan_axes(CLUSTER, Strategy.parse("p=2x1,g=4x1,os=4x2"))
    groups = timing.traffic(axes, workload)

    def totals(transfers) -> Counter:
        found = Counter()
        for t in transfers:
            found[(t.kind, t.level, t.group, t.nodes, "bytes")] += t.bytes
            found[(t.kind, t.level, t.group, t.nodes, "issued")] += t.executions
        return found

    # Regrouped by overlap window, the same bytes and the same collectives issued.
    assert totals(t for ts in groups.values() for t in ts) == totals(predict(axes, workload).transfers)
    assert {t.phase for ts in groups.values() for t in ts} <= set(timing.GROUPS)


@pytest.mark.parametrize("attention", ["xla", "auto"])
def test_compute_counts_model_flops_plus_what_remat_repeats(attention):
    config = load("configs/clusters/a800-8x-ib800.yaml")
    for remat, extra in [("none", 0), ("dots", 1), ("full", 2)]:
        w = llama_workload(dataclasses.replace(MODEL, attention=attention), 64, 1, 2, remat=remat)
        flops = timing.compute_times(w, config).total * config.sustained_flops
        d = w.dims
        attention_forward = 4 * d.n_layers * d.n_heads * d.head_dim * w.seq_len
        layers = sum(leaf.size for leaf in w.leaves if leaf.stacked)
        recompute = [0, attention_forward, 2 * layers + attention_forward][extra]
        # Flash-style attention's backward recomputes the scores Q·Kᵀ: half the attention's forward.
        recompute += 0 if attention == "xla" else attention_forward // 2
        assert flops == pytest.approx((w.flops_per_token() + recompute) * w.tokens_per_device())


def test_windows_hide_communication_behind_compute_but_charge_interference():
    config = load("configs/clusters/a800-8x-ib800.yaml")
    compute = timing.Compute(1.0, 2.0, 0.1, 0.2, micro_batches=2)
    comm = dict.fromkeys(timing.GROUPS, 0.0)
    comm[timing.FORWARD_GATHER] = 0.5  # hidden: costs the interference only
    comm[timing.LAYER_GRADS] = 3.0  # one second more than the backward
    comm[timing.REDUCTION] = 1.0  # half of the last backward (1.1 s) hides it partly
    exposed = timing.exposed_times(comm, compute, config)
    assert exposed["forward"] == pytest.approx(config.overlap_interference * 0.5)
    assert exposed["backward"] == pytest.approx(1.0)
    assert exposed["reduction"] == pytest.approx(1.0 - config.reduction_overlap * 1.1)


def test_step_time_and_mfu_of_a_single_device():
    config = dataclasses.replace(load("configs/clusters/a800-8x-ib800.yaml"), hbm_bandwidth=math.inf)
    axes = plan_axes(Cluster(1, 1), Strategy.parse("p=1x1,g=1x1,os=1x1"))
    # No remat and the materialising attention: every FLOP is a model FLOP, so MFU is the efficiency.
    w = llama_workload(dataclasses.replace(MODEL, attention="xla"), 64, 1, 4, remat="none")
    estimate = timing.estimate(axes, w, config)
    assert sum(estimate.time.communication_s.values()) == 0
    assert estimate.time.mfu == pytest.approx(config.compute_efficiency)
    # By hand: the multiplied parameters are 2 layers x (q 64x64 + k, v 64x32 + o 64x64 + 3 MLP 64x176
    # + 2 norms 64) = 2 x 46208, the final norm 64 and the head 64x256 (the input embedding is looked
    # up): 108864. Per token 6 x 108864 + 12 x 2 layers x 4 heads x 16 x 64 tokens = 751488 FLOPs, at
    # 312e12 x 0.55 = 171.6e12 FLOP/s: 171.6e12 / 751488 = 228.34696e6 tokens/s, and a step of
    # 64 x 4 = 256 tokens takes 256 / 228.34696e6 = 1.1211010e-6 s.
    assert estimate.time.tokens_per_s(1) == pytest.approx(228.34696e6)
    assert estimate.time.step_s == pytest.approx(1.1211010e-6)
    # Flash-style attention recomputes Q·Kᵀ in the backward: 2 x 2 x 4 x 16 x 64 = 16384 FLOPs per token
    # that MFU does not count: 0.55 x 751488 / (751488 + 16384) = 0.53826471.
    flash = llama_workload(MODEL, 64, 1, 4, remat="none")
    assert timing.estimate(axes, flash, config).time.mfu == pytest.approx(0.53826471)


def test_per_micro_batch_communication_scales_with_micro_batches():
    config = load("configs/clusters/a800-8x-ib800.yaml")
    axes = plan_axes(CLUSTER, Strategy.parse("p=4x2,g=4x2,os=4x2"))
    one, four = (
        timing.communication_times(timing.traffic(axes, llama_workload(MODEL, 32, 1, m)), config)
        for m in (1, 4)
    )
    assert four[timing.FORWARD_GATHER] == pytest.approx(4 * one[timing.FORWARD_GATHER])
    assert four[timing.LAYER_GRADS] == pytest.approx(4 * one[timing.LAYER_GRADS])
    assert four[timing.REDUCTION] == pytest.approx(one[timing.REDUCTION])


def test_memory_passes_are_read_and_checked():
    values = yaml.safe_load(Path("configs/clusters/cpu-sim.yaml").read_text())
    config = from_dict(values)
    assert config.memory_passes is not None
    assert set(config.memory_passes) == {*PASS_BLOCKS, "stored_params", "split_results"}
    assert config.memory_passes["stored_params"] == 0  # measured before the profile fitted it: none
    assert config.memory_passes["split_results"] == 2  # nor this: the compiled bytes, read and written
    assert config.pass_bandwidth > 0
    for bad, message in (
        ({"bandwidth_gbps": 0}, "bandwidth_gbps must be positive"),
        ({"grads": -1.0}, "grads must be positive"),
        ({"params": "many"}, "params = 'many' is not a number"),
        ({"optimizer": 3.0}, "unknown memory_passes key"),
    ):
        broken = {**values, "memory_passes": {**values["memory_passes"], **bad}}
        with pytest.raises(ClusterConfigError, match=message):
            from_dict(broken)


def test_a_small_block_passes_at_its_measured_speed():
    values = yaml.safe_load(Path("configs/clusters/cpu-sim.yaml").read_text())
    values["device"]["memory_bandwidths"] = [["1MiB", 4.0], ["4MiB", 3.0], ["64MiB", 1.0]]
    config = from_dict(values)
    per_byte = lambda nbytes: timing.pass_time("grads", nbytes, config) / nbytes  # noqa: E731
    assert per_byte(2**26) == pytest.approx(per_byte(2**27))  # flat beyond the largest buffer measured
    assert per_byte(2**26) == pytest.approx(4 * per_byte(2**20))  # 4 GB/s against 1 at scale
    assert per_byte(2**20) == pytest.approx(per_byte(2**10))  # no faster than the smallest measured
    assert per_byte(2**26) > per_byte(2**23) > per_byte(2**22)
    without = dataclasses.replace(config, memory_bandwidths=None)
    assert timing.pass_time("grads", 2**20, without) == pytest.approx(
        4 * timing.pass_time("grads", 2**20, config)
    )
    for rows in ([["1MiB", 0]], []):
        values["device"]["memory_bandwidths"] = rows
        with pytest.raises(ClusterConfigError, match="memory_bandwidths"):
            from_dict(values)


@functools.cache
def _demo_step(
    strategy: str, micro_batches: int = 1, hierarchical: bool = False
) -> tuple[aj.Trainer, dict, str, LlamaConfig]:
    """The `make demo` model's step under `strategy` with one sequence per device and micro-batch: its
    trainer, batch, compiled program text and model config; cached, as three tests share programs."""
    config = LlamaConfig.from_yaml("configs/models/small.yaml")
    plan = aj.Plan(CLUSTER, aj.resolve(strategy, CLUSTER) if "=" not in strategy else strategy,
                   micro_batches, precision="mixed", remat="full", hierarchical=hierarchical)  # fmt: skip
    model = Llama(config)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))
    trainer = aj.Trainer(plan, model, optimizer, make_loss_fn(model))
    tokens = np.zeros((CLUSTER.num_devices * micro_batches, 65), np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    trainer.setup(jax.random.key(0), batch["inputs"])
    sharded = trainer.shard_batch(batch)
    compiled = trainer.compile(
        trainer.abstract_state(),
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), sharded),
    )
    return trainer, batch, compiled.as_text(), config


@pytest.mark.parametrize("strategy", ["p=2x1,g=4x2,os=2x1", "p=4x2,g=2x1,os=1x1"])
def test_memory_passes_predict_the_compiled_traffic_of_a_model_and_plans_the_probes_never_ran(strategy):
    """The pass counts in cpu-sim were read off probe models under other placements; the compiled
    step of the `make demo` model under these two plans shows 17–33 % more traffic than they predict
    (its 256-token vocabulary and 64-token sequences lie outside the probes' shapes); the bound says
    how far the counts carry, and fails if a change to the step moves the traffic further."""
    hardware = load("cpu-sim")
    trainer, batch, text, config = _demo_step(strategy)
    workload = audit.workload_of(trainer, batch, cost.llama_dims(config))
    memory = timing.estimate(trainer.layout, workload, hardware).prediction.memory
    blocks = timing.pass_blocks(memory, workload)
    predicted = sum(hardware.memory_passes[b] * blocks[b] for b in PASS_BLOCKS)
    assert predicted == pytest.approx(hlo.memory_traffic(text), rel=0.3)


@pytest.mark.parametrize("strategy", ["zero3", "p=2x1,g=4x2,os=2x1"])
def test_a_split_collective_costs_the_compiled_passes_that_round_what_its_stages_pass_on(strategy):
    """XLA:CPU runs a bf16 collective in fp32: split into stages, each stage's fp32 result is rounded to
    bf16 in a kernel of its own before the next stage reads it. The compiled split step touches exactly
    twice those results' bytes more than the flat one, and the time model charges them to the split
    step alone, by the profile's `split_results`."""
    hardware = load("cpu-sim")
    costlier = dataclasses.replace(hardware, memory_passes={**hardware.memory_passes, "split_results": 6.0})
    texts, rounded, extra = {}, {}, {}
    for split in (True, False):
        trainer, batch, texts[split], config = _demo_step(strategy, hierarchical=split)
        workload = audit.workload_of(trainer, batch, cost.llama_dims(config))
        transfers = [t for group in timing.traffic(trainer.layout, workload).values() for t in group]
        rounded[split] = sum(t.rounded for t in transfers)
        extra[split] = (
            timing.estimate(trainer.layout, workload, costlier).time.step_s
            - timing.estimate(trainer.layout, workload, hardware).time.step_s
        )
    assert rounded[False] == 0 and rounded[True] > 0
    assert hlo.memory_traffic(texts[True]) - hlo.memory_traffic(texts[False]) == 2 * rounded[True]
    assert extra[False] == 0 and extra[True] > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["p=2x1,g=4x2,os=2x1"])
def test_the_passes_grow_with_the_micro_batches_as_the_compiled_traffic_does(strategy):
    """Each micro-batch passes over the weights, full-size gradients and its activations again: the
    compiled step's memory traffic grows about 1.8x and 3.1x from one micro-batch to two and four of the
    same size, and the passes priced for it follow (once per step, they would stay flat: 0.27x at four).
    The shipped profile has no accumulator count (measured before the probes ran micro-batches)."""
    # Without the bandwidth table every pass runs at one speed, so seconds × bandwidth are the bytes.
    hardware = dataclasses.replace(load("cpu-sim"), memory_bandwidths=None)
    for micro_batches in (1, 2, 4):
        trainer, batch, text, config = _demo_step(strategy, micro_batches)
        workload = audit.workload_of(trainer, batch, cost.llama_dims(config))
        seconds = timing.estimate(trainer.layout, workload, hardware).time.memory_s
        predicted = (sum(seconds.values()) - hardware.step_overhead) * hardware.pass_bandwidth
        assert predicted == pytest.approx(hlo.memory_traffic(text), rel=0.3), micro_batches


@pytest.mark.slow
def test_a_replicated_g_passes_its_accumulator_once_per_micro_batch_in_the_compiled_step():
    """With micro-batches each one's gradient is added into an fp32 accumulator the size of the G block:
    a replicated G (ddp) passes a full-size one per micro-batch, a sharded one (zero2, zero3) a shard.
    The compiled traffic of the demo model under those three placements at one, two and three
    micro-batches is a sum of the pass blocks, each times its passes per step (`pass_executions`): the
    least-squares fit with the accumulator among them misses no program by 10 % (XLA:CPU of jaxlib
    0.10.2: 1 %, of 0.12: 7 %), less than half what the best fit without it misses (16 %, 20 %)."""
    hardware = load("cpu-sim")
    passed, traffic = [], []
    for strategy, micro_batches in itertools.product(("ddp", "zero2", "zero3"), (1, 2, 3)):
        trainer, batch, text, config = _demo_step(strategy, micro_batches)
        workload = audit.workload_of(trainer, batch, cost.llama_dims(config))
        memory = timing.estimate(trainer.layout, workload, hardware).prediction.memory
        blocks = timing.pass_blocks(memory, workload)
        runs = timing.pass_executions(micro_batches)
        passed.append([blocks[b] * runs[b] for b in PASS_BLOCKS])
        traffic.append(hlo.memory_traffic(text))
    found, compiled = np.array(passed), np.array(traffic, dtype=float)

    def worst_miss(columns: list[int]) -> float:
        counts, *_ = np.linalg.lstsq(found[:, columns], compiled, rcond=None)
        return float(np.max(np.abs(found[:, columns] @ counts / compiled - 1)))

    every = list(range(len(PASS_BLOCKS)))
    with_accumulator = worst_miss(every)
    without = worst_miss([i for i in every if PASS_BLOCKS[i] != "accumulator"])
    assert with_accumulator < 0.1 and with_accumulator < without / 2, (with_accumulator, without)


def test_matmuls_run_at_the_rate_the_cluster_gives_their_tokens_and_dtype():
    config = load("configs/clusters/cpu-sim.yaml")
    table = BandwidthTable((16.0, 64.0), (1e9, 4e9))  # FLOP/s of matmuls over 16 and 64 tokens
    rates = dataclasses.replace(config, matmul_rates={"bfloat16": MatmulRates({0: table})})
    w = llama_workload(dataclasses.replace(MODEL, attention="xla"), 64, 1, 2, remat="none")
    fast, slow = (timing.compute_times(x, rates) for x in (w, w.with_(seq_len=16, micro_batches=8)))
    # The same FLOPs per token and tokens per step; four times slower over 16 tokens at once.
    flops = w.flops_per_token() * w.tokens_per_device()
    assert fast.total == pytest.approx(flops / 4e9)
    slow_flops = w.with_(seq_len=16).flops_per_token() * 16 * 8
    assert slow.total == pytest.approx(slow_flops / 1e9)
    # fp32 compute has no table here: every matmul at the device's one rate, as without any table.
    fp32 = llama_workload(dataclasses.replace(MODEL, attention="xla"), 64, 1, 2, "fp32", remat="none")
    assert timing.compute_times(fp32, rates).total == pytest.approx(flops / config.sustained_flops)
    flat = timing.compute_times(w, dataclasses.replace(config, matmul_rates=None))
    assert flat.total == pytest.approx(flops / config.sustained_flops)


def test_matmul_rates_read_per_dtype_or_as_one_table_for_every_dtype():
    raw = yaml.safe_load(Path("configs/clusters/cpu-sim.yaml").read_text())
    raw["device"]["matmul_rates"] = {"bfloat16": [[8, 2.0], [64, 8.0]], "float32": [[8, 4.0]]}
    config = from_dict(raw, "test")
    assert config.matmul_rate(8, "bfloat16") == 2e9 and config.matmul_rate(64, "bfloat16") == 8e9
    assert config.matmul_rate(8, "float32") == 4e9
    raw["device"]["matmul_rates"] = [[8, 2.0], [64, 8.0]]
    assert from_dict(raw, "test").matmul_rate(64, "float32") == 8e9
    raw["device"]["matmul_rates"] = {"fp16": [[8, 2.0]]}
    with pytest.raises(ClusterConfigError, match=r"unknown dtype.*bfloat16, float32"):
        from_dict(raw, "test")
    raw["device"]["matmul_rates"] = {"bfloat16": {"wide": [[8, 2.0]]}}
    with pytest.raises(ClusterConfigError, match=r"bfloat16: widths must be positive integers"):
        from_dict(raw, "test")


def test_matmul_rates_by_width_interpolate_in_log_width_and_price_each_leaf_at_its_own():
    raw = yaml.safe_load(Path("configs/clusters/cpu-sim.yaml").read_text())
    raw["device"]["matmul_rates"] = {"bfloat16": {128: [[64, 2.0]], 512: [[64, 8.0]]}}
    config = from_dict(raw, "test")
    # Halfway in log-width between 128 and 512 is 256; beyond the measured widths, the nearest one's.
    assert [config.matmul_rate(64, "bfloat16", w) / 1e9 for w in (64, 128, 256, 512, 4096)] == pytest.approx(
        [2.0, 2.0, 5.0, 8.0, 8.0]
    )
    # Each layer leaf at its own width: a model with only 128-wide matrices runs at 2 GFLOP/s, one with
    # only 512-wide ones at 8, whatever else they are.
    narrow = LlamaConfig(vocab_size=128, dim=128, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=128)
    wide = dataclasses.replace(narrow, dim=512, ffn_dim=512, vocab_size=512, n_heads=8, n_kv_heads=8)
    for model, rate in ((narrow, 2e9), (wide, 8e9)):
        w = llama_workload(dataclasses.replace(model, attention="xla"), 64, 1, 1, remat="none")
        layers = sum(leaf.size for leaf in w.leaves if leaf.stacked and len(leaf.shape) > 2)
        compute = timing.compute_times(w, config)
        attention = w.attention_run_flops_per_token(12) // 3 * w.tokens_per_device() / rate
        # The norms' scales are 1-D per layer, priced at the narrowest width: what they add is theirs.
        norms = sum(leaf.size for leaf in w.leaves if leaf.stacked and len(leaf.shape) == 2)
        expected = (2 * layers * 64) / rate + attention + 2 * norms * 64 / 2e9
        assert compute.forward_layers == pytest.approx(expected)


def test_an_untied_input_embedding_is_looked_up_not_multiplied():
    # XLA counts the forward of an untied LLaMA as many FLOPs as the tied one: the lookup multiplies nothing.
    tokens = np.zeros((2, 8), np.int32)
    compiled_flops, model_flops = [], []
    for tied in (False, True):
        config = dataclasses.replace(MODEL, vocab_size=512, attention="xla", tie_embeddings=tied)
        model = Llama(config)
        params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens))  # shapes suffice
        forward = jax.jit(lambda p, m=model: m.apply(p, tokens)).lower(params).compile()
        compiled_flops.append(forward.cost_analysis()["flops"])
        model_flops.append(llama_workload(config, 8).flops_per_token())
    assert compiled_flops[0] == compiled_flops[1] and model_flops[0] == model_flops[1]
    untied = dataclasses.replace(MODEL, vocab_size=512)
    assert model_flops[0] == 6 * (untied.num_params() - 512 * untied.dim) + 12 * 2 * 4 * 16 * 8
    # The Trainer's workload finds the lookup in the model's program, as the config says.
    trainer = aj.Trainer(aj.Plan(CLUSTER, aj.resolve("zero3", CLUSTER), 1), Llama(untied), optax.sgd(0.1),
                         make_loss_fn(Llama(untied)))  # fmt: skip
    trainer.setup(jax.random.key(0), np.zeros((8, 8), np.int32))
    batch = {"inputs": np.zeros((8, 8), np.int32), "targets": np.zeros((8, 8), np.int32)}
    workload = audit.workload_of(trainer, batch, cost.llama_dims(untied))
    assert [leaf.path for leaf in workload.leaves if leaf.looked_up] == [("embed",)]
    assert workload.flops_per_token() == model_flops[0]


@pytest.mark.parametrize("style", ["loop", "scan", "stack", "nnx list", "nnx scan"])
def test_a_traced_models_token_embedding_is_its_only_looked_up_leaf(style):
    from amsp_jax.cost import trace as workload
    from tests import model_zoo

    spec = workload.trace(model_zoo.model(style), (np.zeros((2, 8), np.int32),))
    # Not the learned positions (sliced at fixed rows, then added) nor the head: the token table only.
    assert [leaf.path[-1] for leaf in spec.leaves if leaf.looked_up] == ["embedding"]


def test_a_weight_picked_at_fixed_rows_is_not_looked_up():
    from flax import linen as nn

    from amsp_jax.layers.discovery import looked_up_leaves

    class Loop(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.normal(), (3, x.shape[-1], x.shape[-1]))
            table = self.param("table", nn.initializers.normal(), (10, x.shape[-1]))
            for i in range(3):
                x = x @ jax.lax.dynamic_index_in_dim(w, i, keepdims=False)
            return x + jnp.take(table, jnp.argmax(x, -1), axis=0)

    x = np.ones((2, 4), np.float32)
    params = jax.eval_shape(lambda: Loop().init(jax.random.key(0), x))["params"]
    assert looked_up_leaves(Loop(), params, (x,)) == {("table",)}


def test_a_stored_p_costs_the_same_beyond_its_block_whatever_its_size():
    config = load("configs/clusters/cpu-sim.yaml")
    passes = dict(config.memory_passes or dict.fromkeys(PASS_BLOCKS, 1.0))
    plain = dataclasses.replace(config, memory_passes={**passes, "stored_params": 0.0},
                                pass_bandwidth=config.pass_bandwidth or 1e9)  # fmt: skip
    stored = dataclasses.replace(plain, memory_passes={**passes, "stored_params": 2.0})
    w = llama_workload(MODEL, 64, 1, 1)
    added = {}
    for name in ("ddp", "zero3", "mics", "zero1", "zero2", "p=2x1,g=4x2,os=4x2"):
        axes = plan_axes(CLUSTER, aj.resolve(name, CLUSTER))
        with_it, without = (timing.estimate(axes, w, c).time.step_s for c in (stored, plain))
        added[name] = with_it - without
    # P cast from the master where it is used (ddp, zero3, mics): nothing; stored (a replicated or a
    # half block): the same pass over every fp32 parameter byte.
    assert added["ddp"] == added["zero3"] == added["mics"] == 0
    assert added["zero1"] > 0
    assert added["zero1"] == pytest.approx(added["zero2"]) == pytest.approx(added["p=2x1,g=4x2,os=4x2"])
