"""Runs every phase of every case in a fresh worker process and collects the results.

Per case: train+save+control (build side), then resume with upstream, then resume with the
build, all against one ``torch_dist`` checkpoint kept under ``/dev/shm`` when it fits (else a
temporary directory) and deleted after the case.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from benchmarks.resume_benchmark.cases import BenchmarkCase
from benchmarks.resume_benchmark.launch import rank_result_path, worker_command
from benchmarks.resume_benchmark.results import PROGRESS_MARKER, progress, read_json, write_json
from benchmarks.resume_benchmark.sides import Side, worker_environment
from benchmarks.resume_benchmark.summary import summarize_case

#: Package directory that workers import ``benchmarks.resume_benchmark`` from.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
REPO_ROOT = PACKAGE_ROOT.parent

#: Log lines from workers that the driver echoes besides progress lines.
_ECHO_SUBSTRINGS = ("state_adoption", "Traceback", "Error:")

#: Checkpoint bytes per model parameter (BF16 weights + FP32 main params + two FP32 moments),
#: with headroom; used to decide whether /dev/shm can hold the checkpoint.
_CHECKPOINT_BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class WorkerOutcome:
    """What one worker process (or one ``torchrun`` launch of several ranks) left behind.

    ``result`` is the single process's result, or rank 0's; ``rank_results`` holds every rank's
    result in a multi-rank launch (empty for a single process).
    """

    returncode: int
    result: dict[str, Any] | None
    log: Path
    seconds: float
    rank_results: tuple[dict[str, Any] | None, ...] = ()


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
    for line in stream:
        log.write(line)
        log.flush()
        text = line.rstrip("\n")
        if text.startswith(PROGRESS_MARKER):
            print(text, flush=True)
        elif any(s in text for s in _ECHO_SUBSTRINGS):
            print(f"{prefix} {text}", flush=True)


def run_worker(
    workspace: Workspace,
    side: Side,
    phase: str,
    name: str,
    spec: dict[str, Any] | None,
    timeout_s: float,
    nproc: int | None = None,
) -> WorkerOutcome:
    """Run ``worker --phase phase`` for ``side`` in a fresh process; wait, log, read its result.

    ``nproc`` ``None``: one plain process. Otherwise ``torch.distributed.run`` with ``nproc``
    ranks in a new session (killed as a group on timeout); every rank's result is read.
    """
    result_path = workspace.path(f"{name}.result.json")
    log_path = workspace.path(f"{name}.log")
    rank_paths = [rank_result_path(result_path, r) for r in range(nproc or 0)]
    for path in (result_path, *rank_paths):
        path.unlink(missing_ok=True)
    spec_path = None
    if spec is not None:
        spec_path = workspace.path(f"{name}.spec.json")
        write_json(spec_path, spec)
    command = worker_command(sys.executable, phase, result_path, spec_path, nproc)
    started = time.perf_counter()
    with log_path.open("w") as log:
        log.write(f"# side {side.label}: {side.source}\n# {' '.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(
            command,
            cwd=workspace.shim,
            env=worker_environment(side, REPO_ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=nproc is not None,
        )
        assert proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, f"  [{name}]"), daemon=True)
        pump.start()
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc, group=nproc is not None)
            returncode = proc.wait()
            log.write(f"\n# killed after {timeout_s:.0f} s\n")
        pump.join(timeout=30)
    seconds = time.perf_counter() - started
    if nproc is None:
        result = read_json(result_path) if result_path.is_file() else None
        return WorkerOutcome(returncode, result, log_path, seconds)
    ranks = tuple(read_json(p) if p.is_file() else None for p in rank_paths)
    return WorkerOutcome(returncode, ranks[0], log_path, seconds, ranks)


def _kill(proc: subprocess.Popen[str], group: bool) -> None:
    """Kill the worker; a ``torchrun`` launch (its own session) with all its ranks."""
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            pass
    proc.kill()


def report_failure(outcome: WorkerOutcome, what: str) -> None:
    """Print that ``what`` failed and the last lines of its log."""
    tail = outcome.log.read_text(errors="replace").splitlines()[-25:]
    progress(f"{what} FAILED (exit {outcome.returncode}); last log lines from {outcome.log}:")
    for line in tail:
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


def check_side_import(outcome: WorkerOutcome, side: Side, expected_file: str | None) -> None:
    """Raise if any process (any rank) imported ``megatron.core`` from an unexpected file."""
    if expected_file is None:
        return
    for result in outcome.rank_results or (outcome.result,):
        if result is None:
            continue
        got = (result.get("megatron_core") or {}).get("file")
        if got is not None and got != expected_file:
            raise RuntimeError(
                f"{side.label} worker imported megatron.core from {got}, expected {expected_file}"
            )


def run_case(
    workspace: Workspace,
    case: BenchmarkCase,
    sides: dict[str, Side],
    expected_files: dict[str, str | None],
    requested_checkpoint_root: Path | None,
    timeout_s: float,
) -> dict[str, Any]:
    """Train+save+control, resume upstream, resume build; return the case's summary entry."""
    root = checkpoint_root(requested_checkpoint_root, case)
    holder = Path(tempfile.mkdtemp(prefix=f"resume-benchmark-{case.name}-", dir=root))
    spec_base = {"case": case.to_json(), "checkpoint_dir": str(holder / "checkpoint")}
    resumed: dict[str, dict[str, Any] | None] = {}
    try:
        progress(f"{case.name}: phase train+save+control (build side), checkpoint under {holder}")
        control = run_worker(
            workspace,
            sides["build"],
            "train",
            f"{case.name}.control",
            {**spec_base, "side": "control"},
            timeout_s,
        )
        check_side_import(control, sides["build"], expected_files["build"])
        if control.returncode != 0 or control.result is None:
            report_failure(control, f"{case.name}: train+save+control")
        progress(f"{case.name}: train+save+control finished in {control.seconds:.1f} s")
        saved = control.result is not None and (control.result.get("save") or {}).get("ok")
        if control.returncode == 0 and saved:
            for label in ("upstream", "build"):
                progress(f"{case.name}: phase resume ({label}, fresh process)")
                outcome = run_worker(
                    workspace,
                    sides[label],
                    "resume",
                    f"{case.name}.resume-{label}",
                    {**spec_base, "side": label},
                    timeout_s,
                )
                check_side_import(outcome, sides[label], expected_files[label])
                if outcome.returncode != 0 or outcome.result is None:
                    report_failure(outcome, f"{case.name}: resume ({label})")
                resumed[label] = outcome.result or {
                    "error": f"worker exited {outcome.returncode} without a result "
                    f"(see {outcome.log})"
                }
                progress(f"{case.name}: resume ({label}) finished in {outcome.seconds:.1f} s")
        entry = summarize_case(case, control.result, resumed)
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    entry["logs"] = str(workspace.root)
    return entry
