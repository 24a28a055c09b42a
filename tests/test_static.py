"""The code is linted (ruff) and type-checked (mypy) as part of the test command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> list[str]:
    exe = Path(sys.executable).parent / name
    if exe.exists():
        return [str(exe)]
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; install the dev extras: pip install -e '.[dev]'")
    return [found]


def test_ruff_finds_nothing() -> None:
    proc = subprocess.run([*_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def stage_package(into: Path) -> Path:
    """The installed layout as links: ``planner/`` with ``runtime`` and ``models`` inside it, as
    pyproject's package-dir maps them (mypy runs no import hooks, so it cannot see the editable
    install's mapping, and would read every ``planner.runtime`` import as a missing module)."""
    staged = into / "planner"
    staged.mkdir()
    for entry in (ROOT / "planner").iterdir():
        if entry.name != "__pycache__":
            (staged / entry.name).symlink_to(entry)
    for folder in ("runtime", "models"):
        (staged / folder).symlink_to(ROOT / folder)
    return staged


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    stage_package(tmp_path)
    proc = subprocess.run([*_tool("mypy"), "--config-file", str(ROOT / "pyproject.toml"), "planner"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Success" in proc.stdout and "source files" in proc.stdout


# What the runtime may load of the planner: the plan and the types it is made of (its search
# configuration with the hardware profile, the mesh and the families' meshes it validates against,
# layouts, bucket sizes, byte units), the traced graph its nodes name and the tracer that makes it
# again on each rank, and CDP's stage cut and clock (what runs when: the planner prices them, the
# runtime follows them). Not the search, the solvers, the pricing or the rules.
RUNTIME_CONTRACT = frozenset({
    "planner", "planner.plan", "planner.config", "planner.hardware", "planner.mesh", "planner.schemes", "planner.schemes.tp",
    "planner.layout", "planner.buckets", "planner.units", "planner.ir", "planner.trace", "planner.stages", "planner.cdp_clock",
})


def test_the_runtime_loads_of_the_planner_only_the_plan_and_what_it_is_made_of() -> None:
    """Every runtime module's imports of planner modules (deferred ones included, read from the
    source), and what importing all of them loads (in a fresh interpreter: the package's names
    load on first use, planner/__init__.py), are within RUNTIME_CONTRACT."""
    import ast

    named: dict[str, set[str]] = {}
    for path in sorted((ROOT / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for module in modules:
                if module.startswith("planner") and not module.startswith(("planner.runtime", "planner.models")):
                    named.setdefault(module, set()).add(path.name)
    assert set(named) <= RUNTIME_CONTRACT, {m: sorted(files) for m, files in named.items() if m not in RUNTIME_CONTRACT}
    names = [f"planner.runtime.{p.stem}" for p in sorted((ROOT / "runtime").glob("*.py")) if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for name in {names!r}: importlib.import_module(name)\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('planner') and not m.startswith(('planner.runtime', 'planner.models')))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(proc.stdout.split())
    assert loaded <= RUNTIME_CONTRACT, sorted(loaded - RUNTIME_CONTRACT)


def _names_of(setting: str, module: str, path: Path) -> list[int]:
    """Lines of ``path`` whose code (not docstrings or comments) names ``setting``: as a string, an
    attribute, a keyword, a declared field, or by importing from ``module``."""
    import ast

    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    lines = []
    for node in ast.walk(tree):
        if ((isinstance(node, ast.Constant) and node.value == setting and id(node) not in docstrings)
                or (isinstance(node, ast.Attribute) and node.attr == setting)
                or (isinstance(node, ast.keyword) and node.arg == setting)
                or (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == setting)
                or (isinstance(node, ast.ImportFrom) and (node.module or "").endswith(module))):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_recomputation_is_named_only_by_its_scheme_the_registry_the_search_config_and_the_plan() -> None:
    """The design's proof (planner/schemes/registry.py): activation recomputation, a searched
    dimension with its own pricing, flags, report column, explain lines and runtime, is named by
    code in three files beside its own modules (the registry's entry, SearchConfig's field, the
    plan's field) and by the runtime's compile step, which runs its runtime half. Everything else
    reaches it through the scheme protocol (planner/schemes/base.py) or the sum's vocabulary of
    recomputed segments (Problem.segment_of)."""
    own = {"planner/schemes/recompute.py", "runtime/recompute.py"}
    allowed = {"planner/schemes/registry.py", "planner/config.py", "planner/plan.py", "runtime/compile.py"}
    found = {}
    for folder in ("planner", "runtime"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            lines = _names_of("recompute", "schemes.recompute", path)
            if lines and where not in own:
                found[where] = lines
    assert set(found) <= allowed, f"recompute is named outside its scheme, the registry, SearchConfig and the plan: {found}"
    assert set(found) == allowed, f"the scan finds what it must (a scan that finds nothing proves nothing): {found}"
