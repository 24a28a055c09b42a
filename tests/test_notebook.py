"""examples/tradeoff.ipynb runs top to bottom without a GPU (outputs go to a temporary copy)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the dev extra (nbformat, nbclient, ipykernel) runs the notebook")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "tradeoff.ipynb"


def test_tradeoff_notebook_runs_and_saves_the_knee_plan(tmp_path: Path) -> None:
    copy = tmp_path / NOTEBOOK.name
    shutil.copy(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)
    # the kernel runs in tmp_path: the saved plan lands there, never in the repository
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    nbformat.write(nb, copy)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) >= 2, "the front plot and the 64-vs-128 plot"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "Time/memory front" in text and "knee" in text
    assert (tmp_path / "plan_knee.json").stat().st_size > 0
