"""Turn every rank's worker results of one case into its report entry, and judge it.

Pure Python (no torch). One rank is simply N = 1. The entry holds:

* the case (:func:`case_header`), its ``parallel`` layout (:class:`~.launch.ParallelLayout`),
  the model's ``total_params`` (all ranks) and the inner optimizers;
* ``controls``: one record per train+save+control rank;
* ``rank_sides``: per resume side (``upstream``, ``build``), one record per resume rank: what it
  measured, whether its load peak stayed within its own training peak (step N+1, same process),
  its bitwise comparison, and its ``state_adoption`` record when its worker wrote one;
* ``ranks``: per resume rank, the bytes the build avoided versus upstream on that rank and the
  expectation, 8 B x the optimizer parameters on that rank (``expected_bytes_avoided``; None
  when an adopter besides the default ones handled the state on the build side: measured, not
  predicted);
* the verdicts over all ranks (``bytes_avoided_as_expected``,
  ``load_peaks_within_training_peaks``, ``all_bitwise_equal``) and ``failed_expectations``, the
  reasons ``--check`` fails, one line per rank and check (with an instance-level loader, also
  whether it ran on every rank and, on the build, once per load in place of any adopter).

Same data-parallel size: rank ``r`` of each resume is compared with rank ``r`` of the control
(same shards). Another data-parallel size: the restored state is compared through the
DP-size-independent gathered fingerprint (:func:`.fingerprint.gathered_fingerprint`), all ranks merged; the next step
cannot match the control (the global batch and the reduction order change with the DP size), so
the build's step N+1 on rank ``r`` is compared with upstream's step N+1 on rank ``r`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from benchmarks.resume_benchmark.results import adopters_that_handled, load_outcomes
from benchmarks.resume_benchmark.cases import (
    BenchmarkCase,
    extra_adopters,
    unpredicted_saving_note,
)
from benchmarks.resume_benchmark.launch import ParallelLayout
from benchmarks.resume_benchmark.results import WorkerResult, compare_digests, merge_rank_digests

#: Sides measured on resume, in report order.
RESUME_SIDES = ("upstream", "build")

#: Tolerance for "bytes avoided equals the expectation": max(relative, absolute).
AVOIDED_RELATIVE_TOLERANCE = 0.01
AVOIDED_ABSOLUTE_TOLERANCE = 1 << 20

_MIB = float(1 << 20)

Result = WorkerResult


def case_header(case: BenchmarkCase, layout: ParallelLayout) -> dict[str, Any]:
    """The fields every report entry of ``case`` starts with."""
    return {
        "case": case.name,
        "sharding_format": case.sharding_format,
        "moe": case.moe,
        "precision_aware": case.precision_aware,
        "instance_loader": case.instance_loader,
        "expected_saving_bytes_per_param": case.expected_saving_bytes_per_param,
        "parallel": layout.to_json(),
    }


def _padded(results: Sequence[Result | None], count: int) -> list[Result | None]:
    """``results`` cut or padded with ``None`` (rank without a result file) to ``count``."""
    return [results[r] if r < len(results) else None for r in range(count)]


def _failures(what: str, results: Sequence[Result | None]) -> list[str]:
    return [
        f"{what} rank {r}: "
        + (result["error"] if result else "no result (worker crashed or timed out)")
        for r, result in enumerate(results)
        if result is None or "error" in result
    ]


def _control_record(rank: int, control: Result) -> dict[str, Any]:
    record: dict[str, Any] = {
        "rank": rank,
        "megatron_core": control["megatron_core"],
        "params_on_rank": int(control["model"]["optimizer_params"]),
        "model_params_on_rank": control["model"]["model_params_on_rank"],
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


def resume_measurements(result: Result) -> dict[str, Any]:
    """What one successful resume rank measured.

    The load peak over the pre-load baseline, per optimizer parameter on the rank; whether the
    load peak stayed within the training peak of the same process (step N+1); times; and the
    worker's ``state_adoption`` and ``instance_loader`` records when it has them.
    """
    load = result["load"]
    params = int(result["model"]["optimizer_params"])
    over = load["peak_bytes"] - load["baseline_bytes"]
    recorded: dict[str, Any] = {}
    if "state_adoption" in result:
        recorded["state_adoption"] = result["state_adoption"]
    if "instance_loader" in result:
        recorded["instance_loader"] = result["instance_loader"]
    if "memory_timeline" in result:
        recorded["memory_timeline"] = result["memory_timeline"]
    return {
        "megatron_core": result["megatron_core"],
        "params_on_rank": params,
        "baseline_bytes": load["baseline_bytes"],
        "load_peak_bytes": load["peak_bytes"],
        "load_over_baseline_bytes": over,
        "load_over_baseline_bytes_per_param": over / params if params else None,
        "post_load_allocated_bytes": load["post_load_allocated_bytes"],
        "load_seconds": load["seconds"],
        "next_step_peak_bytes": result["next_step"]["peak_bytes"],
        "load_peak_within_training_peak": load["peak_bytes"] <= result["next_step"]["peak_bytes"],
        "next_step_loss": result["next_step"]["loss"],
        **recorded,
    }


def _unusable(result: Result | None) -> dict[str, Any]:
    """The side record of a rank without a usable result (none, or an ``error``)."""
    if result is None:
        return {"status": "not run"}
    return {"status": "error", "error": result["error"]}


def _resume_side(
    result: Result, restored: Mapping[str, Any], reference: Result | None, reference_name: str
) -> dict[str, Any]:
    """One resume rank: its measurements, the ``restored`` comparison, and step N+1 versus
    ``reference`` (None: nothing to compare it with)."""
    side: dict[str, Any] = {
        "status": "ok",
        **resume_measurements(result),
        "restored_state_equal": restored["equal"],
        "restored_state": dict(restored),
        "next_step_equal": None,
        "next_step_loss_equal": None,
        "next_step_state": None,
    }
    if reference is not None and "error" not in reference:
        after = compare_digests(reference["next_step"]["fingerprint"], result["next_step"]["fingerprint"])
        loss_equal = reference["next_step"]["loss_hex"] == result["next_step"]["loss_hex"]
        side.update(
            next_step_equal=loss_equal and after.equal,
            next_step_loss_equal=loss_equal,
            next_step_state={**after.to_json(), "reference": reference_name},
        )
    return side


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


def _rank_sides(
    layout: ParallelLayout,
    controls: Sequence[Result],
    resumed: Mapping[str, Sequence[Result | None]],
) -> dict[str, list[dict[str, Any]]]:
    """Every resume rank of both sides, compared (see the module docstring)."""
    count = layout.resume_nproc_per_node
    results = {label: _padded(resumed.get(label) or [], count) for label in RESUME_SIDES}
    sides: dict[str, list[dict[str, Any]]] = {}
    for label in RESUME_SIDES:
        gathered = _gathered_comparison(controls, results[label]) if layout.resharded else None
        sides[label] = []
        for r, result in enumerate(results[label]):
            if result is None or "error" in result:
                sides[label].append({"rank": r, **_unusable(result)})
                continue
            if gathered is None:  # same sharding: rank r of the control
                restored = compare_digests(
                    controls[r]["post_save_fingerprint"], result["restored_fingerprint"]
                ).to_json()
                side = _resume_side(result, restored, controls[r], "control, same rank")
            else:  # another DP size: the build's step N+1 against upstream's on the same rank
                upstream = results["upstream"][r] if label == "build" else None
                side = _resume_side(result, gathered, upstream, "upstream resume, same rank")
            sides[label].append({"rank": r, **side})
    return sides


def expectation_fields(
    case: BenchmarkCase, build_sides: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """The case's expected saving per parameter given what the build side's adopters did.

    Only :data:`~.cases.DEFAULT_ADOPTERS` handled the state on every build rank (per the
    recorded outcomes; a rank without outcomes counts every adopter it registered): the case's
    fixed expectation. Any other adopter: ``None`` and a note saying the saving is measured,
    not predicted.
    """
    records = [side.get("state_adoption") for side in build_sides]
    extra = extra_adopters(adopters_that_handled(records))
    outcomes = all((r or {}).get("outcomes") is not None for r in records)
    return {
        "expected_saving_bytes_per_param": case.expected_saving_given(extra),
        "extra_adopters": list(extra),
        "expected_saving_note": unpredicted_saving_note(extra, outcomes) if extra else None,
    }


def saving_fields(expected: int | None, pair: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Bytes the build avoided at load versus upstream on one rank, and whether that is
    ``expected`` (None: not predicted, so the ratio and the verdict are None too)."""
    avoided = pair["upstream"]["load_peak_bytes"] - pair["build"]["load_peak_bytes"]
    as_expected: bool | None = None
    if expected is not None:
        tolerance = max(AVOIDED_RELATIVE_TOLERANCE * expected, AVOIDED_ABSOLUTE_TOLERANCE)
        as_expected = abs(avoided - expected) <= tolerance
    return {
        "expected_bytes_avoided": expected,
        "bytes_avoided": avoided,
        "bytes_avoided_over_baseline": (
            pair["upstream"]["load_over_baseline_bytes"] - pair["build"]["load_over_baseline_bytes"]
        ),
        "bytes_avoided_ratio": (avoided / expected) if expected else None,
        "bytes_avoided_as_expected": as_expected,
    }


