"""Orbax checkpoints of the logical train state, restorable onto any plan and device count.

One Orbax step directory per checkpoint, written under a temporary name and renamed when complete,
so a checkpoint is either whole or absent (a save cut short leaves only a `*.orbax-checkpoint-tmp*`
directory, which Orbax never lists):

  state/  fp32 master weights, optimizer state, step and the carried variable collections (e.g.
          `batch_stats`), each with its sharding (a leaf whose split
          dimension does not divide is stored padded with zeros; `param_shapes` has its real shape);
          the RNG key data
  meta/   JSON: format, step, parameter shapes, and what the caller adds (model, strategy, cluster,
          data position), read first so that a checkpoint of another model fails with a clear error

P is not saved: it is the master cast and gathered onto P's placement (`Trainer.assemble`). A restore
passes the target plan's shardings (`Trainer.abstract_state()`), so a checkpoint written under
ZeRO-3 on 8 devices comes back under any other strategy on 4. Saves are asynchronous: the device
arrays are copied to host memory before `save` returns (the next step may donate them), and the
files are written in the background.

Weights leave without a Trainer: `load_params` reads a checkpoint's master weights as host numpy
arrays on any device count, and `write_params` / `read_params` put a parameter tree in a safetensors
file (what `amsp-jax export` writes and `amsp-jax train --init-from` reads).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import flax
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from amsp_jax.core.mesh import unpad
from amsp_jax.trainer import Trainer, TrainState

FORMAT = "amsp_jax/1"
STATE, META = "state", "meta"
PARAMS_FORMAT = "amsp_jax.params/1"
RUN_CHECKPOINTS = "checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, or of something other than what is being restored."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored state on the target plan, the saved RNG key data and the saved metadata."""

    state: TrainState
    rng: np.ndarray
    meta: dict[str, Any]


def param_shapes(trainer: Trainer) -> dict[str, list[int]]:
    """Every parameter leaf's shape keyed by its '/'-joined path (what a restore must match)."""
    return {"/".join(map(str, p)): list(leaf.shape) for p, leaf in trainer.program.params.leaves.items()}


def optimizer_structure(trainer: Trainer) -> str:
    """The optimizer state's tree structure (which optax transforms, in which order) as text."""
    return str(jax.tree.structure(trainer.abstract_state().opt_state))


def _differences(saved: dict[str, Any], expected: dict[str, Any], limit: int = 4) -> str:
    keys = sorted(set(saved) | set(expected), key=str)
    diffs = [
        f"{k}: {saved.get(k, '-')} here {expected.get(k, '-')}"
        for k in keys
        if saved.get(k) != expected.get(k)
    ]
    more = f" (+{len(diffs) - limit} more)" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


