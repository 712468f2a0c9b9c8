"""The benchmark's report: one table over every configuration of a run, each configuration's
detail, and what ``--check`` holds the build to. Pure Python; re-renders a JSON document::

    python -m benchmarks.resume_benchmark.report RESULT.json [MORE.json ...] \\
        [--markdown-out FILE] [--json-out MERGED.json]

Several documents of the same two sides (e.g. configurations run side by side) merge into one.

A document is one invocation (``{"environment", "sides", "runs": [...]}``) or a single run of the
Megatron-LM client (one entry of ``runs``; e.g. docs/gpu-results/megatron-lm-1b).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from benchmarks.resume_benchmark.configs import (
    DEFAULT_ADOPTERS,
    FP32_MOMENT_PAIR_BYTES,
    Expectation,
)
from benchmarks.resume_benchmark.configs import extra_adopters
from benchmarks.resume_benchmark.megatron_lm import RESUME_SIDES, SCRIPT, failed_phases
from benchmarks.resume_benchmark.megatron_lm import optimizer_elements
from benchmarks.resume_benchmark.memory_timeline import phase_levels
from benchmarks.resume_benchmark.results import OWN_LOADER, adopters_that_handled, write_json

#: Tolerance of "the measured bytes equal the expectation": max(relative, absolute). Relative:
#: 0.05 B over the 8 B of FP32 moments per element (the floor's tolerance, 8.05 B/param).
RELATIVE_TOLERANCE: Final = 0.05 / FP32_MOMENT_PAIR_BYTES
ABSOLUTE_TOLERANCE: Final = 1 << 20

_MIB = float(1 << 20)
#: Half the last digit of Megatron-LM's "max allocated" report (MiB, two decimals).
_REPORT_ROUNDING: Final = 0.005 * _MIB
_TITLE = "# Resume memory in Megatron-LM's `pretrain_gpt.py`: upstream megatron-core vs. the build"


def runs_of(document: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The configurations' run documents of an invocation (a single run: itself)."""
    return list(document["runs"]) if "runs" in document else [document]


@dataclass(frozen=True)
class RunNumbers:
    """What the report and ``--check`` read from one run document.

    ``elements``: the optimizer state on the rank (the build's outcomes), else Megatron's
    parameter count; ``expected`` (None: not predicted): with ``ADOPTS`` the build's load peak
    over pre-load, the FP32 moments it ends with (8 B x elements: no copy of them, nor of the
    weights); with ``KEEPS_LOADER`` the bytes the build avoids, 0.
    """

    name: str
    parameters: int | None
    elements: int | None
    training_peak: int | None
    rises: Mapping[str, int | None]
    reports: Mapping[str, float | None]
    avoided: int | None
    expected: int | None
    expectation: Expectation | None
    extra: tuple[str, ...]


def run_numbers(run: Mapping[str, Any]) -> RunNumbers:
    """The :class:`RunNumbers` of a run document."""
    phases = run["phases"]
    sides = {side: phases.get(f"resume-{side}") or {} for side in RESUME_SIDES}
    control = phases.get("uninterrupted") or {}
    configuration = run.get("configuration") or {}
    expectation = (
        Expectation[configuration["expectation"]] if configuration.get("expectation") else None
    )
    build_adoption = {"outcomes": sides["build"].get("outcomes")}
    extra = extra_adopters(adopters_that_handled([build_adoption]))
    parameters = control.get("parameters")
    elements = optimizer_elements(sides["build"].get("outcomes")) or parameters
    rises = {side: record.get("load_peak_over_baseline") for side, record in sides.items()}
    avoided = None
    if rises["upstream"] is not None and rises["build"] is not None:
        avoided = rises["upstream"] - rises["build"]
    expected = None
    if expectation is not None and not extra and elements:
        adopts = expectation is Expectation.ADOPTS
        expected = FP32_MOMENT_PAIR_BYTES * elements if adopts else 0
    return RunNumbers(
        name=str(configuration.get("name") or "megatron-lm"),
        parameters=parameters,
        elements=elements,
        training_peak=control.get("max_allocated_bytes"),
        rises=rises,
        reports={s: (r.get("first_memory_report") or [None, None])[1] for s, r in sides.items()},
        avoided=avoided,
        expected=expected,
        expectation=expectation,
        extra=extra,
    )


