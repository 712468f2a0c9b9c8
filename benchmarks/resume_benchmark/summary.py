"""Turn the raw worker results of one case into the numbers the report shows.

Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from benchmarks.resume_benchmark.cases import (
    BenchmarkCase,
    extra_adopters,
    unpredicted_saving_note,
)
from benchmarks.resume_benchmark.results import compare_digests

#: Sides measured on resume, in report order.
RESUME_SIDES = ("upstream", "build")

#: Tolerance for "bytes avoided equals the expectation": max(relative, absolute).
AVOIDED_RELATIVE_TOLERANCE = 0.01
AVOIDED_ABSOLUTE_TOLERANCE = 1 << 20


def resume_side(
    control: Mapping[str, Any], result: Mapping[str, Any] | None, params: int
) -> dict[str, Any]:
    """One resume side compared with the control: measurements and bitwise equality."""
    if result is None:
        return {"status": "not run"}
    if "error" in result:
        return {"status": "error", "error": result["error"]}
    restored = compare_digests(control["post_save_fingerprint"], result["restored_fingerprint"])
    after = compare_digests(control["next_step"]["fingerprint"], result["next_step"]["fingerprint"])
    loss_equal = control["next_step"]["loss_hex"] == result["next_step"]["loss_hex"]
    return {
        "status": "ok",
        **resume_measurements(result, params),
        "restored_state_equal": restored.equal,
        "restored_state": restored.to_json(),
        "next_step_equal": loss_equal and after.equal,
        "next_step_loss_equal": loss_equal,
        "next_step_state": after.to_json(),
    }


def resume_measurements(result: Mapping[str, Any], params: int) -> dict[str, Any]:
    """What one successful resume measured (load peak over baseline, times, next-step peak).

    ``params``: the optimizer parameters the per-parameter figure divides by. The worker's
    ``state_adoption`` record (:mod:`.adoption`) is passed on when the result has one.
    """
    load = result["load"]
    over = load["peak_bytes"] - load["baseline_bytes"]
    adoption = {"state_adoption": result["state_adoption"]} if "state_adoption" in result else {}
    return {
        "megatron_core": result["megatron_core"],
        "params_on_rank": result["model"]["optimizer_params"],
        "baseline_bytes": load["baseline_bytes"],
        "load_peak_bytes": load["peak_bytes"],
        "load_over_baseline_bytes": over,
        "load_over_baseline_bytes_per_param": over / params if params else None,
        "post_load_allocated_bytes": load["post_load_allocated_bytes"],
        "load_seconds": load["seconds"],
        "next_step_peak_bytes": result["next_step"]["peak_bytes"],
        "next_step_loss": result["next_step"]["loss"],
        **adoption,
    }


def recorded_adopters(sides: Iterable[Mapping[str, Any]]) -> list[str] | None:
    """Adopters registered on any of ``sides`` (e.g. every build rank), in order; None when
    none of them recorded a list (old results, or no state-adoption subsystem)."""
    names: dict[str, None] = {}
    recorded = False
    for side in sides:
        adopters = (side.get("state_adoption") or {}).get("adopters")
        if adopters is not None:
            recorded = True
            names.update(dict.fromkeys(adopters))
    return list(names) if recorded else None


def expectation_fields(
    case: BenchmarkCase, build_sides: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """The case's expected saving per parameter given the build side's registered adopters.

    Only :data:`~.cases.DEFAULT_ADOPTERS` (or nothing recorded): the case's fixed expectation.
    Others: ``None`` and a note saying the saving is measured, not predicted.
    """
    adopters = recorded_adopters(build_sides)
    extra = extra_adopters(adopters)
    return {
        "expected_saving_bytes_per_param": case.expected_saving_given(adopters),
        "extra_adopters": list(extra),
        "expected_saving_note": unpredicted_saving_note(extra) if extra else None,
    }


def expected_bytes(per_param: int | None, params: int) -> int | None:
    """``per_param`` x ``params``, or None when the saving is not predicted."""
    return None if per_param is None else per_param * params


def case_header(case: BenchmarkCase) -> dict[str, Any]:
    """The fields every report entry of ``case`` starts with (single- or multi-rank)."""
    return {
        "case": case.name,
        "sharding_format": case.sharding_format,
        "moe": case.moe,
        "precision_aware": case.precision_aware,
        "expected_saving_bytes_per_param": case.expected_saving_bytes_per_param,
    }


def summarize_case(
    case: BenchmarkCase,
    control: Mapping[str, Any] | None,
    resumed: Mapping[str, Mapping[str, Any] | None],
) -> dict[str, Any]:
    """One case's report entry from its control and resume results."""
    entry = case_header(case)
    if control is None or "error" in control:
        entry["status"] = "error"
        entry["detail"] = "train+save+control: " + (
            control["error"] if control else "no result (worker crashed or timed out)"
        )
        return entry
    params = int(control["model"]["optimizer_params"])
    entry.update(
        total_params=control["model"]["total_params"],
        params_on_rank=params,
        inner_optimizers=control["model"]["inner_optimizers"],
        control={
            "megatron_core": control["megatron_core"],
            "train_peak_bytes": control["train"]["peak_bytes"],
            "train_losses": [s["loss"] for s in control["train"]["steps"]],
        },
    )
    if not control["save"]["ok"]:
        entry["status"] = "unsupported"
        entry["detail"] = f"unsupported: {control['save']['error']}"
        return entry
    entry["control"].update(
        save_seconds=control["save"]["seconds"],
        checkpoint_bytes=control["save"]["checkpoint_bytes"],
        next_step_peak_bytes=control["next_step"]["peak_bytes"],
        next_step_loss=control["next_step"]["loss"],
    )
    sides = {label: resume_side(control, resumed.get(label), params) for label in RESUME_SIDES}
    entry["sides"] = sides
    entry.update(expectation_fields(case, [sides["build"]]))
    errors = [
        f"{label}: {s.get('error', s['status'])}"
        for label, s in sides.items()
        if s["status"] != "ok"
    ]
    if errors:
        entry["status"] = "error"
        entry["detail"] = "resume failed -- " + "; ".join(errors)
        return entry
    entry.update(
        status="ok",
        detail=None,
        **saving_fields(expected_bytes(entry["expected_saving_bytes_per_param"], params), sides),
        all_bitwise_equal=all(
            s["restored_state_equal"] and s["next_step_equal"] for s in sides.values()
        ),
    )
    return entry


