"""The cost model against the compiled step: bytes exactly, inter-node minimum, memory within a bound."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import subprocess
import sys

import pytest

from amsp_jax import cost
from amsp_jax.compiled import audit
from amsp_jax.core.schedule import MIN_PREFETCH_LAYERS
from tests.helpers import STRATEGIES, TINY, set_up, train_data
from tests.train_helpers import child_env

DIMS = cost.llama_dims(TINY)


def report_for(strategy: str, micro_batches: int, **kw: str) -> audit.Report:
    # The audit compiles the step without running it: a plan's numerics test trains the same trainer.
    return audit.audit_trainer(set_up(strategy, micro_batches, **kw), train_data()[0], DIMS)


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_measured_bytes_equal_predicted_per_kind_and_level(strategy, micro_batches):
    report = report_for(strategy, micro_batches)
    assert report.measured.bytes_by_kind_and_level() == {
        k: v for k, v in report.predicted.bytes_by_kind_and_level().items() if any(v.values())
    }
    assert report.bytes_match
    # XLA:CPU issues every all-gather and reduce-scatter of a leaf on its own and merges all-reduces:
    # the time model counts the collectives the compiled program issues.
    assert report.measured.launches_by_kind_and_level() == {
        k: v for k, v in report.predicted_launches().items() if any(v.values())
    }


@pytest.mark.parametrize("strategy", ["zero3", "p=2x1,g=4x1,os=4x2"])
def test_prefetching_layer_loop_moves_the_predicted_bytes(strategy):
    trainer = set_up(strategy, 1, layers=MIN_PREFETCH_LAYERS, prefetch=True)
    dims = cost.llama_dims(dataclasses.replace(TINY, n_layers=MIN_PREFETCH_LAYERS))
    report = audit.audit_trainer(trainer, train_data()[0], dims)
    assert report.bytes_match, report.table()
    assert abs(report.memory_ratio - 1) <= audit.MEMORY_TOLERANCE, report.table()


@pytest.mark.parametrize("strategy", ["zero3", "p=2x1,g=4x1,os=4x2"])
def test_keeping_the_first_layer_moves_the_predicted_bytes(strategy):
    layers, micro_batches = 4, 3
    kept = report_for(strategy, micro_batches, layers=layers, keep_first_layer=True)
    assert kept.bytes_match, kept.table()
    assert kept.measured.launches_by_kind_and_level() == {
        k: v for k, v in kept.predicted_launches().items() if any(v.values())
    }
    assert abs(kept.memory_ratio - 1) <= audit.MEMORY_TOLERANCE, kept.table()


def test_keeping_the_first_layer_saves_its_gathers_and_reduce_scatters():
    # zero3 on 8 devices: each gather or reduce-scatter of one layer moves 7/8 of it per device (fp32
    # on the CPU's wire). Kept, the first layer is gathered once instead of twice per micro-batch and
    # reduce-scattered once instead of once per micro-batch.
    layers, micro_batches = 4, 3
    layer_bytes = 4 * sum(math.prod(shape) for shape in TINY.layer_shapes().values())
    moved = {}
    for keep in (False, True):
        r = report_for("zero3", micro_batches, layers=layers, keep_first_layer=keep)
        moved[keep] = {kind: sum(v.values()) for kind, v in r.measured.bytes_by_kind_and_level().items()}
    one_layer = layer_bytes * 7 // 8
    assert moved[False]["all-gather"] - moved[True]["all-gather"] == (2 * micro_batches - 1) * one_layer
    assert moved[False]["reduce-scatter"] - moved[True]["reduce-scatter"] == (micro_batches - 1) * one_layer


def _leaf_bytes(trainer, stacked: bool) -> int:
    """fp32 bytes of one layer of every stacked leaf (stacked) or of every other leaf."""
    total = 0
    for path, leaf in trainer.params_layout.leaves.items():
        is_stacked = trainer.params_layout.stack_of(path) is not None
        if is_stacked == stacked:
            total += 4 * math.prod(leaf.shape) // (leaf.shape[0] if stacked else 1)
    return total


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_zero3_crosses_nodes_only_with_one_eighth_pieces(micro_batches):
    # Full sharding over 2 nodes x 4: a hierarchical gather crosses nodes with the 1/8 shard only
    # ((N-1)/N * S/R = S/8 per device); one flat 8-device ring would send 7/8 S across nodes.
    trainer = set_up("zero3", micro_batches)
    report = report_for("zero3", micro_batches)
    layers = TINY.n_layers * micro_batches
    layer_bytes, other_bytes = _leaf_bytes(trainer, True), _leaf_bytes(trainer, False)
    gathers = (2 * layers) * layer_bytes + 1 * other_bytes  # forward + backward re-gather; others hoisted
    reduce_scatters = layers * layer_bytes + micro_batches * other_bytes
    expected = (gathers + reduce_scatters) // 8
    assert report.measured.bytes_by_level()["inter"] == expected
    assert report.measured.bytes_by_kind_and_level()["all-gather"]["inter"] == gathers // 8


def test_ddp_all_reduce_is_hierarchical():
    # Reduce-scatter in the node, all-reduce of the quarter across nodes, all-gather in the node:
    # 2 (N-1)/N * S/R = S/4 crosses nodes instead of 2 * 7/8 S for a flat ring.
    trainer = set_up("ddp", 1)
    report = report_for("ddp", 1)
    total = _leaf_bytes(trainer, True) * TINY.n_layers + _leaf_bytes(trainer, False)
    assert report.measured.bytes_by_level()["inter"] == total // 4
    assert report.measured.bytes_by_kind_and_level()["all-reduce"] == {"intra": 0, "inter": total // 4}


def test_mics_crosses_nodes_once_per_step():
    trainer = set_up("mics", 3)
    report = report_for("mics", 3)
    total = _leaf_bytes(trainer, True) * TINY.n_layers + _leaf_bytes(trainer, False)
    # Only the OS quarter is all-reduced across the two node replicas, once per step.
    assert report.measured.bytes_by_level()["inter"] == total // 4


@pytest.mark.parametrize("strategy", ["zero3", "ddp", "zero1", "p=2x1,g=4x1,os=4x2", "p=4x2,g=4x1,os=1x1"])
def test_compiled_memory_within_the_stated_bound(strategy):
    report = report_for(strategy, 3)
    assert abs(report.memory_ratio - 1) <= audit.MEMORY_TOLERANCE, report.table()
    assert report.match


def test_mixed_precision_bytes_match_with_cpu_fp32_wire():
    report = report_for("p=2x1,g=4x1,os=4x2", 3, precision="mixed")
    assert report.bytes_match, report.table()


def test_report_json_and_table():
    data = report_for("zero1", 1).to_json()
    assert set(data["predicted"]["bytes_per_device"]) == {"intra", "inter"}
    assert {"predicted_bytes_per_device", "compiled_bytes_per_device"} <= set(data["memory"])
    assert data["match"] is True
    assert any(p["phase"].startswith("G to OS") for p in data["predicted"]["phases"])
    assert all(
        {"kind", "level", "bytes_per_device", "executions"} <= set(c) for c in data["measured"]["collectives"]
    )
    table = report_for("zero1", 1).table()
    assert "MATCH" in table
    # The schedule, and so the overlap, is the installed XLA's: it differs between jaxlib releases.
    jaxlib = importlib.metadata.version("jaxlib")
    assert table.splitlines()[0].endswith(f"(compiled by jaxlib {jaxlib})") and data["jaxlib"] == jaxlib


def test_the_bytes_table_keeps_a_1024_gpu_steps_columns_apart():
    # LLaMA-7B zero3 at 1,024 A100s gathers 23,125,695,488 B per device within nodes: the table once
    # printed that beside itself as one 28-digit number.
    row = audit.bytes_row("all-gather", "intra", 23_125_695_488, 23_125_695_489, 65, 63)
    assert row.split() == ["all-gather", "intra", "23,125,695,488", "23,125,695,489", "DIFFERS", "65", "63"]


def test_audit_command_json_and_hlo_dump(tmp_path):
    hlo_file = tmp_path / "step.hlo"
    result = subprocess.run(
        [sys.executable, "-m", "amsp_jax.cli", "audit", "--model", "configs/models/tiny.yaml",
         "--nodes", "2", "--devices-per-node", "4", "--strategy", "p=4x2,g=4x1,os=4x2",
         "--micro-batches", "2", "--seq-len", "16", "--flat-collectives", "--json",
         "--dump-hlo", str(hlo_file)],
        capture_output=True, text=True, check=False, env=child_env(None),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["match"] is True
    assert data["predicted"]["bytes_per_device"] == data["measured"]["bytes_per_device"]
    assert data["measured"]["bytes_per_device"]["inter"] > 0
    # Flat: P's gathers over both nodes are one ring of all 8 devices, not a gather per level.
    gathers = {c["group_size"] for c in data["measured"]["collectives"] if c["kind"] == "all-gather"}
    assert gathers == {8}
    assert hlo_file.read_text().startswith("HloModule")