def _bitwise_ok(side: Mapping[str, Any]) -> bool:
    """Restored state equal, and step N+1 equal wherever it has a reference."""
    return bool(side["restored_state_equal"]) and side["next_step_equal"] is not False


def _rank_records(
    per_param: int | None, sides: Mapping[str, Sequence[Mapping[str, Any]]]
) -> list[dict[str, Any]]:
    """Per resume rank: the saving versus ``per_param`` x its parameters, the build's load peak
    versus its training peak, and bitwise equality of both sides."""
    records = []
    for r, build in enumerate(sides["build"]):
        pair = {label: sides[label][r] for label in RESUME_SIDES}
        params = int(build["params_on_rank"])
        records.append(
            {
                "rank": r,
                "params_on_rank": params,
                **saving_fields(None if per_param is None else per_param * params, pair),
                "load_peak_within_training_peak": build["load_peak_within_training_peak"],
                "all_bitwise_equal": all(_bitwise_ok(s) for s in pair.values()),
            }
        )
    return records


def instance_loader_problems(label: str, side: Mapping[str, Any]) -> list[str]:
    """Why one resume rank did not run as an instance-level loader requires (empty: it did).

    The loader must have run. On the build, every inner ``load_state_dict`` call must have
    fallen back (no adopter stands in for an instance's own method) and called it exactly once.
    """
    calls = (side.get("instance_loader") or {}).get("calls", 0)
    if label != "build":
        return [] if calls else [f"{label}'s instance loader never ran"]
    outcomes = (side.get("state_adoption") or {}).get("outcomes")
    if outcomes is None:
        return ["the build recorded no outcomes, so its instance-loader path cannot be verified"]
    loads = load_outcomes(side["state_adoption"])
    adopted = sorted({str(o["adopter"]) for o in loads if o.get("adopter")})
    problems = [f"adopter {name} installed the state over the instance loader" for name in adopted]
    fallbacks = len(loads) - sum(1 for o in loads if o.get("adopter"))
    if not loads or calls != fallbacks:
        problems.append(
            f"the build's instance loader ran ×{calls} for {fallbacks} load fallback(s) "
            "(expected exactly once each, at least once)"
        )
    return problems


