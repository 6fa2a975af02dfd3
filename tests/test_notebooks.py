"""The notebooks under notebooks/: committed with their outputs, and still running.

Each notebook is executed with nbclient in a kernel of this interpreter (see
notebooks/execute.py: no installed kernel spec is needed and nothing is written to the home
directory).  The committed files must hold the outputs of a complete run, figures included,
so that they read on GitHub, and the same cells must still produce the same kinds of output.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is in requirements-dev.txt; "
                               "install it to test the notebooks")
pytest.importorskip("nbclient", reason="nbclient is in requirements-dev.txt")
pytest.importorskip("ipykernel", reason="ipykernel is in requirements-dev.txt")
pytest.importorskip("matplotlib", reason="matplotlib is in requirements-dev.txt")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
RESULTS_DIR = ROOT / "benchmarks" / "results"
EXPECTED = ("01_position_encodings.ipynb", "02_mrope_qwen_vl.ipynb", "03_benchmarks.ipynb")
MAX_BYTES = 1_500_000
CELL_TIMEOUT_S = 120
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_runner():
    spec = importlib.util.spec_from_file_location("notebook_runner",
                                                  NOTEBOOK_DIR / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runner = _load_runner()
NOTEBOOKS = runner.notebook_paths()


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _pngs(nb) -> list[bytes]:
    return [base64.b64decode(o["data"]["image/png"])
            for c in _code_cells(nb) for o in c.outputs if "image/png" in o.get("data", {})]


def _shape(cell) -> list[str]:
    """What a cell showed, by kind (stdout text, a PNG, a result), ignoring values and
    stderr (warnings depend on the environment)."""
    out = []
    for o in cell.outputs:
        if o.output_type == "stream":
            if o.name == "stdout" and (not out or out[-1] != "stdout"):
                out.append("stdout")
        elif o.output_type in ("display_data", "execute_result"):
            out.append("+".join(sorted(k for k in o.data if k != "text/plain")) or "text")
        else:
            out.append(o.output_type)
    return out


def _has_results() -> bool:
    for path in RESULTS_DIR.glob("*.json"):
        try:
            if isinstance(json.loads(path.read_text()).get("results"), list):
                return True
        except (OSError, ValueError):
            continue
    return False


@pytest.fixture(scope="module")
def jupyter_dirs():
    with runner.private_jupyter_dirs():
        yield


def test_all_notebooks_present():
    assert [p.name for p in NOTEBOOKS] == list(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_with_outputs(path):
    """The committed file is a complete top-to-bottom run with figures and no errors."""
    assert path.stat().st_size < MAX_BYTES, f"{path.name} is {path.stat().st_size} bytes"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    cells = _code_cells(nb)
    assert cells, f"{path.name} has no code cells"
    counts = [c.execution_count for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name}: execution counts {counts}; commit it after one complete run "
        "(make notebooks)")
    errors = [o for c in cells for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} was committed with an error: {errors[0].get('ename')}"
    pngs = _pngs(nb)
    assert pngs, f"{path.name} has no figures; commit it with its outputs (make notebooks)"
    assert all(p.startswith(PNG_MAGIC) for p in pngs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executes(path, jupyter_dirs):
    """The notebook still runs without errors and shows what the committed copy shows."""
    if path.name == "03_benchmarks.ipynb" and not _has_results():
        pytest.skip("no benchmark results under benchmarks/results/ to plot (make bench)")
    committed = nbformat.read(path, as_version=4)
    executed = runner.execute(path, timeout=CELL_TIMEOUT_S)   # raises on a failing cell
    cells = _code_cells(executed)
    assert not [o for c in cells for o in c.outputs if o.output_type == "error"]
    assert _pngs(executed), f"{path.name} drew no figures"
    stale = [i for i, (a, b) in enumerate(zip(_code_cells(committed), cells))
             if _shape(a) != _shape(b)]
    assert not stale, (f"{path.name}: the committed outputs of code cells {stale} differ in "
                       "kind from a fresh run; re-run and commit it (make notebooks)")
