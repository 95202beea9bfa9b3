"""Shared pieces of the training, checkpoint and multi-host tests, and a child process they start.

As a script (`python tests/train_helpers.py CORPUS RUN_DIR`) it is the child of the SIGKILL test: it
trains two steps with a checkpoint after each, and holds the save of step 2 just before Orbax commits
it, printing SAVING, so that the parent's SIGKILL lands mid-save every time, not by luck of timing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import orbax.checkpoint._src.path.atomicity as atomicity
import yaml
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from amsp_jax.cli import train as train_command_module
from amsp_jax.run.config import (
    DataSection,
    ModelSection,
    OptimizerSection,
    PlanSection,
    RunSection,
    TrainConfig,
)
from amsp_jax.run.data import stdlib_files
from amsp_jax.run.train import train

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = str(REPO / "configs" / "models" / "tiny.yaml")


@contextlib.contextmanager
def reused_compilations(directory: Path) -> Iterator[None]:
    """Keep compiled programs on disk for the block, so runs that build the same step compile it once.

    Every `train()` builds a new Trainer and so recompiles programs identical to the previous run's;
    JAX's persistent cache (keyed by the program text) turns those compiles into reads.
    """
    previous = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax_cache.reset_cache()  # JAX decides once whether a cache is in use; make it decide again
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous[1])
        jax_cache.reset_cache()


def write_corpus(directory: Path, files: int = 40) -> Path:
    """A small real-text corpus: copies of the first standard library sources."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, source in enumerate(stdlib_files()[:files]):
        shutil.copyfile(source, directory / f"{i:03d}_{source.name}")
    return directory


def small_run_config(corpus: Path, run_dir: Path, changes: dict[str, object] | None = None) -> TrainConfig:
    """A few-step fp32 run of the tiny model on `corpus`, checkpointing every 3 steps; `changes` has
    dotted keys (`{"run.steps": 3}`).

    adam_eps=1e-3 for the reason given in tests/helpers.py: a small eps turns fp32 rounding of
    near-zero gradient entries into lr-sized differences between summation orders.
    """
    config = TrainConfig(
        model=ModelSection(name=TINY_MODEL),
        data=DataSection(paths=(str(corpus),), seq_len=32, global_batch=16),
        plan=PlanSection(strategy="zero3", precision="fp32"),
        optimizer=OptimizerSection(learning_rate=1e-2, warmup_steps=2, decay_steps=6, adam_eps=1e-3),
        run=RunSection(
            steps=6, eval_every=3, eval_batches=1, checkpoint_every=3, keep_checkpoints=2, dir=str(run_dir),
            progress=False,
        ),
    )  # fmt: skip
    return config.override(changes or {})


def run_train_command(argv: list[str]) -> int:
    """`amsp-jax train ARGV` in this process; its exit code."""
    parser = argparse.ArgumentParser()
    train_command_module.add_arguments(parser)
    return train_command_module.run(parser.parse_args(argv))


def write_config(path: Path, config: TrainConfig) -> Path:
    """`config` as a train config YAML at `path`."""
    path.write_text(yaml.safe_dump(config.to_dict()))
    return path


def file_digests(directory: Path) -> dict[str, str]:
    """Every file under `directory` by relative path, with a digest of its bytes."""
    return {
        str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(directory.rglob("*"))
        if f.is_file()
    }


def child_env(devices: int | None) -> dict[str, str]:
    """The environment of a child process: CPU only, `devices` simulated devices (None: unset).

    The child shares this process's compilation cache, if one is in use, and its XLA flags but the
    device count.
    """
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["JAX_PLATFORMS"] = "cpu"
    if jax.config.jax_compilation_cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = str(jax.config.jax_compilation_cache_dir)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def train_command(*args: str) -> list[str]:
    """`amsp-jax train ARGS` as a child process command line."""
    return [sys.executable, "-m", "amsp_jax.cli.train", *args]


def metric_losses(run_dir: Path) -> dict[int, float]:
    """Training losses by step from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def start_child(*args: str, devices: int | None = 8) -> subprocess.Popen:
    """Start this file as a child process (text stdout, stderr to a pipe)."""
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        env=child_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def _kill_during_save(corpus: str, run_dir: str) -> None:
    """Train two steps, saving each; the save of step 2 stops just before its commit (the rename)."""
    commit = atomicity.AtomicRenameTemporaryPath.finalize

    async def hold_step_two(self: atomicity.AtomicRenameTemporaryPath) -> None:
        if self._final_path.name != "2" and self._final_path.parent.name.split(".")[0] != "2":
            await commit(self)
            return
        print("SAVING", flush=True)
        await asyncio.sleep(3600)

    atomicity.AtomicRenameTemporaryPath.finalize = hold_step_two
    config = small_run_config(Path(corpus), Path(run_dir), {"run.steps": 2, "run.checkpoint_every": 1})
    train(config, out=io.StringIO())


if __name__ == "__main__":
    _kill_during_save(*sys.argv[1:])
