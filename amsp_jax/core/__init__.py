"""The partition space and the step's one schedule: clusters, placements, strategies, plans, mesh axes
and each leaf's PartitionSpec, the per-leaf operations, optimizer-state shardings, config-file lookup."""
