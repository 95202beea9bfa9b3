"""The per-layer overlap share the audit reports, and `benchmarks/xla_overlap.py`, which compares it across
XLA settings: variants compose, each compiles in its own process, failures are named."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from amsp_jax.compiled import audit, gpu_target
from benchmarks import xla_overlap

try:
    gpu_target.check_packages()
    MISSING = ""
except gpu_target.TargetError as e:
    MISSING = str(e)

TINY = ["--model", "tiny", "--target", "h100-sxm", "--nodes", "2", "--devices-per-node", "8",
        "--seq-len", "32", "--precision", "mixed", "--remat", "full"]  # fmt: skip


def test_the_per_layer_hidden_fraction_of_a_hand_written_schedule():
    # tests/hlo/per_layer_overlap.txt, on 4 devices of one node, bytes one device sends (3/4 of the result
    # of a gather, of the operand of a scatter): a layer's gather with a gemm between start and done
    # (3/4 of 1 KiB = 768 B), one with only an elementwise kernel there (3/4 of 3 KiB = 2304 B), a
    # layer's reduce-scatter with a gemm between (3/4 of 4 KiB = 3072 B), and outside the layers an
    # exposed embedding gather and the scalar loss reduction, which the per-layer share leaves out.
    text = (Path(__file__).parent / "hlo" / "per_layer_overlap.txt").read_text()
    memory = SimpleNamespace(
        argument_size_in_bytes=0, output_size_in_bytes=0, alias_size_in_bytes=0, temp_size_in_bytes=0
    )
    compiled = SimpleNamespace(as_text=lambda: text, memory_analysis=lambda: memory)
    axes = SimpleNamespace(cluster=SimpleNamespace(num_devices=4), node_of_device=lambda: [0, 0, 0, 0])
    summary = audit.measure(compiled, axes, ("layers",)).overlap_summary()
    assert (summary["per_layer_hidden_bytes"], summary["per_layer_bytes"]) == (768 + 3072, 768 + 2304 + 3072)
    assert summary["per_layer_hidden_fraction"] == 0.625
    assert summary["by_phase"] == {
        "forward": {"hidden": 0, "exposed": 384},
        "per-layer forward": {"hidden": 768, "exposed": 2304},
        "per-layer backward": {"hidden": 3072, "exposed": 0},
    }
    assert [e["name"] for e in summary["exposed"]] == ["gather_exposed", "embedding"]


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
