"""The ILP that picks placements, micro-batching and remat for a model and cluster, exact against
enumeration."""
