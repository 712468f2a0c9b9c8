"""Runs one ``pretrain_gpt.py`` launch of a side in fresh processes and collects every rank's
result.

A launch is ``torch.distributed.run`` of :mod:`.megatron_lm_probe` (or a side probe,
:mod:`.side_probe`) with the side's ``PYTHONPATH``, in a session of its own, killed as a group
after its timeout. Its console goes to ``<name>.log`` (progress lines and problems echoed);
every rank writes ``<name>.result.rank<r>.json``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO

from benchmarks.resume_benchmark.results import PROGRESS_MARKER, progress, read_json
from benchmarks.resume_benchmark.sides import Side, worker_environment

#: Package directory that launches import ``benchmarks.resume_benchmark`` from.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
REPO_ROOT = PACKAGE_ROOT.parent

#: Log lines from launches that the driver echoes besides progress lines.
_ECHO_SUBSTRINGS = ("state_adoption", "Traceback", "Error:", "FAILED")

#: Log lines shown per rank (and of the launcher itself) when a launch fails.
_FAILURE_TAIL_LINES = 25

#: How ``torch.distributed.run`` prefixes each console line of a rank, set through the
#: environment (torch 2.11 reads the variable but has no command-line flag for it).
RANK_LINE_PREFIX_ENV: Final = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "}
#: Matches that prefix, or torch's default ``[default<local rank>]:``; group 1 is the rank.
RANK_LINE_PREFIX: Final = re.compile(r"^\[(?:rank|default)(\d+)\]: ?")

#: A rank's result file as read.
Result = dict[str, Any]


def rank_result_path(result_path: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its result: ``X.result.json`` -> ``X.result.rank<r>.json``."""
    return result_path.with_name(f"{result_path.stem}.rank{rank}{result_path.suffix}")


@dataclass(frozen=True)
class PhaseOutcome:
    """What one launch left behind: exit status, every rank's result (None: no file)."""

    returncode: int
    results: tuple[Result | None, ...]
    log: Path
    seconds: float

    @property
    def ok(self) -> bool:
        """Exit status 0 and a result from every rank."""
        return self.returncode == 0 and all(r is not None for r in self.results)


class Workspace:
    """Logs and results of one run, plus the import shim launches start from.

    Launches run with the shim directory as working directory: it holds only a link to the
    ``benchmarks`` package, so ``python -m benchmarks.resume_benchmark.megatron_lm_probe`` finds
    the benchmark while the repository's own ``megatron/`` sources never shadow a side's
    ``megatron-core``.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.shim = root / "import-shim"
        self.shim.mkdir(exist_ok=True)
        link = self.shim / "benchmarks"
        if not link.exists():
            link.symlink_to(PACKAGE_ROOT, target_is_directory=True)

    def path(self, name: str) -> Path:
        """A file path inside the workspace."""
        return self.root / name


def _pump(stream: TextIO, log: TextIO, prefix: str) -> None:
    """Copy the launch's output to its log; echo progress lines and problems to stdout."""
    for line in stream:
        log.write(line)
        log.flush()
        text = line.rstrip("\n")
        if PROGRESS_MARKER in text:
            print(text[text.index(PROGRESS_MARKER) :], flush=True)
        elif any(s in text for s in _ECHO_SUBSTRINGS):
            print(f"{prefix} {text}", flush=True)


def run_phase(
    workspace: Workspace,
    side: Side,
    name: str,
    command: Sequence[str],
    timeout_s: float,
    nproc: int = 1,
    env: Mapping[str, str] | None = None,
) -> PhaseOutcome:
    """Run ``command`` for ``side`` (its ranks write ``<name>.result.rank<r>.json``); wait, log,
    read results. ``env`` is added to the side's environment."""
    result_path = workspace.path(f"{name}.result.json")
    log_path = workspace.path(f"{name}.log")
    rank_paths = [rank_result_path(result_path, r) for r in range(nproc)]
    for path in rank_paths:
        path.unlink(missing_ok=True)
    started = time.perf_counter()
    with log_path.open("w") as log:
        log.write(f"# side {side.label}: {side.source}\n# {' '.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(
            list(command),
            cwd=workspace.shim,
            env={**worker_environment(side, REPO_ROOT), **RANK_LINE_PREFIX_ENV, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        assert proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, f"  [{name}]"), daemon=True)
        pump.start()
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            returncode = proc.wait()
            log.write(f"\n# killed after {timeout_s:.0f} s (--worker-timeout)\n")
        except BaseException:  # e.g. Ctrl-C: the launch's own session would outlive the driver
            _kill_group(proc)
            raise
        pump.join(timeout=30)
    seconds = time.perf_counter() - started
    results = tuple(read_json(p) if p.is_file() else None for p in rank_paths)
    return PhaseOutcome(returncode, results, log_path, seconds)


#: Seconds a launcher gets to terminate its ranks before its process group is killed.
_TERMINATE_GRACE_S = 20.0


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Stop the launch and everything it started, a launcher's ranks too.

    ``torch.distributed.run`` starts every rank in a session of its own, which a signal to the
    launcher's process group does not reach: the launcher is asked to terminate first (it then
    terminates its ranks) and only killed, with its group, if it does not exit in time.
    """
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=_TERMINATE_GRACE_S)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def failure_tail(log_text: str, lines: int = _FAILURE_TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of every rank (by its ``[rank<r>]: `` prefix) and of the rest.

    On one rank that is simply the log's last lines; on several, one rank's traceback cannot
    be pushed out of view by another rank's output.
    """
    groups: dict[str, list[str]] = {}
    for line in log_text.splitlines():
        match = RANK_LINE_PREFIX.match(line)
        groups.setdefault(f"rank {match[1]}" if match else "", []).append(line)
    tail = []
    for key in sorted(groups, key=lambda k: (k != "", len(k), k)):
        if key:
            tail.append(f"--- {key}:")
        tail += groups[key][-lines:]
    return tail


def report_failure(outcome: PhaseOutcome, what: str) -> None:
    """Print that ``what`` failed, which ranks left no result, and the log's tail per rank."""
    missing = [str(r) for r, result in enumerate(outcome.results) if result is None]
    failed = [
        str(r)
        for r, result in enumerate(outcome.results)
        if result is not None and "error" in result
    ]
    progress(
        f"{what} FAILED (exit {outcome.returncode}; ranks without a result: "
        f"{', '.join(missing) or 'none'}; ranks reporting an error: {', '.join(failed) or 'none'}); "
        f"log: {outcome.log}"
    )
    for line in failure_tail(outcome.log.read_text(errors="replace")):
        print(f"    {line}", flush=True)
