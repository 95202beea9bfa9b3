"""Per-layer gathering for any Flax model: LayerStack, the prefetched layer loop, finding blocks in
linen and nnx models, and the gathered call."""
