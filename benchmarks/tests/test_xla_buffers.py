"""`benchmarks.xla_buffers` reads XLA's dumps as XLA writes them: a non-tuple value is named without
its `{}` in the buffer assignment and with it in the live ranges, a loop-carried value is marked
`(phi)`, and two buffers at one offset occupy it once."""

from __future__ import annotations

from benchmarks import xla_buffers

# Excerpts in the dumps' own format (jaxlib 0.12.0.1, a step compiled for H100s), shortened.
ASSIGNMENT = """\
allocation 0: size 16, page 0, parameter 4, shape |f32[4]| at ShapeIndex {}, maybe-live-out:
 value: <1 param.22 @0> (size=16,offset=0): f32[4]{0}
allocation 9: size 400, page 0, preallocated-temp:
 value: <7 gemm_fusion_dot.3 @0> (size=100,offset=0): bf16[50]{0}
 value: <8 while.46{4} (phi) @0> (size=200,offset=100): bf16[100]{0}
 value: <9 reduce-scatter.13{2} @0> (size=100,offset=250): bf16[50]{0}
 value: <10 loop_add_fusion.16 @0> (size=100,offset=0): bf16[50]{0}
"""
LIVE_RANGES = """\
HloLiveRange (max 4):
  InstructionSequence:
    0:param.22
    1:gemm_fusion_dot.3
    2:while.46
    3:reduce-scatter.13
  BufferLiveRange:
    param.22{}:0-3
    gemm_fusion_dot.3{}:1-2
    while.46{4}:2-3
    reduce-scatter.13{2}:3-3
    loop_add_fusion.16{}:3-3
  Live ranges at 2 (peak):
    gemm_fusion_dot.3{}: 100 bytes (cumulative: 100 bytes)
"""
VALUES = """\
<7 gemm_fusion_dot.3 @0>
 from instruction: %gemm_fusion_dot.3 = bf16[50] fusion(), metadata={op_name="jit(train_step)/shard_map/dot"}
<8 while.46{4} (phi) @0>
 from instruction: %while.46 = (bf16[100]{0}) while(%tuple.126)
"""


def test_values_ranges_and_occupied_bytes(tmp_path):
    module = "module_0001.jit_train_step.sm_9.0a_gpu_after_optimizations"
    (tmp_path / f"{module}-buffer-assignment.txt").write_text(ASSIGNMENT)
    (tmp_path / f"{module}-live-range.txt").write_text(LIVE_RANGES)
    (tmp_path / f"{module}-buffer-assignment-values.txt").write_text(VALUES)
    size, sequence, buffers = xla_buffers.live_buffers(tmp_path, module)
    assert size == 400 and sequence == ["param.22", "gemm_fusion_dot.3", "while.46", "reduce-scatter.13"]
    by_name = {b.name: b for b in buffers}
    # The parameter's allocation is not the temporaries'; every temporary has its live range.
    names = ["gemm_fusion_dot.3{}", "loop_add_fusion.16{}", "reduce-scatter.13{2}", "while.46{4}"]
    assert sorted(by_name) == names
    assert (by_name["while.46{4}"].start, by_name["while.46{4}"].end) == (2, 3)
    assert by_name["gemm_fusion_dot.3{}"].op == "dot"
    # At 2: [0, 100) and [100, 300); at 3: [100, 300), [250, 350) and [0, 100) -> 350 bytes, not 400.
    assert xla_buffers.profile(sequence, buffers) == [0, 100, 300, 350]
