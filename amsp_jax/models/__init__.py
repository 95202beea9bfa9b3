"""Models for examples, tests and benchmarks."""
