"""The planner under tensor parallelism: what it prices is what the step runs. The model's boundaries
and split dimensions as the planner reads them (`llama_spec`, no trace) against those the step's own
trace of the model records (`step.functions.tensor_boundaries`, whose bytes `tests/test_tensor.py`
checks against the compiled program); a degree the model cannot run is refused by name."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import amsp_jax as aj
from amsp_jax.compiled import audit
from amsp_jax.core.mesh import plan_axes
from amsp_jax.cost import hardware
from amsp_jax.cost.tensor_traffic import tensor_transfers
from amsp_jax.cost.trace import trace
from amsp_jax.models.llama import Llama, LlamaConfig, llama_spec, make_loss_fn
from amsp_jax.planner import search
from amsp_jax.planner.ilp import solve
from amsp_jax.planner.request import PlanError, make_request, tensor_options
from amsp_jax.planner.terms import build_terms
from tests.helpers import CLUSTER, SEQ, TINY, batches, optimizer

KV4_TIED = dataclasses.replace(TINY, n_kv_heads=4, tie_embeddings=True)


@pytest.mark.parametrize(
    ("config", "strategy", "sequence_parallel", "matmul", "micro_batches", "remat", "precision"),
    [
        (TINY, "t=2,zero3", True, "ring", 2, "full", "mixed"),
        (TINY, "t=2,p=1x1,g=2x2,os=2x2", True, "gather", 1, "dots", "mixed"),
        (KV4_TIED, "t=4,p=1x2,g=1x2,os=1x2", False, "gather", 1, "none", "fp32"),
        (KV4_TIED, "t=4,zero3", True, "cannon", 2, "full", "mixed"),
    ],
)
def test_the_planner_counts_the_tensor_collectives_the_step_traces(
    config, strategy, sequence_parallel, matmul, micro_batches, remat, precision
):
    model = Llama(config)
    plan = aj.Plan(
        CLUSTER, aj.resolve(strategy, CLUSTER), micro_batches, precision=precision, remat=remat,
        sequence_parallel=sequence_parallel, tensor_matmul=matmul,
    )  # fmt: skip
    trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model))
    batch = batches(16, 1)[0]
    trainer.setup(jax.random.key(0), batch["inputs"])
    traced = audit.workload_of(trainer, batch, trace(model, (batch["inputs"],)).dims)

    request = make_request(
        llama_spec(config), "cpu-sim", seq_len=SEQ, global_batch=16, precision=precision, remat=remat,
        tensor_degrees=(plan.strategy.tensor,),
    )  # fmt: skip
    form = (sequence_parallel, matmul)
    (at,) = [r for r in tensor_options(request) if (r.sequence_parallel, r.tensor_matmul) == form]
    micro_batch_size = at.sequences_per_device() // micro_batches
    planned = at.workload(micro_batch_size, micro_batches, remat)

    # Every tensor-split leaf splits the same dimension in the planner's description as in the step's.
    split = {leaf.path[-1]: leaf.tensor_dim for leaf in traced.leaves}
    assert {leaf.path[-1]: leaf.tensor_dim for leaf in planned.leaves} == split
    assert sum(dim is not None for dim in split.values()) == (8 if config.tie_embeddings else 9)
    axes = plan_axes(CLUSTER, plan.strategy)
    assert [b.kind for b in planned.boundaries] == [b.kind for b in traced.boundaries]
    assert tensor_transfers(axes, planned) == tensor_transfers(axes, traced)


def test_a_tensor_degree_the_model_cannot_run_is_refused_by_name():
    spec = llama_spec(LlamaConfig(vocab_size=64, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=96))
    request = make_request(spec, "cpu-sim", seq_len=SEQ, global_batch=16, tensor_degrees=(4,))
    with pytest.raises(PlanError, match=r"t=4 does not divide dimension 2 \(6\) of layers/layer/wq"):
        tensor_options(request)
    searched = make_request(spec, "cpu-sim", seq_len=SEQ, global_batch=16)
    assert sorted({r.tensor for r in tensor_options(searched)}) == [1, 2]


@pytest.mark.parametrize("form", ["ring", "cannon"])
def test_the_fused_forms_terms_derived_from_the_gather_forms_equal_their_own(form):
    # The search builds the ring and cannon forms' terms from the gather form's (`search.fused_terms`):
    # every term, the tensor transfers' time in each batching's compute included, must be what building
    # them gives.
    spec = llama_spec(dataclasses.replace(KV4_TIED, n_layers=3))
    request = make_request(spec, "a800-8x-ib800", 2, seq_len=64, global_batch=32, tensor_degrees=(4,))
    forms = {r.tensor_matmul: r for r in tensor_options(request) if r.sequence_parallel}
    assert sorted(forms) == ["cannon", "gather", "ring"]
    gather, fused = forms["gather"], forms[form]
    derived, built = search.fused_terms(build_terms(gather), fused), build_terms(fused)
    for field in dataclasses.fields(built):
        assert getattr(derived, field.name) == getattr(built, field.name), field.name
    assert derived.compute != build_terms(gather).compute  # the forms' tensor transfers differ in time


def test_the_model_state_terms_shared_across_issue_forms_equal_their_own():
    # The search builds the flat form's terms with the hierarchical form's model-state terms
    # (`build_terms(states_from=...)`): every term must be what building the flat form's own gives.
    spec = llama_spec(dataclasses.replace(KV4_TIED, n_layers=3))
    request = make_request(spec, "a800-8x-ib800", 2, seq_len=64, global_batch=32, tensor_degrees=(2,))
    split = tensor_options(request)[0]
    issue = dataclasses.replace(split.implementation, hierarchical=False)
    flat = dataclasses.replace(split, implementation=issue)
    hierarchical = build_terms(split)
    shared, built = build_terms(flat, states_from=hierarchical), build_terms(flat)
    for field in dataclasses.fields(built):
        assert getattr(shared, field.name) == getattr(built, field.name), field.name
    assert built.p_time != hierarchical.p_time  # the two forms' collectives differ in time


def test_the_best_plan_at_each_tensor_degree_is_the_best_of_every_option_solved(monkeypatch):
    # `price_alternatives` skips options whose compute alone is no faster than the best plan found
    # at their degree; the rows it keeps must be those of solving every option.
    spec = llama_spec(dataclasses.replace(KV4_TIED, n_layers=3))
    request = make_request(spec, "a800-8x-ib800", 2, seq_len=64, global_batch=32, tensor_degrees=(1, 4))
    solved: list[object] = []
    monkeypatch.setattr(search, "solve", lambda terms: solved.append(terms) or solve(terms))
    every = search.solved_options(request)
    solved_every, solved[:] = len(solved), []
    table = search.price_alternatives(request)
    assert len(solved) < solved_every  # some options were skipped
    best = {}
    for row in every:
        t = row.strategy.tensor
        if t not in best or row.estimate.time.step_s < best[t].estimate.time.step_s:
            best[t] = row
    kept = {row.strategy.tensor: row for row in (table.chosen, *table.by_tensor)}
    assert sorted(kept) == sorted(best)
    for t, row in kept.items():
        assert row.estimate == best[t].estimate and row.description == best[t].description, t


@pytest.mark.parametrize("config", ["h100-dgx", "a800-8x-ib800"])
def test_a_permute_is_one_step_of_a_ring_all_gather(config):
    # NCCL's ring all-gather over a node's R devices is one launch of R - 1 steps, each device sending
    # one chunk to its neighbour (nccl-tests: (R - 1) chunks per device at the bus bandwidth, one hop
    # of latency per step), so R - 1 permutes of a chunk (a ring form's transfers, `permute_time`) cost
    # the all-gather the bandwidth table prices plus R - 2 more launches; across two nodes the one
    # step of a two-node all-gather is one permute.
    hw = hardware.load(config)
    devices = hw.devices_per_node
    for chunk in (64 * 2**10, 2 * 2**20, 64 * 2**20):
        gather = hw.collective_time("all-gather", "intra", (devices - 1) * chunk, 1, devices, 1)
        steps = (devices - 1) * hw.permute_time(chunk, "intra")
        assert steps == pytest.approx(gather + (devices - 2) * hw.latency_base, rel=1e-12)
        assert hw.permute_time((devices - 1) * chunk, "intra", devices - 1) == pytest.approx(steps, rel=1e-12)
        assert hw.permute_time(chunk, "inter") == pytest.approx(
            hw.collective_time("all-gather", "inter", chunk, 1, 2, 2), rel=1e-12
        )
