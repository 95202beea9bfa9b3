"""Config files given as a path or by the name of one that ships with amsp_jax.

The shipped configs are package data, `amsp_jax/configs/{clusters,models,targets,train}/`, read with
`importlib.resources`, so they are there wherever the package is installed (the repository's
`configs` is a link to the same folder). One rule for every kind: a path to an existing file is that
file; anything else is looked up among the shipped configs by its file name, without the folder and
the kind's suffix and with `_` and `-` alike. So `llama-7b`, `llama-7b.yaml` and
`configs/models/llama-7b.yaml` (from any directory where that path does not exist) all name the
shipped LLaMA-7B, and `h100-sxm` names `targets/h100_sxm.txtpb`.
"""

from __future__ import annotations

import atexit
import contextlib
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from amsp_jax.errors import one_line

SUFFIX = {"clusters": ".yaml", "models": ".yaml", "targets": ".txtpb", "train": ".yaml"}
"""The kinds of shipped configs (their folders) and the suffix of their files."""
NOUN = {
    "clusters": "cluster config",
    "models": "model config",
    "targets": "GPU target",
    "train": "train config",
}
"""What the errors call each kind."""

_extracted = contextlib.ExitStack()  # files copied out of a zipped install, removed at exit
atexit.register(_extracted.close)


def _folder(kind: str) -> Traversable:
    if kind not in SUFFIX:
        raise ValueError(f"unknown kind of config {kind!r}; one of {', '.join(SUFFIX)}")
    return resources.files("amsp_jax") / "configs" / kind


def _key(name: str) -> str:
    return name.replace("_", "-")


def shipped(kind: str) -> list[str]:
    """The names of the shipped configs of `kind` (`clusters`, `models`, `targets`, `train`)."""
    folder, suffix = _folder(kind), SUFFIX[kind]
    return sorted(_key(e.name.removesuffix(suffix)) for e in folder.iterdir() if _is_config(e, suffix))


def _is_config(entry: Traversable, suffix: str) -> bool:
    return entry.is_file() and entry.name.endswith(suffix)


def find(kind: str, given: str | Path, error: type[Exception] = FileNotFoundError) -> Path:
    """The file `given` names: an existing file, else the shipped config of that name; else `error`.

    The error says what does not exist and lists the shipped names of `kind`.
    """
    path = Path(given)
    if path.is_file():
        return path
    folder, suffix = _folder(kind), SUFFIX[kind]
    name = path.name.removesuffix(suffix)
    for entry in folder.iterdir():
        if _is_config(entry, suffix) and _key(entry.name.removesuffix(suffix)) == _key(name):
            return entry if isinstance(entry, Path) else _extracted.enter_context(resources.as_file(entry))
    noun = NOUN[kind]
    known = f"known {noun}s: {', '.join(shipped(kind))} (give a {suffix} file or one of these names)"
    if str(given) == name and not path.exists():  # a bare name
        raise error(f"unknown {noun} {name!r}; {known}")
    what = "is not a file" if path.exists() else "does not exist"
    raise error(f"{noun} {given} {what} and no shipped {noun} is named {name!r}; {known}")


def read_mapping(path: Path, error: type[Exception], what: str) -> dict:
    """The settings in the YAML file `path` (an empty file: none); `error`, with one line naming the file,
    when it is not valid YAML or not a mapping (`what` says what it should map, with an example)."""
    try:
        values = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as problem:
        raise error(f"{path} is not valid YAML ({one_line(problem)}); fix its syntax") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise error(f"{path} is not a mapping of {what}")
    return values
