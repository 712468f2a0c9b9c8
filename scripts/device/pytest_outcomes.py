"""pytest plugin: every test's outcome, one line as it happens, for the scripts that run
Megatron-LM's unit tests on a GPU machine (scripts/device/mlm-unit-tests.sh and
upstream/run-unit-tests.sh).

Loaded with ``-p pytest_outcomes`` (scripts/device/ on PYTHONPATH); it only records. With
``PYTEST_OUTCOMES=FILE`` set it appends tab-separated lines to FILE (``{rank}`` in it becomes
the process's ``RANK``, 0 without one), flushed one by one, so a run that is killed still leaves
everything up to the test it was in:

    COLLECTED    <nodeid>              every test pytest collected (after deselection)
    START        <nodeid>              before a test's setup
    <outcome>    <nodeid>  <seconds>   passed | failed | error | skipped | xfailed | xpassed
    COLLECT_ERROR <path>               a module (or other collector) that failed to collect
    COLLECT_SKIP <path>                a module skipped whole (pytest.importorskip, a module skip)
    SESSION_END  <exit status>         pytest finished normally

A test's ``error`` is a failure in its setup or teardown (a teardown error follows the call's
outcome; the worse one counts, see ``final_outcomes`` in the shell scripts).

With ``PYTEST_OUTCOMES_EXIT_ZERO=1`` the process exits 0 at the end (the status is in the file):
under torch.distributed.run a rank that exits non-zero (any failed test) makes the launcher stop
the other ranks, which may still be finishing their last test.
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
    """Open the outcome file named by ``PYTEST_OUTCOMES``, if set."""
    global _stream
    template = os.environ.get("PYTEST_OUTCOMES")
    if template:
        path = Path(template.replace("{rank}", os.environ.get("RANK", "0")))
        path.parent.mkdir(parents=True, exist_ok=True)
        _stream = open(path, "a", encoding="utf-8")


def pytest_collectreport(report: Any) -> None:
    """Record a collector (usually a test module) that failed to collect or was skipped whole."""
    if report.failed:
        _write("COLLECT_ERROR", report.nodeid or "<session>")
    elif report.skipped:
        _write("COLLECT_SKIP", report.nodeid or "<session>")


def pytest_collection_finish(session: Any) -> None:
    """Record every test that will run, so that tests a killed run never reached still show."""
    for item in session.items:
        _write("COLLECTED", item.nodeid)


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """Mark a test as started (a START without an outcome is the test a killed run was in)."""
    _write("START", nodeid)


def pytest_runtest_logreport(report: Any) -> None:
    """Record the call's outcome, a setup that skipped or failed, and a teardown error."""
    if report.when == "call":
        outcome = "skipped" if report.skipped else report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
    elif report.when == "setup" and not report.passed:
        outcome = "skipped" if report.skipped else "error"
        if report.skipped and hasattr(report, "wasxfail"):
            outcome = "xfailed"
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    else:
        return
    _write(outcome, report.nodeid, f"{report.duration:.2f}")


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """Mark a normal end of the session (and exit 0 with ``PYTEST_OUTCOMES_EXIT_ZERO=1``)."""
    _write("SESSION_END", int(exitstatus))
    if os.environ.get("PYTEST_OUTCOMES_EXIT_ZERO") == "1":
        session.exitstatus = 0
