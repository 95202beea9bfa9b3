"""Read compiled XLA HLO text: its collectives (sizes, device groups, loop trip counts), what XLA
scheduled between each collective's start and done, the bytes its memory-bound kernels touch, and a
roofline price of every instruction.

`text` parses the module; `loops` counts each computation's executions; `replica_groups` expands device
groups; `collectives`, `overlap`, `traffic` and `pricing` read the parsed module.
"""

from amsp_jax.compiled.hlo.collectives import Collective, bytes_per_device, crosses, parse_collectives
from amsp_jax.compiled.hlo.opcodes import COLLECTIVE_KINDS
from amsp_jax.compiled.hlo.overlap import Overlap, overlaps
from amsp_jax.compiled.hlo.pricing import instruction_seconds
from amsp_jax.compiled.hlo.replica_groups import expand_replica_groups
from amsp_jax.compiled.hlo.traffic import memory_traffic

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "Overlap",
    "bytes_per_device",
    "crosses",
    "expand_replica_groups",
    "instruction_seconds",
    "memory_traffic",
    "overlaps",
    "parse_collectives",
]
