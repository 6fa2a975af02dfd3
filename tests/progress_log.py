"""A pytest plugin for runs that may be cut off (scripts/gpu_check.sh's ``tests`` phase, in
a device call of limited time): as each test ends, one line with its outcome, its time
(setup, call and teardown) and its name is appended to the file that POSENC_PROGRESS_LOG
names, flushed at once; a skipped or failed test adds the reason's first line.  The file
ends with pytest's own counts when the session finishes.  So a run killed midway leaves
every finished test's result and time (a junit file is written only at the end), and the
terminal (pytest -v) shows the test that was running.

    POSENC_PROGRESS_LOG=tests.txt python -m pytest -p progress_log ...
"""

from __future__ import annotations

import os
import time

_PATH = os.environ.get("POSENC_PROGRESS_LOG")
_open: dict[str, list] = {}  # nodeid -> [seconds so far, outcome, reason]
_start = time.monotonic()


def _write(line: str) -> None:
    with open(_PATH, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message.splitlines()[0] if crash and crash.message else ""


def pytest_sessionstart(session):
    if _PATH:
        _write(f"# outcome  seconds  test (written as each test ends; pid {os.getpid()})")


def pytest_runtest_logreport(report):
    if not _PATH:
        return
    entry = _open.setdefault(report.nodeid, [0.0, "passed", ""])
    entry[0] += report.duration
    if report.outcome != "passed" and entry[1] == "passed":
        entry[1] = "error" if report.failed and report.when != "call" else report.outcome
        entry[2] = _reason(report)
    if report.when == "teardown":
        seconds, outcome, reason = _open.pop(report.nodeid)
        _write(f"{outcome.upper():8s} {seconds:8.2f}  {report.nodeid}"
               + (f"  -- {reason}" if reason else ""))


def pytest_terminal_summary(terminalreporter, exitstatus):
    if not _PATH:
        return
    counts = {k: len(v) for k, v in terminalreporter.stats.items() if k and k != "warnings"}
    _write(f"# {', '.join(f'{n} {k}' for k, n in sorted(counts.items()))} in "
           f"{time.monotonic() - _start:.1f} s (exit status {int(exitstatus)})")
