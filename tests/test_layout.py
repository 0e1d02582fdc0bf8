"""The code's layout: imports run one way through the layers, nothing imports in a cycle, and the offline commands
start without Ray or torch.

The import graph is read from the source (ast), function-local and TYPE_CHECKING imports included, so an import
hidden inside a function to dodge a cycle still counts as one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("albert_core", "services")

# Highest first: a module may import its own stage's modules and those of any lower layer, never a higher one or a
# sibling stage of its own layer. The package `services` itself holds only RAY_NAMESPACE.
LAYERS = (
    ("services.cli",),
    ("services.demo", "services.experiments", "services.jobs"),
    ("services.train",),
    ("services.eval",),
    ("services.finetune", "services.preprocess"),
    ("services.rundir", "services.data"),
    ("services.cluster",),  # starts Ray, then hands SIGTERM back to the command (services.terminal)
    ("services.terminal",),
    ("services",),
    ("albert_core",),
)
MAX_TOP_LEVEL_MODULES = 5  # services/*.py beside the stage folders


def module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its source (the deepest module each import names)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".") if is_package else name.split(".")[:-1]
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def stage_of(module: str) -> tuple[int, str]:
    """(layer index, stage prefix) of a module: the longest prefix in LAYERS that names it or a package above it."""
    best = None
    for layer, stages in enumerate(LAYERS):
        for stage in stages:
            if (module == stage or module.startswith(stage + ".")) and (best is None or len(stage) > len(best[1])):
                best = (layer, stage)
    assert best is not None, f"{module}: in no layer of LAYERS"
    return best


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_graph_reader_sees_function_local_imports_and_cycles():
    source = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(source) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    # services.cli imports each stage's cli inside no function, services.demo imports services.train.pretrain
    # inside run_demo: both must be seen
    graph = import_graph()
    assert "services.train.pretrain" in graph["services.demo"]
    assert "services.preprocess.cli" in graph["services.cli"]


def test_no_import_cycle_among_the_modules_of_services_and_albert_core():
    assert find_cycle(import_graph()) is None


def test_imports_run_down_the_layers_never_up_or_sideways():
    wrong = []
    for module, targets in import_graph().items():
        layer, stage = stage_of(module)
        for target in targets:
            target_layer, target_stage = stage_of(target)
            if target_stage != stage and target_layer <= layer:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_albert_core_imports_neither_ray_nor_services():
    offenders = []
    for path in (ROOT / "albert_core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("ray", "services")]
    assert offenders == []


def ray_init_calls(path: Path) -> list[int]:
    """The lines of `path` that call ray.init (as `ray.init(...)` or through `from ray import init`)."""
    tree = ast.parse(path.read_text())
    aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "ray"
               for a in n.names if a.name == "init"}  # fmt: skip
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            named = isinstance(f, ast.Name) and f.id in aliases
            if named or (isinstance(f, ast.Attribute) and f.attr == "init" and ast.unparse(f.value) == "ray"):
                lines.append(node.lineno)
    return lines


def test_one_module_of_services_starts_ray():
    """Every command starts Ray through services.cluster.connect (one namespace, loopback unless told otherwise)."""
    callers = {str(p.relative_to(ROOT)) for p in (ROOT / "services").rglob("*.py") if ray_init_calls(p)}
    assert callers == {"services/cluster.py"}


# The names of the test hooks that production modules held: fault injection and example tracing are step callbacks
# the tests install (tests/worker_callbacks.py).
TEST_HOOKS = ("ALBERT_STOP_AFTER_STEP", "ALBERT_TRACE_EXAMPLES", "STOP_ENV", "TRACE_ENV", "SimulatedCrash")


def test_no_test_hook_in_services_or_albert_core():
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in TEST_HOOKS
        if name in path.read_text()
    ]
    assert found == []


def test_services_has_at_most_five_top_level_modules_beside_its_stage_folders():
    top = sorted(p.name for p in (ROOT / "services").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    stages = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file())
    assert stages == ["data", "eval", "experiments", "finetune", "jobs", "preprocess", "rundir", "train"]


def test_albert_core_is_in_rooms_each_saying_what_it_owns():
    """albert_core/ keeps at most its shared files and optim at the top; everything else lives in a domain folder
    whose __init__ is a docstring saying what it owns (and nothing else: importing a room imports no torch)."""
    top = sorted(p.name for p in (ROOT / "albert_core").glob("*.py"))
    assert top == ["__init__.py", "files.py", "optim.py"], top
    rooms = sorted(p.name for p in (ROOT / "albert_core").iterdir() if (p / "__init__.py").is_file())
    assert rooms == ["evaluation", "examples", "finetune", "model", "text"]
    for room in rooms:
        tree = ast.parse((ROOT / "albert_core" / room / "__init__.py").read_text())
        assert ast.get_docstring(tree), f"albert_core/{room}/__init__.py says nothing of what it owns"
        assert len(tree.body) == 1, f"albert_core/{room}/__init__.py holds more than its docstring"


# A process in which `import ray` and `import torch` fail, running `albert ARGS`.
WITHOUT_RAY_AND_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.partition(".")[0] in ("ray", "torch"):
                raise ImportError(f"{name} is not importable in this test")

    sys.meta_path.insert(0, Refuse())
    from services.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def albert_without_ray_and_torch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY_AND_TORCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run directory as a finished run leaves it, written by the ledger alone (no training)."""
    from services.rundir.config import RunConfig
    from services.rundir.ledger import RunLedger

    config = RunConfig.load("tiny", {"run.output_dir": str(tmp_path_factory.mktemp("runs")), "run.name": "r"})
    ledger = RunLedger(config.run_dir, config.run.name, config.to_dict())
    ledger.report(10, {"loss": 3.5})
    ledger.save()
    return config.run_dir


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["status", "RUN"],
        ["eval", "list", "RUN"],
        ["model", "info", "--preset", "albert-base"],
        ["config", "show", "tiny", "--set", "model.overrides.position_bias=none"],
    ],
    ids=lambda args: " ".join(args),
)
def test_offline_commands_run_without_ray_or_torch(args, finished_run):
    done = albert_without_ray_and_torch(*[str(finished_run) if a == "RUN" else a for a in args])
    assert done.returncode == 0, done.stderr
    assert "not importable" not in done.stderr


def test_a_command_that_needs_torch_fails_where_it_is_refused():
    """The harness above refuses for real: a command that needs torch fails under it."""
    done = albert_without_ray_and_torch("convert", "nowhere", "elsewhere")
    assert done.returncode != 0 and "not importable" in done.stderr
