"""One figure per configuration: allocated GPU memory over time during the resume, upstream and
build.

Drawn with matplotlib (Agg, no display) on any machine from the benchmark's JSON document; the
probe only records the timelines (:mod:`.memory_timeline`, which never imports matplotlib). ::

    python -m benchmarks.resume_benchmark.figures RESULT.json [MORE.json ...] --out-dir DIR \\
        [--markdown-out FILE]

writes ``DIR/<configuration>.png`` for every run whose resumes carry a ``memory_timeline``
(``phases["resume-<side>"]["load"]["memory_timeline"]``), prints the paths, and with
``--markdown-out`` writes Markdown image links to them (relative to that file).

Each figure: both sides' allocated bytes over the pre-load baseline against the time since the
load began, on the same axes (left: MiB or GiB; right: bytes per parameter on the rank when the
parameter count is known); each side's peak marked and labelled (MiB and B/param); where the
probe recorded the load's phases, under it one bar per side showing them (pass 1, checkpoint
read, model, pass 2) on the same time axis, with the phase starts as faint vertical lines in the
side's colour above.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from benchmarks.resume_benchmark.megatron_lm import RESUME_SIDES
from benchmarks.resume_benchmark.report import run_numbers, runs_of
from benchmarks.resume_benchmark.memory_timeline import (
    SHORT_PHASE_NAMES,
    iter_levels,
    timeline_problems,
)

#: Side colours (colour-blind safe): upstream vermillion, build blue; other labels cycle on.
SIDE_COLOURS: Final[Mapping[str, str]] = {"upstream": "#D55E00", "build": "#0072B2"}
_OTHER_COLOURS: Final = ("#009E73", "#CC79A7", "#E69F00", "#56B4E9")

DPI: Final = 110
FIGSIZE: Final = (9.6, 5.8)
MIB: Final = float(1 << 20)
GIB: Final = float(1 << 30)

#: A curve peak this far from ``max_memory_allocated() - baseline`` is noted under the title.
NOTED_PEAK_DIFFERENCE: Final = 1 << 20


@dataclass(frozen=True)
class CaseTimelines:
    """The timelines of one figure: the resumes of one configuration (``case``)."""

    case: str
    sides: Mapping[str, Mapping[str, Any]]
    params: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


def side_colour(label: str, index: int) -> str:
    """The colour of side ``label`` (the ``index``-th side of the figure)."""
    return SIDE_COLOURS.get(label, _OTHER_COLOURS[index % len(_OTHER_COLOURS)])


def short_phase_name(label: str) -> str:
    """The name printed in a phase bar (``pass 1``, ``read``, ``model``, ``pass 2``, or the
    label up to its first colon)."""
    if label in SHORT_PHASE_NAMES:
        return SHORT_PHASE_NAMES[label]
    return label.split(":", 1)[0].strip()[:14]


def _unit(largest: float) -> tuple[float, str]:
    return (GIB, "GiB") if largest >= 4 * GIB else (MIB, "MiB")


def _peak_text(label: str, peak: int, params: int | None) -> str:
    """Legend entry of one side: its peak over the baseline in MiB and bytes per parameter."""
    text = f"{label}: peak {peak / MIB:,.0f} MiB"
    if params:
        text += f" = {peak / params:.2f} B/param"
    return text + " over baseline"


def render_case_figure(timelines: CaseTimelines, out_path: Path, *, dpi: int = DPI) -> Path:
    """Draw one case's timelines (every side on the same axes) into the PNG ``out_path``."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sides = {label: t for label, t in timelines.sides.items() if not timeline_problems(t)}
    if not sides:
        raise ValueError(f"{timelines.case}: no usable timeline")
    params = timelines.params
    largest = max(max(abs(v) for _, v in iter_levels(t)) for t in sides.values())
    scale, unit = _unit(float(largest))
    end_s = max(max(float(t["points"][-1][0]) for t in sides.values()), 1e-6)

    figure = Figure(figsize=FIGSIZE, dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    phased = any(t.get("phases") for t in sides.values())  # else no strip of phase bars
    if phased:
        grid = figure.add_gridspec(2, 1, height_ratios=(5.0, 0.55 + 0.45 * len(sides)))
        ax = figure.add_subplot(grid[0])
        strip = figure.add_subplot(grid[1], sharex=ax)
    else:
        ax = strip = figure.add_subplot()

    peaks: list[tuple[str, str, float, float, int]] = []  # side, colour, time, level, bytes
    ax.axhline(0.0, color="#555555", linewidth=0.9, linestyle="-", zorder=1)
    ax.annotate(
        "pre-load baseline",
        xy=(1.0, 0.0),
        xycoords=("axes fraction", "data"),
        xytext=(-4, -11),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="#555555",
    )
    for index, (label, timeline) in enumerate(sides.items()):
        colour = side_colour(label, index)
        points = list(iter_levels(timeline))
        ts = [t for t, _ in points]
        ys = [v / scale for _, v in points]
        peak = int(timeline["peak_bytes_over_baseline"])
        legend = _peak_text(label, peak, params)
        # Earlier sides wider underneath: identical curves (no saving) stay visible as an
        # outline of the first side around the second.
        width = 1.5 + 1.1 * (len(sides) - 1 - index)
        ax.step(ts, ys, where="post", color=colour, linewidth=width, label=legend, zorder=3)
        peak_t = float(timeline["peak_t_s"])
        ax.plot([peak_t], [peak / scale], marker="o", markersize=6, color=colour, zorder=4)
        ax.axhline(peak / scale, color=colour, linewidth=0.8, linestyle=":", zorder=2)
        peaks.append((label, colour, peak_t, peak / scale, peak))
        for phase in timeline.get("phases") or []:
            ax.axvline(
                float(phase["start_s"]), color=colour, linewidth=0.8, linestyle="--", alpha=0.3
            )
        if phased:
            _draw_phase_bar(strip, len(sides) - 1 - index, timeline, colour, end_s)

    ax.set_ylabel(f"allocated over baseline ({unit})")
    ax.grid(True, axis="y", color="#dddddd", linewidth=0.6)
    ax.set_xlim(0.0, end_s * 1.02)
    low, high = ax.get_ylim()
    low = min(low, 0.0)
    ax.set_ylim(low - (high - low) * 0.05, high + (high - low) * 0.16)
    _annotate_peaks(ax, peaks, params, end_s)
    ax.tick_params(labelbottom=not phased)
    ax.legend(loc="upper left", fontsize=9, frameon=False)
    if params:
        per_unit = scale / params  # bytes per parameter of one unit on the left axis

        def to_per_param(values: Any) -> Any:
            return np.asarray(values, dtype=float) * per_unit

        def from_per_param(values: Any) -> Any:
            return np.asarray(values, dtype=float) / per_unit

        secondary = ax.secondary_yaxis("right", functions=(to_per_param, from_per_param))
        secondary.set_ylabel("bytes per parameter on the rank")

    strip.set_xlabel("time since the load began (s)")
    if phased:
        strip.set_yticks(range(len(sides)), [label for label in reversed(list(sides))])
        strip.set_ylim(-0.6, len(sides) - 0.4)
        strip.tick_params(axis="y", length=0)
        for spine in ("top", "right", "left"):
            strip.spines[spine].set_visible(False)

    figure.supxlabel(_phase_key(sides), fontsize=7.5, color="#555555")
    figure.suptitle(f"{timelines.case}: allocated GPU memory during the resume", fontsize=12)
    ax.set_title(_subtitle(timelines, sides), fontsize=8.5, color="#444444", loc="left")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=dpi, format="png", metadata={"Software": None})
    return out_path


