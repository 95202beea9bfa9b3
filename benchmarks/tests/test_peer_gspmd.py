"""The GSPMD peer of the benchmarks: exact against the single-device reference, sharded as intended,
and moving at least the bytes that amsp_jax's matching presets move (read from both compiled programs).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from amsp_jax.compiled import audit
from amsp_jax.models.llama import Llama, make_loss_fn
from benchmarks.peer_gspmd import CLAIM_PAIRS, build_gspmd_step, claim_violations, make_mesh, measure_peer
from benchmarks.tests.support import (
    CLUSTER,
    TINY,
    amsp_step,
    max_relative_error,
    optimizer,
    reference,
    train_data,
)

MICRO_BATCHES = 3  # the global batch of 24 over 8 devices: also what the audit tests compile for amsp_jax
ALL = ("inter", "intra")


@functools.cache
def peer(mode: str) -> tuple:
    """(shardings, compiled step, final state, losses) of the fp32 baseline trained on `train_data()`."""
    model = Llama(TINY)
    data = train_data()
    init_fn, step_fn, shardings = build_gspmd_step(
        model,
        optimizer(),
        make_loss_fn(model),
        make_mesh(CLUSTER),
        (data[0]["inputs"],),
        mode=mode,
        micro_batches=MICRO_BATCHES,
        compute_dtype="float32",
    )
    state = init_fn(jax.random.key(0))
    batches = [jax.device_put(batch, shardings.batch) for batch in data]
    compiled = step_fn.lower(state, batches[0]).compile()
    losses = []
    for batch in batches:
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    return shardings, compiled, state, losses


@pytest.fixture(scope="module")
def expected():
    return reference(Llama(TINY), train_data(), jax.random.key(0))


@pytest.mark.parametrize("mode", ["fsdp", "zero1"])
def test_fp32_baseline_equals_single_device_reference(mode, expected):
    expected_losses, expected_params = expected
    _, _, state, losses = peer(mode)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert max_relative_error(jax.tree.map(np.asarray, state.master), expected_params) < 1e-5
    assert int(state.step) == len(expected_losses)


def _largest_divisible_dim(path: tuple[str, ...], shape: tuple[int, ...]) -> int | None:
    first = 1 if path[0] == "layers" else 0  # never the stacked-layer dimension
    dims = [d for d in range(first, len(shape)) if shape[d] % CLUSTER.num_devices == 0]
    return max(dims, key=lambda d: shape[d], default=None)


@pytest.mark.parametrize("mode", ["fsdp", "zero1"])
def test_state_is_fsdp_sharded_and_the_compute_copy_follows_the_mode(mode):
    shardings, _, state, _ = peer(mode)
    master = jax.tree_util.tree_leaves_with_path(state.master)
    for key_path, leaf in master:
        path = tuple(k.key for k in key_path)
        dim = _largest_divisible_dim(path, leaf.shape)
        spec = P(*[ALL if d == dim else None for d in range(leaf.ndim)])
        assert leaf.sharding.spec == spec, path
        assert leaf.dtype == np.float32
    master_specs = {leaf.sharding.spec for _, leaf in master}
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert moments and all(x.sharding.spec in master_specs for x in moments)
    assert state.step.sharding.spec == P()
    compute = {s.spec for s in jax.tree.leaves(shardings.compute)}
    assert compute == (master_specs if mode == "fsdp" else {P()})


def test_fsdp_gathers_every_layer_forward_and_again_under_remat():
    _, compiled, _, _ = peer("fsdp")
    measured = measure_peer(compiled, CLUSTER)
    layer_loops = TINY.n_layers * MICRO_BATCHES
    gathers = [c for c in measured.collectives if c.kind == "all-gather" and c.trip_count == layer_loops]
    # Nine weights per layer (attention, MLP, two norms), gathered in the forward and the backward scan.
    assert len(gathers) == 2 * 9
    assert len({c.computation for c in gathers}) == 2


@pytest.mark.parametrize(("amsp_name", "peer_name"), list(CLAIM_PAIRS.items()))
def test_amsp_moves_no_more_bytes_than_the_peer(amsp_name, peer_name):
    # Compiled programs only. In fp32 and in mixed precision alike the CPU backend puts fp32 on the
    # wire, so these byte counts are those of the mixed-precision programs the benchmark compares.
    trainer, compiled = amsp_step(amsp_name.removeprefix("amsp-"), MICRO_BATCHES)
    ours = audit.measure(compiled, trainer.layout)
    theirs = measure_peer(peer(peer_name.removeprefix("gspmd-"))[1], CLUSTER)
    assert claim_violations(ours.bytes_by_level(), theirs.bytes_by_level()) == []
    # Each preset's hierarchical collectives cross nodes with 1/4 (reduce-scatter, all-gather: 1/8 of
    # a leaf per device) of what the peer's flat 8-device rings send.
    assert ours.bytes_by_level()["inter"] * 4 <= theirs.bytes_by_level()["inter"]


def test_claim_compares_inter_node_and_total_bytes():
    assert claim_violations({"intra": 70, "inter": 10}, {"intra": 0, "inter": 80}) == []
    assert claim_violations({"intra": 0, "inter": 90}, {"intra": 0, "inter": 80}) == [
        "inter-node 90 B > 80 B",
        "total 90 B > 80 B",
    ]
    assert claim_violations({"intra": 75, "inter": 10}, {"intra": 0, "inter": 80}) == ["total 85 B > 80 B"]
