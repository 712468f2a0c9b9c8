"""Name the tests that kill each given mutant (run from the repository root after a mutmut run).

For every mutant name read from standard input (one a line), runs the given test files in
``mutants/`` with that mutant active (mutmut's trampolines read ``MUTANT_UNDER_TEST``), each
in a process forked from one that has imported torch and megatron-core already, and prints
``mutant<TAB>failed test, failed test, ...`` (``-`` if none fails: the mutant survives these
tests). The installed ``state_adoption`` package must point at
``mutants/megatron/core/optimizer/state_adoption``, as during ``scripts/mutation-test.sh``.

Usage: python scripts/mutation_killers.py TEST_FILE... < mutant-names.txt
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

import megatron.core.optimizer.state_adoption  # noqa: F401  (imported once, before forking)


class _Failures:
    """Collects the node ids of failed tests."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failed.append(report.nodeid)


def killers(mutant: str, test_files: list[str]) -> list[str]:
    """The node ids of the tests in ``test_files`` that fail with ``mutant`` active."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child runs the tests and writes the failures to the pipe
        os.close(read_end)
        os.environ["MUTANT_UNDER_TEST"] = mutant
        failures = _Failures()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        pytest.main(["-q", "-p", "no:randomly", "-p", "no:cacheprovider", *test_files], plugins=[failures])
        with os.fdopen(write_end, "w") as pipe:
            json.dump(sorted(set(failures.failed)), pipe)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return list(json.loads(data)) if data else ["(the test run crashed)"]


def main() -> None:
    """Print each mutant with the tests that kill it."""
    test_files = sys.argv[1:]
    os.chdir("mutants")
    for mutant in (line.strip() for line in sys.stdin):
        if mutant:
            print(f"{mutant}\t{', '.join(killers(mutant, test_files)) or '-'}", flush=True)


if __name__ == "__main__":
    main()
