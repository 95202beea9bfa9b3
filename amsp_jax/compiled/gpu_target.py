"""NVIDIA GPU clusters to compile for on a machine without a GPU (`amsp-jax audit --target`).

XLA's CUDA compiler plugin compiles for a described GPU it does not have: a topology of
`slices x hosts x devices_per_host` devices built from a `GpuTargetConfigProto` (XLA's own device
specs, shipped as package data in `amsp_jax/configs/targets/`; a `.txtpb` file of your own works
too). The devices it returns carry one process index per host, so a `Trainer` given them lays the
plan out over real nodes, and `Trainer.compile` runs XLA's full GPU pipeline (latency-hiding
scheduler, loop pipelining) with the library's GPU options.

Needs the `gpu-aot` extra (`jax-cuda12-plugin`, `jax-cuda12-pjrt` at jaxlib's version, and
`nvidia-cuda-nvcc-cu12` for ptxas; a CUDA 13 JAX's `jax-cuda13-*` plugin and a toolkit's ptxas do too)
and JAX started with `JAX_PLATFORMS=cpu`: otherwise the plugin tries to load the CUDA driver, fails,
and registers no topology.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from importlib import metadata

import jax

from amsp_jax.core import config_files

# CUDA releases whose JAX plugin compiles for a target: the `gpu-aot` extra's first.
CUDA_RELEASES = ("12", "13")
EXTRA_HINT = "install the gpu-aot extra: pip install -e '.[gpu-aot]' (or make test, which installs it)"


class TargetError(ValueError):
    """A GPU target that cannot be compiled for: unknown name, missing packages, JAX already on CUDA."""


def known_targets() -> list[str]:
    """Names accepted by `target_config`: the shipped targets, `_` spelled `-`."""
    return config_files.shipped("targets")


def target_config(name: str) -> str:
    """The `GpuTargetConfigProto` text of a `.txtpb` file or of a shipped target (`h100-sxm`)."""
    return config_files.find("targets", name, TargetError).read_text()


def check_packages() -> None:
    """Raise `TargetError` naming what to install when the CUDA compiler plugin or ptxas is missing.

    The plugin of either CUDA release will do (`jax-cuda12-*` from the `gpu-aot` extra, or the
    `jax-cuda13-*` a CUDA 13 JAX install brings), at jaxlib's version; ptxas from its pip package or
    from a CUDA toolkit on the PATH."""
    jaxlib_version = metadata.version("jaxlib")
    problems: dict[str, list[str]] = {}
    for cuda in CUDA_RELEASES:
        for package in (f"jax-cuda{cuda}-plugin", f"jax-cuda{cuda}-pjrt"):
            try:
                version = metadata.version(package)
            except metadata.PackageNotFoundError:
                problems.setdefault(cuda, []).append(f"{package} is not installed")
                continue
            if version != jaxlib_version:
                problems.setdefault(cuda, []).append(f"{package} is {version}, jaxlib is {jaxlib_version}")
    ready = [cuda for cuda in CUDA_RELEASES if cuda not in problems]
    missing = [] if ready else problems[CUDA_RELEASES[0]]
    if not _has_ptxas():
        missing.append("nvidia-cuda-nvcc-cu12 is not installed and no ptxas is on the PATH")
    if missing:
        raise TargetError(
            f"compiling for a GPU target needs the CUDA compiler plugin: {'; '.join(missing)}; {EXTRA_HINT}"
        )


def _has_ptxas() -> bool:
    def installed(package: str) -> bool:
        try:
            return bool(metadata.version(package))
        except metadata.PackageNotFoundError:
            return False

    packaged = any(installed(f"nvidia-cuda-nvcc-cu{cuda}") for cuda in CUDA_RELEASES)
    return packaged or shutil.which("ptxas") is not None


def topology(name: str, nodes: int, devices_per_node: int) -> list[jax.Device]:
    """The devices of `nodes` hosts × `devices_per_node` GPUs of target `name`, for compiling only."""
    if nodes < 1 or devices_per_node < 1:
        raise TargetError(
            f"a GPU cluster needs at least one node and one device, got {nodes} x {devices_per_node}"
        )
    config = target_config(name)
    check_packages()
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            platform="cuda", topology=f"1x{nodes}x{devices_per_node}", target_config=config
        )
    except NotImplementedError as e:
        platforms = os.environ.get("JAX_PLATFORMS", "")
        raise TargetError(
            f"the CUDA plugin registered no topology ({e}); start JAX with JAX_PLATFORMS=cpu "
            f"(now {platforms!r}) so that the plugin does not try to load a CUDA driver"
        ) from e
    return list(topo.devices)


@functools.cache
def device_memory(device_kind: str) -> int | None:
    """Bytes of memory XLA's device description gives a GPU of this kind (`NVIDIA A100-SXM4-80GB`), read
    from the shipped targets; None for a kind none of them describes."""
    for name in known_targets():
        text = target_config(name)
        kind = re.search(r'device_description_str: "([^"]*)"', text)
        size = re.search(r"device_memory_size: (\d+)", text)
        if kind and size and kind.group(1) == device_kind:
            return int(size.group(1))
    return None
