"""The partition space: clusters, placements of P/G/OS, strategies and the usual presets."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import jax

COMPONENTS = ("params", "grads", "opt_state")
_SHORT = {"p": "params", "g": "grads", "os": "opt_state"}
_SHORT_OF = {v: k for k, v in _SHORT.items()}
TENSOR_KEY = "t"


class StrategyError(ValueError):
    """A strategy that breaks a rule of the partition space."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`nodes` × `devices_per_node` devices; links inside a node are fast, between nodes slow."""

    nodes: int
    devices_per_node: int
    name: str = "cluster"

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(f"a cluster needs at least one node and one device per node, got {self}")

    @property
    def num_devices(self) -> int:
        """All devices of the cluster."""
        return self.nodes * self.devices_per_node

    @classmethod
    def detect(cls, devices: Sequence[jax.Device] | None = None) -> Cluster:
        """The cluster of the running JAX processes: one node per process (host)."""
        devices = list(devices if devices is not None else jax.devices())
        per_process: dict[int, int] = {}
        for device in devices:
            per_process[device.process_index] = per_process.get(device.process_index, 0) + 1
        counts = set(per_process.values())
        if len(counts) != 1:
            raise ValueError(
                f"processes hold different numbers of devices ({per_process}); nodes must be equal"
            )
        return cls(len(per_process), counts.pop(), name=f"detected-{devices[0].platform}")