def saving_fields(
    expected: int | None, sides: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """Bytes the build avoided at load versus upstream, and whether that is ``expected``.

    ``sides``: the ``upstream`` and ``build`` resume measurements of one rank. ``expected``
    None (not predicted): the ratio and the verdict are None too; the saving is only reported.
    """
    avoided = sides["upstream"]["load_peak_bytes"] - sides["build"]["load_peak_bytes"]
    as_expected: bool | None = None
    if expected is not None:
        tolerance = max(AVOIDED_RELATIVE_TOLERANCE * expected, AVOIDED_ABSOLUTE_TOLERANCE)
        as_expected = abs(avoided - expected) <= tolerance
    return {
        "expected_bytes_avoided": expected,
        "bytes_avoided": avoided,
        "bytes_avoided_over_baseline": (
            sides["upstream"]["load_over_baseline_bytes"]
            - sides["build"]["load_over_baseline_bytes"]
        ),
        "bytes_avoided_ratio": (avoided / expected) if expected else None,
        "bytes_avoided_as_expected": as_expected,
    }


def saving_predicted(entry: Mapping[str, Any]) -> bool:
    """False when the entry's saving is measured, not predicted (extra adopters on the build)."""
    return not (
        "expected_saving_bytes_per_param" in entry
        and entry["expected_saving_bytes_per_param"] is None
    )


def case_meets_expectations(entry: Mapping[str, Any]) -> bool:
    """Whether a measured case shows the expected saving and bitwise-identical resumes.

    A saving that is not predicted (:func:`saving_predicted`) is reported, not checked.
    """
    if entry.get("status") == "unsupported":
        return True
    saving_ok = not saving_predicted(entry) or entry.get("bytes_avoided_as_expected")
    return bool(entry.get("status") == "ok" and saving_ok and entry.get("all_bitwise_equal"))
