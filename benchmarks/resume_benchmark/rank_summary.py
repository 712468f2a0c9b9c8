"""Turn the per-rank worker results of one multi-rank case into its report entry.

Pure Python (no torch). The single-rank entry (:func:`.summary.summarize_case`) is unchanged;
a multi-rank entry has the same case-level keys that :func:`.summary.case_meets_expectations`
reads (``status``, ``bytes_avoided_as_expected``, ``all_bitwise_equal``) -- true only when
*every* rank meets the expectation -- plus:

* ``parallel``: the :class:`~.launch.ParallelLayout` (``resharded`` when the resume runs at
  another data-parallel size);
* ``controls``: one record per train+save+control rank;
* ``rank_sides``: per resume side, one record per resume rank (the single-rank side fields plus
  ``rank``, and the rank's ``state_adoption`` record when its worker wrote one; the loader logs
  on global rank 0 only, so only rank 0 has events);
* ``ranks``: per resume rank, the bytes the build avoided on that rank versus
  8 B x the optimizer parameters on that rank (``expected_bytes_avoided``), and whether both
  sides of that rank are bitwise equal to their reference;
* ``extra_adopters`` / ``expected_saving_note``: as in the single-rank entry -- adopters beyond
  the default ones on any build rank make the expectation None (``bytes_avoided_as_expected``
  None on every rank and for the case: the saving is measured, not predicted).

Same data-parallel size: rank ``r`` of each resume is compared with rank ``r`` of the control
(same shards). Another data-parallel size: the restored state is compared through the
DP-size-independent gathered fingerprint (:mod:`.gathered`), all ranks merged; the next step
cannot match the control (the global batch and the reduction order change with the DP size), so
the build's step N+1 on rank ``r`` is compared with upstream's step N+1 on rank ``r`` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.resume_benchmark.cases import BenchmarkCase
from benchmarks.resume_benchmark.launch import ParallelLayout
from benchmarks.resume_benchmark.results import compare_digests, merge_rank_digests
from benchmarks.resume_benchmark.summary import (
    RESUME_SIDES,
    case_header,
    expectation_fields,
    expected_bytes,
    resume_side,
    resume_measurements,
    saving_fields,
)

Result = Mapping[str, Any]


def _padded(results: Sequence[Result | None], count: int) -> list[Result | None]:
    """``results`` cut or padded with ``None`` (rank without a result file) to ``count``."""
    return [results[r] if r < len(results) else None for r in range(count)]


def _params(result: Result) -> int:
    """Optimizer parameters on the rank that produced ``result``."""
    return int(result["model"]["optimizer_params"])


def _control_record(rank: int, control: Result) -> dict[str, Any]:
    record: dict[str, Any] = {
        "rank": rank,
        "megatron_core": control["megatron_core"],
        "params_on_rank": int(control["model"]["optimizer_params"]),
        "model_params_on_rank": control["model"]["total_params"],
        "train_peak_bytes": control["train"]["peak_bytes"],
        "train_losses": [s["loss"] for s in control["train"]["steps"]],
    }
    if control["save"]["ok"]:
        record.update(
            save_seconds=control["save"]["seconds"],
            checkpoint_bytes=control["save"]["checkpoint_bytes"],
            next_step_peak_bytes=control["next_step"]["peak_bytes"],
            next_step_loss=control["next_step"]["loss"],
        )
    return record


def _gathered_comparison(
    controls: Sequence[Result], results: Sequence[Result | None]
) -> dict[str, Any]:
    """Control vs one side's resume through the merged gathered fingerprints."""
    expected, expected_conflicts = merge_rank_digests(
        [c.get("post_save_gathered_fingerprint") or {} for c in controls]
    )
    actual, actual_conflicts = merge_rank_digests(
        [(r or {}).get("restored_gathered_fingerprint") or {} for r in results]
    )
    comparison = compare_digests(expected, actual)
    conflicts = sorted(set(expected_conflicts) | set(actual_conflicts))
    return {
        **comparison.to_json(),
        "equal": comparison.equal and not conflicts,
        "scope": "gathered (unsharded) state, all ranks merged",
        "replica_conflicts": conflicts[:20],
    }


