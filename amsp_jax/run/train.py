"""The training loop of `amsp-jax train`: plan, data, steps, evaluation, metrics, checkpoints, preemption.

`train(config)` runs one run directory end to end: it reads the data (failing before anything is
written when the data is missing), builds the plan for the devices at hand, restores the latest
checkpoint when resuming (onto this plan, whatever plan saved it), prints the plan, then steps with a
progress bar, writes every metric as a JSON line to `metrics.jsonl`, evaluates on the held-out split
every `eval_every` steps, saves asynchronously every `checkpoint_every` steps and once more at the end,
and on SIGTERM saves and returns cleanly. A step whose loss or gradient norm is not finite changes
nothing but the step counter (`Trainer.step`); it is logged as skipped, and `stop_after_bad_steps` of
them in a row stop the run with a `DivergedError`, the newest checkpoint untouched. The training batch
of step i is a pure function of the data RNG and i, so a resumed run sees exactly the batches the
uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
import optax
import yaml
from jax.experimental import multihost_utils
from tqdm import tqdm

from amsp_jax.core import config_files
from amsp_jax.core.plan import REMAT_POLICIES, Plan
from amsp_jax.core.schedule import accumulates, grad_dtype
from amsp_jax.core.space import COMPONENTS, Cluster, Strategy, resolve, zero3
from amsp_jax.cost import hardware as cluster_config
from amsp_jax.cost import llama_workload
from amsp_jax.cost.hardware import ClusterConfig
from amsp_jax.errors import AmspError, check_field_types, one_line
from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn
from amsp_jax.run import data as data_lib
from amsp_jax.run.checkpoint import Checkpointer, CheckpointError, read_params
from amsp_jax.run.distributed import is_primary
from amsp_jax.trainer import Trainer, TrainState

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"


class ConfigError(AmspError):
    """A train config that cannot be run as written."""


class DivergedError(RuntimeError):
    """Training stopped: the loss or gradient norm stayed non-finite for too many steps in a row."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run reads; every field is a key of a train config YAML."""

    model: str = "tiny"
    """A LLaMA model config: a YAML file or a shipped config's name (`tiny`, `small`, `llama-7b`, ...)."""
    data: tuple[str, ...] = ()
    """Text files, directories, JSON lines or token files; empty: the standard library's sources."""
    data_dtype: str = "uint16"
    """Token dtype of raw `.bin` token files."""
    held_out_every: int = 20
    """Every n-th document goes to the held-out split."""
    seq_len: int = 128
    global_batch: int = 16
    """Sequences per optimizer step over all devices (a multiple of devices x micro_batches)."""
    steps: int = 200
    """Train until this many optimizer steps are done (counting those of a resumed checkpoint)."""
    strategy: str = "auto"
    """`auto` (the partitioner, which also sets micro_batches and remat), a preset (`zero3`, `mics`,
    ...) or `p=AxB,g=CxD,os=ExF`."""
    cluster: str | None = None
    """A cluster YAML or a shipped config's name (`a800-8x-ib800`), or `NODESxDEVICES`; default: one node
    per process (2 nodes on simulated CPUs)."""
    cpu_devices: int = 8
    """Simulated devices when there is no accelerator (set before JAX starts)."""
    micro_batches: int = 1
    precision: str = "mixed"
    remat: str = "full"
    keep_first_layer: bool = False
    """With micro-batches, gather the first layer once per step and reduce its gradient once: the layer
    loop then starts and ends beside compute, for one gathered layer and its fp32 gradient in memory."""
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    decay_steps: int | None = None
    """Cosine decay horizon (to 10% of the peak); default: `steps`."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    adam_eps: float = 1e-8
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    run_dir: str = "runs/train-{time}"
    """Where checkpoints and metrics go; `{time}` becomes the start time."""
    resume: bool = False
    """Continue from the latest checkpoint in `run_dir` (an error if there is none)."""
    init_from: str | None = None
    """A parameter file to start from (`amsp-jax export`'s safetensors, or Flax msgpack), with a fresh
    optimizer state; ignored when resuming, whose checkpoint holds the run's own weights."""
    progress: bool = True
    stop_after_bad_steps: int = 5
    """A step whose loss or gradient norm is not finite leaves the state as it was (it is skipped and
    counted in the metrics); this many such steps in a row stop the run with an error."""


# Allowed values of the settings that take a name, and the least value of the counting settings.
CHOICES: dict[str, tuple[str, ...]] = {
    "precision": ("mixed", "fp32"),
    "remat": REMAT_POLICIES,
    "data_dtype": data_lib.TOKEN_DTYPES,
}
AT_LEAST: dict[str, int] = {
    "held_out_every": 2,
    "seq_len": 1,
    "global_batch": 1,
    "steps": 1,
    "cpu_devices": 1,
    "micro_batches": 1,
    "warmup_steps": 0,
    "decay_steps": 1,
    "eval_every": 1,
    "eval_batches": 1,
    "checkpoint_every": 1,
    "keep_checkpoints": 1,
    "stop_after_bad_steps": 1,
}
POSITIVE = ("learning_rate", "grad_clip", "adam_eps")


def check_config(values: dict[str, Any], where: str = "") -> None:
    """Raise a ConfigError naming `where` (a file) and the key when a setting has the wrong type or range."""
    check_field_types(TrainConfig, values, where, ConfigError)
    where = f"{where}: " if where else ""
    for key, least in AT_LEAST.items():
        if values.get(key) is not None and values[key] < least:
            raise ConfigError(f"{where}{key} must be at least {least}, got {values[key]}")
    for key in POSITIVE:
        if key in values and not 0 < values[key] < math.inf:
            raise ConfigError(f"{where}{key} must be a positive number, got {values[key]}")
    if "weight_decay" in values and not 0 <= values["weight_decay"] < math.inf:
        raise ConfigError(f"{where}weight_decay must be zero or positive, got {values['weight_decay']}")
    for key, allowed in CHOICES.items():
        if key in values and values[key] not in allowed:
            raise ConfigError(f"{where}{key} {values[key]!r} is not one of {', '.join(allowed)}")
    data = values.get("data", ())
    if not isinstance(data, tuple) or not all(isinstance(d, str) for d in data):
        raise ConfigError(f"{where}data must be a path or a list of paths, got {values.get('data')!r}")


def load_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """A TrainConfig from a YAML file or shipped config name (`demo`), optional, with `overrides` on top.

    Overrides that are None are ignored.
    """
    values: dict[str, Any] = {}
    where = "train config"
    if path is not None:
        path = config_files.find("train", path, ConfigError)
        where = str(path)
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            raise ConfigError(f"{path} is not valid YAML ({one_line(error)}); fix its syntax") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path} is not a mapping of train settings (e.g. steps: 100)")
    given = {k: v for k, v in overrides.items() if v is not None}
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known, key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown train settings {unknown}; known: {sorted(known)}")
    unknown = sorted(set(given) - known, key=str)
    if unknown:
        raise ConfigError(f"unknown train settings {unknown}; known: {sorted(known)}")
    values, given = _normal_data(values), _normal_data(given)
    check_config(values, where)
    check_config(given, "")
    return TrainConfig(**{**values, **given})


