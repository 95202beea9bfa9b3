"""Rate tables of cluster configs: collective bus bandwidth and matmul FLOP/s by size, and byte units.

A table is measured at a few sizes (`amsp-jax profile`, or nccl-tests for the shipped GPU clusters);
`amsp_jax.cost.hardware.ClusterConfig` holds one per collective kind and level. Between two sizes a
collective's time is affine in its size; below the smallest it costs what the smallest one costs
(latency-bound); above the largest the bandwidth stays flat.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

GB = 1e9
_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
}


class ClusterConfigError(ValueError):
    """A cluster YAML that is missing something or holds a value that cannot be right."""


def parse_size(value: int | float | str) -> float:
    """Bytes from `4096`, `"64KiB"`, `"1 MiB"`, `"1.5GiB"` or `"1e6"`."""
    if isinstance(value, int | float):
        return float(value)
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([KMGT]i?B|B)?\s*", str(value), flags=re.IGNORECASE)
    if not match:
        raise ClusterConfigError(f"size {value!r} is not a number of bytes such as 65536 or '64KiB'")
    return float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]


def format_size(size: float) -> str:
    """`1048576` → `"1MiB"`; sizes that are no power-of-1024 multiple stay plain numbers."""
    for unit in ("GiB", "MiB", "KiB"):
        scale = _UNITS[unit.upper()]
        if size >= scale and size % scale == 0:
            return f"{int(size // scale)}{unit}"
    return str(int(size))


@dataclasses.dataclass(frozen=True)
class BandwidthTable:
    """Bus bandwidth (bytes/s) at increasing message sizes (bytes one device sends in one collective)."""

    sizes: tuple[float, ...]
    busbw: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.busbw):
            raise ClusterConfigError("a bandwidth table needs one or more [size, GB/s] rows")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise ClusterConfigError(f"bandwidth table sizes must increase, got {self.sizes}")
        if min(self.sizes) <= 0 or min(self.busbw) <= 0:
            raise ClusterConfigError("bandwidth table sizes and bandwidths must be positive")

    def at(self, size: float) -> float:
        """Bus bandwidth for a collective in which one device sends `size` bytes.

        Between two measured sizes the time (size over bandwidth) is affine in the size: a fixed cost
        and a rate, the two-point latency-bandwidth line, which priced chained CPU reduce-scatters
        closer than interpolating the bandwidth itself in log-size did.
        """
        if size <= self.sizes[0]:
            # Latency-bound below the smallest measured size: the collective costs what that one costs.
            return self.busbw[0] * size / self.sizes[0]
        if size >= self.sizes[-1]:
            return self.busbw[-1]
        i = bisect.bisect_right(self.sizes, size)
        lo, hi = self.sizes[i - 1], self.sizes[i]
        t_lo, t_hi = lo / self.busbw[i - 1], hi / self.busbw[i]
        return size / (t_lo + (size - lo) / (hi - lo) * (t_hi - t_lo))

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[Any]], where: str) -> BandwidthTable:
        """From YAML rows `[size, GB/s]`."""
        try:
            pairs = sorted((parse_size(size), float(gbps) * GB) for size, gbps in rows)
        except (TypeError, ValueError) as error:
            raise ClusterConfigError(f"{where}: rows must be [size, GB/s] pairs ({error})") from error
        try:
            return cls(tuple(s for s, _ in pairs), tuple(b for _, b in pairs))
        except ClusterConfigError as error:
            raise ClusterConfigError(f"{where}: {error}") from None


@dataclasses.dataclass(frozen=True)
class MatmulRates:
    """FLOP/s of one compute dtype's matmuls by the tokens they run over, per square width measured.

    A (tokens × W)·(W × W) product and its backward run slower per FLOP the narrower W is where a
    fixed cost per op weighs. Between measured widths the rate is interpolated linearly in log-width;
    outside them it is the nearest width's. Width 0: one table for every width.
    """

    tables: Mapping[int, BandwidthTable]

    def at(self, tokens: float, width: float) -> float:
        """FLOP/s of a matmul of `width` (the side of the square of its size) over `tokens` rows."""
        widths = sorted(self.tables)
        if width <= widths[0] or len(widths) == 1:
            return self.tables[widths[0]].at(tokens)
        if width >= widths[-1]:
            return self.tables[widths[-1]].at(tokens)
        i = bisect.bisect_right(widths, width)
        lo, hi = widths[i - 1], widths[i]
        share = math.log(width / lo) / math.log(hi / lo)
        return (1 - share) * self.tables[lo].at(tokens) + share * self.tables[hi].at(tokens)
