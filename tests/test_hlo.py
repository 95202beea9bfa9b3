"""Tests of the HLO readers: hand-written modules (`tests/hlo/*.txt`) and programs compiled on CPU devices."""

import dataclasses
from pathlib import Path
from string import Template

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from amsp_jax.compiled.hlo import (
    Collective,
    bytes_per_device,
    crosses,
    expand_replica_groups,
    instruction_seconds,
    memory_traffic,
    overlaps,
    parse_collectives,
)

FIXTURES = Path(__file__).parent / "hlo"


def _hlo(name: str) -> str:
    """The hand-written HLO module `tests/hlo/<name>.txt`."""
    return (FIXTURES / f"{name}.txt").read_text()


def _peeled_loop(init: str, bound: int, direction: str) -> str:
    """A loop shaped as XLA's GPU passes leave it: no known_trip_count, fused compare and add."""
    return Template(_hlo("peeled_loop")).substitute(init=init, bound=bound, direction=direction)


def _groups(array: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in row) for row in array)


def _by_name(collectives: list[Collective]) -> dict[str, Collective]:
    return {c.name: c for c in collectives}


def test_explicit_and_empty_groups():
    assert expand_replica_groups("{{0,1},{2,3}}", 4) == ((0, 1), (2, 3))
    assert expand_replica_groups("{{0,2,4,6},{1,3,5,7}}", 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert expand_replica_groups("{}", 4) == ((0, 1, 2, 3),)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[2,4]<=[8]", np.arange(8).reshape(2, 4)),
        ("[1,8]<=[8]", np.arange(8).reshape(1, 8)),
        ("[8,1]<=[8]", np.arange(8).reshape(8, 1)),
        ("[4,2]<=[2,4]T(1,0)", np.arange(8).reshape(2, 4).T.reshape(4, 2)),
        ("[2,4]<=[4,2]T(1,0)", np.arange(8).reshape(4, 2).T.reshape(2, 4)),
        ("[2,4]<=[2,2,2]T(1,0,2)", np.arange(8).reshape(2, 2, 2).transpose(1, 0, 2).reshape(2, 4)),
        ("[4,2]<=[2,2,2]T(0,2,1)", np.arange(8).reshape(2, 2, 2).transpose(0, 2, 1).reshape(4, 2)),
        ("[2,2,2]<=[2,2,2]T(2,1,0)", np.arange(8).reshape(2, 2, 2).transpose(2, 1, 0).reshape(4, 2)),
        ("[2,2,4]<=[4,4]T(1,0)", np.arange(16).reshape(4, 4).T.reshape(4, 4)),
    ],
)
def test_iota_groups_match_numpy(text, expected):
    assert expand_replica_groups(text, int(expected.size)) == _groups(expected)


def test_iota_groups_with_mismatched_counts_raise():
    with pytest.raises(ValueError, match="different counts"):
        expand_replica_groups("[2,4]<=[6]", 8)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mesh['a'=2,'b'=4] {'b'}", np.arange(8).reshape(2, 4)),
        ("mesh['a'=2,'b'=4] {'a'}", np.arange(8).reshape(2, 4).T),
        ("mesh['a'=2,'b'=4] {'a','b'}", np.arange(8).reshape(1, 8)),
        ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}", np.arange(8).reshape(2, 4).T),
        # Sub-axis (2)2 of an axis of 8: the devices whose index differs only in its middle bit.
        ("mesh['a'=8] {'a':(2)2}", np.arange(8).reshape(2, 2, 2).transpose(0, 2, 1).reshape(4, 2)),
        ("mesh['a'=8] {'a':(1)2,'a':(4)2}", np.arange(8).reshape(2, 2, 2).transpose(1, 0, 2).reshape(2, 4)),
        ("mesh['a'=2,'b'=4], device_ids=(0,2,4,6,1,3,5,7) {'b'}", np.array([[0, 2, 4, 6], [1, 3, 5, 7]])),
        # As printed for a (dp=2, tp=4) program resharding over tp: the mesh devices are iota(8) as [2,4],
        # transposed, i.e. 0,4,1,5,2,6,3,7, so the tp groups are the contiguous ones.
        (
            "mesh['axis_0'=1,'axis_1'=1,'axis_2'=4,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_2'}",
            np.arange(8).reshape(2, 4),
        ),
        ("mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}", np.arange(8).reshape(2, 4)),
    ],
)
def test_mesh_groups_match_numpy(text, expected):
    assert expand_replica_groups(text, 8) == _groups(expected)