def within_training_peak(report: float | None, training_peak: int | None) -> bool | None:
    """Whether Megatron's "max allocated" report is at most the uninterrupted run's peak.

    Args:
        report: the report in MiB, as Megatron-LM prints it (two decimals).
        training_peak: the uninterrupted run's max allocated bytes.

    Returns:
        None where either is missing; a report equal to the peak once rounded counts as within.
    """
    if report is None or training_peak is None:
        return None
    return report * _MIB <= training_peak + _REPORT_ROUNDING


def expectation_problems(run: Mapping[str, Any]) -> list[str]:
    """Why a run misses what ``--check`` requires (empty: it meets it): every phase ran, equal
    losses and checkpoints, the predicted saving, and with ``ADOPTS`` the default adopter on the
    build side and its first report within the uninterrupted run's training peak."""
    numbers = run_numbers(run)
    problems = [f"{phase} failed or did not run" for phase in failed_phases(run)]
    upstream_diverges = bool((run.get("configuration") or {}).get("upstream_divergence"))
    for side, differences in (run.get("loss_differences") or {}).items():
        if differences and not (side == "upstream" and upstream_diverges):
            problems.append(f"{side}: losses differ from the uninterrupted run: {differences[:3]}")
    if run.get("checkpoint_differences") and not upstream_diverges:
        problems.append(f"saved checkpoints differ: {run['checkpoint_differences'][:3]}")
    if numbers.expected is not None:
        adopts = numbers.expectation is Expectation.ADOPTS
        measured = numbers.rises["build"] if adopts else numbers.avoided
        what = "the build's load peak over pre-load" if adopts else "avoided"
        tolerance = max(RELATIVE_TOLERANCE * numbers.expected, ABSOLUTE_TOLERANCE)
        if measured is None or abs(measured - numbers.expected) > tolerance:
            problems.append(f"{what} {_mib(measured)} MiB, expected {_mib(numbers.expected)} MiB")
    if numbers.expectation is Expectation.ADOPTS and not numbers.extra:
        installed = (run["phases"].get("resume-build") or {}).get("installed_by") or ""
        if not any(name in installed for name in DEFAULT_ADOPTERS):
            problems.append(f"the build's state was installed by {installed or 'nothing recorded'}")
        report, peak = numbers.reports["build"], numbers.training_peak
        if not within_training_peak(report, peak):
            problems.append(
                f"the build's max allocated after the first resumed iteration ({report} MiB) "
                f"exceeds the uninterrupted training peak ({_mib(peak)} MiB)"
            )
    return [f"{numbers.name}: {problem}" for problem in problems]


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / _MIB:,.1f}"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _yes_no(differences: Sequence[str] | None) -> str:
    return (
        "n/a" if differences is None else f"**no** ({len(differences)})" if differences else "yes"
    )


