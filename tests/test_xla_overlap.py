"""The per-layer overlap share the audit reports, on a hand-written schedule whose answer is known."""

from pathlib import Path
from types import SimpleNamespace

from amsp_jax.compiled import audit


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
