"""`python -m amsp_jax.cli`: the `amsp-jax` command."""

from amsp_jax.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
