"""NVIDIA GPU clusters to compile for on a machine without a GPU (`amsp-jax audit --target`).

XLA's CUDA compiler plugin compiles for a described GPU it does not have: a topology of
`slices x hosts x devices_per_host` devices built from a `GpuTargetConfigProto` (XLA's own device
specs, shipped as package data in `amsp_jax/configs/targets/`; a `.txtpb` file of your own works
too). The devices it returns carry one process index per host, so a `Trainer` given them lays the
plan out over real nodes, and `Trainer.compile` runs XLA's full GPU pipeline (latency-hiding
scheduler, loop pipelining) with the library's GPU options.

Needs the `gpu-aot` extra (`jax-cuda12-plugin`, `jax-cuda12-pjrt` at jaxlib's version, and
`nvidia-cuda-nvcc-cu12` for ptxas) and JAX started with `JAX_PLATFORMS=cpu`: otherwise the plugin
tries to load the CUDA driver, fails, and registers no topology.
"""

from __future__ import annotations

import functools
import os
import re
from importlib import metadata

import jax

from amsp_jax import config_files

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
    """Raise `TargetError` naming what to install when the CUDA compiler plugin or ptxas is missing."""
    jaxlib_version = metadata.version("jaxlib")
    problems = []
    for package in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12"):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            problems.append(f"{package} is not installed")
            continue
        if package.startswith("jax-") and version != jaxlib_version:
            problems.append(f"{package} is {version}, jaxlib is {jaxlib_version}")
    if problems:
        raise TargetError(
            f"compiling for a GPU target needs the CUDA compiler plugin: {'; '.join(problems)}; {EXTRA_HINT}"
        )


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
