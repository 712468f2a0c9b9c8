"""pytest plugin for scripts/device/mlm-unit-tests.sh: every test's outcome, one line as it happens.

Loaded with ``-p mlm_unit_outcomes`` (scripts/device/ on PYTHONPATH); it only records. With
``MLM_UNIT_OUTCOMES=FILE`` set it appends tab-separated lines to FILE, flushed one by one, so a
run that is killed still leaves everything up to the test it was in:

    COLLECTED    <nodeid>              every test pytest collected (after deselection)
    START        <nodeid>              before a test's setup
    <outcome>    <nodeid>  <seconds>   passed | failed | error | skipped | xfailed | xpassed
    COLLECT_ERROR <path>               a module (or other collector) that failed to collect
    COLLECT_SKIP <path>                a module skipped whole (pytest.importorskip, a module skip)
    SESSION_END  <exit status>         pytest finished normally

A test's ``error`` is a failure in its setup or teardown (a teardown error follows the call's
outcome; the worse one counts, see ``final_outcomes`` in the shell script).
"""

import os
from typing import Any, Optional, TextIO

_stream: Optional[TextIO] = None


def _write(*fields: object) -> None:
    if _stream is not None:
        _stream.write("\t".join(str(f) for f in fields) + "\n")
        _stream.flush()


def pytest_configure(config: Any) -> None:
    """Open the outcome file named by ``MLM_UNIT_OUTCOMES``, if set."""
    global _stream
    path = os.environ.get("MLM_UNIT_OUTCOMES")
    if path:
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
    """Mark a normal end of the session."""
    _write("SESSION_END", int(exitstatus))
