"""`amsp-jax plan` and `amsp-jax profile` from the command line."""

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
import pytest
import yaml

import amsp_jax as aj
from amsp_jax import cost
from amsp_jax.cli import main, probe
from amsp_jax.cli.rates import PASS_SIZES
from amsp_jax.compiled import audit
from amsp_jax.core import backend
from amsp_jax.cost import host_profile, timing
from amsp_jax.cost.bandwidth import parse_size
from amsp_jax.cost.hardware import FLAT, KINDS, LEVELS, MATMUL_DTYPES, ClusterConfigError, from_dict, load
from amsp_jax.models.llama import Llama, LlamaConfig, make_loss_fn
from tests.doc_commands import documented
from tests.train_helpers import REPO, child_env

# AMSP's setting has no tensor axis (`--tensor 1`); the search over t: tests/test_partitioner.py.
AMSP = [
    "--cluster", "configs/clusters/a800-8x-ib800.yaml", "--nodes", "128",
    "--seq-len", "4096", "--global-batch-tokens", "4194304", "--tensor", "1",
]  # fmt: skip
SMALL_BATCH = ["--seq-len", "64", "--global-batch-tokens", "4096", "--tensor", "1"]
ROW_KEYS = {
    "name", "strategy", "micro_batch_size", "micro_batches", "remat", "step_time_s", "mfu",
    "memory_bytes_per_device", "bytes_per_device", "feasible",
}  # fmt: skip


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# From jaxlib 0.12 the library keeps XLA:CPU's YNNPACK fusions to dots; before, XLA's default stands,
# which fuses elementwise ops and reductions too.
YNNPACK_DOTS_ONLY = tuple(map(int, jaxlib.__version__.split(".")[:2])) >= (0, 12)


def test_plan_json_has_the_chosen_plan_beside_every_preset(capsys):
    out = plan_json(capsys, "--model", "configs/models/llama-7b.yaml", *AMSP)
    assert out["solve_time_s"] > 0  # its speed is measured, not asserted: a loaded machine is slower
    assert out["chosen"]["name"] == "chosen" and out["chosen"]["feasible"]
    names = [row["name"] for row in out["alternatives"]]
    assert names == ["ddp", "zero1", "zero2", "zero3", "mics", "hsdp", "zero++"]
    for row in [out["chosen"], *out["alternatives"]]:
        assert set(row) >= ROW_KEYS
        assert set(row["bytes_per_device"]) == {"intra", "inter"}
    ddp = out["alternatives"][0]
    assert not ddp["feasible"] and "GiB per device" in ddp["reason"]
    best_feasible = max(r["mfu"] for r in out["alternatives"] if r["feasible"])
    assert out["chosen"]["mfu"] >= best_feasible - 1e-9


def test_plan_evaluates_a_given_strategy(capsys):
    out = plan_json(
        capsys, "--model", "configs/models/llama-7b.yaml", *AMSP, "--strategy", "p=1x1,g=8x1,os=8x1"
    )
    assert out["chosen"]["strategy"] == "p=1x1,g=8x1,os=8x1"
    assert out["chosen"]["micro_batch_size"] == 1


def test_plan_prices_the_optimizer_update(capsys):
    args = ["--model", "configs/models/llama-7b.yaml", *AMSP, "--strategy", "p=1x1,g=1x1,os=8x1"]
    adam = plan_json(capsys, *args)["chosen"]
    muon = plan_json(capsys, *args, "--optimizer", "muon")["chosen"]
    assert adam["optimizer_update_bytes_per_device"] == {"intra": 0, "inter": 0}
    moved = muon["optimizer_update_bytes_per_device"]
    assert moved["intra"] > 70e9 and moved["inter"] > 40e9  # Newton–Schulz on split matrices
    for level in ("intra", "inter"):
        assert muon["bytes_per_device"][level] == adam["bytes_per_device"][level] + moved[level]
    assert muon["step_time_s"] > adam["step_time_s"]
    assert main(["plan", *args, "--optimizer", "muon"]) == 0
    assert "of which the muon update's own collectives" in capsys.readouterr().out


