"""How long `amsp-jax profile` takes on this host, and how much memory: wall and CPU seconds and the peak
resident memory of the profile run as a child process, by default and with `--thorough`.

    python -m benchmarks.profile_time [--thorough] [--devices 8]

writes `benchmarks/results/profile_time_cpu<cores>_<yyyymmdd-hhmm>.md` (`results_file`): the command of
each run, its time by part (the profile's own summary line) and the host's load average, since on a
shared host the wall time is the other processes' as much as the profile's and the CPU seconds are the
comparable figure. With `--thorough` it also sets the default profile's fitted memory passes beside the
thorough one's (`fit_agreement`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from amsp_jax.core.backend import DEVICE_COUNT_FLAG, cpu_flags
from benchmarks import results_file


def profile_run(devices: int, thorough: bool, out: Path) -> dict[str, object]:
    """One `amsp-jax profile` in a child process: its command, wall and CPU seconds, peak memory, and
    the summary lines it printed; the profile is written to `out`."""
    argv = ["profile", "--out", str(out), "--no-progress", *(["--thorough"] if thorough else [])]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG))
    env["XLA_FLAGS"] = cpu_flags(flags, devices)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout:
        child = subprocess.Popen([sys.executable, "-m", "amsp_jax.cli", *argv], env=env, stdout=stdout)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own CPU time and peak memory
        wall = time.perf_counter() - start
        stdout.seek(0)
        printed = stdout.read()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"profile failed:\n{printed[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    lines = [line for line in printed.splitlines() if line.startswith(("amsp-jax profile:", "  "))]
    return {
        "command": "amsp-jax " + " ".join(a if a != str(out) else out.name for a in argv),
        "wall": wall, "cpu": cpu, "peak_gib": usage.ru_maxrss / 2**20, "load": (load, os.getloadavg()[0]),
        "lines": lines,
    }  # fmt: skip


def fit_agreement(default: Path, thorough: Path) -> list[str]:
    """A table of the fitted memory passes of the default profile beside `--thorough`'s, each with the
    default's over the thorough one's (empty where either wrote none)."""
    import yaml

    fitted = [yaml.safe_load(path.read_text()).get("memory_passes") for path in (default, thorough)]
    if not all(fitted):
        return []
    rows = [
        f"| {key} | {fitted[0][key]:.4g} | {fitted[1][key]:.4g} | "
        + (f"{fitted[0][key] / fitted[1][key]:.2f} |" if fitted[1][key] else "- |")
        for key in fitted[1]
    ]
    return [
        "Fitted memory passes, the default profile's beside `--thorough`'s (`memory_passes`):",
        "",
        "| number | default | --thorough | ratio |",
        "|---|---|---|---|",
        *rows,
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8, as 2 x 4)")
    parser.add_argument("--thorough", action="store_true", help="also time `amsp-jax profile --thorough`")
    parser.add_argument("--out-dir", default=str(results_file.RESULTS))
    args = parser.parse_args()
    # The header names the devices this process's JAX sees: as many as the profiles ran on.
    os.environ["XLA_FLAGS"] = cpu_flags("", args.devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    runs = []
    cores = os.cpu_count()
    stem = results_file.dated_stem(args.out_dir, "profile_time", f"cpu{cores}")
    for thorough in (False, True) if args.thorough else (False,):
        # Each profile is kept beside the results file: what the time bought.
        out = stem.with_suffix(".thorough.yaml" if thorough else ".yaml")
        runs.append(profile_run(args.devices, thorough, out))
        run = runs[-1]
        print(run["command"], f"{run['wall']:.0f} s wall, {run['cpu']:.0f} s CPU", flush=True)
    lines = [
        results_file.header(f"`amsp-jax profile`: time and peak memory, {args.devices} CPU devices").rstrip(),
        "",
        f"Each run is a child process with {args.devices} simulated CPU devices on this {cores}-core host; "
        "CPU seconds count every thread (user + system); peak memory is the child's largest resident set. "
        "Load average: the host's 1-minute load at the start and the end of the run (other processes "
        "share the cores, so the wall time is theirs as much as the profile's).",
        "",
        "| command | wall s | CPU s | peak memory GiB | load average |",
        "|---|---|---|---|---|",
        *(
            f"| `{r['command']}` | {r['wall']:.0f} | {r['cpu']:.0f} | {r['peak_gib']:.2f} | "
            f"{r['load'][0]:.1f} → {r['load'][1]:.1f} |"
            for r in runs
        ),
        "",
        "What each run printed (its parts' wall seconds):",
        "",
        "```text",
        *(line for r in runs for line in r["lines"]),
        "```",
        "",
    ]
    if args.thorough:
        lines += fit_agreement(stem.with_suffix(".yaml"), stem.with_suffix(".thorough.yaml"))
    path = stem.with_suffix(".md")
    path.write_text("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