class CheckpointDirectory:
    """A directory of Orbax steps, its manager opened on first use: list, wait for and close the saves."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True) -> None:
        """Nothing is created on disk until the first save."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory).absolute()
        self.keep = keep
        self.async_save = async_save
        self._manager: ocp.CheckpointManager | None = None

    def _open(self) -> ocp.CheckpointManager:
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, enable_async_checkpointing=self.async_save, create=True
            )
            self._manager = ocp.CheckpointManager(self.directory, item_names=(STATE, META), options=options)
        return self._manager

    def steps(self) -> list[int]:
        """The steps of every complete checkpoint, oldest first.

        With several processes every one must call this (opening Orbax's manager is collective), and
        the directory must be on a file system they share.
        """
        if self._manager is None and not self.directory.is_dir():
            return []
        return sorted(self._open().all_steps())

    def _require_step(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise CheckpointError(
                f"no checkpoint in {self.directory}; start without --resume, or point --run-dir at the run "
                "to continue"
            )
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory}; it has steps {steps}")
        return step

    def _damaged(self, step: int, error: BaseException) -> CheckpointError:
        earlier = [s for s in self.steps() if s < step]
        fallback = f"resume from step {earlier[-1]}" if earlier else "start again"
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        return CheckpointError(
            f"checkpoint step {step} in {self.directory} is damaged or unreadable ({reason}); delete "
            f"{self.directory / str(step)} to {fallback}, or start a new run directory"
        )

    def wait(self) -> None:
        """Block until every started save is written and finalized."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release Orbax's resources."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None


class Checkpointer(CheckpointDirectory):
    """The checkpoints of one run directory: async save, keep the last `keep`, restore onto any plan."""

    def save(self, trainer: Trainer, state: TrainState, rng: Any, meta: dict[str, Any] | None = None) -> int:
        """Start saving `state` (master, optimizer state, step), `rng` and `meta`; returns the step."""
        step = int(state.step)
        full_meta = {
            **(meta or {}),
            "format": FORMAT,
            "step": step,
            "param_shapes": param_shapes(trainer),
            "optimizer_structure": optimizer_structure(trainer),
        }
        items = {STATE: ocp.args.StandardSave(_state_tree(state, rng)), META: ocp.args.JsonSave(full_meta)}
        self._open().save(step, args=ocp.args.Composite(**items), force=True)
        return step

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata saved with `step` (default: the latest)."""
        step = self._require_step(step)
        try:
            restored = self._open().restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
            meta = dict(restored[META])
        except Exception as error:
            raise self._damaged(step, error) from error
        if meta.get("format") != FORMAT:
            raise self._damaged(
                step, ValueError(f"metadata format {meta.get('format')!r}, expected {FORMAT!r}")
            )
        return meta

    def restore(self, trainer: Trainer, step: int | None = None, model: Any = None) -> Restored:
        """Restore `step` (default: the latest) onto `trainer`'s plan; `model` must equal the saved one.

        `trainer.setup()` (or `init()`) must have run, so that the parameter shapes and the target
        shardings are known.
        """
        step = self._require_step(step)
        meta = self.read_meta(step)
        check_matches(meta, trainer, model, f"the checkpoint in {self.directory} (step {step})")
        try:
            # Not strict: a leaf whose split dimension does not divide is stored zero-padded for the
            # saving plan, and Orbax's truncation or zero padding is exactly the change to this plan's.
            target = ocp.args.StandardRestore(_restore_target(trainer), strict=False)
            restored = self._open().restore(step, args=ocp.args.Composite(**{STATE: target}))[STATE]
        except Exception as error:
            raise self._damaged(step, error) from error
        state = trainer.assemble(
            restored["step"], restored["master"], restored["opt_state"], restored.get("collections")
        )
        return Restored(state, np.asarray(restored["rng"]), meta)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _state_tree(state: TrainState, rng: Any) -> dict[str, Any]:
    """What a checkpoint stores: the step, master, optimizer state, carried collections, RNG key data."""
    tree = {
        "step": state.step,
        "master": state.master,
        "opt_state": state.opt_state,
        "rng": np.asarray(jax.random.key_data(rng) if _is_key(rng) else rng),
    }
    if state.collections:
        tree["collections"] = state.collections
    return tree


def _restore_target(trainer: Trainer) -> dict[str, Any]:
    """The stored tree as abstract arrays with the trainer's shardings, where the restore puts them."""
    abstract = trainer.abstract_state()
    target = {
        "step": abstract.step,
        "master": abstract.master,
        "opt_state": abstract.opt_state,
        "rng": np.zeros(jax.random.key_data(jax.random.key(0)).shape, np.uint32),
    }
    if abstract.collections:
        target["collections"] = abstract.collections
    return target


def check_matches(meta: dict[str, Any], trainer: Trainer, model: Any, what: str) -> None:
    """Raise a CheckpointError when the checkpoint `what` (its `meta`) is of another model or optimizer.

    `model`: the model config the caller expects (None: not checked); parameter shapes and the
    optimizer state's structure are compared with `trainer`'s.
    """
    if model is not None and "model" in meta and meta["model"] != model:
        detail = (
            _differences(meta["model"], model)
            if isinstance(model, dict) and isinstance(meta["model"], dict)
            else f"{meta['model']} here {model}"
        )
        raise CheckpointError(
            f"{what} is of another model: saved {detail}; use the model config it was trained with, or a "
            "new run directory"
        )
    shapes = param_shapes(trainer)
    if meta["param_shapes"] != shapes:
        raise CheckpointError(
            f"{what} holds parameters of other shapes: saved {_differences(meta['param_shapes'], shapes)}; "
            "restore it into the model it was saved from"
        )
    expected = optimizer_structure(trainer)
    if meta["optimizer_structure"] != expected:
        states = [
            ", ".join(re.findall(r"namedtuple\[(\w+)\]", text))
            for text in (meta["optimizer_structure"], expected)
        ]
        raise CheckpointError(
            f"{what} holds the state of another optimizer (saved: {states[0]}; here: {states[1]}); restore "
            "it with the optax chain it was saved with"
        )


