"""The XLA options amsp_jax passes to a compile, on an XLA that does not know some of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amsp_jax import xla


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
    assert xla.compiler_options("gpu", devices=16) == xla.gpu_options()


def test_the_estimator_before_jaxlib_0_11_and_two_collectives_in_flight_from_it(monkeypatch):
    limit = "xla_gpu_experimental_parallel_collective_overlap_limit"
    monkeypatch.setattr(jax, "__version_info__", (0, 10, 2))
    assert xla.gpu_options()["xla_gpu_enable_analytical_latency_estimator"] is True
    assert limit not in xla.gpu_options()
    monkeypatch.setattr(jax, "__version_info__", (0, 11, 2))
    assert "xla_gpu_enable_analytical_latency_estimator" not in xla.gpu_options()
    # Without the estimator, two collectives in flight.
    assert xla.gpu_options()[limit] == 2
