"""The train step as JAX code: the schedule's operations as collectives inside shard_map."""
