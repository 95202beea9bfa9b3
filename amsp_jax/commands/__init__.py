"""The subcommands of `amsp-jax`: each module has `add_arguments(parser)` and `run(args) -> int`."""
