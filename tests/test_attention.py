"""Memory-efficient attention: the blockwise attention equals the materialising one, and saves memory."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amsp_jax import cost
from amsp_jax.compiled import audit
from amsp_jax.core.plan import Plan
from amsp_jax.core.space import Cluster, preset
from amsp_jax.cost import timing
from amsp_jax.models import attention
from amsp_jax.models.llama import Llama, LlamaConfig, ModelConfigError, make_loss_fn
from amsp_jax.trainer import Trainer


@pytest.mark.parametrize(
    ("batch", "seq", "heads", "kv_heads", "head_dim", "block"),
    [
        (2, 37, 4, 2, 16, 8),  # GQA, 5 blocks, the last one padded
        (1, 100, 4, 2, 8, 30),  # blocks of 25 (the fewest equal blocks of at most 30 rows)
        (1, 64, 4, 4, 8, 16),  # multi-head attention, 4 whole blocks
        (2, 16, 6, 2, 8, 512),  # one block
        (1, 40, 4, 1, 8, 40),  # multi-query attention
    ],
)
def test_blockwise_equals_xla_attention_forward_and_gradient(batch, seq, heads, kv_heads, head_dim, block):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim))
    weights = jax.random.normal(keys[3], (batch, seq, heads, head_dim))

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    blockwise = lambda q, k, v: attention.blockwise_attention(q, k, v, block)  # noqa: E731
    np.testing.assert_allclose(
        jax.jit(blockwise)(q, k, v), attention.xla_attention(q, k, v), atol=1e-5, rtol=1e-5
    )
    expected = jax.jit(jax.grad(loss(attention.xla_attention), argnums=(0, 1, 2)))(q, k, v)
    got = jax.jit(jax.grad(loss(blockwise), argnums=(0, 1, 2)))(q, k, v)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-5)


def test_llama_with_blockwise_attention_equals_xla_loss_and_gradients():
    # Rotary embeddings and grouped-query heads in front of the attention, three blocks of 8 tokens.
    config = LlamaConfig(vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=24)
    tokens = np.random.default_rng(0).integers(0, 64, (2, 25)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = nn.meta.unbox(jax.jit(Llama(config).init)(jax.random.key(0), batch["inputs"]))["params"]
    results = {}
    for kind in ("xla", "blockwise"):
        model = Llama(dataclasses.replace(config, attention=kind, attention_block=8))
        results[kind] = jax.jit(jax.value_and_grad(make_loss_fn(model)))(params, batch)
    assert float(results["blockwise"][0]) == pytest.approx(float(results["xla"][0]), abs=1e-5)
    leaves = [jax.tree.leaves(results[kind][1]) for kind in ("blockwise", "xla")]
    for got, expected in zip(*leaves, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_auto_runs_blockwise_where_cudnn_does_not_apply():
    q = jnp.zeros((1, 16, 4, 8), jnp.float32)
    assert "bf16 or fp16" in attention.cudnn_applies(q, q) or "no cuDNN" in attention.cudnn_applies(q, q)
    jaxpr = str(jax.make_jaxpr(lambda q: attention.attention(q, q, q, "auto"))(q))
    assert "custom_vjp_call" in jaxpr and "platform_index" not in jaxpr
    with pytest.raises(ValueError, match="attention 'cudnn'"):
        attention.attention(q, q, q, "cudnn")


def test_attention_config_is_checked():
    with pytest.raises(ModelConfigError, match="attention must be one of auto, xla, blockwise, cudnn"):
        LlamaConfig(attention="flash")
    with pytest.raises(ModelConfigError, match="attention_block must be at least 1"):
        LlamaConfig(attention_block=0)
    assert cost.llama_dims(LlamaConfig(attention="xla")).materialises_scores
    assert not cost.llama_dims(LlamaConfig()).materialises_scores


def test_cost_model_has_no_score_term_for_memory_efficient_attention():
    config = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176)
    for kind, grows in [("auto", 2), ("cudnn", 2), ("xla", 4)]:
        sizes = [
            cost.activation_bytes(cost.llama_workload(dataclasses.replace(config, attention=kind), seq))[1]
            for seq in (4096, 8192)
        ]
        # Linear in the sequence without the scores; nearly quadratic with them.
        assert sizes[1] / sizes[0] == pytest.approx(grows, rel=0.05)
    # The flash backward recomputes Q·Kᵀ (2·L·H·Q·T FLOPs per token over the square, on the tiles it runs).
    flash = cost.llama_workload(config, 4096)
    naive = cost.llama_workload(dataclasses.replace(config, attention="xla"), 4096)
    assert flash.flops_per_token() == naive.flops_per_token()
    extra = timing.recomputed_attention_flops_per_token(flash.with_(remat="none"))
    assert timing.recomputed_attention_flops_per_token(naive.with_(remat="none")) == 0
    square = 2 * config.n_layers * config.n_heads * config.head_dim * 4096
    assert extra == pytest.approx(square * flash.attention_square_fraction(), abs=1)


@pytest.mark.parametrize(("seq", "block"), [(64, 16), (100, 30), (37, 8), (16, 512)])
def test_the_time_model_counts_the_score_tiles_the_blockwise_attention_runs(seq, block, monkeypatch):
    # Count every (query block, key block) tile the kernel computes, forward and backward, as it runs.
    tiles = []
    scores = attention._scores

    def counted(q_i, k_j, i, j, scale):
        jax.debug.callback(lambda: tiles.append(1))
        return scores(q_i, k_j, i, j, scale)

    monkeypatch.setattr(attention, "_scores", counted)
    q = jnp.ones((1, seq, 2, 8))
    jax.grad(lambda q: attention.blockwise_attention(q, q, q, block).sum())(q)
    jax.effects_barrier()
    rows = len(attention._split(q, -(-seq // min(block, seq)), 2)[0, 0])  # one tile's side, padding included
    config = LlamaConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=32,
                         attention="blockwise", attention_block=block)  # fmt: skip
    flash = cost.llama_workload(config, seq)
    # Half the tiles in the forward, half in the backward's recomputation.
    assert len(tiles) / 2 * rows * rows / seq**2 == pytest.approx(flash.attention_square_fraction())
    naive = cost.llama_workload(dataclasses.replace(config, attention="xla"), seq)
    assert naive.attention_square_fraction() == 1.0


LONG = 1024


def long_sequence_step(kind: str, hlo_path: str) -> audit.Report:
    config = LlamaConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=LONG,
        attention=kind, attention_block=128,
    )  # fmt: skip
    cluster = Cluster(2, 4)
    plan = Plan(cluster, preset("zero3", cluster), 1, precision="mixed", remat="full")
    model = Llama(config)
    trainer = Trainer(plan, model, optax.adamw(1e-4), make_loss_fn(model))
    trainer.setup(jax.random.key(0), jnp.zeros((1, LONG), jnp.int32))
    tokens = jax.ShapeDtypeStruct((cluster.num_devices, LONG), jnp.int32)
    dims = cost.llama_dims(config)
    return audit.audit_trainer(trainer, {"inputs": tokens, "targets": tokens}, dims, dump_hlo=hlo_path)


def test_compiled_cpu_step_with_blockwise_attention_needs_far_less_memory(tmp_path):
    # Measured (zero3, 8 CPU devices, 1,024 tokens per device, mixed precision): temporaries 73.0 MB with
    # the materialising attention, 3.7 MB blockwise. The cost model's score term (10 bytes per score,
    # from LLaMA-7B/13B) predicts 41.8 MB of the 69.3 MB difference: this 4-head model holds more.
    xla = long_sequence_step("xla", str(tmp_path / "xla.hlo"))
    flash = long_sequence_step("blockwise", str(tmp_path / "blockwise.hlo"))
    temp = [r.measured.memory_stats["temp_size_in_bytes"] for r in (xla, flash)]
    assert temp[1] * 8 < temp[0]
    compiled_drop = xla.measured.memory_bytes - flash.measured.memory_bytes
    predicted_drop = xla.predicted.memory.total - flash.predicted.memory.total
    assert 1 < compiled_drop / predicted_drop < 2
    # No (seq, seq) buffer in the blockwise program; the materialising one has them.
    square = f"{LONG},{LONG}]"
    assert square in (tmp_path / "xla.hlo").read_text()
    text = (tmp_path / "blockwise.hlo").read_text()
    assert square not in text and attention.SCOPE in text


def test_audit_command_takes_the_attention(tmp_path):
    from amsp_jax.cli import main

    # The tiny model's own attention (auto) runs blockwise on the CPU, so the materialised scores and no
    # blockwise scope show that the flag reached the model; the blockwise program is the test above's.
    hlo = tmp_path / "xla.hlo"
    args = ["audit", "--model", "tiny", "--nodes", "2", "--devices-per-node", "4", "--seq-len", "64",
            "--attention", "xla", "--json", "--dump-hlo", str(hlo)]  # fmt: skip
    assert main(args) in (0, 1)
    assert "64,64]" in hlo.read_text() and attention.SCOPE not in hlo.read_text()