def test_plan_table_marks_what_does_not_fit(capsys):
    assert main(["plan", "--model", "configs/models/llama-7b.yaml", *AMSP]) == 0
    out = capsys.readouterr().out
    assert "chosen" in out and "zero++" in out and "! ddp: needs" in out


def test_plan_fails_clearly_when_nothing_fits(capsys):
    args = ["--cluster", "configs/clusters/a800-8x-ib800.yaml", "--nodes", "1", "--seq-len", "4096"]
    code = main(["plan", "--model", "configs/models/llama-65b.yaml", *args, "--global-batch-tokens", "32768"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no plan fits" in err and "GiB per device" in err and "would fit" in err


def test_plan_says_where_and_when_its_cluster_config_was_measured(capsys):
    args = ["--model", "tiny", "--cluster", "cpu-sim", *SMALL_BATCH]
    assert main(["plan", *args]) == 0
    line = "cpu-sim: profiled on a 2-core, 23 GiB x86_64 VM, 2026-11-25 22:51 UTC, jax 0.10.2; not this host"
    assert line in capsys.readouterr().out
    assert plan_json(capsys, *args)["measured_on"]["date"] == "2026-11-25 22:51 UTC"
    # A config from datasheets says nothing of where it was measured.
    assert "profiled on" not in plan_json(capsys, "--model", "llama-7b", *AMSP)


def test_a_cpu_mesh_without_a_profile_of_this_host_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(host_profile.DIRECTORY, str(tmp_path))
    monkeypatch.setenv(host_profile.MODE, "refuse")
    args = ["plan", "--model", "tiny", "--cluster", "host", *SMALL_BATCH]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no profile of this host for 2x4 CPU devices" in err
    assert f"amsp-jax profile --nodes 2 --out {host_profile.path(2, 4)}" in err


def test_a_cpu_mesh_is_priced_with_this_hosts_profile_measured_once(tmp_path, monkeypatch, capsys):
    """Without a cached profile the plan says what it will measure and for how long, runs the profile
    (here a stand-in that writes cpu-sim under this host's name), caches it, and reads it from the cache
    the next time."""
    monkeypatch.setenv(host_profile.DIRECTORY, str(tmp_path))
    monkeypatch.setenv(host_profile.MODE, "measure")
    runs = []

    def profile(command, env, check):
        runs.append(command)
        assert "--xla_force_host_platform_device_count=8" in env["XLA_FLAGS"]
        assert (backend.CPU_LIBRARY_FUSIONS in env["XLA_FLAGS"]) == YNNPACK_DOTS_ONLY
        out = command[command.index("--out") + 1]
        values = yaml.safe_load((REPO / "configs/clusters/cpu-sim.yaml").read_text())
        here = {"host": socket.gethostname(), "cpu": host_profile.cpu_model(), "jax": jax.__version__}
        Path(out).write_text(yaml.safe_dump({**values, "name": "host", "measured_on": here}))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(host_profile.subprocess, "run", profile)
    args = ["plan", "--model", "tiny", "--cluster", "host", *SMALL_BATCH]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "measuring it now (the profile says how long up front), once" in captured.err
    assert "host: profiled on" in captured.out and "not this host" not in captured.out
    assert len(runs) == 1 and host_profile.path(2, 4).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [host_profile.path(2, 4).name]  # no partial file
    assert main(args) == 0
    assert len(runs) == 1 and "measuring" not in capsys.readouterr().err
    # The key names the host, its CPU, the mesh and jax.
    key = host_profile.key(2, 4)
    assert key.startswith(socket.gethostname().lower()) and f"_cpu2x4_jax{jax.__version__}" in key


def test_the_cpu_platform_runs_ynnpack_as_the_library_sets_it_and_profiles_are_keyed_by_it(monkeypatch):
    """From jaxlib 0.12 the CPU mesh runs with YNNPACK fusions for dots only (`backend.cpu_flags`, set
    here by the suite's conftest as by the CLI): the compiled program of a matmul, a norm and a sum has
    no YNNPACK fusion without a dot, where XLA's default (kept before 0.12) fuses the norm and the sum
    too. Another setting is another host profile."""

    def loss(w, x):
        h = (x @ w).astype(jnp.float32)
        return jnp.sum(jnp.tanh(h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)))

    x, w = jnp.ones((64, 256), jnp.bfloat16), jnp.ones((256, 256), jnp.bfloat16)
    text = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
    bodies = {m[1]: m[2] for m in re.finditer(r"\n(%\S+) .*?\{\n(.*?)\n\}", text, re.S)}
    fused = re.findall(r"calls=(%[^,\s]+),.*__ynn_fusion", text)
    dots_only = all(" dot(" in bodies[name] for name in fused)
    assert fused and dots_only == (backend.CPU_LIBRARY_FUSIONS in os.environ["XLA_FLAGS"].split()), fused
    assert dots_only == YNNPACK_DOTS_ONLY
    profile = host_profile.path(2, 4)
    monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_experimental_ynn_fusion_type= {backend.DEVICE_COUNT_FLAG}=8")
    assert host_profile.path(2, 4) != profile


def test_profile_writes_a_cluster_config_the_planner_reads(tmp_path, monkeypatch, capsys):
    # The README's profile command as written (the docs test leaves it to this test), in a scratch dir.
    from amsp_jax.cli import profile

    args = documented("README.md", "amsp-jax profile ")
    monkeypatch.chdir(tmp_path)
    assert main(args) == 0
    config = load(tmp_path / (args[args.index("--out") + 1] if "--out" in args else "measured.yaml"))
    given = args[args.index("--sizes") + 1] if "--sizes" in args else profile.DEFAULT_SIZES
    sizes = tuple(sorted(parse_size(s) for s in given.split(",")))
    assert (config.nodes, config.devices_per_node) == (2, 4)
    for kind in KINDS:
        for level in (*LEVELS, FLAT):
            assert config.bandwidth[(kind, level)].sizes == sizes
    assert config.flat_ring == (8, 2)  # one ring over both simulated nodes
    # Pairs inside a node, the one smaller group that divides a node of 4 (2 nodes: no smaller one).
    assert {key: table.sizes for key, table in config.group_bandwidth.items()} == {
        (kind, "intra", 2): sizes for kind in KINDS
    }
    assert config.peak_flops > 0 and config.collective_min_itemsize == 4
    # The default matmul sweep over tokens, per compute dtype and width: slower over 8 tokens than 2048.
    for dtype in MATMUL_DTYPES:
        tables = config.matmul_rates[dtype].tables
        assert {w: t.sizes for w, t in tables.items()} == dict.fromkeys((128, 512), (8, 128, 2048))
        for width in tables:
            assert config.matmul_rate(8, dtype, width) < config.matmul_rate(2048, dtype, width)
    # Where and when it was measured, which `plan` prints.
    assert config.measured_on["host"] == socket.gethostname()
    assert config.measured_on["jax"] == jax.__version__ and config.measured_on["date"].endswith("UTC")
    assert host_profile.is_this_host(config.measured_on)
    # Memory passes by buffer size: the rows the time model reads.
    assert config.memory_bandwidths.sizes == tuple(float(n) for n in PASS_SIZES)
    assert config.pass_speed(PASS_SIZES[-1]) == pytest.approx(1.0)
    assert config.memory_passes is None and not config.overlap_enabled
    output = capsys.readouterr().out
    said = re.search(r"about (\d+) minutes? for 8 devices on a quiet 2-core host", output)
    assert said and 1 <= int(said.group(1)) <= 3 and "wrote" in output


@pytest.mark.slow
def test_a_profile_of_one_device_invents_no_collective_bandwidth(tmp_path):
    """One device runs no collective: the config it writes has no bandwidth tables (they were a copied
    1 GB/s placeholder), prices a one-device step, and says why when asked to price a collective."""
    out = tmp_path / "one.yaml"
    child = subprocess.run(
        [sys.executable, "-m", "amsp_jax.cli", "profile", "--out", str(out), "--sizes", "4KiB",
         "--repeats", "1", "--no-passes"],
        env=child_env(1), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert "\nbandwidth:" not in out.read_text() and "no collective measured" in child.stdout
    config = load(out)
    assert (config.nodes, config.devices_per_node) == (1, 1) and not config.bandwidth
    assert config.matmul_rate(2048, "float32") > 0
    with pytest.raises(ClusterConfigError, match="describes one device, which runs no collective"):
        config.busbw("all-gather", "intra", 4096)
    # It prices the step of one device, as benchmarks/gpu_step.py does with a GPU's profile.
    model_config = LlamaConfig.from_yaml(REPO / "configs/models/tiny.yaml")
    model = Llama(model_config)
    cluster = aj.Cluster(1, 1)
    trainer = aj.Trainer(aj.Plan(cluster, aj.resolve("ddp", cluster), 2), model, optax.adamw(1e-3),
                         make_loss_fn(model), devices=jax.devices()[:1])  # fmt: skip
    tokens = np.zeros((4, 17), np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    trainer.setup(jax.random.key(0), batch["inputs"])
    workload = audit.workload_of(trainer, batch, cost.llama_dims(model_config))
    assert timing.estimate(trainer.layout, workload, config).time.step_s > 0


def test_a_config_of_several_devices_still_needs_every_bandwidth_table():
    values = yaml.safe_load((REPO / "configs/clusters/cpu-sim.yaml").read_text())
    del values["bandwidth"]["all-gather"]
    with pytest.raises(ClusterConfigError, match=r"no bandwidth table for all-gather\.intra"):
        from_dict(values)
    values.pop("flat_ring")
    values.update(nodes=1, devices_per_node=1, bandwidth={})
    assert not from_dict(values).bandwidth


def _synthetic_probes(seed: int, counts: dict[str, float]) -> list[probe.Probe]:
    """Ten probes of random blocks whose traffic `counts` gives, passed at 3 GB/s with a fixed 5 ms a
    step on top of what compute and collectives take."""
    rng = np.random.default_rng(seed)
    probes = []
    for i in range(10):
        blocks = tuple(rng.uniform(1e6, 1e8, len(probe.BLOCKS)))
        traffic = sum(counts[b] * x for b, x in zip(probe.BLOCKS, blocks, strict=True))
        probes.append(probe.Probe(str(i), blocks, int(traffic), 0.02 * i, 0.02 * i + 0.005 + traffic / 3e9))
    return probes


def test_probe_fit_recovers_pass_counts_bandwidth_and_overhead():
    counts = {"params": 9.0, "grads": 2.5, "opt_state": 22.0, "model": 0.0, "activations": 40.0,
              "accumulator": 2.0}  # fmt: skip
    passes = probe.fit(_synthetic_probes(0, counts))
    for block, count in counts.items():
        assert passes.per_byte[block] == pytest.approx(count, rel=1e-6, abs=1e-6)
    assert passes.bandwidth == pytest.approx(3e9, rel=1e-6)
    assert passes.step_overhead_s == pytest.approx(0.005, rel=1e-6)
    assert passes.traffic_error < 1e-6


def test_probe_fit_counts_the_per_micro_batch_blocks_once_per_micro_batch():
    # Half the probes run two micro-batches: every parameter, the activations and the accumulator are
    # passed twice (`timing.pass_executions`), the placement's blocks once; the one-micro-batch probes
    # have no accumulator. Told the executions, the fit recovers the counts and the bandwidth.
    rng = np.random.default_rng(6)
    counts = {"params": 4.0, "grads": 2.5, "opt_state": 18.0, "model": 6.0, "activations": 30.0,
              "accumulator": 3.0}  # fmt: skip
    probes = []
    for i in range(12):
        micro_batches = 1 + i % 2
        runs = timing.pass_executions(micro_batches)
        sizes = dict(zip(probe.BLOCKS, rng.uniform(1e6, 1e8, len(probe.BLOCKS)), strict=True))
        sizes["accumulator"] *= micro_batches > 1
        traffic = sum(counts[b] * sizes[b] * runs[b] for b in probe.BLOCKS)
        probes.append(probe.Probe(str(i), tuple(sizes.values()), int(traffic), 0.02 * i,
                                  0.02 * i + 0.005 + traffic / 3e9,
                                  executions=tuple(runs[b] for b in probe.BLOCKS)))  # fmt: skip
    passes = probe.fit(probes)
    for block, count in counts.items():
        assert passes.per_byte[block] == pytest.approx(count, rel=1e-6)
    assert passes.bandwidth == pytest.approx(3e9, rel=1e-6)
    # Read as passed once per step, the same probes' traffic does not fit the blocks.
    assert probe.fit([dataclasses.replace(p, executions=()) for p in probes]).traffic_error > 0.05


def test_probe_fit_recovers_what_a_stored_p_costs_beyond_its_bytes():
    # Half the probes cast P from the master (no P block); the others pay a pass over every fp32
    # parameter byte at 1.5 GB/s that their compiled traffic does not show.
    rng = np.random.default_rng(3)
    counts = {"params": 4.0, "grads": 2.5, "opt_state": 18.0, "model": 6.0, "activations": 30.0,
              "accumulator": 3.0}  # fmt: skip
    probes = []
    for i in range(12):
        blocks = list(rng.uniform(1e6, 1e8, len(probe.BLOCKS)))
        blocks[probe.BLOCKS.index("params")] *= i % 2
        traffic = sum(counts[b] * x for b, x in zip(probe.BLOCKS, blocks, strict=True))
        extra = blocks[probe.BLOCKS.index("params")] > 0 and blocks[probe.BLOCKS.index("model")] / 1.5e9
        probes.append(probe.Probe(str(i), tuple(blocks), int(traffic), 0.02 * i,
                                  0.02 * i + 0.005 + traffic / 3e9 + extra))  # fmt: skip
    with backend.predicting_for("0.10.2"):  # an XLA:CPU that converts a stored bf16 P at each use
        passes = probe.fit(probes)
        # Without a stored P among them the probes say nothing of it.
        alone = probe.fit([p for p in probes if not p.blocks[probe.BLOCKS.index("params")]])
    assert passes.bandwidth == pytest.approx(3e9, rel=1e-6)
    assert passes.step_overhead_s == pytest.approx(0.005, rel=1e-6)
    assert passes.stored_params == pytest.approx(2.0, rel=1e-6)  # bytes at 3 GB/s per byte at 1.5
    assert alone.stored_params == 0
    # From jaxlib 0.11 XLA:CPU runs bf16 dots in bf16: a stored P has no conversion to price.
    with backend.predicting_for("0.12.0"):
        assert probe.fit(probes).stored_params == 0


def test_probe_fit_prices_a_split_by_what_it_ran_beyond_its_flat_twin():
    # Four probes also run split: their own flat twin's time, 20 ms less priced collectives, plus their
    # rounded results at 0.5 GB/s; their passes, blocks and traffic are the twin's. They must not move
    # the pass fit, and the split's price is 6 bytes' worth at 3 GB/s per rounded byte.
    counts = {"params": 4.0, "grads": 2.5, "opt_state": 18.0, "model": 6.0, "activations": 30.0,
              "accumulator": 3.0}  # fmt: skip
    probes = _synthetic_probes(5, counts)
    flat_only = probe.fit(probes)
    assert flat_only.split_results == 2.0  # no pair timed: the compiled bytes' read and write
    for twin in probes[:4]:
        rounded = twin.blocks[0] / 10
        split = twin.measured_s - 0.02 + rounded / 0.5e9
        other = twin.predicted_other_s - 0.02
        label = f"{twin.label} split"
        probes.append(probe.Probe(label, twin.blocks, twin.traffic, other, split, rounded, twin.label))
    passes = probe.fit(probes)
    assert passes.bandwidth == pytest.approx(flat_only.bandwidth, rel=1e-9)
    assert passes.step_overhead_s == pytest.approx(flat_only.step_overhead_s, rel=1e-9)
    assert passes.split_results == pytest.approx(6.0, rel=1e-6)


def test_probe_fit_scales_the_priced_compute_by_what_the_probes_ran():
    # The probes' matmuls took 1.4x what the time model priced (the sweep ran on a faster minute): told
    # the compute apart, the fit recovers that factor with the passes' 3 GB/s and the 5 ms fixed cost;
    # taking the compute as exact, the error lands in those two.
    rng = np.random.default_rng(4)
    counts = {"params": 4.0, "grads": 2.5, "opt_state": 18.0, "model": 6.0, "activations": 30.0,
              "accumulator": 3.0}  # fmt: skip
    probes = []
    for i in range(12):
        blocks = tuple(rng.uniform(1e6, 1e8, len(probe.BLOCKS)))
        traffic = sum(counts[b] * x for b, x in zip(probe.BLOCKS, blocks, strict=True))
        compute, collectives = rng.uniform(0.01, 0.5), 0.003 * i
        measured = 0.005 + 1.4 * compute + collectives + traffic / 3e9
        priced = compute + collectives
        probes.append(probe.Probe(str(i), blocks, int(traffic), priced, measured, compute_s=compute))
    passes = probe.fit(probes)
    assert passes.compute_scale == pytest.approx(1.4, rel=1e-6)
    assert passes.bandwidth == pytest.approx(3e9, rel=1e-6)
    assert passes.step_overhead_s == pytest.approx(0.005, rel=1e-6)
    exact = probe.fit([dataclasses.replace(p, compute_s=0.0) for p in probes])
    assert exact.compute_scale == 1.0
    recovered = (exact.bandwidth, exact.step_overhead_s) == (
        pytest.approx(3e9, rel=0.05),
        pytest.approx(0.005, rel=0.05),
    )
    assert not recovered


def test_profile_writes_the_matmul_rates_the_probe_steps_ran_at(tmp_path, monkeypatch):
    # The sweep's rates, divided by the probe fit's compute scale, are what the written config prices.
    from amsp_jax.cli import profile

    swept = {dtype: {128: [(2, 1e9), (64, 4e9)], 512: [(2, 2e9), (64, 8e9)]} for dtype in MATMUL_DTYPES}
    measured = (8e9, 1e9, swept, [(2**20, 1e9)])  # peak, bandwidth, matmul rates, memory passes
    monkeypatch.setattr(profile, "measure_compute", lambda devices, repeats, thorough, tick: measured)
    monkeypatch.setattr(probe, "run_probes", lambda config, repeats, **kwargs: [])
    fitted = probe.Passes(dict.fromkeys(probe.BLOCKS, 1.0), 2e9, 0.004, 0.0, compute_scale=2.0)
    monkeypatch.setattr(probe, "fit", lambda probes, speed: fitted)
    out = tmp_path / "measured.yaml"
    assert main(["profile", "--out", str(out), "--sizes", "4KiB", "--repeats", "1", "--no-progress"]) == 0
    config = load(out)
    for dtype in MATMUL_DTYPES:
        assert config.matmul_rate(64, dtype, 128) == pytest.approx(2e9)
        assert config.matmul_rate(2, dtype, 512) == pytest.approx(1e9)
    assert config.peak_flops == pytest.approx(8e9)  # the sweep's, for MFU
    assert config.pass_bandwidth == pytest.approx(2e9) and config.step_overhead == pytest.approx(0.004)


def test_a_profile_whose_probe_fit_fails_keeps_what_it_measured(tmp_path, monkeypatch, capsys):
    # A busy host can leave the probe steps' times without a trend; the collectives and matmuls
    # measured before them still price a plan, so the profile is written without the passes.
    from amsp_jax.cli import profile

    swept = {dtype: {128: [(2, 1e9), (64, 4e9)]} for dtype in MATMUL_DTYPES}
    monkeypatch.setattr(profile, "measure_compute", lambda *args, **kwargs: (8e9, 1e9, swept, [(2**20, 1e9)]))
    monkeypatch.setattr(probe, "run_probes", lambda config, repeats, **kwargs: [])

    def fails(probes, speed):
        raise probe.ProbeFitError("the probe steps' times do not grow with their memory passes")

    monkeypatch.setattr(probe, "fit", fails)
    out = tmp_path / "measured.yaml"
    assert main(["profile", "--out", str(out), "--sizes", "4KiB", "--repeats", "1", "--no-progress"]) == 0
    config = load(out)
    assert config.memory_passes is None
    assert config.matmul_rate(64, MATMUL_DTYPES[0], 128) == pytest.approx(4e9)
    assert "without the memory passes" in capsys.readouterr().out


def test_probe_fit_gives_no_step_a_negative_fixed_cost():
    # Where compute and collectives are priced above what the probes take, the free fit's intercept is
    # negative; a step has no negative fixed cost, so the passes alone are fitted to what is left.
    rng = np.random.default_rng(1)
    probes = []
    for i in range(10):
        blocks = tuple(rng.uniform(1e6, 1e8, len(probe.BLOCKS)))
        traffic = 20.0 * sum(blocks)
        probes.append(probe.Probe(str(i), blocks, int(traffic), 0.02 * i, 0.02 * i - 0.004 + traffic / 3e9))
    passes = probe.fit(probes)
    assert passes.step_overhead_s == 0
    rest = np.array([p.measured_s - p.predicted_other_s for p in probes])
    priced = np.array([p.traffic for p in probes]) / passes.bandwidth
    # The least-squares line through the origin in relative error: its residuals, each over its
    # step's time, are orthogonal to the passes so weighted.
    weight = 1 / np.array([p.measured_s for p in probes])
    residual, scaled = weight * (rest - priced), weight * priced
    assert abs(float(residual @ scaled)) < 1e-9 * float(scaled @ scaled)
    assert passes.bandwidth > 3e9


def test_probe_fit_prices_a_small_block_at_its_speed():
    # Blocks of up to 1 MiB run 4x faster per byte than larger ones: the fit of steps built so recovers
    # the bandwidth at scale and the fixed cost where it is told the speeds, and not without them.
    rng = np.random.default_rng(2)
    speed = lambda nbytes: 4.0 if nbytes <= 2**20 else 1.0  # noqa: E731
    probes = []
    for i in range(12):
        sizes = rng.choice([2**20, 2**23], len(probe.BLOCKS)) * rng.uniform(0.5, 1.0, len(probe.BLOCKS))
        blocks = tuple(sizes)
        seconds = sum(10.0 * x / speed(x) for x in blocks) / 3e9
        measured = 0.01 * i + 0.002 + seconds
        probes.append(probe.Probe(str(i), blocks, int(10.0 * sum(blocks)), 0.01 * i, measured))
    passes = probe.fit(probes, speed)
    assert passes.bandwidth == pytest.approx(3e9, rel=1e-6)
    assert passes.step_overhead_s == pytest.approx(0.002, rel=1e-6)
    blind = probe.fit(probes)
    recovered = (blind.bandwidth, blind.step_overhead_s) == (
        pytest.approx(3e9, rel=0.05),
        pytest.approx(0.002, rel=0.05),
    )
    assert not recovered
