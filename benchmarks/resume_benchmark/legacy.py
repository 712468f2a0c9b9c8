"""Result documents written before the benchmark had one path for any number of ranks.

Such an entry (committed in ``docs/gpu-results/``) has no ``parallel`` layout: one ``control``,
``sides`` with one record per side, and the build's saving at the entry's top level. Its resume
records may carry ``state_adoption.events`` -- the state-adoption loader's INFO messages, parsed
from rank 0's log -- instead of the structured ``outcomes`` every rank records today.
:func:`current_entry` gives the report the current shape (:mod:`.summary`) of such an entry --
one rank, its events as load outcomes -- so both render through one path exactly as they did.
The stored documents themselves are never changed.

Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from benchmarks.resume_benchmark.launch import ParallelLayout

#: Start of the old loader message when no adopter installed the state (the fallback).
FALLBACK_PREFIX: Final = "No optimizer state adopter installed the state"

#: The entry-level saving fields of an old entry, which are rank 0's today.
_SAVING_KEYS: Final = (
    "expected_bytes_avoided",
    "bytes_avoided",
    "bytes_avoided_over_baseline",
    "bytes_avoided_ratio",
    "bytes_avoided_as_expected",
    "all_bitwise_equal",
)


def _outcome_of_event(event: Mapping[str, Any]) -> dict[str, Any] | None:
    """The load outcome a logged event stands for, in the current outcome's fields; None for
    other messages.

    Such a log named neither the optimizer nor the own method, and recorded the bytes an
    adopter claimed to have installed by reference (``avoided_bytes``), not what was measured:
    that claim stands as ``reused_bytes``, and the unrecorded fields are None.
    """
    adopter = event.get("adopter")
    if not adopter and not str(event.get("message", "")).startswith(FALLBACK_PREFIX):
        return None
    return {
        "hook_point": "load",
        "optimizer": None,
        "adopter": adopter or None,
        "method": None,
        "reused_bytes": event.get("avoided_bytes") or 0,
        "allocated_bytes": None,
        "declines": [],
        "fallback_reason": None if adopter else str(event.get("message")),
        "error": None,
    }


def _current_side(side: Mapping[str, Any]) -> dict[str, Any]:
    """A resume record as rank 0, its logged ``events`` (if any) as ``outcomes``."""
    record = side.get("state_adoption")
    if record is None or "events" not in record:
        return {"rank": 0, **side}
    outcomes = [o for o in map(_outcome_of_event, record["events"] or []) if o is not None]
    adoption = {"adopters": record.get("adopters"), "outcomes": outcomes}
    return {"rank": 0, **side, "state_adoption": adoption}


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
            label: [_current_side(side)] for label, side in entry["sides"].items()
        }
        saving = {k: entry[k] for k in _SAVING_KEYS if k in entry}
        out["ranks"] = [{"rank": 0, "params_on_rank": entry.get("params_on_rank"), **saving}]
    return out
