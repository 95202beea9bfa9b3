"""Which subpackage may import which: data flows one way, from the partition space to the command line.

A module's imports of `amsp_jax` (at the top or inside a function) must name only the subpackages its own
may use, so that, for example, the planner never depends on a model, and the cost model never on a
compiled program.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "amsp_jax"

# Lower layers first; each may import the ones listed (and itself).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "core": {"errors"},
    "layers": {"errors", "core"},
    "cost": {"errors", "core", "layers"},
    "planner": {"errors", "core", "cost"},
    "models": {"errors", "core", "layers", "cost"},
    "step": {"errors", "core", "layers", "cost"},
    "compiled": {"errors", "core", "layers", "cost", "step"},
    "trainer": {"errors", "core", "layers", "cost", "step", "compiled"},
    "run": {"errors", "core", "layers", "cost", "planner", "models", "step", "compiled", "trainer"},
    "cli": {"errors", "core", "layers", "cost", "planner", "models", "step", "compiled", "trainer", "run"},
}


def unit_of(module: str) -> str | None:
    """The subpackage (or top-level module) a dotted `amsp_jax...` name belongs to."""
    parts = module.split(".")
    if parts[0] != "amsp_jax" or len(parts) < 2:
        return None
    return parts[1]


def imported_units(source: str) -> set[str]:
    """Every amsp_jax subpackage a module's source imports, anywhere in the module."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "amsp_jax":
                names = [f"amsp_jax.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {unit for unit in map(unit_of, names) if unit is not None}
    return found


def violations(unit: str, source: str) -> set[str]:
    """The subpackages `source` (a module of `unit`) imports but may not."""
    return imported_units(source) - ALLOWED[unit] - {unit}


def modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "__init__.py")


def test_every_module_belongs_to_a_known_subpackage():
    units = {p.relative_to(PACKAGE).with_suffix("").parts[0] for p in modules()}
    assert units <= set(ALLOWED), f"modules outside the layering table: {units - set(ALLOWED)}"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_only_the_subpackages_below_it(path):
    unit = path.relative_to(PACKAGE).with_suffix("").parts[0]
    forbidden = violations(unit, path.read_text())
    assert not forbidden, f"{path.relative_to(PACKAGE)} ({unit}) may not import {sorted(forbidden)}"


def test_the_check_catches_a_forbidden_import():
    # A planner that reaches into a model, at the top or inside a function, or through `from amsp_jax import`.
    assert violations("planner", "from amsp_jax.models.llama import LlamaConfig\n") == {"models"}
    assert violations("cost", "def f():\n    from amsp_jax.compiled import hlo\n") == {"compiled"}
    assert violations("core", "from amsp_jax import trainer\n") == {"trainer"}
    assert violations("planner", "import amsp_jax.cost.timing\nfrom amsp_jax.core import space\n") == set()