def test_nested_loops_multiply_trip_counts():
    found = _by_name(parse_collectives(_hlo("nested_loops"), 4))
    assert set(found) == {"ar", "ag", "rs"}
    assert (found["ar"].trip_count, found["ar"].computation) == (12, "inner")
    assert (found["ag"].trip_count, found["ag"].computation) == (4, "outer")
    assert found["rs"].trip_count == 1
    assert found["rs"].replica_groups == ((0, 1, 2, 3),)
    assert (found["ag"].operand_bytes, found["ag"].result_bytes) == (32, 128)


def test_unknown_trip_count_raises_naming_the_loop():
    text = _hlo("nested_loops_unknown_trip_count")
    assert "inner," not in text
    with pytest.raises(ValueError, match=r"'w2'.*'outer'.*no known_trip_count.*'ar'"):
        parse_collectives(text, 4)


def test_unknown_trip_count_without_collectives_is_fine():
    text = _hlo("loop_without_collectives")
    assert parse_collectives(text, 4) == []


def test_async_pairs_count_once_with_output_bytes():
    found = parse_collectives(_hlo("async_pairs"), 4)
    assert [(c.name, c.kind) for c in found] == [
        ("rs", "reduce-scatter"),
        ("ags", "all-gather"),
        ("ars", "all-reduce"),
        ("agc", "all-gather"),
        ("war", "all-reduce"),
        ("cps", "collective-permute"),
        ("a2s", "all-to-all"),
        ("rss", "reduce-scatter"),
    ]
    by_name = _by_name(found)
    assert (by_name["ags"].operand_bytes, by_name["ags"].result_bytes) == (256, 1024)
    assert (by_name["ars"].operand_bytes, by_name["ars"].result_bytes, by_name["ars"].dtype) == (
        272,
        272,
        "f32",
    )
    assert by_name["ars"].replica_groups == ((0, 1, 2, 3),)
    assert (by_name["agc"].operand_bytes, by_name["agc"].result_bytes) == (272, 1088)
    assert (by_name["war"].operand_bytes, by_name["war"].result_bytes) == (256, 256)
    assert (by_name["cps"].operand_bytes, by_name["cps"].result_bytes) == (256, 256)
    assert by_name["cps"].source_target_pairs == ((0, 1), (1, 2), (2, 3), (3, 0))
    assert by_name["cps"].replica_groups == ()
    assert (by_name["a2s"].result_bytes, by_name["rss"].result_bytes) == (256, 128)


def test_async_wrapper_computation_holds_the_collective():
    rs = _by_name(parse_collectives(_hlo("async_pairs"), 4))["rs"]
    assert rs == Collective(
        kind="reduce-scatter",
        name="rs",
        computation="wrapped_rs",
        operand_bytes=256,
        result_bytes=64,
        replica_groups=((0, 1, 2, 3),),
        source_target_pairs=(),
        trip_count=1,
        dtype="f32",
    )


def test_async_wrapper_inside_loop_takes_the_trip_count():
    body = _hlo("async_wrapper_in_loop")
    [rs] = parse_collectives(body, 4)
    assert (rs.name, rs.computation, rs.trip_count, rs.operand_bytes, rs.result_bytes) == (
        "rs",
        "wrapped",
        7,
        32,
        8,
    )


def test_tuple_shaped_combined_all_reduce():
    text = _hlo("combined_all_reduce")
    [ar] = parse_collectives(text, 4)
    assert (ar.kind, ar.operand_bytes, ar.result_bytes, ar.dtype) == ("all-reduce", 40, 40, "f32")
    assert ar.replica_groups == ((0, 1), (2, 3))


