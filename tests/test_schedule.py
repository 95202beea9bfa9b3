"""One schedule: the step executes it, the cost model prices it, the compiled program matches it."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
import pytest

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit
from amsp_jax.core import schedule
from amsp_jax.core.leaf import Leaf
from amsp_jax.core.mesh import plan_axes
from amsp_jax.cost.hardware import load
from amsp_jax.models.llama import Llama, llama_spec, make_loss_fn
from amsp_jax.planner import request as planner_request
from amsp_jax.planner.search import fastest
from amsp_jax.step.functions import train_step
from tests.helpers import CLUSTER, STEPS, TINY, max_relative_error, optimizer, reference, train_data

DIMS = cost.llama_dims(TINY)


def _train(strategy: str, micro_batches: int, layers: int = TINY.n_layers, **knobs) -> tuple:
    model = Llama(dataclasses.replace(TINY, n_layers=layers))
    plan = aj.Plan(CLUSTER, aj.resolve(strategy, CLUSTER), micro_batches, precision="fp32", **knobs)
    trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model))
    data = train_data()
    state = trainer.init(jax.random.key(0), data[0]["inputs"])
    losses = []
    for batch in data:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


@pytest.fixture(scope="module")
def expected():
    return reference(Llama(TINY), train_data(), jax.random.key(0))


@pytest.mark.parametrize(("strategy", "micro_batches"), [("zero3", 3), ("p=2x1,g=4x1,os=4x2", 1), ("ddp", 1)])
def test_flat_collectives_equal_reference_and_audit(expected, strategy, micro_batches):
    trainer, state, losses = _train(strategy, micro_batches, hierarchical=False)
    expected_losses, expected_params = expected
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert max_relative_error(trainer.full_params(state), expected_params) < 1e-5
    assert int(state.step) == STEPS
    report = audit.audit_trainer(trainer, train_data()[0], DIMS)
    assert report.bytes_match, report.table()
    # Every op spans one run of axes only when hierarchical; flat ones span the whole group.
    groups = {op.group for op in trainer.schedule.ops()}
    assert max(groups) == CLUSTER.num_devices or strategy != "zero3"


def test_flat_zero3_sends_seven_eighths_of_each_layer_across_nodes():
    # One flat ring over 8 devices: (n-1)/n of each gathered layer per device, all counted inter-node
    # by the audit, of which N/n = 2/8 crosses the NICs; the split gather crosses with S/8 only.
    trainer, _, _ = _train("zero3", 1, hierarchical=False)
    report = audit.audit_trainer(trainer, train_data()[0], DIMS)
    layer_bytes = sum(
        4 * math.prod(leaf.shape) // leaf.shape[0]
        for path, leaf in trainer.params_layout.leaves.items()
        if trainer.params_layout.stack_of(path) is not None
    )
    other_bytes = sum(
        4 * math.prod(leaf.shape)
        for path, leaf in trainer.params_layout.leaves.items()
        if trainer.params_layout.stack_of(path) is None
    )
    gathered = 2 * TINY.n_layers * layer_bytes + other_bytes  # forward and backward; others once
    measured = report.measured.bytes_by_kind_and_level()["all-gather"]
    assert measured == {"intra": 0, "inter": 7 * gathered // 8}
    workload = audit.workload_of(trainer, train_data()[0], DIMS)
    links = cost.link_bytes(trainer.layout, workload)
    assert links["nic"] * 8 == (links["nic"] + links["node"]) * 2


def test_step_and_cost_model_read_one_prefetch_rule(monkeypatch):
    # The rule lives in `schedule`; changing it there changes what the step traces and what the cost
    # model holds in memory. The prefetch loop has its own backward, so its program has no remat.
    layers = schedule.MIN_PREFETCH_LAYERS

    def has_remat(trainer) -> bool:
        abstract = trainer.abstract_state()
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), train_data()[0])
        return "remat" in str(jax.make_jaxpr(functools.partial(train_step, trainer.program))(abstract, batch))

    def planned(**knobs):
        model = Llama(dataclasses.replace(TINY, n_layers=layers))
        plan = aj.Plan(CLUSTER, aj.resolve("zero3", CLUSTER), 1, precision="fp32", **knobs)
        trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model))
        trainer.setup(jax.random.key(0), train_data()[0]["inputs"])
        workload = audit.workload_of(trainer, train_data()[0], cost.llama_dims(model.config))
        return trainer, cost.memory(trainer.layout, workload).peaks["backward"].gathered

    looped, looped_gathered = planned(prefetch=True)
    scanned, scanned_gathered = planned()
    assert not has_remat(looped) and has_remat(scanned)
    assert looped_gathered > scanned_gathered
    monkeypatch.setattr(schedule, "MIN_PREFETCH_LAYERS", layers + 1)
    moved, moved_gathered = planned(prefetch=True)
    assert has_remat(moved) and moved_gathered == scanned_gathered


def test_step_and_cost_model_read_one_first_layer_rule(monkeypatch):
    # `schedule.keeps_first_layer` decides for both: turned off there, the step traces no gather of the
    # first layer outside the loop and the cost model holds no first layer.
    model = Llama(dataclasses.replace(TINY, n_layers=4))

    def planned(keep: bool) -> tuple[int, int, list]:
        plan = aj.Plan(CLUSTER, aj.resolve("zero3", CLUSTER), 3, precision="fp32", keep_first_layer=keep)
        trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model))
        trainer.setup(jax.random.key(0), train_data()[0]["inputs"])
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), train_data()[0])
        traced = jax.make_jaxpr(functools.partial(train_step, trainer.program))(
            trainer.abstract_state(), batch
        )
        gathers = str(traced).count("all_gather")
        workload = audit.workload_of(trainer, train_data()[0], cost.llama_dims(model.config))
        return gathers, cost.memory(trainer.layout, workload).total, trainer.schedule.ops()

    plain, kept = planned(False), planned(True)
    assert kept[0] > plain[0] and kept[1] > plain[1] and kept[2] != plain[2]
    monkeypatch.setattr(schedule, "keeps_first_layer", lambda *_: False)
    assert planned(True) == plain


def test_a_stacked_leafs_ops_by_hand():
    # p=2x1,g=4x1,os=4x2 on 2 nodes x 4: P over intra0 (2), G over intra0, intra1 (4), OS over those and
    # inter0 (8). A stacked (4, 16, 32) leaf splits its 16 rows (the layer dimension is never split).
    axes = plan_axes(CLUSTER, aj.resolve("p=2x1,g=4x1,os=4x2", CLUSTER))
    leaf = Leaf(("layers", "layer", "w"), (4, 16, 32), True, unit=("layers",), layer_stack=True)
    settings = schedule.StepSettings(micro_batches=3, remat="full", param_itemsize=4, reduce_itemsize=4)
    ops = schedule.leaf_schedule(axes, leaf, settings).ops()
    layer = ("layers",)
    fields = ("phase", "kind", "axes", "group", "nodes", "dim", "elements", "executions", "unit", "feeds")
    assert [tuple(getattr(op, f) for f in fields) for op in ops] == [
        # One layer (16 x 32 = 512) per layer and micro-batch (4 x 3 = 12): half of it gathered over 2,
        (schedule.FORWARD_GATHER, "all-gather", ("intra0",), 2, 1, 0, 256, 12, layer, False),
        (schedule.BACKWARD_GATHER, "all-gather", ("intra0",), 2, 1, 0, 256, 12, layer, False),
        # the whole layer's gradient reduce-scattered over the node's 4,
        (schedule.GRAD_REDUCE, "reduce-scatter", ("intra0", "intra1"), 4, 1, 0, 512, 12, layer, False),
        # G's quarter of the leaf (2,048 / 4) scattered over the nodes onto OS, once,
        (schedule.REDUCTION, "reduce-scatter", ("inter0",), 2, 2, 1, 512, 1, None, False),
        # and OS's eighth (256) gathered back to P's half: across the nodes first, then in the node.
        (schedule.REFRESH, "all-gather", ("inter0",), 2, 2, 1, 256, 1, None, True),
        (schedule.REFRESH, "all-gather", ("intra1",), 2, 1, 1, 512, 1, None, False),
    ]
    # Ring bytes a device sends: (n - 1) blocks for a gather, (n - 1) / n of the buffer for a scatter.
    assert [op.bytes_sent() for op in ops] == [1024, 1024, 1536, 1024, 1024, 2048]


def test_nccl_latency_grows_with_the_ring():
    # NCCL's ring (Simple protocol): 8.4 us + 3.4 us per NVLink step + 14 us per network step.
    config = load("configs/clusters/a800-8x-ib800.yaml")
    assert config.latency("all-gather", 1024, 128) == pytest.approx((8.4 + 896 * 3.4 + 127 * 14) * 1e-6)
    assert config.latency("all-reduce", 16, 2) == pytest.approx((8.4 + 2 * (14 * 3.4 + 14)) * 1e-6)
    small, large = (config.collective_time("all-gather", "inter", 2**20, 1, n, n) for n in (2, 128))
    assert large - small == pytest.approx(126 * 14e-6)


def test_flat_ring_across_nodes_is_paced_by_the_slower_of_nics_and_node_links():
    config = load("configs/clusters/a800-8x-ib800.yaml")
    # A flat all-gather of 3,584 MiB per device over 16 devices on 2 nodes: 2/16 of it (448 MiB) crosses
    # the NICs at the table's 11.5 GB/s (41 ms), the rest (3,136 MiB) the node's links at 153 GB/s (21
    # ms); the NICs set the pace. Latency: 8.4 us + 14 NVLink steps x 3.4 us + 1 network step x 14 us.
    seconds = config.collective_time("all-gather", "inter", 3584 * 2**20, 1, 16, 2)
    assert seconds == pytest.approx(448 * 2**20 / 11.5e9 + 70e-6)


def test_planner_compares_flat_and_split_collectives_and_hands_back_a_plan():
    request = planner_request.make_request(llama_spec("tiny"), "cpu-sim", seq_len=32, global_batch=8)
    choices = {i.hierarchical for i in planner_request.implementations(request)}
    assert choices == {True, False}
    chosen = fastest(request)
    plan = chosen.to_plan(CLUSTER, "fp32")
    assert plan.hierarchical == chosen.implementation.hierarchical and plan.strategy == chosen.strategy
    # The CPU backend cannot overlap collectives with compute: no prefetch loop there.
    assert plan.prefetch is False
    one_node = dataclasses.replace(request, cluster=request.cluster.with_shape(1, 8))
    assert {i.hierarchical for i in planner_request.implementations(one_node)} == {True}
