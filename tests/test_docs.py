"""Every command and code block of README.md and docs/ runs as written.

Each markdown file is one test: its ```bash / ```sh / ```console commands and its ```python blocks run
in document order in a scratch directory that links the repository's `configs/` and `examples/`, so a
block may read what an earlier one of the same file wrote (a run directory, a checkpoint). Each shell
command runs in bash of its own, with `amsp-jax` as `sys.executable -m amsp_jax.cli` and `python` as
this interpreter; the CLI sizes the simulated CPU platform from its flags, as it does for a user.
Consecutive python blocks run in one subprocess (one JAX start), each in a fresh namespace, with 8
simulated CPU devices (tests/conftest.py's setting, inherited through the environment). Every command
and block must exit 0 and print neither `MISMATCH` nor a traceback; a file's failures are reported
together.

Three commands are recognised and not run: `make demo` and `make test` (`make test` is what runs this
test, and `make demo` trains 300 steps of the `demo` config, which the training guide runs for 2), and
`pip install ...` (it would change the environment under test). The commands of tests/doc_commands.py's
`RUN_BY` run once, as written, in the test named there, which checks what they write. Every other
command runs here; long ones are shortened with flags in the docs themselves. Fences in ```text,
```yaml or ```json are shown, not run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_commands import ROOT, RUN_BY, SHELL, blocks, documented, run_by, shell_commands

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = (*SHELL, "python")
# Fences shown and not run: configs, program output, and text that is not a command.
SHOWN = ("text", "yaml", "json")
NOT_RUN = re.compile(r"^\s*(make (demo|test)\b|pip install\b)")
BAD_OUTPUT = ("MISMATCH", "Traceback")
TIMEOUT_S = 600

PYTHON_RUNNER = """
import json, sys, traceback
failed = []
for label, code in json.loads(sys.stdin.read()):
    print(f"--- {label}", flush=True)
    try:
        exec(compile(code, label, "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        failed.append(label)
    sys.stdout.flush()
sys.exit(f"failed: {failed}" if failed else 0)
"""


SHELL_PRELUDE = (
    "set -euo pipefail\n"
    'amsp-jax() { "$DOCS_PYTHON" -m amsp_jax.cli "$@"; }\n'
    'python() { "$DOCS_PYTHON" "$@"; }\n'
)


def shell_script(command: str, runner: str | None = None) -> str:
    """One command as a bash script; a command that is not run, or that the test `runner` runs, becomes
    a no-op that names it."""
    if NOT_RUN.match(command):
        command = f": not run by the docs test: {shlex.quote(command.splitlines()[0])}"
    elif runner:
        command = f": run as written by {runner}: {shlex.quote(command.splitlines()[0])}"
    return SHELL_PRELUDE + command + "\n"


def environment(for_shell: bool) -> dict[str, str]:
    env = dict(os.environ, DOCS_PYTHON=sys.executable, PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if for_shell:  # the commands size the CPU platform from their own flags, as they do for a user
        flags = env.get("XLA_FLAGS", "").split()
        env["XLA_FLAGS"] = " ".join(f for f in flags if "xla_force_host_platform_device_count" not in f)
    return env


def segments(path: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    """What runs, in document order: ("shell", [(label, script)]) per command, and consecutive python
    blocks as one ("python", [(label, code), ...]); a label names the file and line."""
    name = path.relative_to(ROOT)
    found: list[tuple[str, list[tuple[str, str]]]] = []
    for language, line, text in blocks(path):
        if language in SHELL:
            for offset, command in shell_commands(language, text):
                script = shell_script(command, run_by(str(name), command))
                found.append(("shell", [(f"{name}:{line + 1 + offset}", script)]))
        elif language == "python":
            if found and found[-1][0] == "python":
                found[-1][1].append((f"{name}:{line}", text))
            else:
                found.append(("python", [(f"{name}:{line}", text)]))
    return found


def run_segment(kind: str, items: list[tuple[str, str]], cwd: Path) -> str | None:
    """Run one segment; what went wrong, or None."""
    if kind == "shell":
        ((label, script),) = items
        command, stdin = ["bash", "-c", script], None
    else:
        label = ", ".join(label for label, _ in items)
        command, stdin = [sys.executable, "-c", PYTHON_RUNNER], json.dumps(items)
    result = subprocess.run(
        command,
        input=stdin,
        cwd=cwd,
        env=environment(kind == "shell"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    problems = [f"exit code {result.returncode}"] if result.returncode else []
    problems += [f"printed {bad}" for bad in BAD_OUTPUT if bad in output]
    return f"{label}: {', '.join(problems)}\n{output[-4000:]}" if problems else None


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move the detail into docs/"


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_block_is_run_or_shown(path):
    """A fence without a language, or with one this test neither runs nor lists as shown, would be
    skipped silently."""
    for language, line, _ in blocks(path):
        assert language in RUN + SHOWN, f"{path.name}:{line}: fence language {language!r}; use {RUN + SHOWN}"


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_links_resolve(path):
    """Relative links (to results files, other pages, sources) name files that exist."""
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if not re.match(r"[a-z]+:", target):
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)}: broken link {target}"


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_blocks_run(path, tmp_path):
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    failures = [f for kind, items in segments(path) if (f := run_segment(kind, items, tmp_path))]
    assert not failures, "\n\n".join(failures)


def test_commands_are_found(tmp_path):
    """The parser the test runs on: continuation lines joined, comments and console output left out;
    make and pip lines are not run (here `make test` would fail: there is no Makefile in the
    directory)."""
    console = "$ amsp-jax plan --model tiny \\\n      --nodes 2\noutput line\n\n$ make demo\n"
    expected = [(0, "amsp-jax plan --model tiny \\\n      --nodes 2"), (4, "make demo")]
    assert shell_commands("console", console) == expected
    bash = "# a comment\nmake test   # the suite\npip install 'amsp-jax[cuda]'\necho ok\n"
    assert [n for n, _ in shell_commands("bash", bash)] == [1, 2, 3]
    for _, command in shell_commands("bash", bash):
        result = subprocess.run(
            ["bash", "-c", shell_script(command)], cwd=tmp_path, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


def test_every_name_the_docs_give_exists():
    """`amsp_jax.x.y` in the prose names a module or an attribute of one (dotted names the docs teach)."""
    import importlib

    missing = []
    for path in DOCS:
        for name in sorted(set(re.findall(r"\bamsp_jax(?:\.[A-Za-z_]\w*)+", path.read_text()))):
            parts = name.split(".")
            for split in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:split]))
                except ImportError:
                    continue
                for attribute in parts[split:]:
                    obj = getattr(obj, attribute, None)
                break
            if obj is None:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_every_command_left_to_another_test_is_in_its_document_and_that_test_exists():
    for (document, start), test in RUN_BY.items():
        assert documented(document, start), (document, start)
        file, name = test.split("::")
        assert f"def {name}(" in (ROOT / file).read_text(), f"{test} does not exist"
