"""pytest plugin for upstream/run-unit-tests.sh: one line per test outcome, written as it happens.

Loaded with ``-p pytest_outcomes`` (upstream/ on PYTHONPATH); it only reports. Each rank appends
to ``$PYTEST_OUTCOMES_DIR/rank<RANK>.tsv``, flushed per line so that a run killed by a hang (a
per-test timeout that ends the process) still leaves everything up to that test:

    START   <nodeid>                       before a test's setup
    <outcome> <nodeid> <seconds>           passed | failed | skipped | error (setup/teardown)
    SESSION_END <exitstatus>               pytest finished normally
"""

import os
from pathlib import Path
from typing import Any, Optional, TextIO

_stream: Optional[TextIO] = None


def _write(*fields: object) -> None:
    if _stream is not None:
        _stream.write("\t".join(str(f) for f in fields) + "\n")
        _stream.flush()


def pytest_configure(config: Any) -> None:
    """Open this rank's file if ``PYTEST_OUTCOMES_DIR`` is set."""
    global _stream
    directory = os.environ.get("PYTEST_OUTCOMES_DIR")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        rank = os.environ.get("RANK", "0")
        _stream = open(Path(directory) / f"rank{rank}.tsv", "a", encoding="utf-8")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """Mark a test as started (the last START without an outcome is the one that hung)."""
    _write("START", nodeid)


def pytest_runtest_logreport(report: Any) -> None:
    """Record the call outcome, a setup skip or failure, and a teardown error."""
    if report.when == "call":
        outcome = "skipped" if report.skipped else report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
    elif report.when == "setup" and not report.passed:
        outcome = "skipped" if report.skipped else "error"
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    else:
        return
    _write(outcome, report.nodeid, f"{report.duration:.2f}")


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """Mark a normal end of the session.

    With ``PYTEST_OUTCOMES_EXIT_ZERO=1`` the process then exits 0 (the status is in the file):
    under torch.distributed.run a rank that exits non-zero (any failed test) makes the launcher
    stop the other ranks, which may still be finishing their last test.
    """
    _write("SESSION_END", int(exitstatus))
    if os.environ.get("PYTEST_OUTCOMES_EXIT_ZERO") == "1":
        session.exitstatus = 0
