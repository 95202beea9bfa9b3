"""The XLA options amsp_jax passes to a compile, on an XLA that does not know some of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amsp_jax.compiled import xla
from amsp_jax.cost.hardware import for_device_kind


def _lowered():
    return jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.arange(4.0))


def test_an_option_this_xla_does_not_know_is_left_out_with_a_warning_naming_it():
    options = {**xla.gpu_options(), "xla_gpu_option_from_another_release": True}
    with pytest.warns(UserWarning, match="xla_gpu_option_from_another_release") as caught:
        compiled = xla.compile_lowered(_lowered(), options)
    assert len(caught) == 1
    # The options XLA knows stay: only the unknown one is named.
    assert not any(name in str(caught[0].message) for name in xla.gpu_options())
    np.testing.assert_allclose(compiled(jnp.arange(4.0)), np.sin(np.arange(4.0)) * 2, rtol=1e-6)


def test_known_options_compile_without_a_warning(recwarn):
    xla.compile_lowered(_lowered(), xla.gpu_options())
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_any_other_compile_error_is_raised():
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_gpu_all_gather_combine_threshold_bytes"):
        xla.compile_lowered(_lowered(), {"xla_gpu_all_gather_combine_threshold_bytes": "many"})


def test_one_device_gets_only_the_memory_budget_and_the_cpu_xlas_defaults():
    assert xla.compiler_options("gpu", 1 << 26, None, devices=1) is None
    assert xla.compiler_options("gpu", 1 << 26, 150, devices=1) == {"xla_gpu_memory_limit_slop_factor": 150}
    assert xla.compiler_options("cpu", devices=8) is None


def test_a_gpu_cluster_gets_the_overlap_options_with_combine_thresholds_of_a_layer():
    # A 100 MiB layer: gathers combine up to one layer, all-reduces up to two, reduce-scatters up to
    # 32 MiB so that each layer's gradient stays a collective of its own.
    options = xla.compiler_options("cuda", 100 << 20, 150, devices=16)
    assert options["xla_gpu_all_gather_combine_threshold_bytes"] == 104_857_600
    assert options["xla_gpu_all_reduce_combine_threshold_bytes"] == 209_715_200
    assert options["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 33_554_432
    assert options["xla_gpu_memory_limit_slop_factor"] == 150
    assert options["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert options["optimization_level"] == 19  # XLA's EFFORT_O1, JAX's optimization level O1
    # A 1 MiB layer: gathers still combine up to the 64 MiB floor; no budget given, none set.
    small = xla.compiler_options("rocm", 1 << 20, None, devices=2)
    assert small["xla_gpu_all_gather_combine_threshold_bytes"] == 67_108_864
    assert "xla_gpu_memory_limit_slop_factor" not in small


def test_the_analytical_estimator_only_before_jaxlib_0_11_and_one_collective_in_flight(monkeypatch):
    limit = "xla_gpu_experimental_parallel_collective_overlap_limit"
    for version, estimator in (((0, 10, 2), True), ((0, 11, 2), False)):
        monkeypatch.setattr(jax, "__version_info__", version)
        options = xla.gpu_options()
        assert ("xla_gpu_enable_analytical_latency_estimator" in options) is estimator
        # XLA's default of one collective in flight: with the instruction profile, more only cost memory.
        assert limit not in options
        # A ring plan's transfers run beside the layer's weight gathers (`layers.tensor_ring`).
        assert xla.gpu_options(collective_matmul=True)[limit] == 2


def test_a_gpu_is_priced_with_the_shipped_config_of_its_model():
    # The A800 is an A100 with less NVLink: its shipped config prices A100s, shaped to the cluster.
    a100 = for_device_kind("NVIDIA A100-SXM4-80GB", 128, 8)
    assert (a100.name, a100.nodes, a100.devices_per_node) == ("a800-8x-ib800", 128, 8)
    assert a100.peak_flops == 312e12  # A100's dense bf16 peak
    assert for_device_kind("NVIDIA H100 80GB HBM3", 2, 8).name == "h100-dgx"
    assert for_device_kind("NVIDIA H200", 2, 8) is None and for_device_kind("cpu", 2, 4) is None
