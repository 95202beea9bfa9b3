"""Tensor and sequence parallelism in the step: every model style under t = 2 and t = 4, with sequence
parallelism on and off, combined with P/G/OS placements and micro-batches, against plain `jax.grad` on
one device; the weights held as tensor slices; a checkpoint restored without the tensor axis; the
errors that name what to change."""

from __future__ import annotations

import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.compiled import audit, gpu_target, xla
from amsp_jax.core.schedule import COLLECTIVE_PERMUTE
from amsp_jax.cost import timing
from amsp_jax.cost.hardware import for_device_kind
from amsp_jax.errors import is_input_error
from amsp_jax.layers import tensor_ring
from amsp_jax.models.llama import Llama, LlamaConfig, ModelConfigError, make_loss_fn
from amsp_jax.run.checkpoint import Checkpointer
from amsp_jax.trainer import TrainerError
from tests import model_zoo, tensor_models
from tests.helpers import CLUSTER, TINY, batches, max_relative_error, optimizer, reference

# t = 4 splits the key/value heads four ways.
TINY_KV4 = dataclasses.replace(TINY, n_kv_heads=4)
STEPS = 2


def model_and_loss(name: str) -> tuple[object, object]:
    if name in ("llama", "llama kv4"):
        model = Llama(TINY_KV4 if name == "llama kv4" else TINY)
        return model, make_loss_fn(model)
    model = tensor_models.model(name)
    return model, tensor_models.loss_fn(model)


@functools.cache
def data() -> list[dict[str, np.ndarray]]:
    return batches(24, STEPS)


@functools.cache
def expected(name: str) -> tuple[list[float], dict]:
    model, loss_fn = model_and_loss(name)
    return reference(model, data(), jax.random.key(0), loss_fn)


def train(name: str, strategy: str, sequence_parallel: bool, micro_batches: int, form: str = "gather", **kw):
    model, loss_fn = model_and_loss(name)
    cluster = kw.pop("cluster", CLUSTER)
    plan = aj.Plan(
        cluster, aj.resolve(strategy, cluster), micro_batches, precision="fp32",
        sequence_parallel=sequence_parallel, tensor_matmul=form,
    )  # fmt: skip
    trainer = aj.Trainer(plan, model, optimizer(), loss_fn, **kw)
    state = trainer.init(jax.random.key(0), data()[0]["inputs"])
    losses = []
    for batch in data():
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


# (model, strategy, sequence parallelism, micro-batches, matmul form): each style once, each placement
# kind, t = 2 and t = 4 (one data-parallel rank per node), sequence parallelism on and off, M = 1 and 3,
# each matmul form (the ring's q/k/v share one ring in the LLaMA, run one each as linen modules; the
# cannon form at t = 4, the 2 x 2 square, for each model style). A
# LayerStack of linen blocks runs as the LLaMA's does; t = 4 without sequence parallelism, below,
# compiled for H100s.
CASES = [
    ("llama", "t=2,zero3", True, 1, "ring"),
    ("llama", "t=2,p=1x1,g=2x1,os=2x2", False, 3, "gather"),
    ("llama kv4", "t=4,p=1x2,g=1x2,os=1x2", True, 3, "gather"),
    ("loop", "t=2,mics", True, 1, "gather"),
    ("scan", "t=2,zero3", False, 3, "gather"),
    ("scan", "t=4,p=1x1,g=1x2,os=1x2", True, 3, "ring"),
    ("nnx", "t=2,zero3", True, 1, "gather"),
    ("llama kv4", "t=4,zero3", True, 1, "cannon"),
    ("scan", "t=4,p=1x2,g=1x2,os=1x2", True, 3, "cannon"),
    ("nnx", "t=4,mics", True, 1, "cannon"),
]


