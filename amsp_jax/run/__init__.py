"""The training application of `amsp-jax train`.

config (the train config's sections), train (inputs, plan, trainer and state, then the run), loop (the
steps) and hooks (metrics log, progress bar, held-out eval, checkpoints, divergence guard,
preemption), checkpoint (Orbax checkpoints and parameter files), data (token streams and batches),
distributed (devices and processes before JAX starts).
"""