def test_scalars_concatenated_into_one_all_reduce_are_scalar_reductions():
    # As XLA:GPU combines the loss and norm partial sums (seen compiling LLaMA-30B for 1,024 A100s).
    text = _hlo("concatenated_scalars")
    found = _by_name(parse_collectives(text, 2))
    assert found["scalars"].scalar and not found["tensor"].scalar


def test_calls_conditionals_and_fusions_are_followed():
    text = _hlo("calls_conditionals_fusions")
    found = _by_name(parse_collectives(text, 4))
    assert {name: (c.kind, c.computation) for name, c in found.items()} == {
        "fag": ("all-gather", "fused"),
        "car": ("all-reduce", "callee"),
        "ya2a": ("all-to-all", "yes"),
        "bcp": ("collective-permute", "b0"),
    }
    assert all(c.trip_count == 1 for c in found.values())


def test_collective_outside_the_call_graph_raises():
    text = _hlo("orphan_collective")
    with pytest.raises(ValueError, match=r"'lost'.*not reached from ENTRY"):
        parse_collectives(text, 4)


def test_shapes_layouts_inline_operand_shapes_and_index_comments():
    text = _hlo("shapes_layouts_comments")
    found = _by_name(parse_collectives(text, 4))
    expected = 8 * 128 * 4 + 8 * 2 + 4 + 4 + 2 * 2 + 16 + 3 * 4 + 8
    # The one-element arrays (s32[] and f64[1]) are scalar reductions merged into the tuple: recorded apart.
    tensors = expected - 4 - 8
    assert (found["combined"].operand_bytes, found["combined"].result_bytes) == (tensors, tensors)
    assert not found["combined"].scalar
    assert found["combined.scalars"].scalar and found["combined.scalars"].result_bytes == 12
    assert (found["old"].operand_bytes, found["old"].result_bytes) == (4096, 16384)


def test_mesh_replica_groups_in_an_instruction():
    text = _hlo("mesh_replica_groups")
    found = _by_name(parse_collectives(text, 8))
    assert found["a"].replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert found["b"].replica_groups == ((7, 6, 5, 4), (3, 2, 1, 0))


def _collective(kind: str, **changes) -> Collective:
    base = Collective(
        kind=kind,
        name="c",
        computation="main",
        operand_bytes=1024,
        result_bytes=4096,
        replica_groups=((0, 1, 2, 3), (4, 5, 6, 7)),
        source_target_pairs=(),
        trip_count=1,
        dtype="f32",
    )
    return dataclasses.replace(base, **changes)


def test_bytes_per_device_for_each_kind():
    assert bytes_per_device(_collective("all-gather")) == 3 * 4096 // 4
    assert bytes_per_device(_collective("reduce-scatter", operand_bytes=4096, result_bytes=1024)) == 3072
    assert bytes_per_device(_collective("all-reduce", operand_bytes=4096)) == 2 * 3 * 4096 // 4
    assert bytes_per_device(_collective("all-to-all", operand_bytes=4096)) == 3072
    permute = _collective("collective-permute", replica_groups=(), source_target_pairs=((0, 1), (1, 0)))
    assert bytes_per_device(permute) == 4096
    assert bytes_per_device(dataclasses.replace(permute, trip_count=3)) == 3 * 4096


def test_bytes_per_device_edge_cases():
    assert bytes_per_device(_collective("all-gather", trip_count=5)) == 5 * 3072
    assert bytes_per_device(_collective("all-reduce", replica_groups=((0,), (1,)))) == 0
    assert bytes_per_device(_collective("collective-permute", replica_groups=())) == 0
    self_pairs = _collective("collective-permute", replica_groups=(), source_target_pairs=((0, 0), (1, 1)))
    assert bytes_per_device(self_pairs) == 0
    # 2*(3-1)*4/3 = 5.33 bytes: a ring moves whole elements, so the count rounds up.
    assert bytes_per_device(_collective("all-reduce", result_bytes=4, replica_groups=((0, 1, 2),))) == 6