def checkpoint_directory(path: str | Path) -> Path:
    """The directory of Orbax steps: `path` itself, or a run directory's `checkpoints/`."""
    path = Path(path).absolute()
    nested = path / RUN_CHECKPOINTS
    return nested if nested.is_dir() else path


def saved_meta(checkpoint_dir: str | Path, step: int | None = None) -> dict[str, Any]:
    """The metadata of a checkpoint (default: the latest) in a run directory or its `checkpoints/`."""
    checkpointer = Checkpointer(checkpoint_directory(checkpoint_dir))
    try:
        if not checkpointer.steps():
            raise CheckpointError(
                f"no checkpoint in {checkpointer.directory}; give the run directory of an `amsp-jax train` "
                "run (or its checkpoints/ directory)"
            )
        return checkpointer.read_meta(step)
    finally:
        checkpointer.close()


def load_params(checkpoint_dir: str | Path, step: int | None = None) -> dict[str, Any]:
    """The full fp32 parameters of a checkpoint (default: its latest step) as host numpy arrays.

    `checkpoint_dir` is a run directory or its `checkpoints/`. No Trainer, model or particular
    device count is needed: only the master weights are read, whole, whatever plan wrote them.
    """
    directory = checkpoint_directory(checkpoint_dir)
    meta = saved_meta(directory, step)
    step = meta["step"]
    # The state was written by Orbax's standard handler, whose files the PyTree handler reads; it
    # gives the saved tree's metadata and restores the master weights alone (partial_restore).
    handlers = {STATE: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
    manager = ocp.CheckpointManager(directory, item_handlers=handlers)
    try:
        saved = manager.item_metadata(step)[STATE]["master"]
        target = {"master": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)}
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                **{STATE: ocp.args.PyTreeRestore(target, restore_args=as_numpy, partial_restore=True)}
            ),
        )
    except Exception as error:
        raise Checkpointer(directory)._damaged(step, error) from error
    finally:
        manager.close()
    # Padded leaves (see `Checkpointer.restore`) are cut back to the shapes the metadata records.
    flat = traverse_util.flatten_dict(flax.core.unfreeze(restored[STATE]["master"]))
    shapes = meta["param_shapes"]
    return traverse_util.unflatten_dict(
        {
            path: unpad(np.asarray(x, np.float32), shapes.get("/".join(map(str, path)), np.shape(x)))
            for path, x in flat.items()
        }
    )


def write_params(params: Any, path: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write a parameter tree as a safetensors file: one tensor per leaf, keys its '/'-joined path.

    `metadata` (JSON-serialisable values) is stored in the file's header beside the format name.
    """
    from safetensors.numpy import save_file

    flat = traverse_util.flatten_dict(flax.core.unfreeze(params), sep="/")
    tensors = {key: np.ascontiguousarray(np.asarray(value)) for key, value in flat.items()}
    header = {"format": PARAMS_FORMAT, **{k: json.dumps(v) for k, v in (metadata or {}).items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=header)
    return path


def read_params(path: str | Path) -> dict[str, Any]:
    """A parameter tree (nested dicts of numpy arrays) from a safetensors file ('/'-joined keys, as
    `write_params` and `amsp-jax export` write) or a Flax msgpack file (`flax.serialization`)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"parameter file {path} does not exist; write one with `amsp-jax export`")
    try:
        if path.suffix == ".msgpack":
            tree = flax.serialization.msgpack_restore(path.read_bytes())
            return jax.tree.map(np.asarray, flax.core.unfreeze(tree))
        from safetensors.numpy import load_file

        return traverse_util.unflatten_dict(load_file(str(path)), sep="/")
    except Exception as error:
        raise CheckpointError(
            f"{path} is not a readable parameter file ({str(error).strip()[:200] or type(error).__name__}); "
            "give a .safetensors file (amsp-jax export) or a Flax .msgpack file"
        ) from error


def params_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata `write_params` stored in a safetensors file (values decoded from JSON)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        header = handle.metadata() or {}
    return {k: (v if k == "format" else json.loads(v)) for k, v in header.items()}