def _draw_phase_bar(
    strip: Any, row: int, timeline: Mapping[str, Any], colour: str, end_s: float
) -> None:
    """One side's phases as consecutive boxes in row ``row`` of the strip under the plot."""
    for number, phase in enumerate(timeline.get("phases") or []):
        start = float(phase["start_s"])
        width = max(float(phase["end_s"]) - start, 0.0)
        strip.broken_barh(
            [(start, width)],
            (row - 0.36, 0.72),
            facecolors=colour,
            alpha=0.78 if number % 2 == 0 else 0.45,
            edgecolor="white",
            linewidth=0.8,
        )
        name = short_phase_name(str(phase["label"]))
        if width / end_s >= 0.012 * max(len(name), 3):
            strip.text(
                start + width / 2,
                row,
                name,
                ha="center",
                va="center",
                fontsize=8,
                color="white",
                fontweight="bold",
            )


def _annotate_peaks(
    ax: Any, peaks: Sequence[tuple[str, str, float, float, int]], params: int | None, end_s: float
) -> None:
    """Label each peak marker above it (``side 24.03 B/param``, or MiB without a parameter
    count); labels of peaks close to each other are stacked, the highest peak's lowest."""
    low, high = ax.get_ylim()
    placed: list[tuple[float, float]] = []
    for label, colour, t, level, peak in sorted(peaks, key=lambda p: -p[3]):
        stacked = sum(
            1
            for pt, pl in placed
            if abs(t - pt) < 0.15 * end_s and abs(level - pl) < 0.08 * (high - low)
        )
        value = f"{peak / params:.2f} B/param" if params else f"{peak / MIB:,.0f} MiB"
        # A label centred on a peak near either edge would run past the axes: anchor it inward.
        left, right = ax.get_xlim()
        where = (t - left) / (right - left) if right > left else 0.5
        ha = "right" if where > 0.8 else "left" if where < 0.2 else "center"
        ax.annotate(
            f"{label} {value}",
            xy=(t, level),
            xytext=(0, 7 + 12 * stacked),
            textcoords="offset points",
            ha=ha,
            fontsize=8.5,
            color=colour,
            fontweight="bold",
            zorder=5,
        )
        placed.append((t, level))


