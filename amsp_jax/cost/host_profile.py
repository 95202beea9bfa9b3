"""This host's profile: the cluster config a CPU mesh is priced with, measured once and cached per host.

A CPU mesh of simulated devices shares the host's cores and memory, so its rates are the host's own:
the shipped `cpu-sim` was measured on another machine, whose numbers put a step off by a factor of two
here. `load(nodes, per_node)` returns the profile of this host for a mesh of that shape, from the cache
(`directory()`: `$AMSP_JAX_PROFILE_DIR`, else `$XDG_CACHE_HOME/amsp-jax/profiles`, else
`~/.cache/amsp-jax/profiles`), one file per `key(nodes, per_node)`: host name, CPU model, mesh shape,
jax version and the CPU platform's XLA settings, each of which changes the rates. Without one it
measures it first (`amsp-jax profile` in a child process, its time said up front and a progress bar
shown), or, with `AMSP_JAX_HOST_PROFILE=refuse`, stops with one line naming the command that makes it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from amsp_jax.core.backend import DEVICE_COUNT_FLAG, cpu_flags
from amsp_jax.cost.bandwidth import ClusterConfigError

if TYPE_CHECKING:
    from amsp_jax.cost.hardware import ClusterConfig

HOST = "host"  # the cluster name that means this host's profile (`--cluster host`)
MODE = "AMSP_JAX_HOST_PROFILE"  # `measure` (the default) or `refuse` where no profile is cached
DIRECTORY = "AMSP_JAX_PROFILE_DIR"
MODES = ("measure", "refuse")


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), else what `platform` knows, else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def jax_version() -> str:
    """The installed jax's version, read without importing jax (which would fix the device count)."""
    return metadata.version("jax")


def cpu_settings() -> str:
    """A short digest of the CPU platform's XLA settings this process runs with (the `--xla_cpu` flags
    of `cpu_flags` over `XLA_FLAGS`): the code XLA:CPU runs a step with follows them."""
    flags = cpu_flags(os.environ.get("XLA_FLAGS", "")).split()
    settings = sorted(f for f in flags if f.startswith("--xla_cpu"))
    return hashlib.sha1(" ".join(settings).encode()).hexdigest()[:8]


def key(nodes: int, per_node: int) -> str:
    """The cache key of a profile of `nodes` × `per_node` simulated CPU devices on this host: host
    name, CPU model, mesh shape, jax version and XLA:CPU settings, since each changes what the devices
    run at."""
    slug = lambda text: re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")  # noqa: E731
    host = f"{slug(socket.gethostname())}_{slug(cpu_model())}"
    return f"{host}_cpu{nodes}x{per_node}_jax{jax_version()}_xla{cpu_settings()}"


def directory() -> Path:
    """Where profiles of this host are cached."""
    if os.environ.get(DIRECTORY):
        return Path(os.environ[DIRECTORY])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "amsp-jax" / "profiles"


def path(nodes: int, per_node: int) -> Path:
    """The cached profile of `nodes` × `per_node` CPU devices on this host (which may not exist yet)."""
    return directory() / f"{key(nodes, per_node)}.yaml"


def profile_command(nodes: int, per_node: int, out: Path | str) -> str:
    """The `amsp-jax profile` command line that writes this host's profile of that mesh to `out`."""
    # The CLI gives the CPU platform --nodes x 4 devices; another count is set through XLA_FLAGS.
    flags = "" if per_node == 4 else f"XLA_FLAGS=--xla_force_host_platform_device_count={nodes * per_node} "
    return f"{flags}amsp-jax profile --nodes {nodes} --out {out}"


def measure(nodes: int, per_node: int, say: Callable[[str], None]) -> Path:
    """Run the default profile of `nodes` × `per_node` CPU devices in a child process (its progress
    bar on stderr) and move it into the cache: the cache never holds a half-written profile."""
    target = path(nodes, per_node)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}.yaml")
    say(
        f"no profile of this host for {nodes}x{per_node} CPU devices yet: measuring it now (the profile "
        f"says how long up front), once: it is cached as {target}. "
        f"`{profile_command(nodes, per_node, 'FILE')}` makes one ahead; {MODE}=refuse refuses instead."
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG))
    env["XLA_FLAGS"] = cpu_flags(flags, nodes * per_node)
    command = ["profile", "--nodes", str(nodes), "--out", str(partial), "--name", HOST]
    child = subprocess.run([sys.executable, "-m", "amsp_jax.cli", *command], env=env, check=False)
    if child.returncode != 0:
        partial.unlink(missing_ok=True)
        raise ClusterConfigError(f"measuring this host's profile failed (exit code {child.returncode})")
    partial.replace(target)
    return target


def load(nodes: int, per_node: int, say: Callable[[str], None] | None = None) -> ClusterConfig:
    """This host's `ClusterConfig` for a mesh of `nodes` × `per_node` CPU devices: cached, else
    measured now, or refused (`AMSP_JAX_HOST_PROFILE=refuse`) with one line naming `amsp-jax profile`."""
    from amsp_jax.cost import hardware

    found = path(nodes, per_node)
    if not found.exists():
        mode = os.environ.get(MODE, "measure")
        if mode not in MODES:
            raise ClusterConfigError(f"{MODE}={mode!r}: use one of {', '.join(MODES)}")
        if mode == "refuse":
            raise ClusterConfigError(
                f"no profile of this host for {nodes}x{per_node} CPU devices: "
                f"`{profile_command(nodes, per_node, found)}` measures it (a few minutes on 2 cores), or "
                "give a cluster config"
            )
        measure(nodes, per_node, say or _say)
    return hardware.load(found)


def _say(line: str) -> None:
    print(f"amsp-jax: {line}", file=sys.stderr, flush=True)


def is_this_host(measured_on: dict[str, str] | None) -> bool:
    """Whether a profile's `measured_on` names this host, its CPU and its jax."""
    if not measured_on:
        return False
    here = {"host": socket.gethostname(), "cpu": cpu_model(), "jax": jax_version()}
    return all(measured_on.get(k) == v for k, v in here.items())
