"""Runs the phases of a case in fresh worker processes and collects every rank's result.

One case is one story: train+save+control (build side), then resume with upstream, then
resume with the build, all against one ``torch_dist`` checkpoint kept under ``/dev/shm`` when
it fits (else a temporary directory) and deleted after the case. Each phase is one launch on
the layout's ranks (:func:`.launch.worker_command`: a plain process on one rank,
``torch.distributed.run`` on several); every rank writes its own result, and
:func:`.summary.summarize_case` turns them into the case's report entry.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, cast

from benchmarks.resume_benchmark.cases import BenchmarkCase
from benchmarks.resume_benchmark.launch import (
    RANK_LINE_PREFIX,
    RANK_LINE_PREFIX_ENV,
    ParallelLayout,
    rank_result_path,
    worker_command,
)
from benchmarks.resume_benchmark.results import (
    PROGRESS_MARKER,
    WorkerResult,
    progress,
    read_json,
    write_json,
)
from benchmarks.resume_benchmark.sides import Side, worker_environment
from benchmarks.resume_benchmark.summary import RESUME_SIDES, summarize_case

#: Package directory that workers import ``benchmarks.resume_benchmark`` from.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
REPO_ROOT = PACKAGE_ROOT.parent

#: Log lines from workers that the driver echoes besides progress lines.
_ECHO_SUBSTRINGS = ("state_adoption", "Traceback", "Error:", "FAILED")

#: Log lines shown per rank (and of the launcher itself) when a phase fails.
_FAILURE_TAIL_LINES = 25

#: Checkpoint bytes per model parameter (BF16 weights + FP32 main params + two FP32 moments),
#: with headroom; used to decide whether /dev/shm can hold the checkpoint.
_CHECKPOINT_BYTES_PER_PARAM = 16

#: A rank's result file as read (a :class:`~.results.WorkerResult` for train/resume).
Result = dict[str, Any]


@dataclass(frozen=True)
class PhaseOutcome:
    """What one phase launch left behind: exit status, every rank's result (None: no file)."""

    returncode: int
    results: tuple[Result | None, ...]
    log: Path
    seconds: float

    @property
    def ok(self) -> bool:
        """Exit status 0 and a result from every rank."""
        return self.returncode == 0 and all(r is not None for r in self.results)

    def results_or_errors(self) -> list[Result]:
        """Every rank's result; a rank without one gets an ``error`` record naming the log."""
        return [
            result
            or {
                "error": f"rank {rank}: worker exited {self.returncode} without a result "
                f"(see {self.log})"
            }
            for rank, result in enumerate(self.results)
        ]


