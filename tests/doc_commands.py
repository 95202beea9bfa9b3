"""The fenced blocks and shell commands of README.md and docs/, as tests/test_docs.py runs them, and the
documented commands another test runs as written.

A command in `RUN_BY` is run once in `make test`: by the test named, which takes it from its document
(`documented`) and checks what it prints or writes; tests/test_docs.py runs every other command.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)
SHELL = ("bash", "sh", "console")

# (document, how the command starts) -> the test that runs it as written.
RUN_BY = {
    ("README.md", "amsp-jax profile "): (
        "tests/test_plan_cli.py::test_profile_writes_a_cluster_config_the_planner_reads"
    ),
    ("docs/guides/models.md", "amsp-jax plan --model examples/gpt_entry.py:"): (
        "tests/test_plan_any_model.py::test_plan_command_takes_a_python_entry_point"
    ),
}


def blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, line of the opening fence, text) of every fenced block, in order."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        found.append((match[1], text.count("\n", 0, match.start()) + 1, match[2]))
    return found


def shell_commands(language: str, text: str) -> list[tuple[int, str]]:
    """(line within the block, command) of a shell block's commands, continuation lines joined; blank
    and comment lines, and a console block's output lines (those not after a `$ ` prompt or a
    continuation), are left out."""
    commands: list[tuple[int, str]] = []
    continued = False
    for number, line in enumerate(text.splitlines()):
        if continued:
            commands[-1] = (commands[-1][0], commands[-1][1] + "\n" + line)
        elif language == "console" and not line.startswith("$ "):
            continue
        else:
            command = line.removeprefix("$ ") if language == "console" else line
            if not command.strip() or command.lstrip().startswith("#"):
                continue
            commands.append((number, command))
        continued = line.endswith("\\")
    return commands


def run_by(document: str, command: str) -> str | None:
    """The test that runs `command` of `document` (a path relative to the repository), or None."""
    for (doc, start), test in RUN_BY.items():
        if doc == document and command.lstrip().startswith(start):
            return test
    return None


def documented(document: str, start: str) -> list[str]:
    """The arguments after `amsp-jax` of the command of `document` that `RUN_BY` names by `start`."""
    assert (document, start) in RUN_BY, f"add ({document!r}, {start!r}) to RUN_BY in {__file__}"
    for language, _, text in blocks(ROOT / document):
        if language in SHELL:
            for _, command in shell_commands(language, text):
                if command.lstrip().startswith(start):
                    return shlex.split(command.replace("\\\n", " "))[1:]
    raise AssertionError(f"{document} has no command starting {start!r}")
