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