def _normal_data(values: dict[str, Any]) -> dict[str, Any]:
    """`data` as a tuple: one path, a list of paths, or left out when empty (None)."""
    data = values.get("data")
    if data is None:
        return {k: v for k, v in values.items() if k != "data"}
    if isinstance(data, str):
        return {**values, "data": (data,)}
    if isinstance(data, list | tuple):
        return {**values, "data": tuple(data)}
    return values


# ---- plan ---------------------------------------------------------------------------------------------


def _hardware(name_or_path: str | Path) -> ClusterConfig:
    try:
        return cluster_config.load(name_or_path)
    except (cluster_config.ClusterConfigError, KeyError) as error:
        raise ConfigError(f"cluster config {name_or_path}: {error}") from None


def choose_cluster(spec: str | None, devices: Sequence[jax.Device]) -> tuple[Cluster, ClusterConfig | None]:
    """The cluster of `devices`, and its hardware config (bandwidths, peak FLOP/s) where one is known.

    `spec`: a cluster YAML or a shipped config's name (its devices per node, as many nodes as
    the devices fill), `NODESxDEVICES`, or None: one node per process, except that simulated CPU
    devices of one process stand for two nodes (so inter-node placements can be tried) with the
    `cpu-sim` hardware config.
    """
    if spec and not re.fullmatch(r"\d+x\d+", spec.lower()):
        hardware = _hardware(spec)
        per_node = hardware.devices_per_node
        if len(devices) % per_node:
            raise ConfigError(
                f"{len(devices)} devices do not fill nodes of {per_node} ({spec}); use a matching cluster "
                "config or --cluster NODESxDEVICES"
            )
        cluster = Cluster(len(devices) // per_node, per_node, hardware.name)
        return cluster, hardware.with_shape(cluster.nodes)
    if spec:
        nodes, per_node = (int(n) for n in spec.lower().split("x"))
        if nodes * per_node != len(devices):
            raise ConfigError(
                f"cluster {spec} has {nodes * per_node} devices but this run has {len(devices)}; give "
                "NODESxDEVICES that multiply to the device count (or set cpu_devices on the CPU)"
            )
        return Cluster(nodes, per_node, "given"), None
    simulated = devices[0].platform == "cpu"
    if simulated and len({d.process_index for d in devices}) == 1 and len(devices) % 2 == 0:
        cluster = Cluster(2, len(devices) // 2, "cpu-sim")
    else:
        cluster = Cluster.detect(devices)
    if simulated:
        return cluster, _hardware("cpu-sim").with_shape(cluster.nodes, cluster.devices_per_node)
    return cluster, None


@dataclasses.dataclass(frozen=True)
class PlanChoice:
    """The strategy and step knobs of a run, and a note saying where they came from."""

    strategy: Strategy
    micro_batches: int
    remat: str
    note: str
    hierarchical: bool = True
    prefetch: bool | None = None


def auto_plan(
    model: LlamaConfig, cluster: Cluster, hardware: ClusterConfig | None, config: TrainConfig
) -> PlanChoice:
    """The partitioner's strategy, micro-batches and remat for the hardware; ZeRO-3 without hardware."""
    if hardware is None:
        return PlanChoice(
            zero3(cluster),
            config.micro_batches,
            config.remat,
            "auto: no hardware config for this cluster (give --cluster, a cluster YAML or name), so zero3",
        )
    from amsp_jax.cost import llama_dims
    from amsp_jax.planner import partitioner
    from amsp_jax.planner.search import choose

    # The same entry point as for any model (`amsp_jax.choose`: the traced leaves and blocks), with the
    # config's exact dimensions for the FLOP and activation model.
    example = np.zeros((1, config.seq_len), np.int32)
    try:
        chosen = choose(
            Llama(model), (example,), hardware, global_batch=config.global_batch, nodes=cluster.nodes,
            precision=config.precision, dims=llama_dims(model), keep_first_layer=config.keep_first_layer,
        )  # fmt: skip
    except partitioner.PlanError as error:
        raise ConfigError(f"strategy auto: {error}") from None
    collectives = "collectives split at node boundaries" if chosen.hierarchical else "flat collectives"
    note = (
        f"auto: the partitioner's choice for {hardware.name}, M={chosen.micro_batches}, remat "
        f"{chosen.remat}, {collectives}"
    )
    return PlanChoice(
        chosen.strategy, chosen.micro_batches, chosen.remat, note, chosen.hierarchical, chosen.prefetch
    )


def choose_plan(
    model: LlamaConfig, cluster: Cluster, hardware: ClusterConfig | None, config: TrainConfig
) -> PlanChoice:
    """`config.strategy` for `cluster`: `auto` asks the partitioner, anything else is resolved as given."""
    if config.strategy == "auto":
        return auto_plan(model, cluster, hardware, config)
    note = config.strategy if "=" not in config.strategy else "given"
    return PlanChoice(resolve(config.strategy, cluster), config.micro_batches, config.remat, note)


def _path_name(path: tuple[Any, ...]) -> str:
    return "/".join(map(str, path))


def describe_plan(trainer: Trainer) -> list[str]:
    """The plan as printed lines: mesh, placements, batch split, precision, replicated leaves, gathering."""
    plan, layout, params = trainer.plan, trainer.layout, trainer.program.params
    held = grad_dtype(plan.micro_batches, plan.precision.reduce_dtype)
    grads = "fp32 accumulation" if accumulates(plan.micro_batches) else held
    dtype = {"params": plan.precision.param_dtype, "grads": grads, "opt_state": "fp32"}
    what = {
        "params": f"P  ({dtype['params']})",
        "grads": f"G  ({dtype['grads']}, reduced in {plan.precision.reduce_dtype})",
        "opt_state": "OS (fp32 master + optimizer state)",
    }
    mesh = " x ".join(f"{name}={size}" for name, size in layout.mesh.shape.items())
    lines = [f"strategy    {plan.strategy}", f"mesh        {mesh} (inter-node axes first)"]
    for comp in COMPONENTS:
        axes = layout.axes(comp)
        lines.append(
            f"  {what[comp]:<44} {getattr(plan.strategy, comp)} over ({', '.join(axes) or 'replicated'})"
        )
    kept = "; first layer kept for the step" if plan.keep_first_layer and plan.micro_batches > 1 else ""
    lines.append(
        f"precision   {plan.precision.name}; remat {plan.remat}; micro-batches {plan.micro_batches}{kept}"
    )
    sizes = {p: math.prod(leaf.shape) for p, leaf in params.leaves.items()}
    lines.append(f"parameters  {sum(sizes.values()):,} in {len(sizes)} leaves")
    replicated = params.replicated()
    if max(layout.size(layout.axes(c)) for c in COMPONENTS) == 1:
        lines.append("replicated  every leaf (the strategy shards nothing)")
    elif replicated:
        names = ", ".join(_path_name(p) for p in replicated[:4]) + (" ..." if len(replicated) > 4 else "")
        count = sum(sizes[p] for p in replicated)
        lines.append(f"replicated  {len(replicated)} leaves ({count:,} parameters) whole everywhere: {names}")
    else:
        lines.append("replicated  none")
    padding = params.padding()
    if padding:
        lines.append(f"padded      {padding}")
    per_layer = [p for p in sizes if params.per_layer(p)]
    if not layout.axes("params"):
        lines.append("gathering   none: P is replicated, every device holds all of it")
    elif params.stacks or params.blocks:
        units = dict.fromkeys((*params.stacks, *params.blocks))
        lines.append(
            f"gathering   per layer in {', '.join(_path_name(s) for s in units)} "
            f"({sum(sizes[p] for p in per_layer):,} parameters); the other {len(sizes) - len(per_layer)} "
            "leaves whole once per step"
        )
    else:
        lines.append(
            "gathering   whole tree: no layers found in the model, so every step gathers all of P at once "
            "instead of one layer at a time"
        )
    return lines


def model_flops_per_token(model: LlamaConfig, seq_len: int) -> float:
    """Model FLOPs per token, as the time model counts them (`Workload.flops_per_token`)."""
    return llama_workload(model, seq_len).flops_per_token()


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with linear warmup and cosine decay to 10% of the peak."""
    decay = max(config.decay_steps or config.steps, config.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, decay, end_value=config.learning_rate / 10
    )
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=config.adam_eps, weight_decay=config.weight_decay),
    )


def make_evaluator(trainer: Trainer) -> Callable[[TrainState, Any], jax.Array]:
    """Held-out loss: forward only, gathering P per layer as the step does."""
    return trainer.evaluate


# ---- the loop -----------------------------------------------------------------------------------------


class Preemption:
    """SIGTERM as a request to save and stop; every process stops at the same step.

    One process: a Python handler sets a flag. Several processes: JAX's preemption service (started by
    `jax.distributed.initialize`) already catches SIGTERM and agrees on a step with the others.
    """

    def __init__(self) -> None:
        """Install the handler (one process only; the previous handler is restored by `close`)."""
        self.requested = False
        self.multiprocess = jax.process_count() > 1
        self._previous: Any = None
        # Python handlers can only be installed from the main thread.
        if not self.multiprocess and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step`."""
        if self.multiprocess:
            self.requested = self.requested or multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def close(self) -> None:
        """Put back the SIGTERM handler that was there before."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


@dataclasses.dataclass
class TrainResult:
    """What a run did: losses by step, held-out losses by step, the final state and trainer."""

    losses: dict[int, float]
    eval_losses: dict[int, float]
    state: TrainState
    trainer: Trainer
    run_dir: Path
    preempted: bool


@dataclasses.dataclass
class _Setup:
    """A run ready to step: the trainer, its state, the data and where the run's files go."""

    config: TrainConfig
    model: LlamaConfig
    corpus: data_lib.Corpus
    trainer: Trainer
    state: TrainState
    data_seed: np.ndarray
    position: int
    run_dir: Path
    checkpoints: Checkpointer
    hardware: ClusterConfig | None
    plan_note: str
    """Where the strategy came from (a preset, given, the partitioner)."""
    origin: str
    """A fresh start, or the checkpoint resumed from."""

    def meta(self) -> dict[str, Any]:
        """What a checkpoint records beside the arrays."""
        cluster = self.trainer.plan.cluster
        return {
            "model": dataclasses.asdict(self.model),
            "strategy": str(self.trainer.plan.strategy),
            "cluster": f"{cluster.nodes}x{cluster.devices_per_node}",
            "data": self.corpus.source,
            "data_position": self.position,
        }


def _run_dir(template: str) -> Path:
    if "{time}" not in template:
        return Path(template)
    stamp = int(time.time())
    if jax.process_count() > 1:
        stamp = int(multihost_utils.broadcast_one_to_all(np.int64(stamp)))
    return Path(template.format(time=time.strftime("%Y%m%d-%H%M%S", time.localtime(stamp))))


def _read_inputs(config: TrainConfig) -> tuple[data_lib.Corpus, LlamaConfig]:
    """The corpus and model config, checked against each other before anything is written."""
    corpus = data_lib.load_corpus(config.data, config.held_out_every, config.data_dtype)
    model = LlamaConfig.from_yaml(config_files.find("models", config.model, ConfigError))
    if corpus.vocab_size is not None and corpus.vocab_size > model.vocab_size:
        raise ConfigError(
            f"the data has {corpus.vocab_size} token ids but {config.model} a vocabulary of "
            f"{model.vocab_size}; use a model with vocab_size >= {corpus.vocab_size}"
        )
    if corpus.largest_token >= model.vocab_size:
        raise data_lib.DataError(
            f"the data ({corpus.source}) holds token id {corpus.largest_token}, outside the vocabulary of "
            f"{model.vocab_size} of {config.model}; use a model with vocab_size > {corpus.largest_token}, "
            f"or check the token dtype (data_dtype {config.data_dtype})"
        )
    if config.seq_len > model.max_seq_len:
        raise ConfigError(f"seq_len {config.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
    data_lib.check_fits(corpus.train, config.seq_len, "training")
    data_lib.check_fits(corpus.held_out, config.seq_len, "held-out")
    return corpus, model


def setup(config: TrainConfig, devices: Sequence[jax.Device] | None = None) -> _Setup:
    """Read the inputs, build the plan and trainer, and initialise or restore the state."""
    corpus, model_config = _read_inputs(config)
    run_dir = _run_dir(config.run_dir)
    checkpoints = Checkpointer(run_dir / CHECKPOINT_DIR, keep=config.keep_checkpoints)
    try:
        return _setup(config, corpus, model_config, run_dir, checkpoints, devices)
    except BaseException:
        # Orbax's manager runs a background event loop: close it here, or the interpreter's exit
        # prints "Event loop is closed" tracebacks after the error.
        checkpoints.close()
        raise


def _setup(
    config: TrainConfig,
    corpus: data_lib.Corpus,
    model_config: LlamaConfig,
    run_dir: Path,
    checkpoints: Checkpointer,
    devices: Sequence[jax.Device] | None,
) -> _Setup:
    if config.resume:
        checkpoints.read_meta()  # no checkpoint, or unreadable metadata: fail before any work
    elif checkpoints.steps():
        raise CheckpointError(
            f"{checkpoints.directory} already holds checkpoints (steps {checkpoints.steps()}); pass "
            "--resume to continue that run, or choose another --run-dir"
        )
    devices = list(devices if devices is not None else jax.devices())
    cluster, hardware = choose_cluster(config.cluster, devices)
    choice = choose_plan(model_config, cluster, hardware, config)
    plan = Plan(
        cluster, choice.strategy, choice.micro_batches, precision=config.precision, remat=choice.remat,
        hierarchical=choice.hierarchical, prefetch=choice.prefetch, keep_first_layer=config.keep_first_layer,
        memory_limit=None if hardware is None else hardware.memory_limit,
    )  # fmt: skip
    model = Llama(model_config)
    trainer = Trainer(plan, model, make_optimizer(config), make_loss_fn(model), devices=devices)
    example = np.zeros((config.global_batch, config.seq_len), np.int32)
    trainer.check_batch({"inputs": example})

    init_key, data_key = jax.random.split(jax.random.key(config.seed))
    if config.resume:
        trainer.setup(init_key, example)
        restored = checkpoints.restore(trainer, model=dataclasses.asdict(model_config))
        state, data_seed, position = restored.state, restored.rng, int(restored.meta["data_position"])
        origin = (
            f"resumed at step {int(state.step)}, saved under {restored.meta.get('strategy')} on "
            f"{restored.meta.get('cluster')}"
        )
    elif config.init_from:
        trainer.setup(init_key, example)
        try:
            state = trainer.state_from_params(read_params(config.init_from))
        except ValueError as error:
            raise ConfigError(f"init_from {config.init_from}: {error}") from None
        data_seed, position = np.asarray(jax.random.key_data(data_key)), 0
        origin = f"fresh start from the parameters in {config.init_from}"
    else:
        state = trainer.init(init_key, example)
        data_seed, position, origin = np.asarray(jax.random.key_data(data_key)), 0, "fresh start"
    return _Setup(
        config,
        model_config,
        corpus,
        trainer,
        state,
        data_seed,
        position,
        run_dir,
        checkpoints,
        hardware,
        choice.note,
        origin,
    )


def _header(run: _Setup) -> list[str]:
    config, model, trainer = run.config, run.model, run.trainer
    cluster, devices = trainer.plan.cluster, trainer.layout.mesh.devices.flat
    per_device = config.global_batch // (cluster.num_devices * trainer.plan.micro_batches)
    lines = [
        "amsp-jax train",
        f"devices     {cluster.num_devices} x {devices[0].platform} in {jax.process_count()} process(es); "
        f"cluster {cluster.nodes} nodes x {cluster.devices_per_node} ({cluster.name})",
        f"model       llama {config.model}: dim {model.dim}, {model.n_layers} layers, {model.n_heads} heads, "
        f"vocab {model.vocab_size}",
    ]
    for line in describe_plan(trainer):
        lines.append(f"{line}  [{run.plan_note}]" if line.startswith("strategy") else line)
    lines += [
        f"batch       {config.global_batch} sequences x {config.seq_len} tokens per step; {per_device} "
        "sequence(s) per device and micro-batch",
        f"data        {run.corpus.describe()}",
        f"run         {run.run_dir} ({run.origin}); eval every {config.eval_every}, "
        f"checkpoint every {config.checkpoint_every} (keep {config.keep_checkpoints})",
    ]
    if run.hardware:
        peak = run.hardware.peak_flops
        lines.append(f"MFU         against {run.hardware.name}'s peak of {peak:.3g} FLOP/s per device")
    else:
        lines.append("MFU         n/a (no cluster config gives the peak FLOP/s)")
    return lines


def train(
    config: TrainConfig, devices: Sequence[jax.Device] | None = None, out: TextIO | None = None
) -> TrainResult:
    """Run `config` to `config.steps` on `devices` (default: all); see the module docstring."""
    run = setup(config, devices)
    primary = is_primary()
    out = out or sys.stdout
    for line in _header(run):
        if primary:
            print(line, file=out, flush=True)
    try:
        losses, eval_losses, preempted = _loop(run, primary, out)
        saved = run.checkpoints.steps()  # on every process: opening Orbax's manager is collective
    finally:
        run.checkpoints.close()
    if primary and losses:
        first, last = min(losses), max(losses)
        summary = (
            f"loss        first {losses[first]:.4f} (step {first}) -> last {losses[last]:.4f} (step {last})"
        )
        if eval_losses:
            summary += f"; held-out {eval_losses[max(eval_losses)]:.4f} (step {max(eval_losses)})"
        print(summary, file=out)
        print(
            f"files       {run.checkpoints.directory} (steps {saved}), {run.run_dir / METRICS_FILE}",
            file=out,
            flush=True,
        )
    return TrainResult(losses, eval_losses, run.state, run.trainer, run.run_dir, preempted)


def _loop(run: _Setup, primary: bool, out: TextIO) -> tuple[dict[int, float], dict[int, float], bool]:
    """Step from the state's step to `config.steps`: metrics, evaluation, checkpoints, SIGTERM."""
    config, trainer = run.config, run.trainer
    start = int(run.state.step)
    losses: dict[int, float] = {}
    eval_losses: dict[int, float] = {}
    if start >= config.steps:
        if primary:
            print(f"already at step {start} >= steps {config.steps}; nothing to do", file=out)
        return losses, eval_losses, False

    evaluate = make_evaluator(trainer)
    held_out = data_lib.eval_batches(
        run.corpus.held_out, config.eval_batches, config.global_batch, config.seq_len
    )
    tokens_per_step = config.global_batch * config.seq_len
    flops_per_token = model_flops_per_token(run.model, config.seq_len)
    peak = run.hardware.peak_flops * trainer.plan.cluster.num_devices if run.hardware else None
    if primary:
        run.run_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = (run.run_dir / METRICS_FILE).open("a") if primary else None
    bar = tqdm(
        total=config.steps, initial=start, disable=not (config.progress and primary), dynamic_ncols=True
    )
    clock = {"step": start, "time": time.perf_counter()}
    bad = {"run": 0, "total": 0}

    def log(record: dict[str, Any]) -> None:
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

    def record(step: int, metrics: dict[str, jax.Array]) -> None:
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        # The step skips its update exactly when one of these is not finite (`Trainer` docstring).
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        bad["total"] += skipped
        bad["run"] = bad["run"] + 1 if skipped else 0
        now = time.perf_counter()
        # The first step of a process includes compilation: no rate for it.
        rate = (
            tokens_per_step * (step - clock["step"]) / (now - clock["time"])
            if clock["step"] > start
            else None
        )
        clock.update(step=step, time=now)
        mfu = rate * flops_per_token / peak if rate and peak else None
        losses[step] = loss
        log(
            {
                "step": step,
                # JSON has no NaN or infinity: a non-finite value is written as null.
                "loss": loss if math.isfinite(loss) else None,
                "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
                "skipped": skipped,
                "skipped_total": bad["total"],
                "tokens_per_s": rate,
                "mfu": mfu,
                "time": time.time(),
            }
        )
        speed = f"{rate:,.0f} tok/s" if rate else "compiling"
        skips = f", {bad['total']} skipped" if bad["total"] else ""
        bar.set_postfix_str(
            f"loss {loss:.4f}, {speed}, MFU " + (f"{mfu:.1%}" if mfu else "n/a") + skips, refresh=False
        )
        bar.update(step - bar.n)
        if skipped and primary:
            bar.write(
                f"step {step}: loss {loss} / gradient norm {grad_norm} not finite; update skipped "
                f"({bad['run']} in a row, stop at {config.stop_after_bad_steps})",
                file=out,
            )
        if bad["run"] >= config.stop_after_bad_steps:
            run.checkpoints.wait()
            saved = run.checkpoints.steps()
            newest = f"step {saved[-1]} in {run.checkpoints.directory}" if saved else "none saved yet"
            raise DivergedError(
                f"the loss or gradient norm was not finite for {bad['run']} steps in a row (steps "
                f"{step - bad['run'] + 1}-{step}), each skipped, so training stopped; the newest "
                f"checkpoint ({newest}) holds the last good state: resume from it with a lower "
                "learning_rate or grad_clip, or check the data of those steps"
            )

    def run_eval(step: int) -> None:
        loss = float(np.mean([float(evaluate(run.state, batch)) for batch in held_out]))
        eval_losses[step] = loss
        log({"step": step, "eval_loss": loss})
        if primary:
            bar.write(f"step {step}: held-out loss {loss:.4f}", file=out)
        clock["time"] = time.perf_counter()

    preemption = Preemption()
    pending: tuple[int, dict[str, jax.Array]] | None = None
    preempted = False
    try:
        for step in range(start + 1, config.steps + 1):
            batch = data_lib.train_batch(
                run.corpus.train, run.position, config.global_batch, config.seq_len, run.data_seed
            )
            data_lib.check_vocab(batch, run.model.vocab_size)
            run.state, metrics = trainer.step(run.state, batch)
            run.position += 1
            # The previous step's metrics are read only now, so the host never waits on the step in flight.
            if pending is not None:
                record(*pending)
            pending = (step, metrics)
            preempted = preemption.reached(step)
            if step % config.eval_every == 0 or step == config.steps:
                record(*pending)
                pending = None
                run_eval(step)
            if step % config.checkpoint_every == 0 or step == config.steps or preempted:
                run.checkpoints.save(trainer, run.state, run.data_seed, run.meta())
            if preempted:
                if primary:
                    bar.write(
                        f"SIGTERM: saved step {step} to {run.checkpoints.directory}; stopping", file=out
                    )
                break
        if pending is not None:
            record(*pending)
    finally:
        bar.close()
        preemption.close()
        if metrics_file is not None:
            metrics_file.close()
    return losses, eval_losses, preempted
