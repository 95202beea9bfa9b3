"""`amsp-jax train` end to end: inputs, plan, trainer and state, then the loop with its hooks.

`train(config)` runs one run directory: it reads the data (failing before anything is written when
the data is missing), builds the plan for the devices at hand, restores the latest checkpoint when
resuming (onto this plan, whatever plan saved it), prints the plan, then runs the loop
(`amsp_jax.run.loop`) with its hooks (`amsp_jax.run.hooks`): metrics to `metrics.jsonl`, a progress
bar, held-out evaluation every `run.eval_every` steps, an asynchronous save every
`run.checkpoint_every` steps and at the end, a divergence guard, and a save-and-stop on SIGTERM. The
training batch of step i is a pure function of the data RNG and i, so a resumed run sees exactly the
batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from amsp_jax.core import config_files
from amsp_jax.core.plan import Plan
from amsp_jax.core.space import Cluster, Strategy, resolve, zero3
from amsp_jax.cost import hardware as cluster_config
from amsp_jax.cost import host_profile, llama_workload
from amsp_jax.cost.hardware import ClusterConfig
from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn
from amsp_jax.run import data as data_lib
from amsp_jax.run import hooks
from amsp_jax.run.checkpoint import Checkpointer, CheckpointError, param_shapes, read_params
from amsp_jax.run.config import ConfigError, TrainConfig, load_config
from amsp_jax.run.distributed import is_primary
from amsp_jax.run.hooks import DivergedError
from amsp_jax.run.loop import MetricsReader, loop
from amsp_jax.step.batch import check_batch
from amsp_jax.trainer import Trainer, TrainState

__all__ = ["ConfigError", "DivergedError", "TrainConfig", "TrainResult", "load_config", "setup", "train"]

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"


# ---- plan ---------------------------------------------------------------------------------------------


def _hardware(name_or_path: str | Path) -> ClusterConfig:
    try:
        return cluster_config.load(name_or_path)
    except (cluster_config.ClusterConfigError, KeyError) as error:
        raise ConfigError(f"cluster config {name_or_path}: {error}") from None


def choose_cluster(
    spec: str | None, devices: Sequence[jax.Device], auto: bool = True
) -> tuple[Cluster, ClusterConfig | None]:
    """The cluster of `devices`, and its hardware config (bandwidths, peak FLOP/s) where one is known.

    `spec`: a cluster YAML or a shipped config's name (its devices per node, as many nodes as
    the devices fill), `NODESxDEVICES`, `host`, or None: one node per process, except that simulated
    CPU devices of one process stand for two nodes (so inter-node placements can be tried), priced
    with this host's profile (`cost.host_profile`): measured first where none is cached and the
    planner needs it (`auto`: the strategy is the planner's), else only where cached.
    """
    simulated = devices[0].platform == "cpu"
    if spec and spec != host_profile.HOST and not re.fullmatch(r"\d+x\d+", spec.lower()):
        hardware = _hardware(spec)
        per_node = hardware.devices_per_node
        if len(devices) % per_node:
            raise ConfigError(
                f"{len(devices)} devices do not fill nodes of {per_node} ({spec}); use a matching cluster "
                "config or --cluster NODESxDEVICES"
            )
        cluster = Cluster(len(devices) // per_node, per_node, hardware.name)
        return cluster, hardware.with_shape(cluster.nodes)
    if spec and spec != host_profile.HOST:
        nodes, per_node = (int(n) for n in spec.lower().split("x"))
        if nodes * per_node != len(devices):
            raise ConfigError(
                f"cluster {spec} has {nodes * per_node} devices but this run has {len(devices)}; give "
                "NODESxDEVICES that multiply to the device count (or set cpu_devices on the CPU)"
            )
        return Cluster(nodes, per_node, "given"), None
    if simulated and len({d.process_index for d in devices}) == 1 and len(devices) % 2 == 0:
        cluster = Cluster(2, len(devices) // 2, "cpu-sim")
    else:
        cluster = Cluster.detect(devices)
    if not simulated:
        return cluster, None
    if not (auto or spec or host_profile.path(cluster.nodes, cluster.devices_per_node).exists()):
        return cluster, None  # a fixed strategy does not wait minutes for a profile it only prints MFU from
    try:
        return cluster, host_profile.load(cluster.nodes, cluster.devices_per_node)
    except cluster_config.ClusterConfigError as error:
        raise ConfigError(str(error)) from None


def auto_plan(model: LlamaConfig, cluster: Cluster, hardware: ClusterConfig, config: TrainConfig) -> Plan:
    """The planner's plan (strategy, micro-batches, remat, collectives) for the model on `hardware`."""
    from amsp_jax.cost import llama_dims
    from amsp_jax.planner import PlanError, choose

    # The same entry point as for any model, with the config's exact dimensions for the FLOP and
    # activation model.
    example = np.zeros((1, config.data.seq_len), np.int32)
    try:
        return choose(
            Llama(model), (example,), hardware, global_batch=config.data.global_batch, nodes=cluster.nodes,
            precision=config.plan.precision, dims=llama_dims(model),
            keep_first_layer=config.plan.keep_first_layer,
        )  # fmt: skip
    except PlanError as error:
        raise ConfigError(f"strategy auto: {error}") from None


def choose_plan(
    model: LlamaConfig, cluster: Cluster, hardware: ClusterConfig | None, config: TrainConfig
) -> tuple[Plan, str]:
    """The plan of `config.plan` on `cluster`, and a note saying where its strategy came from.

    `auto` asks the planner (ZeRO-3 where no hardware config is known); anything else is resolved
    as given.
    """
    settings = config.plan

    def plan(strategy: Strategy, micro_batches: int, remat: str, **collectives: Any) -> Plan:
        return Plan(
            cluster, strategy, micro_batches, precision=settings.precision, remat=remat,
            keep_first_layer=settings.keep_first_layer,
            memory_limit=None if hardware is None else hardware.memory_limit, **collectives,
        )  # fmt: skip

    if settings.strategy != "auto":
        note = settings.strategy if "=" not in settings.strategy else "given"
        return plan(resolve(settings.strategy, cluster), settings.micro_batches, settings.remat), note
    if hardware is None:
        note = "auto: no hardware config for this cluster (give --cluster, a cluster YAML or name), so zero3"
        return plan(zero3(cluster), settings.micro_batches, settings.remat), note
    chosen = auto_plan(model, cluster, hardware, config)
    collectives = "collectives split at node boundaries" if chosen.hierarchical else "flat collectives"
    note = (
        f"auto: the planner's choice for {hardware.name}, M={chosen.micro_batches}, remat "
        f"{chosen.remat}, {collectives}"
    )
    return plan(
        chosen.strategy, chosen.micro_batches, chosen.remat, hierarchical=chosen.hierarchical,
        prefetch=chosen.prefetch,
    ), note  # fmt: skip


def model_flops_per_token(model: LlamaConfig, seq_len: int) -> float:
    """Model FLOPs per token, as the time model counts them (`Workload.flops_per_token`)."""
    return llama_workload(model, seq_len).flops_per_token()


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with linear warmup and cosine decay to 10% of the peak."""
    opt = config.optimizer
    decay = max(opt.decay_steps or config.run.steps, opt.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, opt.learning_rate, opt.warmup_steps, decay, end_value=opt.learning_rate / 10
    )
    return optax.chain(
        optax.clip_by_global_norm(opt.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=opt.adam_eps, weight_decay=opt.weight_decay),
    )


# ---- set-up -------------------------------------------------------------------------------------------


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
class RunSetup:
    """A run ready to step: the trainer, its state, the data and where the run's files go."""

    config: TrainConfig
    model: LlamaConfig
    corpus: data_lib.Corpus
    trainer: Trainer
    state: TrainState
    data_seed: np.ndarray
    position: int
    """The index of the next training batch."""
    run_dir: Path
    checkpoints: Checkpointer
    hardware: ClusterConfig | None
    plan_note: str
    """Where the strategy came from (a preset, given, the planner)."""
    origin: str
    """A fresh start, or the checkpoint resumed from."""

    def meta(self, data_position: int) -> dict[str, Any]:
        """What a checkpoint records beside the arrays; `data_position`: the index of its next batch."""
        cluster = self.trainer.plan.cluster
        return {
            "model": dataclasses.asdict(self.model),
            "strategy": str(self.trainer.plan.strategy),
            "cluster": f"{cluster.nodes}x{cluster.devices_per_node}",
            "data": self.corpus.source,
            "data_position": data_position,
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
    data = config.data
    corpus = data_lib.load_corpus(data.paths, data.held_out_every, data.dtype)
    name = config.model.name
    model = LlamaConfig.from_yaml(config_files.find("models", name, ConfigError))
    if corpus.vocab_size is not None and corpus.vocab_size > model.vocab_size:
        raise ConfigError(
            f"the data has {corpus.vocab_size} token ids but {name} a vocabulary of "
            f"{model.vocab_size}; use a model with vocab_size >= {corpus.vocab_size}"
        )
    if corpus.largest_token >= model.vocab_size:
        raise data_lib.DataError(
            f"the data ({corpus.source}) holds token id {corpus.largest_token}, outside the vocabulary of "
            f"{model.vocab_size} of {name}; use a model with vocab_size > {corpus.largest_token}, "
            f"or check the token dtype (data.dtype {data.dtype})"
        )
    if data.seq_len > model.max_seq_len:
        raise ConfigError(f"seq_len {data.seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
    data_lib.check_fits(corpus.train, data.seq_len, "training")
    data_lib.check_fits(corpus.held_out, data.seq_len, "held-out")
    return corpus, model


def setup(config: TrainConfig, devices: Sequence[jax.Device] | None = None) -> RunSetup:
    """Read the inputs, build the plan and trainer, and initialise or restore the state."""
    corpus, model_config = _read_inputs(config)
    run_dir = _run_dir(config.run.dir)
    checkpoints = Checkpointer(run_dir / CHECKPOINT_DIR, keep=config.run.keep_checkpoints)
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
) -> RunSetup:
    if config.run.resume:
        checkpoints.read_meta()  # no checkpoint, or unreadable metadata: fail before any work
    elif checkpoints.steps():
        raise CheckpointError(
            f"{checkpoints.directory} already holds checkpoints (steps {checkpoints.steps()}); pass "
            "--resume to continue that run, or choose another --run-dir"
        )
    devices = list(devices if devices is not None else jax.devices())
    cluster, hardware = choose_cluster(config.plan.cluster, devices, config.plan.strategy == "auto")
    plan, note = choose_plan(model_config, cluster, hardware, config)
    model = Llama(model_config)
    trainer = Trainer(plan, model, make_optimizer(config), make_loss_fn(model), devices=devices)
    example = np.zeros((config.data.global_batch, config.data.seq_len), np.int32)
    check_batch(plan, {"inputs": example})
    state, data_seed, position, origin = _initial_state(config, trainer, checkpoints, example, model_config)
    return RunSetup(
        config, model_config, corpus, trainer, state, data_seed, position, run_dir, checkpoints, hardware,
        note, origin,
    )  # fmt: skip


def _initial_state(
    config: TrainConfig, trainer: Trainer, checkpoints: Checkpointer, example: np.ndarray, model: LlamaConfig
) -> tuple[TrainState, np.ndarray, int, str]:
    """The state to start from, the data seed, the next batch's index, and where the state came from."""
    init_key, data_key = jax.random.split(jax.random.key(config.run.seed))
    fresh_seed = np.asarray(jax.random.key_data(data_key))
    if config.run.resume:
        trainer.setup(init_key, example)
        restored = checkpoints.restore(trainer, model=dataclasses.asdict(model))
        origin = (
            f"resumed at step {int(restored.state.step)}, saved under {restored.meta.get('strategy')} on "
            f"{restored.meta.get('cluster')}"
        )
        return restored.state, restored.rng, int(restored.meta["data_position"]), origin
    if config.run.init_from:
        trainer.setup(init_key, example)
        try:
            state = trainer.state_from_params(read_params(config.run.init_from))
        except ValueError as error:
            raise ConfigError(f"init_from {config.run.init_from}: {error}") from None
        return state, fresh_seed, 0, f"fresh start from the parameters in {config.run.init_from}"
    return trainer.init(init_key, example), fresh_seed, 0, "fresh start"


# ---- the run ------------------------------------------------------------------------------------------


def _header(run: RunSetup) -> list[str]:
    config, model, trainer = run.config, run.model, run.trainer
    cluster, devices = trainer.plan.cluster, trainer.layout.mesh.devices.flat
    data_devices = cluster.num_devices // trainer.plan.strategy.tensor  # a tensor group shares its examples
    per_device = config.data.global_batch // (data_devices * trainer.plan.micro_batches)
    count = sum(int(np.prod(shape)) for shape in param_shapes(trainer).values())
    lines = [
        "amsp-jax train",
        f"devices     {cluster.num_devices} x {devices[0].platform} in {jax.process_count()} process(es); "
        f"cluster {cluster.nodes} nodes x {cluster.devices_per_node} ({cluster.name})",
        f"model       llama {config.model.name}: {count:,} parameters, dim {model.dim}, {model.n_layers} "
        f"layers, {model.n_heads} heads, vocab {model.vocab_size}",
    ]
    for line in trainer.describe().splitlines():
        lines.append(f"{line}  [{run.plan_note}]" if line.startswith("plan ") else line)
    run_settings = config.run
    lines += [
        f"batch       {config.data.global_batch} sequences x {config.data.seq_len} tokens per step; "
        f"{per_device} sequence(s) per data-parallel device and micro-batch",
        f"data        {run.corpus.describe()}",
        f"run         {run.run_dir} ({run.origin}); eval every {run_settings.eval_every}, "
        f"checkpoint every {run_settings.checkpoint_every} (keep {run_settings.keep_checkpoints})",
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
    """Run `config` to `config.run.steps` on `devices` (default: all); see the module docstring."""
    run = setup(config, devices)
    primary = is_primary()
    out = out or sys.stdout
    for line in _header(run):
        if primary:
            print(line, file=out, flush=True)
    try:
        losses, eval_losses, preempted = _steps(run, primary, out)
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


def _steps(run: RunSetup, primary: bool, out: TextIO) -> tuple[dict[int, float], dict[int, float], bool]:
    """Step from the state's step to `run.steps`: losses and held-out losses by step, and preemption."""
    config, trainer = run.config, run.trainer
    data, settings = config.data, config.run
    start = int(run.state.step)
    say = hooks.printer(out, primary)
    if start >= settings.steps:
        say(f"already at step {start} >= steps {settings.steps}; nothing to do")
        return {}, {}, False
    if primary:
        run.run_dir.mkdir(parents=True, exist_ok=True)

    def batch_of(step: int) -> dict[str, np.ndarray]:
        index = run.position + step - start - 1
        batch = data_lib.train_batch(run.corpus.train, index, data.global_batch, data.seq_len, run.data_seed)
        data_lib.check_vocab(batch, run.model.vocab_size)
        return batch

    def meta(step: int) -> dict[str, Any]:
        return run.meta(run.position + step - start)

    log = hooks.MetricsLog(run.run_dir / METRICS_FILE if primary else None)
    held_out = data_lib.eval_batches(
        run.corpus.held_out, settings.eval_batches, data.global_batch, data.seq_len
    )
    evaluation = hooks.HeldOutEval(trainer, held_out, settings.eval_every, log, say)
    # In this order: a step is logged before the guard may stop on it, marked preempted before it is saved.
    side_jobs = [
        log,
        hooks.ProgressBar(start, settings.steps, settings.progress and primary),
        hooks.DivergenceGuard(settings.stop_after_bad_steps, run.checkpoints, say),
        evaluation,
        hooks.Preemption(),
        hooks.Checkpoints(run.checkpoints, trainer, run.data_seed, meta, settings.checkpoint_every, say),
    ]
    peak = run.hardware.peak_flops * trainer.plan.cluster.num_devices if run.hardware else None
    reader = MetricsReader(
        start, data.global_batch * data.seq_len, model_flops_per_token(run.model, data.seq_len), peak
    )
    steps = range(start + 1, settings.steps + 1)
    run.state, last = loop(trainer, run.state, steps, batch_of, reader, side_jobs)
    run.position += last.number - start if last else 0
    return log.losses, evaluation.losses, bool(last and last.preempted)
