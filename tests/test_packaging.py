"""The configs ship with the package: a built wheel holds them and `amsp-jax plan` runs from anywhere.

Config arguments take a file path or the name of a shipped config (`amsp_jax.core.config_files`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from amsp_jax.compiled import gpu_target
from amsp_jax.core import config_files
from amsp_jax.cost import hardware as cluster_config
from amsp_jax.models.llama import ModelConfigError, llama_spec
from amsp_jax.planner import make_request
from amsp_jax.run.train import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "amsp_jax" / "configs"


def shipped_files() -> list[str]:
    """The config files in the source tree, as paths inside the package."""
    files = [p for p in CONFIGS.rglob("*") if p.suffix in {".yaml", ".txtpb"}]
    return sorted(str(p.relative_to(REPO).as_posix()) for p in files)


def test_the_repository_configs_folder_is_the_package_one():
    assert (REPO / "configs").resolve() == CONFIGS.resolve()
    assert len(shipped_files()) >= 12


@pytest.mark.parametrize(
    ("kind", "given", "file"),
    [
        ("models", "llama-7b", "models/llama-7b.yaml"),
        ("models", "llama-7b.yaml", "models/llama-7b.yaml"),
        ("models", "configs/models/llama-7b.yaml", "models/llama-7b.yaml"),
        ("models", "/no/such/folder/tiny.yaml", "models/tiny.yaml"),
        ("clusters", "cpu_sim", "clusters/cpu-sim.yaml"),
        ("targets", "h100-sxm", "targets/h100_sxm.txtpb"),
        ("targets", "a100_sxm_80.txtpb", "targets/a100_sxm_80.txtpb"),
        ("train", "demo", "train/demo.yaml"),
    ],
)
def test_a_name_or_a_missing_path_finds_the_shipped_config(kind, given, file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so that `configs/...` does not exist here
    found = config_files.find(kind, given)
    assert found.resolve() == (CONFIGS / file).resolve()


def test_an_existing_file_wins_over_the_shipped_one(tmp_path, monkeypatch):
    own = tmp_path / "configs" / "models" / "llama-7b.yaml"
    own.parent.mkdir(parents=True)
    own.write_text("dim: 64\n")
    monkeypatch.chdir(tmp_path)
    assert config_files.find("models", "configs/models/llama-7b.yaml") == Path("configs/models/llama-7b.yaml")
    assert config_files.find("models", own) == own


def test_unknown_names_list_the_shipped_ones():
    models = ", ".join(config_files.shipped("models"))
    unknown = rf"unknown model config 'llama-8b'; known model configs: {models} \(give a \.yaml file"
    with pytest.raises(ModelConfigError, match=unknown):
        config_files.find("models", "llama-8b", ModelConfigError)
    missing = r"train config /no/x\.yaml does not exist and no shipped .* known train configs: demo"
    with pytest.raises(ConfigError, match=missing):
        load_config("/no/x.yaml")
    with pytest.raises(cluster_config.ClusterConfigError, match=r"cluster configs: a800-8x-ib800, cpu-sim"):
        cluster_config.load("a900")
    with pytest.raises(gpu_target.TargetError, match=r"known GPU targets: a100-sxm-80, h100-sxm"):
        gpu_target.target_config("h200")


def test_every_reader_takes_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cluster_config.load("a800-8x-ib800").name == "a800-8x-ib800"
    assert "H100" in gpu_target.target_config("h100-sxm")
    assert load_config("demo").model.name == "small"
    request = make_request(llama_spec("tiny"), "cpu-sim", seq_len=32, global_batch=8)
    assert request.model.dims.dim == 64


def test_the_wheel_ships_the_configs_and_plan_runs_from_any_directory(tmp_path):
    """Build a wheel from a copy of the sources, install it elsewhere, and plan from an empty directory."""
    source, wheels, site, empty = (tmp_path / name for name in ("source", "wheels", "site", "empty"))
    shutil.copytree(REPO / "amsp_jax", source / "amsp_jax", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert build.returncode == 0, f"{build.stderr[-3000:]}\n(needs setuptools>=70.1: pip install -e '.[dev]')"
    (wheel,) = wheels.glob("amsp_jax-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert sorted(n for n in names if n.startswith("amsp_jax/configs/")) == shipped_files()
        assert all(archive.getinfo(n).file_size > 0 for n in shipped_files())

    install = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]

    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(PYTHONPATH=str(site), JAX_PLATFORMS="cpu")
    code = "import amsp_jax.core.config_files as c; print(c.__file__); print(c.find('models', 'llama-7b'))"
    where = subprocess.run([sys.executable, "-c", code], cwd=empty, env=env, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-3000:]
    module, model = where.stdout.split()
    assert Path(module).is_relative_to(site) and Path(model).is_relative_to(site)

    plan = subprocess.run(
        [sys.executable, "-m", "amsp_jax.cli", "plan", "--model", "configs/models/llama-7b.yaml",
         "--cluster", "a800-8x-ib800", "--nodes", "16", "--seq-len", "4096",
         "--global-batch-tokens", "524288", "--json"],
        cwd=empty, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert json.loads(plan.stdout)["chosen"]["feasible"]
    assert list(empty.iterdir()) == []
