"""The GPU run plan on the CPU: ``scripts/gpu_check.sh``'s two commands fit the calls they
are made for (``first`` within 7 minutes, ``bench`` within 4, each writing at most 8 files,
the summary first), and ``tests/progress_log.py``, the log of the ``tests`` phase, keeps
every finished test's result when the run is killed.  What needs a GPU is in test_cuda.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MAX_FILES = 8  # a call returns at most 8 files
KILL_AFTER = 10  # gpu_check.sh: timeout --kill-after


def _budget(phase: str) -> int:
    """The default of PHASE_BUDGET, the seconds `phases` gives the phase's steps."""
    found = set(re.findall(rf"\$\{{{phase.upper()}_BUDGET:-(\d+)\}}", SCRIPT.read_text()))
    assert len(found) == 1, f"{phase}: defaults {found} in {SCRIPT.name}"
    return int(found.pop())


def test_first_and_bench_fit_their_calls():
    assert _budget("first") + KILL_AFTER <= 7 * 60
    assert _budget("bench") + KILL_AFTER <= 4 * 60
    assert f"--kill-after={KILL_AFTER}" in SCRIPT.read_text()


@pytest.mark.skipif(bool(torch.version.cuda),
                    reason="a CUDA build of torch: `first` would build and run the GPU phases")
def test_first_without_a_cuda_torch_stops_at_preflight_with_the_summary_first(tmp_path):
    run = subprocess.run([str(SCRIPT), "first", str(tmp_path)],
                         env=dict(os.environ, PYTHON=sys.executable), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["first.log", "summary.txt"] and len(files) <= MAX_FILES
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("first: preflight build math tests within")
    assert summary[1].startswith("FAILED  preflight")
    assert summary[2] == "SKIPPED build math tests: preflight failed"
    assert "MISSING a CUDA build of torch" in (tmp_path / "first.log").read_text()
    # printed last as well, so the end of the output holds it
    assert run.stdout.rstrip().endswith(summary[-1])


def pytest_with_progress_log(where, *args: str) -> tuple:
    """pytest run in ``where`` with tests/progress_log.py as a plugin writing
    ``where/tests.txt``: (that path, the finished process)."""
    log = where / "tests.txt"
    env = dict(os.environ, POSENC_PROGRESS_LOG=str(log),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests"),
                                                        os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                          "-p", "progress_log", *args], cwd=where, env=env,
                         capture_output=True, text=True, timeout=120)
    return log, run


def test_the_progress_log_keeps_every_finished_test_when_the_run_is_killed(tmp_path):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(f"""
        import os, signal, pytest

        def test_passes():
            pass

        def test_fails():
            assert 1 == 2, "one is not two"

        def test_skips():
            pytest.skip("no device here")

        @pytest.fixture
        def broken():
            raise RuntimeError("setup broke")

        def test_errors(broken):
            pass

        def test_killed():
            os.kill(os.getpid(), signal.{signal.SIGKILL.name})

        def test_never_reached():
            pass
    """))
    log, run = pytest_with_progress_log(tmp_path, "-v", "test_sample.py")
    assert run.returncode == -signal.SIGKILL, run.stdout + run.stderr
    assert "test_sample.py::test_killed" in run.stdout  # -v: the name as it starts
    lines = log.read_text().splitlines()
    assert lines[0].startswith("# outcome")
    got = {line.split()[2]: (line.split()[0], line) for line in lines[1:]}
    assert [n.split("::")[1] for n in got] == ["test_passes", "test_fails", "test_skips",
                                               "test_errors"]
    outcome = {n.split("::")[1]: o for n, (o, _) in got.items()}
    assert outcome == {"test_passes": "PASSED", "test_fails": "FAILED",
                       "test_skips": "SKIPPED", "test_errors": "ERROR"}
    text = {n.split("::")[1]: line for n, (_, line) in got.items()}
    assert "one is not two" in text["test_fails"]
    assert "no device here" in text["test_skips"]
    assert "setup broke" in text["test_errors"]
    assert all(re.match(r"\w+\s+\d+\.\d\d\s", line) for line in lines[1:])


def test_the_progress_log_ends_with_the_counts(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_a():\n    pass\n\n"
                                          "def test_b():\n    pass\n")
    log, run = pytest_with_progress_log(tmp_path, "-q", "test_two.py")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = log.read_text().splitlines()
    assert len(lines) == 4 and re.match(r"# 2 passed in \d+\.\d s \(exit status 0\)$", lines[-1])
