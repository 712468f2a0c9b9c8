"""Runs the phases of one case on several ranks (``torch.distributed.run``) and collects them.

The multi-rank counterpart of :func:`.driver.run_case`: train+save+control on
``nproc_per_node`` ranks (build side), then resume with upstream and with the build on
``resume_nproc_per_node`` ranks, each phase one ``torchrun`` launch whose ranks each write their
own result; :func:`.rank_summary.summarize_multi_rank_case` turns them into the case's entry.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.resume_benchmark.cases import BenchmarkCase
from benchmarks.resume_benchmark.driver import (
    Workspace,
    WorkerOutcome,
    check_side_import,
    checkpoint_root,
    report_failure,
    run_worker,
)
from benchmarks.resume_benchmark.launch import ParallelLayout
from benchmarks.resume_benchmark.rank_summary import summarize_multi_rank_case
from benchmarks.resume_benchmark.results import progress
from benchmarks.resume_benchmark.sides import Side


def _all_ranks_ok(outcome: WorkerOutcome) -> bool:
    """Exit status 0 and a result from every rank."""
    return outcome.returncode == 0 and all(r is not None for r in outcome.rank_results)


def _all_saved(outcome: WorkerOutcome) -> bool:
    """Every rank's save succeeded."""
    return all(r is not None and (r.get("save") or {}).get("ok") for r in outcome.rank_results)


def _phase(
    workspace: Workspace,
    side: Side,
    phase: str,
    name: str,
    spec: dict[str, Any],
    timeout_s: float,
    layout: ParallelLayout,
    expected_file: str | None,
) -> WorkerOutcome:
    nproc = layout.phase_nproc(phase)
    outcome = run_worker(workspace, side, phase, name, spec, timeout_s, nproc)
    check_side_import(outcome, side, expected_file)
    if not _all_ranks_ok(outcome):
        report_failure(outcome, f"{name} ({nproc} ranks)")
    progress(f"{name}: {nproc} ranks finished in {outcome.seconds:.1f} s")
    return outcome


def run_multi_rank_case(
    workspace: Workspace,
    case: BenchmarkCase,
    sides: dict[str, Side],
    expected_files: dict[str, str | None],
    requested_checkpoint_root: Path | None,
    timeout_s: float,
    layout: ParallelLayout,
) -> dict[str, Any]:
    """Train+save+control, resume upstream, resume build on several ranks; the case's entry."""
    root = checkpoint_root(requested_checkpoint_root, case)
    holder = Path(tempfile.mkdtemp(prefix=f"resume-benchmark-{case.name}-", dir=root))
    spec_base = {
        "case": case.to_json(),
        "checkpoint_dir": str(holder / "checkpoint"),
        "parallel": layout.to_json(),
    }
    resumed: dict[str, list[dict[str, Any] | None]] = {}
    try:
        progress(
            f"{case.name}: phase train+save+control (build side, {layout.nproc_per_node} ranks), "
            f"checkpoint under {holder}"
        )
        control = _phase(
            workspace,
            sides["build"],
            "train",
            f"{case.name}.control",
            {**spec_base, "side": "control"},
            timeout_s,
            layout,
            expected_files["build"],
        )
        if _all_ranks_ok(control) and _all_saved(control):
            for label in ("upstream", "build"):
                progress(
                    f"{case.name}: phase resume ({label}, fresh processes, "
                    f"{layout.resume_nproc_per_node} ranks)"
                )
                outcome = _phase(
                    workspace,
                    sides[label],
                    "resume",
                    f"{case.name}.resume-{label}",
                    {**spec_base, "side": label},
                    timeout_s,
                    layout,
                    expected_files[label],
                )
                resumed[label] = [
                    result
                    or {
                        "error": f"rank {r}: worker exited {outcome.returncode} without a "
                        f"result (see {outcome.log})"
                    }
                    for r, result in enumerate(outcome.rank_results)
                ]
        entry = summarize_multi_rank_case(case, layout, list(control.rank_results), resumed)
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    entry["logs"] = str(workspace.root)
    return entry
