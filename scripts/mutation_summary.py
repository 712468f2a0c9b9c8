"""Summarise a mutmut run of the state-adoption subsystem (run from the repository root).

Reads the per-file results mutmut keeps under ``mutants/`` and prints one line of counts
per source file, then every mutant that was not killed with its diff (``--diffs``) or its
name only. Exit status 0 always: the report, not this script, judges the survivors.

Usage: python scripts/mutation_summary.py [--diffs]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

SOURCE_DIR = Path("megatron/core/optimizer/state_adoption")
COLUMNS = ("killed", "survived", "timeout", "suspicious", "no tests", "not checked")


def main() -> None:
    """Print the counts table and the mutants that were not killed."""
    diffs = "--diffs" in sys.argv[1:]
    not_killed: list[tuple[str, str, Path]] = []
    rows = []
    totals: Counter[str] = Counter()
    for source in sorted(SOURCE_DIR.glob("*.py")):
        meta = Path("mutants") / (str(source) + ".meta")
        if not meta.exists():
            continue
        exit_codes = json.loads(meta.read_text())["exit_code_by_key"]
        counts: Counter[str] = Counter(status_by_exit_code[code] for code in exit_codes.values())
        totals.update(counts)
        rows.append((source.name, len(exit_codes), counts))
        not_killed.extend(
            (name, status_by_exit_code[code], source)
            for name, code in exit_codes.items()
            if status_by_exit_code[code] != "killed"
        )
    header = f"{'file':<18}{'mutants':>8}" + "".join(f"{c:>13}" for c in COLUMNS) + f"{'other':>8}"
    print(header)
    for name, total, counts in rows + [("TOTAL", sum(r[1] for r in rows), totals)]:
        other = total - sum(counts[c] for c in COLUMNS)
        print(f"{name:<18}{total:>8}" + "".join(f"{counts[c]:>13}" for c in COLUMNS) + f"{other:>8}")
    print()
    print(f"{len(not_killed)} mutants not killed")
    for name, status, source in not_killed:
        print(f"{status}: {name}")
        if diffs:
            print(get_diff_for_mutant(name, path=source))
            print()


if __name__ == "__main__":
    main()