def summary_table(document: Mapping[str, Any]) -> list[str]:
    """One row per configuration and resume side."""
    runs = runs_of(document)
    plan = runs[0]["plan"]
    after = f"{plan['resume_at'] + 1}..{plan['train_iters']}"
    lines = [
        "| configuration | side | optimizer elements on the rank | pre-load MiB | load peak over "
        "pre-load MiB | B/param | avoided vs upstream MiB | avoided ÷ (8 B × elements) | max "
        f"allocated after iteration {plan['resume_at'] + 1} (Megatron) MiB | uninterrupted "
        f"training peak MiB | checkpoint load s | losses {after} equal | checkpoints after "
        f"{plan['train_iters']} identical | state installed by |",
        "|" + "---|" * 14,
    ]
    for run in runs:
        numbers = run_numbers(run)
        for side in RESUME_SIDES:
            record = run["phases"].get(f"resume-{side}") or {}
            rise = numbers.rises[side]
            build = side == "build"
            ratio = "—"
            if build and numbers.avoided is not None and numbers.expected:
                ratio = f"{numbers.avoided / numbers.expected:.4f}"
            elif build and numbers.expected == 0:
                ratio = "expected 0"
            elif build and numbers.extra:
                ratio = f"not predicted ({', '.join(numbers.extra)})"
            cells = [
                numbers.name,
                side,
                f"{numbers.elements:,}" if numbers.elements else "n/a",
                _mib((record.get("load") or {}).get("baseline_bytes")),
                _mib(rise),
                (
                    f"{rise / numbers.elements:.2f}"
                    if rise is not None and numbers.elements
                    else "n/a"
                ),
                _mib(numbers.avoided) if build else "—",
                ratio,
                f"{numbers.reports[side]:,.1f}" if numbers.reports[side] is not None else "n/a",
                _mib(numbers.training_peak),
                _seconds((record.get("load") or {}).get("seconds")),
                _yes_no((run.get("loss_differences") or {}).get(side)),
                _yes_no(run.get("checkpoint_differences")) if build else "—",
                record.get("installed_by") or ("n/a" if not record else OWN_LOADER),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def run_markdown(run: Mapping[str, Any]) -> str:
    """One run's detail: its table per side, the training peak, per-rank peaks, the checkpoint
    comparison and what the client added to the arguments."""
    plan, records = run["plan"], run["phases"]
    control = records.get("uninterrupted") or {}
    params = control.get("parameters")
    training_peak = control.get("max_allocated_bytes")
    mode = "yes" if plan["deterministic"] else "no"
    lines = [
        f"Megatron-LM `{SCRIPT}` from {run['megatron_lm']}; iterations "
        f"1..{plan['train_iters']}, resumed at {plan['resume_at']}; deterministic mode: {mode}; "
        "parameters (rank 0): " + (f"{params:,}" if params else "unknown"),
        "",
        "| side | load peak over pre-load, MiB | B/param | max allocated after iteration "
        f"{plan['resume_at'] + 1} (Megatron), MiB | ≤ uninterrupted training peak | losses "
        f"{plan['resume_at'] + 1}..{plan['train_iters']} equal | state installed by |",
        "|---|---|---|---|---|---|---|",
    ]
    for side in RESUME_SIDES:
        record = records.get(f"resume-{side}") or {}
        if not record:
            lines.append(
                f"| {side} | " + " | ".join(["run failed (see the logs)"] + ["n/a"] * 5) + " |"
            )
            continue
        peak = record.get("load_peak_over_baseline")
        report = record.get("first_memory_report")
        within = within_training_peak(report[1] if report else None, training_peak)
        differences = run["loss_differences"].get(side)
        cells = [
            side,
            f"{peak / _MIB:,.1f}" if peak is not None else "n/a",
            f"{peak / params:.2f}" if peak is not None and params else "n/a",
            f"{report[1]:,.1f}" if report else "n/a",
            {None: "n/a", True: "yes", False: "no"}[within],
            "n/a" if differences is None else "**no**" if differences else "yes",
            record.get("installed_by") or "own loader (no outcomes recorded)",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _phase_table(records, params)
    lines += _rounding_lines(records)
    if training_peak:
        lines.append(f"\nUninterrupted run's training peak: {training_peak / _MIB:,.1f} MiB.")
    for side in RESUME_SIDES:
        rises = (records.get(f"resume-{side}") or {}).get("rank_load_peaks") or []
        if len(rises) > 1:
            shown = ", ".join("n/a" if r is None else f"{r / _MIB:,.1f}" for r in rises)
            lines.append(
                f"{side}: load peak over pre-load per rank, MiB: {shown} (the table: the highest)."
            )
    saved, counted = run.get("checkpoint_differences"), run.get("checkpoint_compared")
    if saved is not None:
        verdict = (
            "identical, tensor by tensor" if not saved else f"{len(saved)} differ: {saved[:5]}"
        )
        if counted:
            verdict += (
                f" ({counted['tensors']:,} tensors, {counted['bytes'] / _MIB:,.1f} MiB compared)"
            )
        lines.append(
            f"Checkpoints saved at iteration {plan['train_iters']} by the two resumes: {verdict}."
        )
    lines += ["", "What the client added:", *(f"- {note}" for note in run["notes"])]
    return "\n".join(lines) + "\n"


def _phase_table(records: Mapping[str, Any], params: int | None) -> list[str]:
    """Where the load's memory goes: per side and phase, the highest level within the phase and
    the level at its end, over pre-load (B/param where the parameters are known)."""
    timelines = {
        side: timeline
        for side in RESUME_SIDES
        if isinstance(timeline := ((records.get(f"resume-{side}") or {}).get("load") or {}).get(
            "memory_timeline"), dict) and "phases" in timeline
    }  # fmt: skip
    if not timelines:
        return []
    unit, scale = ("B/param", float(params)) if params else ("MiB", _MIB)
    labels = [label for label, _, _ in phase_levels(next(iter(timelines.values())))]
    lines = [
        "",
        f"Where the load's memory goes ({unit} over pre-load: highest within each phase / at its end):",
        "",
        "| side | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for side, timeline in timelines.items():
        cells = [
            f"{peak / scale:.2f} / {end / scale:.2f}" for _, peak, end in phase_levels(timeline)
        ]
        lines.append(f"| {side} | " + " | ".join(cells) + " |")
    return lines


def _rounding_lines(records: Mapping[str, Any]) -> list[str]:
    """Per side, the allocator's rounding of the blocks the load still holds at its end."""
    lines = []
    for side in RESUME_SIDES:
        load = (records.get(f"resume-{side}") or {}).get("load") or {}
        rounding = (load.get("memory_timeline") or {}).get("rounding")
        if not isinstance(rounding, dict):
            continue
        largest = ", ".join(
            f"{count} x {requested / _MIB:,.2f} MiB in {block / _MIB:,.2f} MiB ({phase})"
            for requested, block, count, phase in rounding["largest"][:4]
        )
        lines.append(
            f"{side}: the load's {rounding['blocks']:,} blocks held at its end: "
            f"{rounding['block_bytes'] / _MIB:,.1f} MiB allocated for "
            f"{rounding['requested_bytes'] / _MIB:,.1f} MiB requested (allocator rounding "
            f"{rounding['rounding_bytes'] / _MIB:,.2f} MiB" + (f"; largest: {largest})." if largest else ").")
        )
    return ["", *lines] if lines else []


def markdown_report(document: Mapping[str, Any]) -> str:
    """The whole report: a single run's detail, or an invocation's header, table and details."""
    if "runs" not in document:
        return run_markdown(document)
    environment = document.get("environment") or {}
    lines = [
        _TITLE,
        "",
        f"- GPU: {environment.get('gpu_name')} (driver {environment.get('driver')}); torch "
        f"{environment.get('torch')} (CUDA {environment.get('torch_cuda')}); Transformer Engine "
        f"{environment.get('transformer_engine')}; Python {environment.get('python')}",
    ]
    for label, side in (document.get("sides") or {}).items():
        lines.append(
            f"- {label}: megatron-core {side.get('version')} from `{side.get('file')}` "
            f"({side.get('source')})"
        )
    lines += [
        f"- ranks per run: {document.get('nproc_per_node', 1)}; load peak = the allocator's peak "
        "inside Megatron-LM's `load_checkpoint` over the level it began at (the rank where it "
        "rose most); expected saving = 8 B × optimizer elements on that rank with the default "
        "adopter, 0 where it declines",
        "",
        *summary_table(document),
    ]
    for run in runs_of(document):
        configuration = run.get("configuration") or {}
        heading = configuration.get("name") or "megatron-lm"
        if configuration.get("description"):
            heading += f": {configuration['description']}"
        arguments = " ".join(run.get("script_args") or [])
        lines += ["", f"## {heading}", "", f"`{SCRIPT} {arguments}`", ""]
        if configuration.get("upstream_divergence"):
            lines += [
                f"Upstream's resume is known to diverge: {configuration['upstream_divergence']}.",
                "",
            ]
        lines.append(run_markdown(run))
    return "\n".join(lines).rstrip() + "\n"


def merge_documents(documents: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One invocation's document holding the runs of ``documents`` (in order).

    Raises:
        ValueError: when the documents' sides are not the same megatron-core files and versions.
    """
    first = dict(documents[0])
    identity = [
        {label: (s.get("version"), s.get("file")) for label, s in d["sides"].items()}
        for d in documents
    ]
    if any(i != identity[0] for i in identity):
        raise ValueError(f"the documents compare different sides: {identity}")
    return {**first, "runs": [run for d in documents for run in runs_of(d)]}


def main(argv: Sequence[str] | None = None) -> int:
    """Re-render JSON documents (merged) as Markdown (stdout, or ``--markdown-out``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.resume_benchmark.report")
    parser.add_argument("documents", nargs="+", type=Path, help="--json-out files")
    parser.add_argument("--markdown-out", type=Path)
    parser.add_argument("--json-out", type=Path, help="the merged document")
    args = parser.parse_args(argv)
    documents = [json.loads(path.read_text()) for path in args.documents]
    document = documents[0] if len(documents) == 1 else merge_documents(documents)
    text = markdown_report(document)
    if args.json_out:
        write_json(args.json_out, document)
    if args.markdown_out:
        args.markdown_out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
