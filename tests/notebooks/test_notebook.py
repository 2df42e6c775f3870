"""notebooks/compare_arms.ipynb executes top to bottom on a tiny real sweep and draws its figures."""

from __future__ import annotations

import nbclient
import nbformat
import pytest

from conftest import REPO

# executes the notebook on a real 4-job sweep (tiny_sweep)
pytestmark = pytest.mark.slow


def test_analysis_notebook_executes_on_a_tiny_sweep(tiny_sweep, monkeypatch):
    monkeypatch.setenv("PRMPPO_RUNS", str(tiny_sweep))  # the kernel inherits the environment
    notebook = nbformat.read(REPO / "notebooks" / "compare_arms.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "4 runs" in text and "arm=prm: seeds [0, 1]" in text and "arm=orm: seeds [0, 1]" in text
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) >= 3  # accuracy, rewards, hacking monitors
    tables = [out["data"]["text/markdown"] for out in outputs if "text/markdown" in out.get("data", {})]
    assert any("PRM - ORM" in table for table in tables)
