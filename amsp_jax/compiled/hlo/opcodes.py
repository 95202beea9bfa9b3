"""The HLO opcodes the readers group together: collectives, their async halves, wrappers, matrix work."""

from __future__ import annotations

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")

# The start half of an async pair stands for the pair; the -done (and -update) halves are never counted.
START_OPCODES = {f"{kind}-start": kind for kind in COLLECTIVE_KINDS}
COLLECTIVE_OPCODES = {kind: kind for kind in COLLECTIVE_KINDS} | START_OPCODES
DONE_OPCODES = {f"{kind}-done" for kind in COLLECTIVE_KINDS} | {"async-done", "async-update", "fusion-done"}
# Instructions that start their callee and return before it ends: a generic async-start, and the async
# fusions a scalar all-reduce may be wrapped in (jaxlib >= 0.11).
ASYNC_WRAPPERS = {"async-start", "fusion-start"}
WRAPPER_OPCODES = {"fusion", *ASYNC_WRAPPERS}
MATRIX_OPCODES = {"dot", "convolution", "custom-call"}
CALLING_OPCODES = {"fusion", "call", "while", "conditional", *ASYNC_WRAPPERS}
