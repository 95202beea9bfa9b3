"""What a plan costs before it runs: the workload of a model, bytes per collective, memory,
optimizer-update traffic, time, hardware configs."""