@dataclasses.dataclass(frozen=True, order=True)
class Placement:
    """A component sharded over `intra` devices of a node times `inter` nodes, replicated elsewhere."""

    intra: int = 1
    inter: int = 1

    @property
    def degree(self) -> int:
        """How many devices hold distinct pieces."""
        return self.intra * self.inter

    def contains(self, other: Placement) -> bool:
        """Whether this placement's group contains `other`'s (both factors divide)."""
        return self.intra % other.intra == 0 and self.inter % other.inter == 0

    def __str__(self) -> str:
        return f"{self.intra}x{self.inter}"

    @classmethod
    def parse(cls, text: str) -> Placement:
        """`"4x2"` → Placement(4, 2)."""
        match = re.fullmatch(r"\s*(\d+)\s*[x×,]\s*(\d+)\s*", text)
        if not match:
            raise StrategyError(f"placement {text!r} is not of the form INTRAxINTER, e.g. '8x1'")
        return cls(int(match.group(1)), int(match.group(2)))


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One placement for each of the compute params (P), gradients (G) and optimizer state (OS), and the
    tensor-parallel degree `tensor` (t): each node's devices form groups of t that split every layer's
    matmuls, and P/G/OS are placed over the node's devices_per_node / t data-parallel ranks times the
    nodes, as they are over whole nodes when t = 1."""

    params: Placement
    grads: Placement
    opt_state: Placement
    tensor: int = 1

    def __str__(self) -> str:
        placements = ",".join(f"{_SHORT_OF[c]}={getattr(self, c)}" for c in COMPONENTS)
        return placements if self.tensor == 1 else f"{TENSOR_KEY}={self.tensor},{placements}"

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """`"p=4x1,g=4x1,os=8x2"` or `"t=2,p=2x1,g=2x1,os=4x2"` → Strategy; the inverse of `str()`
        (`t` omitted means 1)."""
        found: dict[str, Placement] = {}
        tensor = 1
        for part in filter(None, (p.strip() for p in text.split(";" if ";" in text else ","))):
            key, _, value = part.partition("=")
            key = key.strip().lower()
            if key == TENSOR_KEY:
                if not value.strip().isdigit() or int(value) < 1:
                    raise StrategyError(
                        f"tensor degree {value.strip()!r} in {text!r} is not a positive integer; "
                        "write e.g. 't=2'"
                    )
                tensor = int(value)
                continue
            if key not in _SHORT:
                raise StrategyError(f"unknown component {key!r} in {text!r}; use t=, p=, g= and os=")
            found[_SHORT[key]] = Placement.parse(value)
        missing = [_SHORT_OF[c] for c in COMPONENTS if c not in found]
        if missing:
            raise StrategyError(
                f"strategy {text!r} lacks {', '.join(missing)}; write e.g. 'p=1x1,g=1x1,os=8x1'"
            )
        return cls(**found, tensor=tensor)

    def placements(self) -> dict[str, Placement]:
        """Component name → placement."""
        return {c: getattr(self, c) for c in COMPONENTS}

    def data_parallel(self, cluster: Cluster) -> Cluster:
        """The cluster the placements range over: each node's devices_per_node / t data-parallel ranks."""
        return dataclasses.replace(cluster, devices_per_node=cluster.devices_per_node // self.tensor)

    def validate(self, cluster: Cluster, allow_partial_nodes: bool = False) -> Strategy:
        """Raise a StrategyError naming the component, the rule and a valid alternative; else self."""
        if self.tensor < 1 or cluster.devices_per_node % self.tensor:
            raise StrategyError(
                f"tensor degree t={self.tensor} does not divide the {cluster.devices_per_node} devices "
                "per node (a tensor group stays inside one node); use one of "
                f"{_divisors(cluster.devices_per_node)}"
            )
        data = self.data_parallel(cluster)
        r, n = data.devices_per_node, data.nodes
        per_node = (
            "devices per node"
            if self.tensor == 1
            else f"data-parallel ranks per node (devices / t={self.tensor})"
        )
        for comp, pl in self.placements().items():
            if pl.intra < 1 or pl.inter < 1:
                raise StrategyError(f"{comp} placement {pl}: factors must be positive")
            if r % pl.intra:
                raise StrategyError(
                    f"{comp} placement {pl}: intra={pl.intra} does not divide the {r} {per_node}; "
                    f"use one of {_divisors(r)}"
                )
            if n % pl.inter:
                raise StrategyError(
                    f"{comp} placement {pl}: inter={pl.inter} does not divide the {n} nodes; "
                    f"use one of {_divisors(n)}"
                )
            if pl.inter > 1 and pl.intra != r and not allow_partial_nodes:
                raise StrategyError(
                    f"{comp} placement {pl}: a group that spans {pl.inter} nodes must use whole nodes "
                    f"(intra={r}); use {Placement(r, pl.inter)}, or pass allow_partial_nodes=True"
                )
        items = list(self.placements().items())
        for i, (ca, a) in enumerate(items):
            for cb, b in items[i + 1 :]:
                if not (a.contains(b) or b.contains(a)):
                    alt = Placement(max(a.intra, b.intra), max(a.inter, b.inter))
                    raise StrategyError(
                        f"{ca} {a} and {cb} {b} are not nested (one group must contain the other: both "
                        f"factors dividing); e.g. make {cb} {alt}"
                        if alt.contains(a) and alt.contains(b)
                        else f"{ca} {a} and {cb} {b} are not nested; pick factors that divide each other"
                    )
        return self


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _all(cluster: Cluster) -> Placement:
    return Placement(cluster.devices_per_node, cluster.nodes)


def ddp(cluster: Cluster) -> Strategy:
    """Everything replicated."""
    one = Placement(1, 1)
    return Strategy(one, one, one)


def zero1(cluster: Cluster) -> Strategy:
    """Optimizer state sharded over all devices."""
    one = Placement(1, 1)
    return Strategy(one, one, _all(cluster))


def zero2(cluster: Cluster) -> Strategy:
    """Gradients and optimizer state sharded over all devices."""
    return Strategy(Placement(1, 1), _all(cluster), _all(cluster))


def zero3(cluster: Cluster) -> Strategy:
    """Everything sharded over all devices (FSDP)."""
    return Strategy(_all(cluster), _all(cluster), _all(cluster))


def mics(cluster: Cluster, intra: int | None = None, inter: int = 1) -> Strategy:
    """Everything sharded within a partition group (default: one node), replicated across groups."""
    group = Placement(intra or cluster.devices_per_node, inter)
    return Strategy(group, group, group).validate(cluster)


def hsdp(cluster: Cluster) -> Strategy:
    """PyTorch HYBRID_SHARD: shard within a node, replicate across nodes (MiCS with one node)."""
    return mics(cluster)


# The placements AMSP chose for LLaMA on 128 nodes of 8 A800s (arXiv 2311.00257, "AMSP: Reducing
# Communication Overhead of ZeRO for Efficient LLM Training", section 6), as (s0, s1) = (intra, inter)
# per component; the same from 8 to 1,024 GPUs. The paper publishes none for 65B.
AMSP_PUBLISHED = {
    "llama-7b": "p=1x1,g=1x1,os=8x1",
    "llama-13b": "p=4x1,g=4x1,os=8x1",
    "llama-30b": "p=8x1,g=8x1,os=8x4",
}

PRESETS = {"ddp": ddp, "zero1": zero1, "zero2": zero2, "zero3": zero3, "mics": mics, "hsdp": hsdp}


def preset(name: str, cluster: Cluster) -> Strategy:
    """A preset strategy by name (`ddp`, `zero1`, `zero2`, `zero3`, `mics`, `hsdp`) for `cluster`."""
    if name not in PRESETS:
        raise StrategyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name](cluster)


def resolve(text: str, cluster: Cluster) -> Strategy:
    """A preset name, a preset with a tensor degree (`"t=2,zero3"`: the preset over the data-parallel
    ranks each node has beside its tensor groups) or a strategy string, validated for `cluster`."""
    head, _, rest = text.partition(",")
    key = head.partition("=")[0]
    if key.strip().lower() == TENSOR_KEY and rest.strip() in PRESETS:
        replicated = Strategy.parse(f"{head},p=1x1,g=1x1,os=1x1").validate(cluster)
        data = replicated.data_parallel(cluster)
        return dataclasses.replace(preset(rest.strip(), data), tensor=replicated.tensor).validate(cluster)
    strategy = preset(text, cluster) if text in PRESETS else Strategy.parse(text)
    return strategy.validate(cluster)