def test_crosses():
    node_of_device = [0, 0, 0, 0, 1, 1, 1, 1]
    assert not crosses(_collective("all-gather"), node_of_device)
    assert crosses(_collective("all-gather", replica_groups=((0, 4), (1, 5), (2, 6), (3, 7))), node_of_device)
    ring = _collective("collective-permute", replica_groups=(), source_target_pairs=((0, 1), (1, 2)))
    assert not crosses(ring, node_of_device)
    assert crosses(dataclasses.replace(ring, source_target_pairs=((3, 4),)), node_of_device)


def test_real_compiled_shard_map_program():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))

    def body(x):
        def step(_, acc):
            gathered = jax.lax.all_gather(acc, "b", axis=0, tiled=True)
            return acc + 0.5 * gathered[: acc.shape[0]]

        y = jax.lax.fori_loop(0, 5, step, x)
        return jax.lax.psum_scatter(y, ("a", "b"), scatter_dimension=0, tiled=True)

    f = jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"), out_specs=P(("a", "b")))
    x = jnp.ones((64, 32), jnp.float32)  # each device holds a (32, 8) f32 block: 1024 bytes
    text = jax.jit(f).lower(x).compile().as_text()
    found = parse_collectives(text, 8)

    assert sorted((c.kind, c.trip_count) for c in found) == [("all-gather", 5), ("reduce-scatter", 1)]
    ag = next(c for c in found if c.kind == "all-gather")
    rs = next(c for c in found if c.kind == "reduce-scatter")
    assert (ag.operand_bytes, ag.result_bytes, ag.dtype) == (1024, 4096, "f32")
    assert {len(g) for g in ag.replica_groups} == {4}
    assert sorted(ag.replica_groups) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert (rs.operand_bytes, rs.result_bytes) == (1024, 128)
    assert rs.replica_groups == (tuple(range(8)),)
    assert bytes_per_device(ag) == 5 * 3 * 4096 // 4
    assert bytes_per_device(rs) == 7 * 1024 // 8
    node_of_device = [d // 4 for d in range(8)]
    assert not crosses(ag, node_of_device)
    assert crosses(rs, node_of_device)


def test_a_loop_bound_xla_cannot_read_is_counted_from_the_loops_scalars():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    mesh = Mesh(np.array(jax.devices()[:4]), ("b",))

    def body(x):
        # As the step's micro-batch loop: a bound behind an optimization barrier has no known_trip_count.
        bound = jax.lax.optimization_barrier(jnp.int32(6))
        return jax.lax.fori_loop(1, bound, lambda _, acc: acc + jax.lax.psum(acc, "b"), x)

    f = jax.shard_map(body, mesh=mesh, in_specs=P("b"), out_specs=P("b"))
    text = jax.jit(f).lower(jnp.ones((8, 4), jnp.float32)).compile().as_text()
    [loop] = [line for line in text.splitlines() if " while(" in line]
    assert "known_trip_count" not in loop
    [ar] = parse_collectives(text, 4)
    assert (ar.kind, ar.trip_count) == ("all-reduce", 5)


@pytest.mark.parametrize(
    ("init", "bound", "direction", "trips"),
    [(1, 5, "LT", 2), (0, 5, "LT", 3), (0, 4, "LE", 3), (2, 9, "NE", None), (6, 5, "LT", 0), (1, 3, "NE", 1)],
)
def test_trip_count_without_known_trip_count_runs_the_induction_variable(init, bound, direction, trips):
    # Counted by hand: i = init, init + 2, ... while `i direction bound`; NE from 2 to 9 by 2 never stops.
    text = _peeled_loop(f"constant({init})", bound, direction)
    if trips is None:
        with pytest.raises(ValueError, match=r"'w'.*no known_trip_count.*'ag'"):
            parse_collectives(text, 4)
        return
    [ag] = parse_collectives(text, 4)
    assert ag.trip_count == trips


def test_trip_count_with_an_unknown_init_raises():
    with pytest.raises(ValueError, match=r"while loop 'w'.*no known_trip_count.*all-gather 'ag'"):
        parse_collectives(_peeled_loop("copy(%q)", 5, "LT"), 4)


def test_overlaps_read_the_schedule_between_start_and_done():
    found = overlaps(_hlo("scheduled"))
    assert set(found) == {"ags", "rss", "ags2", "ar"}
    assert (found["ags"].compute, found["ags"].is_sync, found["ags"].hidden) == (("f",), False, True)
    # XLA marked it synchronous: nothing runs beside it, whatever the text order says.
    assert (found["rss"].compute, found["rss"].is_sync, found["rss"].hidden) == ((), True, False)
    # Only elementwise work between: counted, but not matrix compute to hide behind.
    assert (found["ags2"].compute, found["ags2"].other_kernels, found["ags2"].hidden) == ((), 1, False)
    assert (found["ar"].asynchronous, found["ar"].hidden) == (False, False)


def test_overlaps_of_an_async_wrapper_and_of_a_loop_holding_compute():
    wrapped = _hlo("async_wrapper_around_compute")
    found = overlaps(wrapped)
    # The reduce-scatter inside %wrapped_rs is timed by its wrapper's start/update/done in ENTRY.
    assert found["rs"].computation == "wrapped_rs"
    assert found["rs"].compute == ("between", "loop")
    assert found["rs"].hidden


def test_an_async_fusion_holding_a_collective_is_followed_and_times_it():
    # jaxlib >= 0.11 may run the loss's scalar all-reduce as an async fusion (fusion-start/fusion-done).
    [reduction] = parse_collectives(_hlo("async_fusion"), 4)
    assert (reduction.name, reduction.computation, reduction.trip_count, reduction.scalar) == (
        "all-reduce.2", "fused_all-reduce", 1, True,
    )  # fmt: skip
    found = overlaps(_hlo("async_fusion"))["all-reduce.2"]
    assert (found.asynchronous, found.compute, found.hidden) == (True, ("f",), True)


def _traffic(fn, *args, **jit_kwargs) -> int:
    return memory_traffic(jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text())


def test_memory_traffic_counts_each_kernels_reads_and_writes():
    mib = 2**20
    x = jnp.ones((mib // 4,), jnp.float32)
    # One fused kernel reads two fp32 MiB and writes one bf16 half-MiB.
    assert _traffic(lambda x, y: (x * 2 + y).astype(jnp.bfloat16), x, x) == 2 * mib + mib // 2


def test_memory_traffic_counts_every_trip_of_a_loop():
    x = jnp.ones((2**18,), jnp.float32)  # 1 MiB

    def loop(trips):
        return lambda x: jax.lax.fori_loop(0, trips, lambda i, c: c * 1.5 + 1.0, x)

    # Each trip reads and writes the carry once: 2 MiB more per trip (and the loop counter's few bytes),
    # whatever XLA adds around the loop.
    extra = _traffic(loop(9), x) - _traffic(loop(5), x)
    assert 4 * 2 * 2**20 <= extra < 4 * 2 * 2**20 + 1024


def test_memory_traffic_counts_an_in_place_update_by_its_slice():
    buffer, row = jnp.ones((16, 2**16), jnp.float32), jnp.ones((2**16,), jnp.float32)  # 4 MiB, 256 KiB

    def updates(trips):
        def fn(buffer, row):
            step = lambda i, b: jax.lax.dynamic_update_slice(b, (row * i)[None], (i, 0))  # noqa: E731
            return jax.lax.fori_loop(0, trips, step, buffer)

        return fn

    # A trip reads the row and writes one row of the buffer in place (XLA may stage the scaled row in a
    # temporary of its own), never the whole 4 MiB buffer.
    traffic = {trips: _traffic(updates(trips), buffer, row, donate_argnums=0) for trips in (4, 8)}
    assert 4 * 2 * 2**18 <= traffic[8] - traffic[4] < 4 * 4 * 2**18


def test_memory_traffic_counts_an_async_fusion_as_the_fusion_it_starts():
    # jaxlib 0.11 starts some loop fusions asynchronously (a layer loop's in-place updates among them).
    started = _hlo("in_place_update_started")
    assert "fusion-start" in started
    # The 4 KiB row is read and written over its slot of the buffer, which is not read, the rest of the
    # 64 KiB buffer left alone (plus the 4-byte index).
    assert memory_traffic(_hlo("in_place_update")) == 2 * 4096 + 4
    assert memory_traffic(started) == memory_traffic(_hlo("in_place_update"))


def test_memory_traffic_counts_a_slice_of_a_stacked_buffer_by_the_slice():
    stack = jnp.ones((16, 2**16), jnp.float32)  # 4 MiB: 16 rows of 256 KiB

    def reads(trips):
        def fn(stack):
            step = lambda i, acc: acc + jax.lax.dynamic_index_in_dim(stack, i, keepdims=False) * 2.0  # noqa: E731
            return jax.lax.fori_loop(0, trips, step, jnp.zeros((2**16,), jnp.float32))

        return fn

    # A trip reads one row of the stack and the carry and writes the carry: 3 × 256 KiB, never the
    # whole 4 MiB stack (a layer loop reads one layer of its stacked weights per trip).
    extra = _traffic(reads(8), stack) - _traffic(reads(4), stack)
    assert 4 * 3 * 2**18 <= extra < 4 * 4 * 2**18


def test_instruction_seconds_prices_kernels_by_a_roofline_collectives_by_the_callback_and_loops_by_trips():
    flop_rate, memory_rate, launch = 1e12, 1e11, 1e-6
    sizes = []

    def collective(c):
        sizes.append((c.kind, c.result_bytes, len(c.replica_groups[0]), c.trip_count))
        return 5e-6

    seconds = instruction_seconds(_hlo("priced"), 4, collective, flop_rate, memory_rate, launch)
    # The gemm: 2·64·256·128 FLOPs at 1 TFLOP/s (4.19 µs) against its 224 KiB of operands and result at
    # 100 GB/s (2.29 µs): compute-bound.
    gemm = launch + 2 * 64 * 256 * 128 / flop_rate
    assert seconds["y"] == pytest.approx(gemm)
    # The scaling kernel moves 64 KiB in and 64 KiB out and multiplies nothing.
    assert seconds["s"] == pytest.approx(launch + 2 * 64 * 256 * 4 / memory_rate)
    # One execution of the all-gather, as the callback prices it; its -done and the plumbing cost nothing.
    assert seconds["ag"] == 5e-6 and sizes == [("all-gather", 128 * 256 * 4, 4, 1)]
    assert seconds["agd"] == seconds["t"] == seconds["r"] == seconds["x"] == 0
    # The loop: three trips of its body (gemm, gather, the counter's add) and of its condition.
    body = gemm + 5e-6 + seconds["next"]
    assert seconds["loop"] == pytest.approx(3 * (body + seconds["lt"]))
    assert seconds["next"] == pytest.approx(launch + 3 * 4 / memory_rate)


def test_instruction_seconds_names_each_instruction_as_xla_scheduled_it():
    # After scheduling, XLA makes a permute with nothing to overlap synchronous: a new instruction that
    # keeps the scheduled start's name in its metadata (as jaxlib 0.12 prints it), which is the name a
    # later compile's scheduler looks up in the profile.
    text = """HloModule renamed, is_scheduled=true

ENTRY %main (x: bf16[512,2048]) -> bf16[512,2048] {
  %x = bf16[512,2048]{1,0} parameter(0), metadata={scheduling_name="x"}
  ROOT %ppermute.3 = bf16[512,2048]{1,0} collective-permute(%x), channel_id=1,
    source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(step)/ppermute"
    scheduling_name="collective-permute-start.7" stack_frame_id=3},
    backend_config={"collective_backend_config":{"is_sync":true}}
}
"""
    seconds = instruction_seconds(text, 2, lambda c: 5e-6, 1e12, 1e11, 1e-6)
    assert seconds == {"x": 0.0, "collective-permute-start.7": 5e-6}
