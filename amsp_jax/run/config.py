"""The settings of `amsp-jax train`: a train config of five sections, each checking its own values.

A train config YAML has one mapping per section; any may be left out, and so may any setting:

    model:     {name: small}
    data:      {paths: [], seq_len: 128, global_batch: 16}
    plan:      {strategy: auto}
    optimizer: {learning_rate: 3.0e-3}
    run:       {steps: 300, dir: runs/demo-{time}}

A section raises a one-line `ConfigError` naming the setting as `section.key` when a value has the
wrong type or range; `load_config` puts the file's path in front. Overrides (the command line's flags)
are dotted keys, `{"run.steps": 10}`, checked the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from amsp_jax.core import config_files
from amsp_jax.core.plan import REMAT_POLICIES
from amsp_jax.errors import AmspError, check_field_types
from amsp_jax.run.data import TOKEN_DTYPES


class ConfigError(AmspError):
    """A train config that cannot be run as written."""


@dataclasses.dataclass(frozen=True)
class Section:
    """A section of a train config: a frozen dataclass whose settings are checked when it is built."""

    section: ClassVar[str]
    """The section's key in a train config."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            try:
                check_field_types(type(self), {field.name: getattr(self, field.name)}, "", ConfigError)
            except ConfigError as error:
                raise ConfigError(f"{self.section}.{error}") from None
        self.check()

    def check(self) -> None:
        """Raise a ConfigError when a value is out of range (the types are already checked)."""

    def at_least(self, **least: int) -> None:
        """Raise unless each named setting (None allowed) is at least its bound."""
        for key, bound in least.items():
            value = getattr(self, key)
            if value is not None and value < bound:
                raise ConfigError(f"{self.section}.{key} must be at least {bound}, got {value}")

    def positive(self, *keys: str) -> None:
        """Raise unless each named setting is a finite number above zero."""
        for key in keys:
            value = getattr(self, key)
            if not 0 < value < math.inf:
                raise ConfigError(f"{self.section}.{key} must be a positive number, got {value}")

    def one_of(self, key: str, allowed: tuple[str, ...]) -> None:
        """Raise unless the named setting is one of `allowed`."""
        value = getattr(self, key)
        if value not in allowed:
            raise ConfigError(f"{self.section}.{key} {value!r} is not one of {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    """Which model is trained."""

    section: ClassVar[str] = "model"

    name: str = "tiny"
    """A LLaMA model config: a YAML file or a shipped config's name (`tiny`, `small`, `llama-7b`, ...)."""


@dataclasses.dataclass(frozen=True)
class DataSection(Section):
    """The text, its split, and the batches drawn from it."""

    section: ClassVar[str] = "data"

    paths: tuple[str, ...] = ()
    """Text files, directories, JSON lines or token files; empty: the standard library's sources."""
    dtype: str = "uint16"
    """Token dtype of raw `.bin` token files."""
    held_out_every: int = 20
    """Every n-th document goes to the held-out split."""
    seq_len: int = 128
    global_batch: int = 16
    """Sequences per optimizer step over all devices (a multiple of devices x micro_batches)."""

    def __post_init__(self) -> None:
        # YAML and the command line give one path as a string and several as a list.
        paths = self.paths
        if paths is None:
            paths = ()
        elif isinstance(paths, str):
            paths = (paths,)
        elif isinstance(paths, list):
            paths = tuple(paths)
        object.__setattr__(self, "paths", paths)
        super().__post_init__()

    def check(self) -> None:
        """Paths are strings; counts in range; a known token dtype."""
        if not isinstance(self.paths, tuple) or not all(isinstance(p, str) for p in self.paths):
            raise ConfigError(f"data.paths must be a path or a list of paths, got {self.paths!r}")
        self.at_least(held_out_every=2, seq_len=1, global_batch=1)
        self.one_of("dtype", TOKEN_DTYPES)


@dataclasses.dataclass(frozen=True)
class PlanSection(Section):
    """How the step is sharded over the devices."""

    section: ClassVar[str] = "plan"

    strategy: str = "auto"
    """`auto` (the planner, which also sets micro_batches and remat), a preset (`zero3`, `mics`,
    ...) or `p=AxB,g=CxD,os=ExF`."""
    cluster: str | None = None
    """A cluster YAML or a shipped config's name (`a800-8x-ib800`), `NODESxDEVICES`, or `host` (this host's
    profile); default: one node per process (2 nodes on simulated CPUs, priced with this host's profile)."""
    cpu_devices: int = 8
    """Simulated devices when there is no accelerator (set before JAX starts)."""
    micro_batches: int = 1
    precision: str = "mixed"
    remat: str = "full"
    keep_first_layer: bool = False
    """With micro-batches, gather the first layer once per step and reduce its gradient once: the layer
    loop then starts and ends beside compute, for one gathered layer and its fp32 gradient in memory."""

    def check(self) -> None:
        """Counts in range; a known precision and remat policy."""
        self.at_least(cpu_devices=1, micro_batches=1)
        self.one_of("precision", ("mixed", "fp32"))
        self.one_of("remat", REMAT_POLICIES)


@dataclasses.dataclass(frozen=True)
class OptimizerSection(Section):
    """AdamW after global-norm clipping, with linear warmup and cosine decay to 10% of the peak."""

    section: ClassVar[str] = "optimizer"

    learning_rate: float = 3e-3
    warmup_steps: int = 20
    decay_steps: int | None = None
    """Cosine decay horizon; default: `run.steps`."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    adam_eps: float = 1e-8

    def check(self) -> None:
        """Rates and bounds positive, weight decay not negative."""
        self.at_least(warmup_steps=0, decay_steps=1)
        self.positive("learning_rate", "grad_clip", "adam_eps")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(f"optimizer.weight_decay must be zero or positive, got {self.weight_decay}")


@dataclasses.dataclass(frozen=True)
class RunSection(Section):
    """How long to train, what to do on the way, and where the files go."""

    section: ClassVar[str] = "run"

    steps: int = 200
    """Train until this many optimizer steps are done (counting those of a resumed checkpoint)."""
    seed: int = 0
    """Seed of the initial parameters and of the order of the training batches."""
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    dir: str = "runs/train-{time}"
    """Where checkpoints and metrics go; `{time}` becomes the start time."""
    resume: bool = False
    """Continue from the latest checkpoint in `dir` (an error if there is none)."""
    init_from: str | None = None
    """A parameter file to start from (`amsp-jax export`'s safetensors, or Flax msgpack), with a fresh
    optimizer state; ignored when resuming, whose checkpoint holds the run's own weights."""
    progress: bool = True
    stop_after_bad_steps: int = 5
    """A step whose loss or gradient norm is not finite leaves the state as it was (it is skipped and
    counted in the metrics); this many such steps in a row stop the run with an error."""

    def check(self) -> None:
        """Every count at least 1."""
        self.at_least(
            steps=1, eval_every=1, eval_batches=1, checkpoint_every=1, keep_checkpoints=1,
            stop_after_bad_steps=1,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run reads; each section is a mapping of a train config YAML."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    plan: PlanSection = dataclasses.field(default_factory=PlanSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    run: RunSection = dataclasses.field(default_factory=RunSection)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """A config from nested mappings (a parsed YAML file); unknown sections and keys are errors."""
        sections = {}
        for name, settings in values.items():
            section = _section_class(name)
            if not isinstance(settings, dict):
                raise ConfigError(
                    f"{name} must be a mapping of its settings (e.g. {name}: {{{_example(section)}}}), "
                    f"got {settings!r}"
                )
            _check_known(section, settings)
            sections[name] = section(**settings)
        return cls(**sections)

    def override(self, changes: Mapping[str, Any]) -> TrainConfig:
        """This config with `changes` on top: dotted keys (`run.steps`); a None value changes nothing."""
        nested: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            if value is None:
                continue
            name, dot, setting = key.partition(".")
            if not dot:
                home = [k for k in known_keys() if k.endswith(f".{key}")]
                hint = f"did you mean {home[0]}?" if home else f"known: {', '.join(known_keys())}"
                raise ConfigError(f"unknown train settings [{key!r}]; a setting is section.key; {hint}")
            section = _section_class(name)
            _check_known(section, {setting: value})
            nested.setdefault(name, {})[setting] = value
        sections = {name: dataclasses.replace(getattr(self, name), **kv) for name, kv in nested.items()}
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The config as nested mappings of plain values, as a train config YAML holds it."""
        values = dataclasses.asdict(self)
        values["data"]["paths"] = list(values["data"]["paths"])
        return values


def _field_names(section: type[Section]) -> list[str]:
    return [f.name for f in dataclasses.fields(section)]


def _sections() -> dict[str, type[Section]]:
    return {s.section: s for s in (ModelSection, DataSection, PlanSection, OptimizerSection, RunSection)}


def known_keys() -> list[str]:
    """Every setting as its dotted key (`run.steps`)."""
    return [f"{name}.{key}" for name, section in _sections().items() for key in _field_names(section)]


def _example(section: type[Section]) -> str:
    first = dataclasses.fields(section)[0]
    return f"{first.name}: {first.default if first.default is not None else '...'}"


def _section_class(name: str) -> type[Section]:
    """The section called `name`; for a setting written outside its section, say where it goes."""
    sections = _sections()
    if name in sections:
        return sections[name]
    home = next((s for s in sections.values() if name in _field_names(s)), None)
    if home is not None:
        raise ConfigError(
            f"{name} is a setting of the {home.section} section; write it under {home.section}: "
            f"({home.section}: {{{name}: ...}})"
        )
    raise ConfigError(f"unknown train section {name!r}; the sections are {', '.join(sections)}")


def _check_known(section: type[Section], settings: dict[str, Any]) -> None:
    known = _field_names(section)
    unknown = sorted((f"{section.section}.{k}" for k in set(settings) - set(known)), key=str)
    if unknown:
        raise ConfigError(f"unknown train settings {unknown}; known in {section.section}: {', '.join(known)}")


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """A TrainConfig from a YAML file or shipped config name (`demo`), optional, with `overrides` on top.

    `overrides` has dotted keys (`{"run.steps": 10}`); a None value is ignored.
    """
    config = TrainConfig()
    if path is not None:
        path = config_files.find("train", path, ConfigError)
        values = config_files.read_mapping(path, ConfigError, "train settings (e.g. run: {steps: 100})")
        try:
            config = TrainConfig.from_dict(values)
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from None
    return config.override(overrides or {})
