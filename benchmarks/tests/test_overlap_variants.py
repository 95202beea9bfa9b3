"""`benchmarks/xla_overlap.py`, which compares the audit's per-layer overlap across XLA settings:
variants compose, each compiles in its own process, failures are named."""

import pytest

from amsp_jax.compiled import gpu_target
from benchmarks import xla_overlap

try:
    gpu_target.check_packages()
    MISSING = ""
except gpu_target.TargetError as e:
    MISSING = str(e)

TINY = ["--model", "tiny", "--target", "h100-sxm", "--nodes", "2", "--devices-per-node", "8",
        "--seq-len", "32", "--precision", "mixed", "--remat", "full"]  # fmt: skip


def test_a_variant_joins_its_settings_and_an_unknown_one_is_named():
    flags, overrides, audit_flags = xla_overlap.variant("loop+limit2+early")
    assert flags == "--xla_gpu_experimental_collective_start_as_early_as_possible=true"
    assert overrides == {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
    assert audit_flags == ["--prefetch", "loop"]
    with pytest.raises(SystemExit, match=r"unknown setting limit3 in 'loop\+limit3'; known: library, loop"):
        xla_overlap.variant("loop+limit3")


@pytest.mark.slow
@pytest.mark.skipif(bool(MISSING), reason=MISSING)
def test_each_variant_is_audited_in_its_own_process_and_a_flag_xla_rejects_is_reported(monkeypatch):
    monkeypatch.setitem(xla_overlap.SETTINGS, "no-such-flag", ("--xla_gpu_no_such_flag_here=true", {}, []))
    audited = xla_overlap.run_variant("limit2", "zero3", TINY, timeout=300)
    assert audited["bytes_match"], audited
    # zero3 gathers every layer in the forward and again in the backward, where it scatters its gradient.
    assert {"per-layer forward", "per-layer backward"} <= set(audited["by_phase"]), audited["by_phase"]
    assert audited["overrides"] == {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
    rejected = xla_overlap.run_variant("no-such-flag", "zero3", TINY, timeout=300)
    assert "Unknown flag in XLA_FLAGS: --xla_gpu_no_such_flag_here" in rejected["error"], rejected
