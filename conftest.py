"""Test set-up of `tests/` and `benchmarks/tests/`: 8 simulated CPU devices and quick code generation,
set before JAX is imported anywhere; one compilation cache.

The cache: the xdist workers compile many of the same programs (a plan's step for its numerics test
and its audit, the single-device references several modules share), and so do the processes tests
start. JAX's persistent compilation cache in a directory made for this session lets the first
compile serve the others (the step of a zero3 plan: 13.6 s compiled, 3.9 s loaded; its compiled
text and memory analysis, which the audits read, are the same). The controller makes the directory
before the workers start, they inherit it through the environment, and it is removed at exit. Set
`JAX_COMPILATION_CACHE_DIR` yourself to keep a cache across runs.
"""

import atexit
import os
import shutil
import tempfile

from amsp_jax.core.backend import cpu_flags

# LLVM's lowest optimisation level for the kernels XLA generates: a test's compile takes about half
# as long (a zero3 step of the tiny model: 13.1 s -> 6.9 s) and nothing a test asserts changes: the
# HLO passes, the schedule, buffer assignment (compiled memory), the collectives and the losses are the
# same (checked on that step, and on a step compiled for H100s: the same overlap audit). Only the
# generated code runs slower, which the tests' tiny models do not feel.
FAST_CODEGEN = "--xla_backend_optimization_level=0"
# The CPU platform as the library runs it (`core.backend.cpu_flags`, which imports no JAX): 8 devices.
os.environ["XLA_FLAGS"] = cpu_flags(f"{os.environ.get('XLA_FLAGS', '')} {FAST_CODEGEN}", 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="amsp-jax-test-compilations-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# This host's profile (amsp_jax.cost.host_profile), where a CPU mesh is planned without a cluster
# config: the suite's own cache, never the user's, holding the shipped cpu-sim as the profile of 2 x 4
# devices, so what the tests plan does not hang on this machine; any other shape is refused rather than
# measured for minutes. Processes the tests start inherit both settings.
if "AMSP_JAX_PROFILE_DIR" not in os.environ:
    _profiles = tempfile.mkdtemp(prefix="amsp-jax-test-profiles-")
    os.environ["AMSP_JAX_PROFILE_DIR"] = _profiles
    atexit.register(shutil.rmtree, _profiles, ignore_errors=True)
    from amsp_jax.cost import host_profile

    shutil.copy(
        os.path.join(os.path.dirname(__file__), "amsp_jax", "configs", "clusters", "cpu-sim.yaml"),
        host_profile.path(2, 4),
    )
os.environ["AMSP_JAX_HOST_PROFILE"] = "refuse"

# Tests that compile the same plans' steps: tests/helpers.py caches a plan's trainer and its compiled
# step per process, so these files run first, together, where xdist's worksteal gives one worker its
# contiguous first share of the tests (a plan's audit then reuses the step its numerics test compiled).
SHARED_PROGRAMS = ("tests/test_audit.py", "tests/test_step.py")


def pytest_collection_modifyitems(items: list) -> None:
    """Move the tests of `SHARED_PROGRAMS` to the front, keeping every other order."""
    first = [item for item in items if item.nodeid.split("::")[0] in SHARED_PROGRAMS]
    rest = [item for item in items if item.nodeid.split("::")[0] not in SHARED_PROGRAMS]
    items[:] = first + rest
