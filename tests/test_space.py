"""The partition space: parsing, validation rules and presets."""

import pytest

from amsp_jax import Cluster, Placement, Strategy, StrategyError, preset, resolve

CLUSTER = Cluster(2, 4)


def test_strategy_round_trips_through_its_string():
    for text in ["p=4x1,g=4x1,os=8x2", "p=1x1,g=1x1,os=8x1", "p=2x1,g=4x1,os=4x2"]:
        assert str(Strategy.parse(text)) == text
    assert Strategy.parse("p=4x2, g=4x1; os=1x1".replace(";", ",")) == Strategy(
        Placement(4, 2), Placement(4, 1), Placement(1, 1)
    )


def test_presets_on_two_nodes_of_four():
    assert str(preset("ddp", CLUSTER)) == "p=1x1,g=1x1,os=1x1"
    assert str(preset("zero1", CLUSTER)) == "p=1x1,g=1x1,os=4x2"
    assert str(preset("zero2", CLUSTER)) == "p=1x1,g=4x2,os=4x2"
    assert str(preset("zero3", CLUSTER)) == "p=4x2,g=4x2,os=4x2"
    assert str(preset("mics", CLUSTER)) == "p=4x1,g=4x1,os=4x1"
    assert preset("hsdp", CLUSTER) == preset("mics", CLUSTER)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("p=3x1,g=4x1,os=4x1", ["params", "intra=3", "does not divide", "[1, 2, 4]"]),
        ("p=1x1,g=1x3,os=4x1", ["grads", "inter=3", "[1, 2]"]),
        ("p=2x2,g=4x2,os=4x2", ["params", "whole nodes", "4x2", "allow_partial_nodes"]),
        ("p=1x1,g=1x1", ["lacks os"]),
        ("q=1x1,g=1x1,os=1x1", ["unknown component 'q'"]),
        ("p=axb,g=1x1,os=1x1", ["INTRAxINTER"]),
    ],
)
def test_invalid_strategies_name_the_component_the_rule_and_a_fix(text, words):
    with pytest.raises(StrategyError) as error:
        resolve(text, CLUSTER)
    for word in words:
        assert word in str(error.value)


def test_groups_must_nest():
    with pytest.raises(StrategyError, match="not nested"):
        resolve("p=2x1,g=3x1,os=6x1", Cluster(1, 6))


def test_partial_nodes_allowed_on_request():
    strategy = Strategy.parse("p=2x2,g=4x2,os=4x2")
    assert strategy.validate(CLUSTER, allow_partial_nodes=True) is strategy


def test_unknown_preset():
    with pytest.raises(StrategyError, match="choose one of"):
        preset("zero4", CLUSTER)