def _phase_key(sides: Mapping[str, Mapping[str, Any]]) -> str:
    """The key to the bars' short names (for the phases shown, in load order), at most two
    lines."""
    names: dict[str, str] = {}
    for timeline in sides.values():
        for phase in timeline.get("phases") or []:
            label = str(phase["label"])
            short = short_phase_name(label)
            if label.startswith(short + ":"):
                label = label[len(short) + 1 :].strip()
            names.setdefault(short, label)
    parts = [f"{short} = {label}" for short, label in names.items() if short != label]
    if not parts:
        return ""
    text = "phases: " + " · ".join(parts)
    if len(text) > 115 and len(parts) > 1:
        half = (len(parts) + 1) // 2
        text = "phases: " + " · ".join(parts[:half]) + "\n" + " · ".join(parts[half:])
    return text


def _subtitle(timelines: CaseTimelines, sides: Mapping[str, Mapping[str, Any]]) -> str:
    parts = []
    if timelines.params:
        parts.append(f"{timelines.params:,} optimizer parameters on the rank")
    sources = sorted({str(t.get("source")) for t in sides.values()})
    parts.append("source: " + ", ".join(sources))
    notes = list(timelines.notes)
    for label, timeline in sides.items():
        if timeline.get("dropped_events"):
            notes.append(f"{label}: trace buffer overflowed, levels anchored at the end")
        difference = (timeline.get("consistency") or {}).get("peak_difference_bytes")
        if difference is not None and abs(difference) >= NOTED_PEAK_DIFFERENCE:
            notes.append(
                f"{label}: curve peak {difference / MIB:+,.1f} MiB from max_memory_allocated()"
            )
    return " · ".join(parts) + ("\n" + "; ".join(notes) if notes else "")