@pytest.mark.parametrize(("name", "strategy", "sequence_parallel", "micro_batches", "form"), CASES)
def test_tensor_parallel_step_equals_single_device_reference(
    name, strategy, sequence_parallel, micro_batches, form, monkeypatch
):
    # A column ring of three blocks or more goes both ways round on every jaxlib here (in the step from
    # jaxlib 0.11); two blocks have one way.
    monkeypatch.setattr(tensor_ring, "_both_ways", lambda degree: degree > 2)
    expected_losses, expected_params = expected(name)
    trainer, state, losses = train(name, strategy, sequence_parallel, micro_batches, form)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert max_relative_error(trainer.full_params(state), expected_params) < 1e-5
    # The step just compiled moves exactly the bytes the cost model counts, per kind and level: the
    # placements' collectives and the tensor boundaries' (forward, remat, backward); its memory is
    # within the audit's bound, as for t = 1 (activations at their shapes: tests/test_memory_at_shapes.py).
    report = audit.audit_trainer(trainer, data()[0])
    assert report.bytes_match and report.match, report.table()
    boundaries = [t for t in report.predicted.transfers if t.phase.startswith("tensor boundaries")]
    assert boundaries and all(t.level == "intra" for t in boundaries)
    permutes = report.measured.bytes_by_kind_and_level().get("collective-permute", {}).get("intra", 0)
    assert bool(permutes) == (form != "gather")
    if form == "cannon":  # inside the layers the square moves blocks between pairs of ranks, nothing else
        measured = report.measured
        in_layers = [
            c.kind for c, level in zip(measured.collectives, measured.levels, strict=True)
            if level == "intra" and measured.is_per_layer(c) and not c.scalar
        ]  # fmt: skip
        # (The nnx model's blocks are not a stack: the audit names no collective of it per-layer.)
        assert set(in_layers) <= {"collective-permute"} and (bool(in_layers) or name == "nnx")


def test_weights_are_held_as_tensor_slices_split_again_over_the_data_ranks():
    model, loss_fn = model_and_loss("llama")
    plan = aj.Plan(CLUSTER, aj.resolve("t=2,zero3", CLUSTER), precision="fp32")
    trainer = aj.Trainer(plan, model, optimizer(), loss_fn)
    state = trainer.init(jax.random.key(0), data()[0]["inputs"])
    # wq is (layers, dim, q_heads, head_dim) = (2, 32, 4, 8): the 4 heads over t = 2, and one tensor
    # rank's (2, 32, 2, 8) over its 4 data-parallel ranks on the first non-layer dimension: (2, 8, 2, 8).
    wq = state.master["layers"]["layer"]["wq"]  # OS (and P, derived from it in fp32) under zero3
    assert {shard.data.shape for shard in wq.addressable_shards} == {(2, 8, 2, 8)}
    # The two tensor ranks of a group hold different heads; the ranks of a data group, one tensor slice.
    layout = trainer.program.layout
    assert layout.all_axes[-1] == "tensor" and layout.axis_size("tensor") == 2
    norm = state.master["layers"]["layer"]["attention_norm"]  # whole on the tensor axis
    assert {shard.data.shape for shard in norm.addressable_shards} == {(2, 8)}


def test_a_checkpoint_of_a_tensor_parallel_plan_restores_onto_four_devices_without_it(tmp_path):
    trainer, state, _ = train("llama", "t=2,p=2x2,g=2x2,os=2x2", True, 1)
    checkpoints = Checkpointer(tmp_path, async_save=False)
    checkpoints.save(trainer, state, jax.random.key(0))
    four = jax.devices()[:4]
    model, loss_fn = model_and_loss("llama")
    cluster = aj.Cluster(1, 4)
    other = aj.Trainer(aj.Plan(cluster, aj.resolve("zero3", cluster), precision="fp32"), model, optimizer(),
                       loss_fn, devices=four)  # fmt: skip
    other.setup(jax.random.key(0), data()[0]["inputs"])
    try:
        restored = checkpoints.restore(other).state
    finally:
        checkpoints.close()
    host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    assert jax.tree.all(jax.tree.map(np.array_equal, host(restored.master), host(state.master)))
    assert jax.tree.all(jax.tree.map(np.array_equal, other.full_params(restored), trainer.full_params(state)))


def test_a_matmul_form_is_checked_when_the_plan_is_made():
    strategy = aj.resolve("t=2,zero3", CLUSTER)
    with pytest.raises(ValueError, match=re.escape("unknown tensor_matmul 'systolic'; use one of")):
        aj.Plan(CLUSTER, strategy, tensor_matmul="systolic")
    for form in ("ring", "cannon"):
        with pytest.raises(ValueError, match="needs sequence parallelism"):
            aj.Plan(CLUSTER, aj.resolve("t=4,zero3", CLUSTER), sequence_parallel=False, tensor_matmul=form)
    assert aj.Plan(CLUSTER, strategy, tensor_matmul="ring").describe().endswith(", ring matmuls")
    # The square is 2 x 2 inside a node; 4 x 4 would need 16 devices in one. Bad input, so the
    # commands print it as one line.
    with pytest.raises(ValueError, match=r"needs t=4, not t=2 \(the next square, 4 x 4, needs 16") as e:
        aj.Plan(CLUSTER, strategy, tensor_matmul="cannon")
    assert is_input_error(e.value)
    square = aj.Plan(CLUSTER, aj.resolve("t=4,zero3", CLUSTER), tensor_matmul="cannon")
    assert square.describe().endswith(", cannon matmuls")


