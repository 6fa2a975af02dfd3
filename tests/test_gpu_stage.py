"""The stage of the GPU check, on the CPU: ``scripts/gpu_stage.sh``, the step that
``scripts/gpu_check.sh`` stages its CUDA build with, staging ``make wheel``'s Meson build
(``build/``, the CPU ``_C``) the same way, and ``tests/test_cuda.py`` collected from that
stage as the ``tests`` phase collects it on a GPU machine.  A stage without a module of
the package (the ``posenc_torch.hf`` package once) fails here, not on a lent GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"


def _modules(package_dir: Path) -> list[str]:
    return sorted(p.relative_to(package_dir.parent).as_posix()
                  for p in package_dir.rglob("*.py") if "__pycache__" not in p.parts)


def _on_path(stage: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stage), env.get("PYTHONPATH")]))
    return env


def _collect(env: dict[str, str]) -> subprocess.CompletedProcess:
    """pytest --collect-only of test_cuda.py, from tests/ as gpu_check.sh runs it."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "test_cuda.py"], cwd=ROOT / "tests", env=env, capture_output=True, text=True)


def _collected(run: subprocess.CompletedProcess) -> int:
    m = re.search(r"^(\d+) tests? collected", run.stdout, re.M)
    assert run.returncode == 0 and m, run.stdout[-3000:] + run.stderr[-3000:]
    return int(m.group(1))


@pytest.fixture(scope="module")
def stage(tmp_path_factory) -> Path:
    if not (BUILD / "build.ninja").is_file():
        pytest.fail("no Meson build in build/ to stage: `make wheel` (part of `make build`) "
                    "configures and builds it")
    out = tmp_path_factory.mktemp("gpu-stage")
    run = subprocess.run([str(ROOT / "scripts" / "gpu_stage.sh"), str(BUILD), str(out)],
                         env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def test_the_stage_holds_every_module_of_the_package(stage):
    assert _modules(stage / "posenc_torch") == _modules(ROOT / "posenc_torch")
    assert list((stage / "posenc_torch").glob("_C*.so"))


def test_the_package_and_its_hf_wing_import_from_the_stage(stage):
    run = subprocess.run(
        [sys.executable, "-c", "import posenc_torch, posenc_torch.hf\n"
         "print(posenc_torch.__file__); print(posenc_torch.hf.__file__)"],
        cwd=ROOT / "tests", env=_on_path(stage), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    for where in run.stdout.split():
        assert Path(where).resolve().is_relative_to(stage.resolve()), where


def test_test_cuda_is_collected_from_the_stage_as_from_the_installed_package(stage):
    """Every test of test_cuda.py, as many as from the installed wheel (each then skips
    for the missing GPU, with the reason)."""
    assert _collected(_collect(_on_path(stage))) == _collected(_collect(dict(os.environ)))


def test_a_stage_of_the_top_level_modules_alone_fails_the_collection(stage, tmp_path):
    """What gpu_check.sh staged before (posenc_torch/*.py and _C): collecting test_cuda.py
    from it fails on the missing posenc_torch.hf, as this test's checks would report."""
    old = tmp_path / "posenc_torch"
    old.mkdir()
    for f in (stage / "posenc_torch").iterdir():
        if f.is_file():
            shutil.copy2(f, old / f.name)
    run = _collect(_on_path(tmp_path))
    assert run.returncode != 0
    assert "No module named 'posenc_torch.hf'" in run.stdout + run.stderr
