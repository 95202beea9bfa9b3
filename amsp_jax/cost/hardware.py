"""Cluster hardware from a cluster YAML: its schema, loading, and the collective times it prices.

A cluster config says what one device can hold and compute, and how fast each collective kind runs
inside a node and across nodes. Bandwidths are nccl-tests *bus* bandwidths, indexed by the bytes one
device sends in one collective — exactly what `amsp_jax.cost` counts per execution — so the time of
a collective is simply `bytes_per_device / busbw(bytes_per_device)` (nccl-tests PERFORMANCE.md: for a
ring all-gather or reduce-scatter busbw = algbw·(n−1)/n, and the per-device ring bytes are
S·(n−1)/n, so S/algbw = bytes/busbw; for all-reduce both carry 2(n−1)/n). The tables and how they
are read between and beyond their sizes are `amsp_jax.cost.bandwidth`'s.

`load` takes a path or the name of a shipped config (`a800-8x-ib800`, `h100-dgx`, `cpu-sim`; see
`amsp_jax.core.config_files`). Schema (every number carries its source in a comment in the YAML file):

    name: a800-8x-ib800
    nodes: 128                    # default node count; callers may override
    devices_per_node: 8
    collective_min_itemsize: 1    # optional; 4 where 16-bit collectives run in fp32 (XLA:CPU)
    device: {name, memory_bytes, usable_memory_fraction, peak_flops, compute_efficiency,
             hbm_bandwidth, matmul_rates}
                                  # matmul_rates (optional, written by `amsp-jax profile`): per
                                  # compute dtype (bfloat16, float32), rows [tokens, GFLOP/s]: the
                                  # rate of a layer's matmuls over that many tokens at once (a bare
                                  # list of rows: the same for every dtype), or a mapping of square
                                  # widths W to such rows, each measured on (tokens x W)·(W x W);
                                  # a dtype without rows runs at peak_flops × compute_efficiency
                                  # memory_bandwidths (optional, written by `amsp-jax profile`): rows
                                  # [bytes per device, GB/s] of an elementwise op into a fresh buffer
    overlap: {enabled, reduction_fraction, interference}   # enabled: false where collectives block compute
    latency: {base_us, intra_hop_us, inter_hop_us}   # optional: NCCL-style ring latency per op
    measured_on: {host, cpu, date, jax}   # optional, written by `amsp-jax profile`: where and when
    memory_passes: {bandwidth_gbps, step_overhead_ms, params, grads, opt_state, model, activations,
                    accumulator, stored_params, split_results}
                                  # optional, written by `amsp-jax profile`: bytes the step's memory-bound
                                  # kernels touch per byte of each block, and the bandwidth they reach;
                                  # stored_params: per fp32 parameter byte where P is stored apart;
                                  # split_results: per byte a split collective's stages hand on
    bandwidth:
      all-gather | reduce-scatter | all-reduce:
        intra | inter: [[SIZE, GB_PER_S], ...]    # SIZE: bytes, or e.g. "1MiB"
        intra/N | inter/N: [[SIZE, GB_PER_S], ...]
                                  # optional, written by `amsp-jax profile`: groups of N devices of one
                                  # node (intra/N) or of N nodes (inter/N), fewer than the level's own
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from amsp_jax.core import config_files
from amsp_jax.core.space import Cluster
from amsp_jax.cost.bandwidth import (
    GB,
    BandwidthTable,
    ClusterConfigError,
    MatmulRates,
    format_size,
    parse_size,
)

__all__ = [  # the rate tables and units live in `cost.bandwidth`; configs name them from here too
    "FLAT",
    "GB",
    "KINDS",
    "LEVELS",
    "MATMUL_DTYPES",
    "PASS_BLOCKS",
    "PASS_DEFAULTS",
    "PASS_KEYS",
    "PER_MICRO_BATCH_BLOCKS",
    "SPLIT_RESULTS",
    "STORED_PARAMS",
    "BandwidthTable",
    "ClusterConfig",
    "ClusterConfigError",
    "MatmulRates",
    "for_cluster",
    "for_device_kind",
    "format_size",
    "from_dict",
    "load",
    "parse_size",
]

KINDS = ("all-gather", "reduce-scatter", "all-reduce")
# The blocks a step's memory-bound kernels pass over (amsp_jax.cost.timing.memory_times).
PASS_BLOCKS = ("params", "grads", "opt_state", "model", "activations", "accumulator")
# The blocks passed once per micro-batch (the others once per step): every full-size weight and
# gradient, the activations, and the fp32 accumulator each micro-batch's gradient is added into.
PER_MICRO_BATCH_BLOCKS = ("model", "activations", "accumulator")
# Bytes per fp32 parameter byte passed where P is stored apart from the master, since XLA:CPU converts
# a stored 16-bit weight at each use (the probe steps' times show it, their compiled bytes do not).
STORED_PARAMS = "stored_params"
# Bytes' worth of passes per byte a split collective's stages hand on, since a backend running
# collectives wider than their dtype rounds them in kernels of their own (`cost.rounded_bytes`); the
# default 2 is the compiled read and write, the probe steps time what a running step pays.
SPLIT_RESULTS = "split_results"
PASS_KEYS = ("bandwidth_gbps", "step_overhead_ms", *PASS_BLOCKS, STORED_PARAMS, SPLIT_RESULTS)
PASS_DEFAULTS = {SPLIT_RESULTS: 2.0}
LEVELS = ("intra", "inter")
# A table measured over one ring of every device of the profiled machines (`flat_ring`): what a flat
# collective across nodes costs there, latency included, where the two-link formula of
# `ClusterConfig.collective_time` assumes the NICs and the node's links work side by side.
FLAT = "flat"
MATMUL_DTYPES = ("bfloat16", "float32")  # the compute dtypes of the `mixed` and `fp32` precisions
MEASURED_ON_KEYS = ("host", "cpu", "date", "jax")  # the provenance `amsp-jax profile` writes


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """The hardware of a cluster: per-device memory and compute, and collective bandwidth tables."""

    name: str
    nodes: int
    devices_per_node: int
    memory_bytes: float
    usable_memory_fraction: float
    peak_flops: float
    compute_efficiency: float
    hbm_bandwidth: float
    reduction_overlap: float
    overlap_interference: float
    bandwidth: Mapping[tuple[str, str], BandwidthTable]
    collective_min_itemsize: int = 1
    device_name: str = ""
    overlap_enabled: bool = True
    latency_base: float = 0.0
    latency_intra_hop: float = 0.0
    latency_inter_hop: float = 0.0
    memory_passes: Mapping[str, float] | None = None  # bytes touched per byte of each block (timing)
    pass_bandwidth: float = 0.0  # bytes/s of those passes while the step runs
    step_overhead: float = 0.0  # seconds per step that no term of the time model covers
    # FLOP/s of a layer's matmuls by compute dtype, width and tokens at once, since a few dozen tokens
    # run far below the large-matmul rate on a CPU (no table for a dtype: `sustained_flops`).
    matmul_rates: Mapping[str, MatmulRates] | None = None
    flat_ring: tuple[int, int] | None = None  # (devices, nodes) of the ring the `flat` tables measured
    # Bytes/s of an elementwise op into a fresh buffer by its bytes per device, since on a CPU a large
    # buffer's pages are mapped on first touch where a small one is reused (none: every size alike).
    memory_bandwidths: BandwidthTable | None = None
    # Tables of groups smaller than a level's own (`intra/2`), by (kind, level, devices in the group).
    group_bandwidth: Mapping[tuple[str, str, int], BandwidthTable] = dataclasses.field(default_factory=dict)
    # Where and when `amsp-jax profile` measured the numbers (host, cpu, date, jax), since a profile
    # prices the machine it was measured on and no other (none: a config written from datasheets).
    measured_on: Mapping[str, str] | None = None

    @property
    def provenance(self) -> str:
        """One line saying where and when the config was measured ('' where it does not say)."""
        m = self.measured_on
        if not m:
            return ""
        cpu = f" ({m['cpu']})" if m.get("cpu") else ""
        where = f"{m.get('host', 'an unnamed host')}{cpu}"
        return f"profiled on {where}, {m.get('date', 'undated')}, jax {m.get('jax', 'unknown')}"

    @property
    def platform(self) -> str:
        """`cpu` for a profiled CPU host (`amsp-jax profile` names its device by JAX's device kind,
        `cpu`), else `gpu`."""
        return "cpu" if self.device_name.lower() == "cpu" else "gpu"

    @property
    def memory_limit(self) -> float:
        """Bytes a plan may use per device."""
        return self.memory_bytes * self.usable_memory_fraction

    @property
    def sustained_flops(self) -> float:
        """FLOP/s one device sustains on the model's compute."""
        return self.peak_flops * self.compute_efficiency

    def matmul_rate(self, tokens: float, dtype: str, width: float = 0.0) -> float:
        """FLOP/s of one device's `dtype` matmuls of `width` (`MatmulRates.at`; 0: the narrowest
        measured) over `tokens` rows at once (`sustained_flops` without a table for that dtype)."""
        rates = (self.matmul_rates or {}).get(dtype)
        if rates is None:
            return self.sustained_flops
        return rates.at(tokens, width) * self.compute_efficiency

    def pass_speed(self, nbytes: float) -> float:
        """How much faster than over the largest measured buffer a memory pass over `nbytes` per device
        runs (`memory_bandwidths`; 1 without them): the memory passes' bandwidth is fitted at scale."""
        table = self.memory_bandwidths
        if table is None:
            return 1.0
        return table.at(max(nbytes, table.sizes[0])) / table.busbw[-1]

    def cluster(self, nodes: int | None = None) -> Cluster:
        """The partition-space cluster of `nodes` (default: the config's) nodes."""
        return Cluster(nodes or self.nodes, self.devices_per_node, self.name)

    def with_shape(self, nodes: int, devices_per_node: int | None = None) -> ClusterConfig:
        """The same hardware with another node count (and, for simulated clusters, devices per node)."""
        return dataclasses.replace(
            self, nodes=nodes, devices_per_node=devices_per_node or self.devices_per_node
        )

    def busbw(self, kind: str, level: str, size: float, group: int = 0) -> float:
        """Bus bandwidth (bytes/s) of a `kind` collective at `level` where one device sends `size` bytes,
        over `group` devices at that level: from the table measured for groups of that size where there
        is one (a shorter ring runs faster, `amsp_jax.cli.rates.group_meshes`), else the level's."""
        table = self.group_bandwidth.get((kind, level, group)) or self.bandwidth.get((kind, level))
        if table is None:
            why = (
                " (it describes one device, which runs no collective: use a config profiled on the cluster"
                " to plan, or a shipped one such as h100-dgx)"
                if not self.bandwidth
                else ""
            )
            raise ClusterConfigError(f"cluster {self.name!r} has no bandwidth table for {kind} {level}{why}")
        return table.at(size)

    def latency(self, kind: str, group: int, nodes: int) -> float:
        """Seconds of fixed cost of one ring collective over `group` devices on `nodes` nodes.

        NCCL's tuning model (src/graph/tuning.cc): a base latency plus one hop per ring step, each step
        inside a node costing an NVLink hop and each step between nodes a network hop; an all-reduce
        walks the ring twice. A group of 0 (transfers merged across groups) has no latency term.
        """
        if group <= 1:
            return 0.0
        nodes = max(nodes, 1)
        hops = (group - nodes) * self.latency_intra_hop + (nodes - 1) * self.latency_inter_hop
        return self.latency_base + (2 if kind == "all-reduce" else 1) * hops

    def permute_time(self, size: float, level: str, executions: int = 1) -> float:
        """Seconds of `executions` collective-permutes that send `size` bytes per device in all, each to
        one neighbour inside a node (`level` intra) or on another node (inter): per send one ring step,
        its latency (one hop) and its bytes at the bus bandwidth of a ring whose every step carries them.

        The one price of a permute: the time model's (`timing.transfer_time`) and the one XLA's scheduler
        is given (`compiled.xla.scheduling_profile`). A level's table describes rings of all its devices
        (a node's; two nodes'), each step carrying 1/(devices - 1) of what a device sends, so it is read
        at that many sends: read at one send's bytes it would price it as that many latency-bound steps.
        """
        if size <= 0 or executions <= 0:
            return 0.0
        nodes, ring = (1, max(self.devices_per_node, 2)) if level == "intra" else (2, 2)
        per_send = size / executions
        hop = self.latency("all-gather", 2, nodes)
        return executions * hop + size / self.busbw("all-gather", level, (ring - 1) * per_send)

    def collective_time(
        self, kind: str, level: str, size: int, executions: int, group: int = 0, nodes: int = 0
    ) -> float:
        """Seconds for `executions` collectives that move `size` bytes per device in all, over groups
        of `group` devices on `nodes` nodes: latency per execution plus bytes over bus bandwidth.

        A flat ring that spans nodes with several devices per node sends only nodes/group of its bytes
        across the NICs (it enters and leaves each node once); the rest hop over the node's links, at
        the same time: the slower of the two sets the pace. A ring of the shape `flat_ring` measured
        (`amsp-jax profile`) is priced from that measurement instead, latency and all.
        """
        if size <= 0 or executions <= 0:
            return 0.0
        fixed = executions * self.latency(kind, group, nodes)
        per_op = size / executions
        if level == "inter" and (group, nodes) == self.flat_ring and (kind, FLAT) in self.bandwidth:
            return size / self.busbw(kind, FLAT, per_op)
        if level == "inter" and group > nodes > 0:
            nic = size * nodes / group
            return fixed + max(
                nic / self.busbw(kind, "inter", nic / executions, nodes),
                (size - nic) / self.busbw(kind, "intra", per_op, group // nodes),
            )
        return fixed + size / self.busbw(kind, level, per_op, group)


def _number(section: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = section.get(key, default)
    if value is None:
        raise ClusterConfigError(f"{where}: missing {key!r}")
    try:
        if isinstance(value, bool):
            raise TypeError(value)
        number = float(value)
    except (TypeError, ValueError) as error:
        raise ClusterConfigError(f"{where}: {key} = {value!r} is not a number") from error
    if not math.isfinite(number):
        raise ClusterConfigError(f"{where}: {key} = {value!r} is not a finite number")
    if number <= 0:
        raise ClusterConfigError(f"{where}: {key} must be positive, got {number}")
    return number


def from_dict(values: Mapping[str, Any], where: str = "cluster config") -> ClusterConfig:
    """A `ClusterConfig` from the parsed YAML mapping."""
    for section in ("device", "overlap", "bandwidth"):
        if not isinstance(values.get(section) or {}, Mapping):
            raise ClusterConfigError(f"{where}: {section} must be a mapping, got {values[section]!r}")
    for kind, levels in (values.get("bandwidth") or {}).items():
        if not isinstance(levels or {}, Mapping):
            raise ClusterConfigError(f"{where}: bandwidth.{kind} must map intra/inter to [size, GB/s] rows")
    device = values.get("device") or {}
    latency_s = _latency(values.get("latency") or {}, where)
    passes = _memory_passes(values.get("memory_passes"), where)
    tables, group_tables = _bandwidth_tables(values.get("bandwidth") or {}, where)
    missing = [f"{k}.{lv}" for k in KINDS for lv in LEVELS if (k, lv) not in tables]
    # A config of one device (a profile of one GPU) runs no collective and may measure none.
    if missing and _number(values, "nodes", where) * _number(values, "devices_per_node", where) > 1:
        raise ClusterConfigError(f"{where}: no bandwidth table for {', '.join(missing)}")
    flat_ring = _flat_ring(values.get("flat_ring"), any(level == FLAT for _, level in tables), where)
    overlap = values.get("overlap") or {}
    fraction, interference = _overlap_fractions(overlap, where)
    return ClusterConfig(
        name=str(values.get("name", "cluster")),
        nodes=int(_number(values, "nodes", where)),
        devices_per_node=int(_number(values, "devices_per_node", where)),
        memory_bytes=_number(device, "memory_bytes", f"{where}: device"),
        usable_memory_fraction=min(1.0, _number(device, "usable_memory_fraction", f"{where}: device", 1.0)),
        peak_flops=_number(device, "peak_flops", f"{where}: device"),
        compute_efficiency=min(1.0, _number(device, "compute_efficiency", f"{where}: device", 1.0)),
        hbm_bandwidth=_number(device, "hbm_bandwidth", f"{where}: device"),
        reduction_overlap=fraction,
        overlap_interference=interference,
        bandwidth=tables,
        collective_min_itemsize=int(_number(values, "collective_min_itemsize", where, 1)),
        device_name=str(device.get("name", "")),
        overlap_enabled=bool(overlap.get("enabled", True)),
        latency_base=latency_s["base_us"],
        latency_intra_hop=latency_s["intra_hop_us"],
        latency_inter_hop=latency_s["inter_hop_us"],
        memory_passes=passes and {key: passes[key] for key in (*PASS_BLOCKS, STORED_PARAMS, SPLIT_RESULTS)},
        pass_bandwidth=passes["bandwidth_gbps"] * GB if passes else 0.0,
        step_overhead=passes["step_overhead_ms"] * 1e-3 if passes else 0.0,
        matmul_rates=_matmul_rates(device.get("matmul_rates"), f"{where}: device.matmul_rates"),
        memory_bandwidths=None
        if device.get("memory_bandwidths") is None
        else BandwidthTable.from_rows(device["memory_bandwidths"], f"{where}: device.memory_bandwidths"),
        flat_ring=flat_ring,
        group_bandwidth=group_tables,
        measured_on=_measured_on(values.get("measured_on"), where),
    )


def _measured_on(section: Any, where: str) -> dict[str, str] | None:
    if section is None:
        return None
    if not isinstance(section, Mapping) or set(section) - set(MEASURED_ON_KEYS):
        raise ClusterConfigError(f"{where}: measured_on must be a mapping of {', '.join(MEASURED_ON_KEYS)}")
    return {str(k): str(v) for k, v in section.items()}


def _latency(latency: Any, where: str) -> dict[str, float]:
    """Seconds of the `latency` section's base and per-hop terms (0 where absent)."""
    if not isinstance(latency, Mapping):
        raise ClusterConfigError(f"{where}: latency must be a mapping of base_us, intra_hop_us, inter_hop_us")
    latency_s = {}
    for key in ("base_us", "intra_hop_us", "inter_hop_us"):
        try:
            latency_s[key] = float(latency.get(key, 0.0)) * 1e-6
        except (TypeError, ValueError) as error:
            value = latency.get(key)
            raise ClusterConfigError(f"{where}: latency.{key} = {value!r} is not a number") from error
        if latency_s[key] < 0:
            raise ClusterConfigError(f"{where}: latency.{key} must not be negative")
    return latency_s


def _bandwidth_tables(
    section: Mapping[str, Any], where: str
) -> tuple[dict[tuple[str, str], BandwidthTable], dict[tuple[str, str, int], BandwidthTable]]:
    """The `bandwidth` section's tables: by (kind, level), and by (kind, level, group) for `intra/N`."""
    tables: dict[tuple[str, str], BandwidthTable] = {}
    group_tables: dict[tuple[str, str, int], BandwidthTable] = {}
    for kind, levels in section.items():
        if kind not in KINDS:
            raise ClusterConfigError(f"{where}: unknown collective kind {kind!r}; use {KINDS}")
        for level, rows in (levels or {}).items():
            table = BandwidthTable.from_rows(rows, f"{where}: bandwidth.{kind}.{level}")
            if level in (*LEVELS, FLAT):
                tables[(kind, level)] = table
            elif match := re.fullmatch(rf"({'|'.join(LEVELS)})/([0-9]+)", str(level)):
                if int(match[2]) < 2:
                    raise ClusterConfigError(f"{where}: bandwidth.{kind}.{level}: a group needs 2 devices")
                group_tables[(kind, match[1], int(match[2]))] = table
            else:
                raise ClusterConfigError(
                    f"{where}: unknown level {level!r} under {kind}; use {', '.join((*LEVELS, FLAT))}, "
                    "or intra/N, inter/N for groups of N"
                )
    return tables, group_tables


def _overlap_fractions(overlap: Mapping[str, Any], where: str) -> tuple[float, float]:
    """The `overlap` section's reduction fraction and interference, each in [0, 1]."""
    try:
        fraction = float(overlap.get("reduction_fraction", 0.5))
        interference = float(overlap.get("interference", 0.0))
    except (TypeError, ValueError):
        raise ClusterConfigError(f"{where}: overlap fractions must be numbers, got {dict(overlap)}") from None
    if not (0 <= fraction <= 1 and 0 <= interference <= 1):
        raise ClusterConfigError(f"{where}: overlap fractions must lie in [0, 1], got {dict(overlap)}")
    return fraction, interference


def _flat_ring(section: Any, has_tables: bool, where: str) -> tuple[int, int] | None:
    if section is None and not has_tables:
        return None
    if not isinstance(section, Mapping) or not has_tables:
        raise ClusterConfigError(
            f"{where}: `flat` bandwidth tables and `flat_ring: {{devices: N, nodes: M}}` (the ring they "
            "were measured over) come together"
        )
    devices, nodes = (int(_number(section, key, f"{where}: flat_ring")) for key in ("devices", "nodes"))
    return devices, nodes


def _matmul_rates(section: Any, where: str) -> dict[str, MatmulRates] | None:
    if section is None:
        return None
    if not isinstance(section, Mapping):
        return dict.fromkeys(MATMUL_DTYPES, _widths(section, where))
    unknown = sorted(set(section) - set(MATMUL_DTYPES))
    if unknown:
        raise ClusterConfigError(f"{where}: unknown dtype(s) {unknown}; use {', '.join(MATMUL_DTYPES)}")
    return {dtype: _widths(rows, f"{where}.{dtype}") for dtype, rows in section.items()}


def _widths(section: Any, where: str) -> MatmulRates:
    """Rows for every width, or a mapping of widths to rows."""
    if not isinstance(section, Mapping):
        return MatmulRates({0: BandwidthTable.from_rows(section, where)})
    if not section or any(isinstance(w, bool) or not isinstance(w, int) or w <= 0 for w in section):
        found = sorted(map(str, section))
        raise ClusterConfigError(f"{where}: widths must be positive integers, got {found}")
    return MatmulRates({w: BandwidthTable.from_rows(rows, f"{where}.{w}") for w, rows in section.items()})


def _memory_passes(section: Any, where: str) -> dict[str, float] | None:
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ClusterConfigError(f"{where}: memory_passes must be a mapping of {', '.join(PASS_KEYS)}")
    unknown = sorted(set(section) - set(PASS_KEYS))
    if unknown:
        raise ClusterConfigError(f"{where}: unknown memory_passes key(s) {unknown}; use {PASS_KEYS}")
    found = {}
    for key in PASS_KEYS:
        value = section.get(key, PASS_DEFAULTS.get(key, 0.0))
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ClusterConfigError(f"{where}: memory_passes.{key} = {value!r} is not a number")
        if value < 0 or (key == "bandwidth_gbps" and value == 0):
            raise ClusterConfigError(f"{where}: memory_passes.{key} must be positive, got {value}")
        found[key] = float(value)
    return found


def load(path: str | Path) -> ClusterConfig:
    """Read a cluster YAML: a file, or a shipped config by name (`a800-8x-ib800`; see `config_files`)."""
    path = config_files.find("clusters", path, ClusterConfigError)
    what = "cluster settings (name, nodes, device, ...)"
    values = config_files.read_mapping(path, ClusterConfigError, what)
    return from_dict(values, str(path))


def for_cluster(cluster: Cluster) -> ClusterConfig:
    """Hardware for a bare `Cluster`: the shipped cluster config of its name if any, else this host's
    profile of that CPU mesh (`amsp_jax.cost.host_profile`: cached, or measured first)."""
    if cluster.name in config_files.shipped("clusters"):
        return load(cluster.name).with_shape(cluster.nodes, cluster.devices_per_node)
    from amsp_jax.cost import host_profile

    return host_profile.load(cluster.nodes, cluster.devices_per_node)


# GPU models that share another's compute and memory (NVIDIA's export variants cut only NVLink).
_SAME_GPU = {"A800": "A100", "H800": "H100"}
_GPU_MODEL = re.compile(r"\b([A-Z]\d{2,3})\b")


def _gpu_model(name: str) -> str | None:
    found = _GPU_MODEL.search(name.replace("-", " "))
    return found and _SAME_GPU.get(found.group(1), found.group(1))


def for_device_kind(device_kind: str, nodes: int, devices_per_node: int) -> ClusterConfig | None:
    """The shipped cluster config of a GPU's model (`NVIDIA A100-SXM4-80GB`: `a800-8x-ib800`, the A800
    having the A100's compute and memory), shaped to `nodes` × `devices_per_node`; None for another."""
    model = _gpu_model(device_kind)
    for name in config_files.shipped("clusters"):
        config = load(name)
        if model and _gpu_model(config.device_name) == model:
            return config.with_shape(nodes, devices_per_node)
    return None
