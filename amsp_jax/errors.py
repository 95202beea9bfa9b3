"""The error base class of bad input: what the `amsp-jax` commands report as one line, without a traceback."""

from __future__ import annotations

import sys


class AmspError(ValueError):
    """Input that cannot be used as given; the message names the problem and the fix."""


# Errors of the library and of its readers that mean "the input is wrong", by module and class name.
# Looked up in `sys.modules` so that classifying an error never imports a module (Orbax takes a second).
_INPUT_ERRORS = (
    ("amsp_jax.core.space", "StrategyError"),
    ("amsp_jax.planner.request", "PlanError"),
    ("amsp_jax.cost.hardware", "ClusterConfigError"),
    ("amsp_jax.run.checkpoint", "CheckpointError"),
    ("yaml", "YAMLError"),
)


def is_input_error(error: BaseException) -> bool:
    """Whether `error` reports bad input (a message for the user) rather than a bug of the library."""
    if isinstance(error, AmspError | OSError):
        return True
    for module, name in _INPUT_ERRORS:
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None and isinstance(error, kind):
            return True
    return False


def one_line(error: BaseException) -> str:
    """The error's message on one line (YAML parser messages span several)."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if problem and mark is not None:  # a YAML syntax error
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return text or type(error).__name__


def _type_name(kind: str) -> str:
    return {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}[kind]


def check_field_types(cls: type, values: dict[str, object], where: str, error: type[Exception]) -> None:
    """Raise `error` (prefixed `where: `) when a value does not have the type its field of `cls` declares.

    Understands the annotations the config dataclasses use: `int`, `float`, `str`, `bool`, each
    optionally `| None`. An int passes as a float; a bool never passes as a number.
    """
    annotations: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        annotations.update({k: str(v) for k, v in getattr(klass, "__annotations__", {}).items()})
    for key, value in values.items():
        kinds = [k.strip() for k in annotations.get(key, "").split("|")]
        if value is None and "None" in kinds:
            continue
        kind = next((k for k in kinds if k in ("int", "float", "str", "bool")), None)
        if kind is None:
            continue
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, int | float) and not isinstance(value, bool),
            "str": isinstance(value, str),
            "bool": isinstance(value, bool),
        }[kind]
        if not ok:
            raise error(f"{where}: " * bool(where) + f"{key} must be {_type_name(kind)}, got {value!r}")