def test_presets_take_a_tensor_degree():
    assert str(aj.resolve("t=2,zero3", CLUSTER)) == "t=2,p=2x2,g=2x2,os=2x2"
    assert str(aj.resolve("t=2,mics", CLUSTER)) == "t=2,p=2x1,g=2x1,os=2x1"
    assert str(aj.resolve("t=4,zero1", CLUSTER)) == "t=4,p=1x1,g=1x1,os=1x2"


def test_a_model_without_logical_names_under_t_names_what_to_annotate():
    model = model_zoo.GPT("loop")
    plan = aj.Plan(CLUSTER, aj.resolve("t=2,zero3", CLUSTER), precision="fp32")
    trainer = aj.Trainer(plan, model, optimizer(), lambda p, b: 0.0)
    with pytest.raises(TrainerError, match=re.escape("annotate its kernels")):
        trainer.setup(jax.random.key(0), data()[0]["inputs"])


def test_a_degree_that_does_not_divide_the_heads_names_the_leaf():
    model, loss_fn = model_and_loss("llama")  # 2 key/value heads
    plan = aj.Plan(CLUSTER, aj.resolve("t=4,zero3", CLUSTER), precision="fp32")
    trainer = aj.Trainer(plan, model, optimizer(), loss_fn)
    with pytest.raises(aj.TensorRuleError, match=r"parameter layers/layer/wk has 2 elements on dimension 2"):
        trainer.setup(jax.random.key(0), data()[0]["inputs"])


def test_tensor_rules_can_keep_a_name_whole():
    # Rules that keep the feed-forward whole: w1 is not split, and the bundled LLaMA, whose layers are
    # written for split heads and ffn units, says so when the step traces it.
    model, loss_fn = model_and_loss("llama")
    plan = aj.Plan(CLUSTER, aj.resolve("t=2,zero3", CLUSTER), precision="fp32")
    rules = (("mlp", None), *aj.DEFAULT_TENSOR_RULES)
    trainer = aj.Trainer(plan, model, optimizer(), loss_fn, tensor_rules=rules)
    state = trainer.init(jax.random.key(0), data()[0]["inputs"])
    assert trainer.program.params.leaves[("layers", "layer", "w1")].leaf.tensor_dim is None
    assert trainer.program.params.leaves[("layers", "layer", "wq")].leaf.tensor_dim == 2
    with pytest.raises(ModelConfigError, match="the tensor rules keep it whole"):
        trainer.step(state, data()[0])