class Workspace:
    """Logs, specs and results of one run, plus the import shim workers start from.

    Workers run with the shim directory as working directory: it holds only a link to the
    ``benchmarks`` package, so ``python -m benchmarks.resume_benchmark.worker`` finds the
    benchmark while the repository's own ``megatron/`` sources never shadow a side's
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
    """Copy the worker's output to its log; echo progress lines and problems to stdout."""
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
    phase: str,
    name: str,
    spec: Mapping[str, Any] | None,
    timeout_s: float,
    nproc: int = 1,
    command: list[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> PhaseOutcome:
    """Run ``worker --phase phase`` (or ``command``) for ``side`` on ``nproc`` ranks; wait, log,
    read results. ``env`` is added to the side's worker environment.

    The launch runs in its own session and is killed as a group after ``timeout_s``.
    """
    result_path = workspace.path(f"{name}.result.json")
    log_path = workspace.path(f"{name}.log")
    rank_paths = [rank_result_path(result_path, r) for r in range(nproc)]
    for path in rank_paths:
        path.unlink(missing_ok=True)
    spec_path = None
    if spec is not None:
        spec_path = workspace.path(f"{name}.spec.json")
        write_json(spec_path, spec)
    if command is None:
        command = worker_command(sys.executable, phase, result_path, spec_path, nproc)
    started = time.perf_counter()
    with log_path.open("w") as log:
        log.write(f"# side {side.label}: {side.source}\n# {' '.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(
            command,
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
        except BaseException:  # e.g. Ctrl-C: the worker's own session would outlive the driver
            _kill_group(proc)
            raise
        pump.join(timeout=30)
    seconds = time.perf_counter() - started
    results = tuple(read_json(p) if p.is_file() else None for p in rank_paths)
    return PhaseOutcome(returncode, results, log_path, seconds)


#: Seconds a launcher gets to terminate its ranks before its process group is killed.
_TERMINATE_GRACE_S = 20.0


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Stop the worker and everything it started, a launcher's ranks too.

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


def checkpoint_root(requested: Path | None, case: BenchmarkCase) -> Path:
    """``requested``, else ``/dev/shm`` when it exists and has room, else the temp directory."""
    if requested is not None:
        requested.mkdir(parents=True, exist_ok=True)
        return requested
    shm = Path("/dev/shm")
    needed = _CHECKPOINT_BYTES_PER_PARAM * case.size.approx_parameter_count(case.moe)
    if shm.is_dir():
        try:
            if shutil.disk_usage(shm).free > 1.25 * needed:
                return shm
        except OSError:
            pass
    return Path(tempfile.gettempdir())


def check_side_import(outcome: PhaseOutcome, side: Side, expected_file: str | None) -> None:
    """Raise if any rank imported ``megatron.core`` from another file than the side's probe."""
    if expected_file is None:
        return
    for rank, result in enumerate(outcome.results):
        got = ((result or {}).get("megatron_core") or {}).get("file")
        if got is not None and got != expected_file:
            raise RuntimeError(
                f"{side.label} worker rank {rank} imported megatron.core from {got}, "
                f"expected {expected_file}"
            )


@dataclass(frozen=True)
class CaseRun:
    """What every phase of one case needs besides the case itself."""

    workspace: Workspace
    sides: Mapping[str, Side]
    expected_files: Mapping[str, str | None]
    layout: ParallelLayout
    checkpoint_root: Path | None
    timeout_s: float


def _phase(
    run: CaseRun, label: str, phase: str, name: str, spec: Mapping[str, Any]
) -> PhaseOutcome:
    """One phase of one side on the layout's ranks, with progress and failure reporting."""
    nproc = run.layout.phase_nproc(phase)
    ranks = f"{nproc} rank{'s' if nproc > 1 else ''}"
    progress(f"{name}: {phase} ({label} side, fresh process, {ranks})")
    outcome = run_phase(run.workspace, run.sides[label], phase, name, spec, run.timeout_s, nproc)
    check_side_import(outcome, run.sides[label], run.expected_files[label])
    if not outcome.ok:
        report_failure(outcome, f"{name} ({label} side, {ranks})")
    progress(f"{name}: {phase} ({label} side, {ranks}) finished in {outcome.seconds:.1f} s")
    return outcome


def run_case(run: CaseRun, case: BenchmarkCase) -> dict[str, Any]:
    """Train+save+control, resume upstream, resume build; return the case's report entry."""
    root = checkpoint_root(run.checkpoint_root, case)
    holder = Path(tempfile.mkdtemp(prefix=f"resume-benchmark-{case.name}-", dir=root))
    spec = {
        "case": case.to_json(),
        "checkpoint_dir": str(holder / "checkpoint"),
        "parallel": run.layout.to_json(),
    }
    resumed: dict[str, list[WorkerResult | None]] = {}
    try:
        progress(f"{case.name}: checkpoint under {holder}")
        control = _phase(run, "build", "train", f"{case.name}.control", {**spec, "side": "control"})
        saved = all((r or {}).get("save", {}).get("ok") for r in control.results)
        if control.ok and saved:
            for label in RESUME_SIDES:
                name = f"{case.name}.resume-{label}"
                outcome = _phase(run, label, "resume", name, {**spec, "side": label})
                resumed[label] = [cast(WorkerResult, r) for r in outcome.results_or_errors()]
        controls = [cast(WorkerResult | None, r) for r in control.results]
        entry = summarize_case(case, run.layout, controls, resumed)
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    entry["logs"] = str(run.workspace.root)
    return entry
