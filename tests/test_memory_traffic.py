"""The GPU traffic form (`amsp_jax.cost.memory_traffic`): which configs it prices, at what bandwidth, and
its bytes against the compiled programs of shapes and placements it was not fitted on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import yaml
from jax.sharding import NamedSharding

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit, gpu_target, hlo
from amsp_jax.core import backend
from amsp_jax.core.mesh import batch_spec
from amsp_jax.cost import memory_traffic, timing
from amsp_jax.cost.hardware import from_dict, load
from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def recorded_profile(name: str):
    return from_dict(yaml.safe_load(json.loads((RESULTS / name).read_text())["profile"]))


def test_a_profiled_gpu_prices_its_traffic_and_a_datasheet_or_cpu_config_does_not():
    assert memory_traffic.applies(recorded_profile("gpu_step_h100_20261126-0743.json"))
    # h100-dgx's assumed efficiency stands for the memory-bound kernels; cpu-sim fits its own passes.
    assert not memory_traffic.applies(load("h100-dgx"))
    assert not memory_traffic.applies(load("cpu-sim"))


def test_the_bandwidth_is_the_fastest_pass_the_profile_measured():
    # This H100 profile read 2,510 GB/s at 16 MiB and 1,462 at 64 MiB, its `hbm_bandwidth`.
    h100 = recorded_profile("gpu_step-llama3-1b_h100_20261126-0743.json")
    assert h100.hbm_bandwidth == pytest.approx(1.4619e12)
    assert memory_traffic.bandwidth(h100) == pytest.approx(2.510e12)
    # Where the largest buffer is the fastest, that is the profile's own bandwidth (1 GiB: 3.1073 TB/s).
    h200 = recorded_profile("gpu_step-micro-batches_h200_20261126-1330.json")
    assert memory_traffic.bandwidth(h200) == pytest.approx(3.1073e12)


def test_each_shipped_form_has_every_term_and_says_on_which_jaxlib_it_was_fitted():
    assert set(memory_traffic.shipped().coefficients) == set(memory_traffic.TERMS)
    for (major, minor), name in backend.TRAFFIC_FORMS:
        path = Path(memory_traffic.__file__).parent.parent / "configs" / "traffic" / f"{name}.yaml"
        assert set(memory_traffic.load(path).coefficients) == set(memory_traffic.TERMS)
        text = path.read_text()
        assert "benchmarks.gpu_traffic_fit" in text and "gpu_traffic_fit_h100-compiled_" in text
        fitted_on = re.search(r"jax/jaxlib (\d+)\.(\d+)", text)
        assert fitted_on and (int(fitted_on[1]), int(fitted_on[2])) >= (major, minor), name


# Not among benchmarks/gpu_traffic_fit.py's probe shapes: another width, depth, vocabulary and sequence.
HELD_OUT = LlamaConfig(vocab_size=6000, dim=576, n_layers=3, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                       max_seq_len=768, name="held-out")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("devices", "strategy", "micro_batches", "remat"),
    [(1, "ddp", 2, "dots"), (1, "ddp", 1, "full"), (4, "zero1", 1, "none"), (4, "zero3", 2, "none")],
)
def test_the_form_predicts_the_compiled_traffic_of_a_shape_it_was_not_fitted_on(
    devices, strategy, micro_batches, remat
):
    try:
        gpu_target.check_packages()
    except gpu_target.TargetError as e:
        pytest.skip(str(e))
    model = Llama(HELD_OUT)
    cluster = aj.Cluster(1, devices, "probe")
    seq, per_device = 768, 2
    tokens = np.random.default_rng(0).integers(0, 6000, (per_device * micro_batches * devices, seq + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    plan = aj.Plan(cluster, aj.resolve(strategy, cluster), micro_batches, precision="mixed", remat=remat)
    trainer = aj.Trainer(plan, model, optax.adamw(1e-3), make_loss_fn(model),
                         devices=list(gpu_target.topology("h100-sxm", 1, devices)))  # fmt: skip
    trainer.setup(jax.random.key(0), batch["inputs"])
    spec = NamedSharding(trainer.layout.mesh, batch_spec(trainer.layout, 2))
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=spec) for k, v in batch.items()}
    compiled = trainer.compile(trainer.abstract_state(), abstract)
    workload = audit.workload_of(trainer, batch, cost.llama_dims(HELD_OUT))
    blocks = timing.pass_blocks(cost.memory(trainer.layout, workload), workload)
    form = memory_traffic.shipped()
    predicted = sum(form.bytes(memory_traffic.terms(blocks, workload, devices)).values())
    assert predicted / hlo.memory_traffic(compiled.as_text()) == pytest.approx(1, abs=0.15)