class GlobalHeads(nn.Module):
    """Splits its projection into heads with the model's global head count, as many models do."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(64, 32, embedding_init=tensor_models.named(tensor_models.normal, "vocab", "embed"))(
            tokens
        )
        q = nn.Dense(
            32, kernel_init=tensor_models.named(tensor_models.normal, "embed", "heads"), use_bias=False
        )(x)
        q = q.reshape(*q.shape[:2], 4, 8)  # 4 heads of 8, whatever t
        out = nn.Dense(32, kernel_init=tensor_models.named(tensor_models.normal, "heads", "embed"))
        return nn.Dense(64)(out(q.reshape(*q.shape[:2], -1)))


def test_a_reshape_to_the_global_head_count_is_named_with_its_fix():
    model = GlobalHeads()
    plan = aj.Plan(CLUSTER, aj.resolve("t=2,zero3", CLUSTER), precision="fp32")
    trainer = aj.Trainer(
        plan, model, optimizer(), lambda p, b: model.apply({"params": p}, b["inputs"]).mean()
    )
    state = trainer.init(jax.random.key(0), data()[0]["inputs"])
    with pytest.raises(TrainerError, match=re.escape("reshape with -1 for their count")):
        trainer.step(state, data()[0])


def test_a_split_kernel_with_a_whole_bias_names_the_names_to_give():
    class Unnamed(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = nn.Embed(64, 32, embedding_init=tensor_models.named(tensor_models.normal, "vocab", "embed"))(
                tokens
            )
            return nn.Dense(64, kernel_init=tensor_models.named(tensor_models.normal, "embed", "vocab"))(x)

    model = Unnamed()
    plan = aj.Plan(CLUSTER, aj.resolve("t=2,zero3", CLUSTER), precision="fp32")
    trainer = aj.Trainer(
        plan, model, optimizer(), lambda p, b: model.apply({"params": p}, b["inputs"]).mean()
    )
    state = trainer.init(jax.random.key(0), data()[0]["inputs"])
    with pytest.raises(aj.TensorRuleError, match=re.escape("give the bias the kernel's output names")):
        trainer.step(state, data()[0])


try:
    gpu_target.check_packages()
    MISSING = ""
except gpu_target.TargetError as error:
    MISSING = str(error)


# Compiled for 2 nodes of 8 H100s: XLA:GPU's own schedule, fusion and collective passes. The ring form
# on a model 2,048 wide: its transfers hide behind the block products. The cannon form with
# micro-batches: the head's kernel moves hoisted out of their loop, as on the CPU. The gather form 2,048
# wide at t = 4 (issue 44): its memory within 10 % of the prediction, the layers' backward its peak.
WIDE = LlamaConfig(
    vocab_size=1024, dim=2048, n_layers=4, n_heads=16, n_kv_heads=16, ffn_dim=5632, max_seq_len=2048
)
NARROW = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=176, max_seq_len=64)


@pytest.mark.skipif(bool(MISSING), reason=MISSING)
@pytest.mark.parametrize(("strategy", "sequence_parallel", "micro_batches", "form"), [
    ("t=2,zero3", True, 2, "gather"), ("t=4,p=2x2,g=2x2,os=2x2", False, 1, "gather"),
    ("t=2,zero3", True, 1, "ring"), ("t=4,zero3", True, 3, "cannon"), ("t=4,zero3", True, 1, "wide gather"),
])  # fmt: skip
def test_h100_compiled_bytes_equal_the_prediction(strategy, sequence_parallel, micro_batches, form):
    devices = gpu_target.topology("h100-sxm", 2, 8)
    cluster = aj.Cluster.detect(devices)
    wide, form = form == "ring" or form.startswith("wide "), form.removeprefix("wide ")
    config = WIDE if wide else NARROW
    plan = aj.Plan(
        cluster, aj.resolve(strategy, cluster), micro_batches, precision="mixed",
        sequence_parallel=sequence_parallel, tensor_matmul=form,
    )  # fmt: skip
    model = Llama(config)
    trainer = aj.Trainer(plan, model, optax.adamw(1e-4), make_loss_fn(model), devices=devices)
    seq = config.max_seq_len
    trainer.setup(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))
    data_devices = cluster.num_devices // plan.strategy.tensor
    tokens = jax.ShapeDtypeStruct((data_devices * micro_batches, seq), jnp.int32)
    report = audit.audit_trainer(trainer, {"inputs": tokens, "targets": tokens}, cost.llama_dims(config))
    assert report.bytes_match, report.table()
    assert any(t.phase.startswith("tensor boundaries") for t in report.predicted.transfers)
    if wide and form == "gather":
        assert report.predicted.memory.peak_name == "backward"
        assert abs(report.memory_ratio - 1) <= 0.10, report.table()
    if form == "ring":
        # At least 90 % of the ring's bytes have a gemm between their transfer's start and done.
        hidden, total = report.measured.hidden_bytes("collective-permute")
        assert total and hidden >= 0.9 * total, (hidden, total)
        # The compiled program's permutes, priced as XLA's scheduler is told (`xla.collective_seconds`,
        # from their HLO bytes and trip counts), take the time the time model gives the predicted ones.
        hardware = for_device_kind(devices[0].device_kind, 2, 8)
        assert hardware is not None
        nodes = trainer.program.layout.node_of_device()
        compiled = sum(
            xla.collective_seconds(c, hardware, nodes)
            for c in report.measured.collectives if c.kind == COLLECTIVE_PERMUTE and not c.scalar
        )  # fmt: skip
        predicted = [t for t in report.predicted.transfers if t.kind == COLLECTIVE_PERMUTE]
        assert compiled == pytest.approx(sum(timing.transfer_time(t, hardware) for t in predicted), rel=1e-9)