def _resharded_side(
    result: Result | None,
    restored: Mapping[str, Any],
    reference: Result | None,
) -> dict[str, Any]:
    """One rank of one side of a resume at another DP size (see the module docstring)."""
    if result is None:
        return {"status": "not run"}
    if "error" in result:
        return {"status": "error", "error": result["error"]}
    side: dict[str, Any] = {
        "status": "ok",
        **resume_measurements(result, int(result["model"]["optimizer_params"])),
        "restored_state_equal": restored["equal"],
        "restored_state": dict(restored),
        "next_step_equal": None,
        "next_step_loss_equal": None,
        "next_step_state": None,
    }
    if reference is not None and "error" not in reference:
        after = compare_digests(
            reference["next_step"]["fingerprint"], result["next_step"]["fingerprint"]
        )
        loss_equal = reference["next_step"]["loss_hex"] == result["next_step"]["loss_hex"]
        side.update(
            next_step_equal=loss_equal and after.equal,
            next_step_loss_equal=loss_equal,
            next_step_state={**after.to_json(), "reference": "upstream resume, same rank"},
        )
    return side


def _rank_sides(
    layout: ParallelLayout,
    controls: Sequence[Result],
    resumed: Mapping[str, Sequence[Result | None]],
) -> dict[str, list[dict[str, Any]]]:
    count = layout.resume_nproc_per_node
    results = {label: _padded(resumed.get(label) or [], count) for label in RESUME_SIDES}
    sides: dict[str, list[dict[str, Any]]] = {}
    for label in RESUME_SIDES:
        if not layout.resharded:
            sides[label] = [
                {
                    "rank": r,
                    **resume_side(controls[r], results[label][r], _params(controls[r])),
                }
                for r in range(count)
            ]
            continue
        restored = _gathered_comparison(controls, results[label])
        reference = results["upstream"] if label == "build" else [None] * count
        sides[label] = [
            {"rank": r, **_resharded_side(results[label][r], restored, reference[r])}
            for r in range(count)
        ]
    return sides


def _bitwise_ok(side: Mapping[str, Any]) -> bool:
    """Restored state equal, and step N+1 equal wherever it has a reference."""
    return bool(side["restored_state_equal"]) and side["next_step_equal"] is not False


def _rank_records(
    per_param: int | None, sides: Mapping[str, Sequence[Mapping[str, Any]]]
) -> list[dict[str, Any]]:
    """Per resume rank: the saving versus ``per_param`` x its parameters, and bitwise equality."""
    records = []
    for r, build in enumerate(sides["build"]):
        pair = {label: sides[label][r] for label in RESUME_SIDES}
        params = int(build["params_on_rank"])
        records.append(
            {
                "rank": r,
                "params_on_rank": params,
                **saving_fields(expected_bytes(per_param, params), pair),
                "all_bitwise_equal": all(_bitwise_ok(s) for s in pair.values()),
            }
        )
    return records


def _failures(what: str, results: Sequence[Result | None]) -> list[str]:
    return [
        f"{what} rank {r}: "
        + (result["error"] if result else "no result (worker crashed or timed out)")
        for r, result in enumerate(results)
        if result is None or "error" in result
    ]


def summarize_multi_rank_case(
    case: BenchmarkCase,
    layout: ParallelLayout,
    controls: Sequence[Result | None],
    resumed: Mapping[str, Sequence[Result | None]],
) -> dict[str, Any]:
    """One multi-rank case's report entry from every rank's control and resume results."""
    entry = {**case_header(case), "parallel": layout.to_json()}
    padded = _padded(controls, layout.nproc_per_node)
    failed = _failures("train+save+control", padded)
    if failed:
        entry.update(status="error", detail="; ".join(failed))
        return entry
    ok = [c for c in padded if c is not None]
    entry["inner_optimizers"] = ok[0]["model"]["inner_optimizers"]
    entry["controls"] = [_control_record(r, c) for r, c in enumerate(ok)]
    unsaved = [c for c in ok if not c["save"]["ok"]]
    if unsaved:
        entry.update(status="unsupported", detail=f"unsupported: {unsaved[0]['save']['error']}")
        return entry
    sides = _rank_sides(layout, ok, resumed)
    entry["rank_sides"] = sides
    entry.update(expectation_fields(case, sides["build"]))
    errors = [
        f"{label} rank {s['rank']}: {s.get('error', s['status'])}"
        for label, per_rank in sides.items()
        for s in per_rank
        if s["status"] != "ok"
    ]
    if errors:
        entry.update(status="error", detail="resume failed -- " + "; ".join(errors))
        return entry
    per_param = entry["expected_saving_bytes_per_param"]
    ranks = _rank_records(per_param, sides)
    entry.update(
        status="ok",
        detail=None,
        ranks=ranks,
        bytes_avoided_as_expected=(
            None if per_param is None else all(r["bytes_avoided_as_expected"] for r in ranks)
        ),
        all_bitwise_equal=all(r["all_bitwise_equal"] for r in ranks),
    )
    return entry


def is_multi_rank_entry(entry: Mapping[str, Any]) -> bool:
    """Whether a report entry came from :func:`summarize_multi_rank_case`."""
    return "parallel" in entry
