"""Tensor-parallel strategies and rules: the strategy string round-trips and names its fixes; the
logical-name rules split what Flax's own resolution (linen `nn.logical_to_mesh_axes`) splits."""

from __future__ import annotations

import re

import flax.linen as nn
import pytest

from amsp_jax.core import tensor
from amsp_jax.core.space import Cluster, Placement, Strategy, StrategyError


def test_a_tensor_degree_round_trips_and_defaults_to_one():
    text = "t=2,p=4x2,g=4x2,os=4x2"
    strategy = Strategy.parse(text)
    assert strategy.tensor == 2 and str(strategy) == text
    assert Strategy.parse(str(strategy)) == strategy
    assert Strategy.parse("p=1x1,g=1x1,os=8x1").tensor == 1
    assert str(Strategy.parse("p=1x1,g=1x1,os=8x1")) == "p=1x1,g=1x1,os=8x1"
    strategy.validate(Cluster(2, 8))
    assert strategy.data_parallel(Cluster(2, 8)) == Cluster(2, 4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("t=3,p=1x1,g=1x1,os=1x1", "use one of [1, 2, 4, 8]"),
        ("t=0,p=1x1,g=1x1,os=1x1", "not a positive integer"),
        ("t=two,p=1x1,g=1x1,os=1x1", "not a positive integer"),
        ("t=2,p=8x1,g=8x1,os=8x1", "does not divide the 4 data-parallel ranks per node"),
        ("t=2,p=8x2,g=8x2,os=8x2", "use one of [1, 2, 4]"),
        ("t=4,p=1x2,g=1x2,os=2x2", "must use whole nodes (intra=2)"),
    ],
)
def test_a_bad_tensor_strategy_names_the_fix(text, message):
    with pytest.raises(StrategyError, match=re.escape(message)):
        Strategy.parse(text).validate(Cluster(2, 8))


def test_positional_strategies_keep_tensor_one():
    one = Placement(1, 1)
    assert Strategy(one, one, one).tensor == 1


NAMES = [
    ("embed", "mlp"),
    ("mlp", "embed"),
    ("embed", "q_heads", "kv"),
    ("heads", "kv", "embed"),
    ("vocab", "embed"),
    ("embed",),
    (None, "mlp"),
    ("layers", "embed", "mlp"),
    ("mlp", "heads"),  # two names on the tensor axis: the first dimension takes it
    ("norm",),
]


@pytest.mark.parametrize("names", NAMES, ids=["-".join(map(str, n)) for n in NAMES])
def test_rules_split_what_linen_resolves(names):
    """Flax's own resolution of the same rules is the reference."""
    expected = nn.logical_to_mesh_axes(names, tensor.DEFAULT_TENSOR_RULES)
    dims = [d for d, axis in enumerate(expected) if axis == tensor.TENSOR]
    assert tensor.tensor_dim(names) == (dims[0] if dims else None)


def test_an_override_keeps_a_name_whole_by_its_first_rule():
    rules = tensor.normalize_rules([("vocab", None), *tensor.DEFAULT_TENSOR_RULES])
    names = ("vocab", "embed")
    assert tensor.tensor_dim(names, rules) is None
    assert nn.logical_to_mesh_axes(names, rules) == nn.logical_to_mesh_axes((None, None), rules)


@pytest.mark.parametrize("bad", [("mlp",), ("mlp", "data"), (3, "tensor")])
def test_a_bad_rule_names_the_fix(bad):
    with pytest.raises(tensor.TensorRuleError, match="tensor"):
        tensor.normalize_rules([bad])