# --------------------------------------------------------------------------------------------
# Finding timelines in a benchmark document
# --------------------------------------------------------------------------------------------


def case_timelines(document: Mapping[str, Any]) -> list[CaseTimelines]:
    """One figure per run of the document (:func:`.report.runs_of`) whose resumes recorded a
    timeline, named after its configuration."""
    found = []
    for run in runs_of(document):
        phases = run["phases"]
        recorded = {
            side: ((phases.get(f"resume-{side}") or {}).get("load") or {}).get("memory_timeline")
            for side in RESUME_SIDES
        }
        recorded = {side: t for side, t in recorded.items() if t is not None}
        if recorded:
            sides, notes = _usable(recorded)
            numbers = run_numbers(run)
            found.append(CaseTimelines(numbers.name, sides, numbers.elements, notes=notes))
    return found


def _usable(recorded: Mapping[str, Any]) -> tuple[dict[str, Mapping[str, Any]], tuple[str, ...]]:
    """The timelines that can be drawn, and a note per side whose record cannot (e.g. the
    probe stored ``{"error": ...}`` because recording failed)."""
    sides: dict[str, Mapping[str, Any]] = {}
    notes: list[str] = []
    for label, timeline in recorded.items():
        problems = timeline_problems(timeline)
        if not problems:
            sides[label] = timeline
            continue
        why = timeline.get("error") if isinstance(timeline, Mapping) else None
        notes.append(f"{label}: no timeline ({why or problems[0]})")
    return sides, tuple(notes)


def figure_name(timelines: CaseTimelines) -> str:
    """``<configuration>.png`` (characters outside letters, digits, ``-_.`` as ``_``)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in timelines.case) + ".png"


def write_figures(
    documents: Sequence[Mapping[str, Any]], out_dir: Path
) -> list[tuple[CaseTimelines, Path]]:
    """Render every run with timelines in ``documents`` into ``out_dir``; repeated names (the
    same configuration in several documents) get ``-2``, ``-3`` ... before ``.png``."""
    written: list[tuple[CaseTimelines, Path]] = []
    used: set[str] = set()
    for document in documents:
        for timelines in case_timelines(document):
            if not timelines.sides:
                print(
                    f"{timelines.case}: nothing to draw ({'; '.join(timelines.notes)})",
                    file=sys.stderr,
                )
                continue
            name = figure_name(timelines)
            stem, number = name[: -len(".png")], 2
            while name in used:
                name, number = f"{stem}-{number}.png", number + 1
            used.add(name)
            written.append((timelines, render_case_figure(timelines, out_dir / name)))
    return written


def markdown_images(written: Sequence[tuple[CaseTimelines, Path]], relative_to: Path) -> list[str]:
    """Markdown lines embedding the figures, paths relative to the directory ``relative_to``
    (where the Markdown file lives)."""
    return [
        f"![{timelines.case}: allocated GPU memory during the resume]"
        f"({Path(os.path.relpath(path.resolve(), relative_to.resolve())).as_posix()})"
        for timelines, path in written
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.resume_benchmark.figures RESULT.json ... --out-dir DIR``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.resume_benchmark.figures",
        description="Draw one PNG per configuration with memory timelines in JSON documents.",
    )
    parser.add_argument("documents", nargs="+", type=Path, help="--json-out files of runs")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the PNGs go")
    parser.add_argument("--markdown-out", type=Path, help="write Markdown image links here")
    args = parser.parse_args(argv)
    documents = [json.loads(path.read_text()) for path in args.documents]
    written = write_figures(documents, args.out_dir)
    for _, path in written:
        print(path)
    if not written:
        print("no run with a memory timeline found", file=sys.stderr)
        return 1
    if args.markdown_out:
        lines = markdown_images(written, args.markdown_out.parent)
        args.markdown_out.write_text("".join(line + "\n\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
