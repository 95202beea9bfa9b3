"""A CPU mesh's train step under XLA:CPU's library-fusion settings: what jaxlib does by default, YNNPACK
for dots only (what amsp_jax runs its CPU meshes with, `amsp_jax.core.backend.cpu_flags`) and no YNNPACK.

    python -m benchmarks.cpu_fusions [--model 30m] [--strategy zero2] [--micro-batches 2]
        [--remat full] [--devices 8] [--rounds 3] [--steps 3]

XLA reads its flags once per process, so each setting runs in a child process of its own, in rounds
over the settings so that a slow spell of the host falls on all of them alike. Each child compiles the
step of `benchmarks.plan_vs_measured`'s model (mixed precision), runs it once untimed and times
`--steps` steps; the median over all rounds is reported, with the child's CPU seconds per wall second.
Writes benchmarks/results/cpu_fusions_cpu<devices>_<date>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from amsp_jax.core.backend import CPU_LIBRARY_FUSIONS, DEVICE_COUNT_FLAG
from benchmarks import results_file

SETTINGS = {
    "jaxlib's default": "",
    "YNNPACK for dots only (amsp_jax)": CPU_LIBRARY_FUSIONS,
    "no YNNPACK": CPU_LIBRARY_FUSIONS.split("=")[0] + "=",
}


def child(args: argparse.Namespace) -> None:
    """Time the step in this process (its XLA flags set by the parent) and print one JSON line."""
    import jax

    import amsp_jax as aj

    flags = os.environ["XLA_FLAGS"]  # the parent's setting, which importing plan_vs_measured would change
    from benchmarks.plan_vs_measured import MODELS, Llama, make_batch, make_loss_fn, optimizer

    os.environ["XLA_FLAGS"] = flags

    config, seq_len = MODELS[args.model]
    cluster = aj.Cluster(1, args.devices, "cpu-sim") if args.devices < 8 else aj.Cluster(2, 4, "cpu-sim")
    plan = aj.Plan(cluster, aj.resolve(args.strategy, cluster), args.micro_batches, precision="mixed",
                   remat=args.remat)  # fmt: skip
    model = Llama(config)
    host_batch = make_batch(config, cluster.num_devices * args.micro_batches, seq_len)
    trainer = aj.Trainer(plan, model, optimizer(), make_loss_fn(model))
    key = jax.random.key(0)
    trainer.setup(key, host_batch["inputs"])
    batch = trainer.shard_batch(host_batch)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
    step = trainer.compile(trainer.abstract_state(), abstract)
    # What the setting did: the program's YNNPACK fusions, and those of them without a dot.
    text = step.as_text()
    bodies = {m[1]: m[2] for m in re.finditer(r"\n(%\S+) .*?\{\n(.*?)\n\}", text, re.S)}
    fused = re.findall(r"calls=(%[^,\s]+),.*__ynn_fusion", text)
    state = trainer.init(key, host_batch["inputs"])
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times, cpu = [], os.times()
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    used = os.times()
    busy = used.user + used.system - cpu.user - cpu.system
    without_dot = sum(" dot(" not in bodies.get(name, "") for name in fused)
    print(json.dumps({"times": times, "cpu_per_wall": busy / sum(times), "ynn": [len(fused), without_dot]}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="30m")
    parser.add_argument("--strategy", default="zero2")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--devices", type=int, default=8, choices=(1, 2, 4, 8))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=str(results_file.RESULTS))
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    argv = sys.argv[1:]
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, flag in SETTINGS.items():
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            env["XLA_FLAGS"] = f"{DEVICE_COUNT_FLAG}={args.devices} {flag}".strip()
            done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_fusions", *argv, "--child", name],
                                  env=env, capture_output=True, text=True, check=True)  # fmt: skip
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{name}: {statistics.median(runs[name][-1]['times']):.3f} s", flush=True)
    os.environ["XLA_FLAGS"] = f"{DEVICE_COUNT_FLAG}={args.devices}"  # the header names these devices
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    stem = results_file.dated_stem(args.out_dir, "cpu_fusions", f"cpu{args.devices}")
    lines = [
        results_file.header("A CPU mesh's step under XLA:CPU's library-fusion settings").rstrip(),
        "",
        f"{args.model}, {args.strategy}, {args.micro_batches} micro-batch(es), remat {args.remat}, mixed "
        f"precision, {args.devices} simulated device(s); each setting in its own process, {args.rounds} "
        f"rounds of {args.steps} timed steps. Load average at the end: {os.getloadavg()[0]:.2f}.",
        "",
        "| XLA:CPU setting | `XLA_FLAGS` added | YNNPACK fusions (without a dot) | median step (s) | "
        "fastest (s) | CPU s per wall s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, flag in SETTINGS.items():
        times = [t for run in runs[name] for t in run["times"]]
        cpu = statistics.median(run["cpu_per_wall"] for run in runs[name])
        shown = f"`{flag}`" if flag else "(none)"
        fused, without_dot = runs[name][0]["ynn"]
        lines.append(f"| {name} | {shown} | {fused} ({without_dot}) | {statistics.median(times):.3f} | "
                     f"{min(times):.3f} | {cpu:.2f} |")  # fmt: skip
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem.with_suffix('.md')}")


if __name__ == "__main__":
    main()