def _mib(value: float) -> str:
    return f"{value / _MIB:,.1f} MiB"


def _rank_failures(
    record: Mapping[str, Any],
    pair: Mapping[str, Mapping[str, Any]],
    peak_required: bool,
    instance_loader: bool,
) -> list[str]:
    """Why one resume rank misses the expectation (empty: it meets it)."""
    r = record["rank"]
    failures = []
    if record["bytes_avoided_as_expected"] is False:
        failures.append(
            f"rank {r}: the build avoided {_mib(record['bytes_avoided'])} at load versus upstream, "
            f"expected {_mib(record['expected_bytes_avoided'])} "
            f"({record['params_on_rank']:,} optimizer params on the rank) within "
            f"max({AVOIDED_RELATIVE_TOLERANCE:.0%}, {_mib(AVOIDED_ABSOLUTE_TOLERANCE)})"
        )
    build = pair["build"]
    if peak_required and not build["load_peak_within_training_peak"]:
        failures.append(
            f"rank {r}: the build's load peak {_mib(build['load_peak_bytes'])} is above its "
            f"training peak (step N+1, same process) {_mib(build['next_step_peak_bytes'])}"
        )
    for label, side in pair.items():
        if not side["restored_state_equal"]:
            failures.append(f"rank {r}: {label}'s restored state is not bitwise equal")
        if side["next_step_equal"] is False:
            failures.append(f"rank {r}: {label}'s step N+1 is not bitwise equal")
        if instance_loader:
            failures += [f"rank {r}: {p}" for p in instance_loader_problems(label, side)]
    return failures


def summarize_case(
    case: BenchmarkCase,
    layout: ParallelLayout,
    controls: Sequence[Result | None],
    resumed: Mapping[str, Sequence[Result | None]],
) -> dict[str, Any]:
    """One case's report entry from every rank's control and resume results."""
    entry = case_header(case, layout)
    padded = _padded(controls, layout.nproc_per_node)
    failed = _failures("train+save+control", padded)
    if failed:
        entry.update(status="error", detail="; ".join(failed))
        return entry
    ok = [c for c in padded if c is not None]
    entry["total_params"] = ok[0]["model"]["total_params"]
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
    peak_required = per_param is not None and case.load_peak_within_training_peak_expected
    ranks = _rank_records(per_param, sides)
    entry.update(
        status="ok",
        detail=None,
        ranks=ranks,
        bytes_avoided_as_expected=(
            None if per_param is None else all(r["bytes_avoided_as_expected"] for r in ranks)
        ),
        load_peaks_within_training_peaks=(
            all(r["load_peak_within_training_peak"] for r in ranks) if peak_required else None
        ),
        all_bitwise_equal=all(r["all_bitwise_equal"] for r in ranks),
        failed_expectations=[
            failure
            for r in ranks
            for failure in _rank_failures(
                r,
                {label: sides[label][r["rank"]] for label in RESUME_SIDES},
                peak_required,
                case.instance_loader is not None,
            )
        ],
    )
    return entry


def case_meets_expectations(entry: Mapping[str, Any]) -> bool:
    """What ``--check`` requires of one entry: a format that cannot be saved is a result;
    otherwise status ``ok`` and no ``failed_expectations`` on any rank."""
    if entry.get("status") == "unsupported":
        return True
    return entry.get("status") == "ok" and entry.get("failed_expectations") == []
