"""The training application: config, loop, data, checkpoints, export and multi-host set-up."""
