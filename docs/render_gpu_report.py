"""Render the tables of docs/gpu-report.md from the committed JSON in docs/gpu-results/.

Each table of the report's current results follows a marker naming its source::

    <!-- rendered from gpu-results/megatron-lm-small/suite.json: the summary -->
    <!-- rendered from gpu-results/megatron-lm-small/suite.json: the phases of moe -->

"the summary" is the first table of the benchmark's report of that JSON
(``python -m benchmarks.resume_benchmark.report``); "the phases of NAME" is the per-phase table
("Where the load's memory goes") of configuration NAME. From the repository root::

    python docs/render_gpu_report.py           # rewrite the tables after their markers
    python docs/render_gpu_report.py --check   # exit 1, naming them, if any table is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPORT = DOCS / "gpu-report.md"
MARKER = re.compile(r"<!-- rendered from (?P<path>\S+\.json): the (?P<what>summary|phases of \S+) -->")
_PHASES = "Where the load's memory goes"


def _tables(lines: list[str]) -> list[tuple[int, list[str]]]:
    """Each table of ``lines`` (consecutive lines starting with ``|``), with its first index."""
    found: list[tuple[int, list[str]]] = []
    start = None
    for i, line in enumerate([*lines, ""]):
        if line.startswith("|") and start is None:
            start = i
        elif not line.startswith("|") and start is not None:
            found.append((start, lines[start:i]))
            start = None
    return found


def rendered_table(relative_path: str, what: str) -> list[str]:
    """The table ``what`` of the benchmark's report of ``docs/<relative_path>``."""
    sys.path.insert(0, str(DOCS.parent))
    from benchmarks.resume_benchmark.report import markdown_report

    document = json.loads((DOCS / relative_path).read_text())
    lines = markdown_report(document).splitlines()
    tables = _tables(lines)
    if what == "summary":
        return tables[0][1]
    name = what.removeprefix("phases of ")
    heading = next(
        i for i, line in enumerate(lines) if line == f"## {name}" or line.startswith(f"## {name}: ")
    )
    intro = next(i for i in range(heading, len(lines)) if lines[i].startswith(_PHASES))
    return next(table for start, table in tables if start > intro)


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every marked table rendered anew, and the markers whose table changed."""
    lines = text.splitlines()
    out: list[str] = []
    stale: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        match = MARKER.fullmatch(line.strip())
        if not match:
            continue
        table = rendered_table(match["path"], match["what"])
        old: list[str] = []
        j = i + 1 if i < len(lines) and not lines[i].strip() else i
        while j < len(lines) and lines[j].startswith("|"):
            old.append(lines[j])
            j += 1
        if old != table:
            stale.append(line.strip())
        if j < len(lines) and not lines[j].strip():
            j += 1
        out.extend(["", *table, ""])
        i = j
    return "\n".join(out) + "\n", stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/render_gpu_report.py")
    parser.add_argument("--check", action="store_true", help="only report stale tables")
    args = parser.parse_args(argv)
    text, stale = render(REPORT.read_text())
    if args.check:
        for marker in stale:
            print(f"stale: {marker}", file=sys.stderr)
        return 1 if stale else 0
    REPORT.write_text(text)
    print(f"{REPORT.name}: rendered; {len(stale)} table(s) changed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
