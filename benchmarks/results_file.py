"""Where a benchmark run writes: a new file per run, `<theme>_<hardware>_<yyyymmdd-hhmm>.md`, headed by the
command, the jax/jaxlib versions and the hardware, so that earlier results stay readable beside it."""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def hardware() -> str:
    """A short name for the devices JAX runs on: `h100`, `h200x8`, `cpu8` (8 host-platform devices)."""
    import jax

    devices = jax.devices()
    if devices[0].platform == "cpu":
        return f"cpu{len(devices)}"
    kind = re.sub(r"[^a-z0-9]+", "-", devices[0].device_kind.lower()).strip("-")
    kind = next((word for word in kind.split("-") if re.fullmatch(r"[a-z]\d{2,4}[a-z]?", word)), kind)
    return kind if len(devices) == 1 else f"{kind}x{len(devices)}"


def dated_stem(out_dir: str | Path, theme: str, hardware_name: str) -> Path:
    """`out_dir/<theme>_<hardware>_<yyyymmdd-hhmm>` (with `-2`, `-3`, ... where a file of that stem exists),
    for the run's `.md` and any `.json` or `.png` beside it."""
    when = datetime.datetime.now(datetime.UTC)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = f"{theme}_{hardware_name}_{when:%Y%m%d-%H%M}"
    stem, n = base, 1
    while any(out.glob(f"{stem}.*")):
        n += 1
        stem = f"{base}-{n}"
    return out / stem


def header(title: str, argv: list[str] | None = None) -> str:
    """The results file's head: its title, the command that wrote it, versions and hardware."""
    import jax
    import jaxlib

    devices = jax.devices()
    command = " ".join(
        shlex.quote(a) for a in (argv if argv is not None else ["python", "-m", *_module_argv()])
    )
    return "\n".join(
        [
            f"# {title}",
            "",
            f"- Command: `{command}`",
            f"- jax {jax.__version__}, jaxlib {jaxlib.__version__}, Python {platform.python_version()}",
            f"- Hardware: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}); host "
            f"{platform.machine()}, {os.cpu_count()} CPU cores",
            "",
            "",
        ]
    )


def _module_argv() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = spec.name if spec is not None else Path(sys.argv[0]).stem
    return [name, *sys.argv[1:]]
