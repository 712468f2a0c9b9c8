"""Result documents written before the benchmark had one path for any number of ranks.

Such an entry (committed in ``docs/gpu-results/``) has no ``parallel`` layout: one ``control``,
``sides`` with one record per side, and the build's saving at the entry's top level.
:func:`current_entry` gives the report the current shape (:mod:`.summary`) of such an entry --
one rank -- so both render through one path exactly as they did. The stored documents
themselves are never changed.

Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from benchmarks.resume_benchmark.launch import ParallelLayout

#: The entry-level saving fields of an old entry, which are rank 0's today.
_SAVING_KEYS: Final = (
    "expected_bytes_avoided",
    "bytes_avoided",
    "bytes_avoided_over_baseline",
    "bytes_avoided_ratio",
    "bytes_avoided_as_expected",
    "all_bitwise_equal",
)


def current_entry(entry: Mapping[str, Any]) -> Mapping[str, Any]:
    """``entry`` in the current shape: unchanged if it has a layout, else as rank 0 of one."""
    if "parallel" in entry:
        return entry
    out = {k: v for k, v in entry.items() if k not in ("control", "sides")}
    out["parallel"] = ParallelLayout().to_json()
    if "control" in entry:
        out["controls"] = [
            {"rank": 0, "params_on_rank": entry.get("params_on_rank"), **entry["control"]}
        ]
    if "sides" in entry:
        out["rank_sides"] = {
            label: [{"rank": 0, **side}] for label, side in entry["sides"].items()
        }
        saving = {k: entry[k] for k in _SAVING_KEYS if k in entry}
        out["ranks"] = [{"rank": 0, "params_on_rank": entry.get("params_on_rank"), **saving}]
    return out
