"""The resume benchmark's state-adoption record, on the CPU (no GPU).

Covers what a resume worker records on every rank -- the registered adopters and the
structured outcome of every hook point during the load, taken from the installed build's real
loader and outcome hooks (upstream, without the subsystem, records null) -- the expectation
(fixed while only the default adopter handles the state, measured-not-predicted when another
one does), and the report's ``state installed by`` column, also for documents written before
outcomes existed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark_fakes import (
    install_fake_gpu,
    run_phases_in_process,
    standin_is_te_fused_adam,
    without_state_adoption,
)
from benchmark_results import RESULTS, column, document, entry
from builders import Owner, cloned_state_dict, fresh_standin, numel_bytes, trained_standin

from benchmarks.resume_benchmark.results import (
    adopters_that_handled,
    fallback_text,
    installed_by_text,
    recording_outcomes,
    registered_adopter_names,
)
from benchmarks.resume_benchmark.cases import DEFAULT_ADOPTERS, PRESETS, extra_adopters, make_case
from benchmarks.resume_benchmark.driver import CaseRun, Workspace, run_case
from benchmarks.resume_benchmark.launch import ParallelLayout
from benchmarks.resume_benchmark.report import main as report_main
from benchmarks.resume_benchmark.report import markdown_report
from benchmarks.resume_benchmark.sides import Side
from benchmarks.resume_benchmark.summary import case_meets_expectations
from megatron.core.optimizer.state_adoption import (
    export_inner_optimizer_state_dict,
    load_inner_optimizer_state_dict,
    registered_state_adopters,
)

TINY = PRESETS["tiny"]
MIB = 1 << 20
PARAMS = 100 * MIB
PLUGIN = "te_fused_adam_precision_aware"
FP32 = "te_fused_adam_fp32"
DASH = "—"


def _load() -> None:
    """The real loader on a stand-in FusedAdam, as a DistributedOptimizer calls it."""
    load_inner_optimizer_state_dict(Owner(fresh_standin()), cloned_state_dict(trained_standin()))


# --------------------------------------------------------------------------- worker record


def test_outcomes_of_the_real_loader_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    _load()  # before the block: not recorded
    with recording_outcomes() as outcomes:
        _load()  # the default adopter does not know the stand-in: the own loader runs
        standin_is_te_fused_adam(monkeypatch)
        _load()
        export_inner_optimizer_state_dict(Owner(fresh_standin()))
    _load()  # after the block: the hook is gone
    assert outcomes is not None and [(o["hook_point"], o["adopter"]) for o in outcomes] == [
        ("load", None), ("load", FP32), ("export", None)]  # fmt: skip
    fallback, adopted, _ = outcomes
    assert fallback["optimizer"].startswith("FusedAdamStandIn 0x")  # which inner optimizer
    assert fallback["method"] == "FusedAdamStandIn.load_state_dict" and fallback["reused_bytes"] == 0
    assert fallback["allocated_bytes"] == numel_bytes(fresh_standin())  # TE's second copy
    assert [name for name, _ in fallback["declines"]][0] == FP32
    assert fallback["fallback_reason"] and fallback["error"] is None
    assert adopted["reused_bytes"] == numel_bytes(fresh_standin()) and adopted["allocated_bytes"] == 0
    assert adopted["method"] is None and adopted["declines"] == []
    json.dumps(outcomes)
    record = {"adopters": registered_adopter_names(), "outcomes": outcomes}
    assert installed_by_text(record) == f"own loader ×1, {FP32} ×1"
    reason = fallback_text(record)
    assert reason is not None and reason.startswith(fallback["fallback_reason"])
    assert f"{FP32}: " in reason


def test_the_hook_is_removed_when_the_load_raises() -> None:
    with pytest.raises(RuntimeError, match="load failed"):
        with recording_outcomes() as outcomes:
            _load()
            raise RuntimeError("load failed")
    _load()
    assert outcomes is not None and len(outcomes) == 1


def test_upstream_records_null(monkeypatch: pytest.MonkeyPatch) -> None:
    names = registered_adopter_names()
    assert names == [r.name for r in registered_state_adopters()] and FP32 in (names or [])
    without_state_adoption(monkeypatch)
    assert registered_adopter_names() is None
    with recording_outcomes() as outcomes:
        pass
    assert outcomes is None and installed_by_text({"adopters": None, "outcomes": None}) is None


def test_every_resume_rank_records_its_outcomes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Both load passes of both DistributedOptimizers on each of two ranks, each outcome
    measuring 8 B x that optimizer's parameters on that rank installed by reference and nothing
    allocated; upstream records null."""
    install_fake_gpu(monkeypatch)
    standin_is_te_fused_adam(monkeypatch)
    run_phases_in_process(monkeypatch)
    sides = {"upstream": Side("upstream", Path("/up"), "t"), "build": Side("build", None, "t")}
    run = CaseRun(Workspace(tmp_path / "w"), sides, {"upstream": None, "build": None},
                  ParallelLayout(2, 1, 1, 2), tmp_path / "ckpt", 60.0)  # fmt: skip
    summary = run_case(run, make_case("moe", TINY))
    assert summary["status"] == "ok", summary.get("detail")
    for side in summary["rank_sides"]["upstream"]:
        assert side["state_adoption"] == {"adopters": None, "outcomes": None}
    for side in summary["rank_sides"]["build"]:
        outcomes = side["state_adoption"]["outcomes"]
        loads = [o for o in outcomes if o["hook_point"] == "load"]
        assert [o["adopter"] for o in loads] == [FP32] * 4
        assert sum(o["reused_bytes"] for o in loads) == 2 * 8 * side["params_on_rank"]
        assert [o["allocated_bytes"] for o in loads] == [0] * 4
        assert len({o["optimizer"] for o in loads}) == 2  # the dense and the expert optimizer
        assert sum(o["hook_point"] == "export" for o in outcomes) == 4
    assert summary["extra_adopters"] == []  # registered plugins declined: still predicted
    assert summary["expected_saving_bytes_per_param"] == 8 and case_meets_expectations(summary)
    markdown = markdown_report(document([summary], ParallelLayout(2, 1, 1, 2)))
    assert column(markdown, "state installed by") == {
        "control (uninterrupted)": [DASH] * 2, "upstream": [DASH] * 2, "build": [f"{FP32} ×4"] * 2}  # fmt: skip


# --------------------------------------------------------------------------- expectation


def _outcome(adopter: str | None, hook_point: str = "load") -> dict[str, Any]:
    return {"hook_point": hook_point, "optimizer": f"FusedAdam 0x7f00 (40 params, {PARAMS:,} elements)",
            "adopter": adopter, "method": None if adopter else "FusedAdam.load_state_dict",
            "reused_bytes": 8 * PARAMS if adopter else 0, "allocated_bytes": 0 if adopter else 8 * PARAMS,
            "declines": [] if adopter else [[FP32, "the optimizer is precision-aware"]],
            "fallback_reason": None if adopter else "every adopter declined", "error": None}  # fmt: skip


def _adoption(adopters: list[str], *handled: str | None) -> dict[str, Any]:
    return {"adopters": adopters, "outcomes": [_outcome(a) for a in handled]}


UPSTREAM: dict[str, Any] = {"adopters": None, "outcomes": None}


def _entry(case: str, build_bytes: float, build: dict[str, Any] | None, **kwargs: Any) -> dict[str, Any]:
    return entry(case, [build_bytes], [PARAMS], build_adoption=[build], **{"upstream_adoption": UPSTREAM, **kwargs})


def test_expectation_depends_on_extra_adopters_only() -> None:
    dense, aware = make_case("dp_reshardable", TINY), make_case("precision_aware_bf16", TINY)
    assert DEFAULT_ADOPTERS == (FP32,)
    for adopters in (None, [], [FP32], (FP32, FP32)):
        assert extra_adopters(adopters) == ()
        assert dense.expected_saving_given(adopters) == 8 == dense.expected_saving_bytes_per_param
        assert aware.expected_saving_given(adopters) == 0 == aware.expected_saving_bytes_per_param
    assert extra_adopters([PLUGIN, FP32, PLUGIN]) == (PLUGIN,)
    assert dense.expected_saving_given([FP32, PLUGIN]) is None


def test_adopters_that_handled_the_state() -> None:
    assert adopters_that_handled([_adoption([FP32, PLUGIN], FP32, None)]) == [FP32]
    assert adopters_that_handled([_adoption([FP32], PLUGIN), _adoption([FP32], FP32)]) == [PLUGIN, FP32]
    assert adopters_that_handled([{"adopters": [FP32, PLUGIN], "outcomes": None}]) == [FP32, PLUGIN]
    assert adopters_that_handled([UPSTREAM, None]) is None


def test_a_registered_plugin_that_declined_keeps_the_expectation() -> None:
    summary = _entry("dp_reshardable", 8.0, _adoption([FP32, PLUGIN], FP32, FP32))
    assert summary["expected_saving_bytes_per_param"] == 8 and summary["extra_adopters"] == []
    assert summary["ranks"][0]["bytes_avoided_as_expected"] and case_meets_expectations(summary)
    missed = _entry("dp_reshardable", 12.0, _adoption([FP32], FP32, FP32))
    assert missed["bytes_avoided_as_expected"] is False and not case_meets_expectations(missed)
    aware = _entry("precision_aware_bf16", 16.0, _adoption([FP32], None, None))
    assert aware["ranks"][0]["expected_bytes_avoided"] == 0 and case_meets_expectations(aware)


def test_an_extra_adopter_that_handled_the_state_makes_the_saving_measured() -> None:
    handled = _adoption([FP32, PLUGIN], PLUGIN, PLUGIN)
    for case, build_bytes in (("precision_aware_bf16", 12.0), ("dp_reshardable", 16.0)):
        summary = _entry(case, build_bytes, handled)
        rank = summary["ranks"][0]
        assert summary["status"] == "ok" and summary["expected_saving_bytes_per_param"] is None
        assert rank["expected_bytes_avoided"] is None and rank["bytes_avoided_ratio"] is None
        assert summary["bytes_avoided_as_expected"] is None
        assert summary["load_peaks_within_training_peaks"] is None  # not required either
        assert rank["bytes_avoided"] == int((16.0 - build_bytes) * PARAMS)  # still reported
        assert summary["extra_adopters"] == [PLUGIN]
        assert summary["expected_saving_note"] == (
            f"not predicted: adopters {PLUGIN} handled the state on the build side; "
            "the saving is measured, not predicted"
        )
        assert case_meets_expectations(summary)  # status ok and bitwise equal suffice
    corrupted = _entry("precision_aware_bf16", 12.0, handled, build_restored=["corrupted"])
    assert corrupted["all_bitwise_equal"] is False and not case_meets_expectations(corrupted)
    without_outcomes = _entry("dp_reshardable", 8.0, {"adopters": [FP32, PLUGIN], "outcomes": None})
    assert without_outcomes["expected_saving_note"].startswith(f"not predicted: adopters {PLUGIN} registered")
    upstream_only = _entry("dp_reshardable", 16.0, UPSTREAM, upstream_adoption=handled)
    assert upstream_only["expected_saving_bytes_per_param"] == 8  # the build side decides


def test_any_rank_whose_extra_adopter_handled_the_state_decides() -> None:
    ranks = [_adoption([FP32, PLUGIN], FP32), _adoption([FP32, PLUGIN], PLUGIN)]
    summary = entry("moe", [12.0, 12.0], build_adoption=ranks, upstream_adoption=UPSTREAM)
    assert summary["expected_saving_bytes_per_param"] is None and summary["extra_adopters"] == [PLUGIN]
    assert [r["expected_bytes_avoided"] for r in summary["ranks"]] == [None, None]
    assert case_meets_expectations(summary)
    default = entry("moe", [8.0, 8.0], build_adoption=[_adoption([FP32], FP32)] * 2)
    assert default["ranks"][0]["expected_bytes_avoided"] == 8 * PARAMS
    assert default["bytes_avoided_as_expected"] is True and case_meets_expectations(default)


# --------------------------------------------------------------------------- report


def test_report_shows_who_installed_the_state_on_each_rank() -> None:
    aware = _entry("precision_aware_bf16", 12.0, _adoption([FP32, PLUGIN], PLUGIN, PLUGIN))
    dense = _entry("dp_reshardable", 8.0, _adoption([FP32], FP32, FP32))
    fallback = _entry("precision_aware_bf16", 16.0, _adoption([FP32], None, None))
    two_ranks = entry("moe", [8.0, 8.0], build_adoption=[_adoption([FP32], FP32), _adoption([FP32], None)],
                      upstream_adoption=UPSTREAM)  # fmt: skip
    markdown = markdown_report(document([aware, dense, fallback, two_ranks]))
    assert column(markdown, "state installed by")["build"] == [
        f"{PLUGIN} ×2", f"{FP32} ×2", "own loader ×2", f"{FP32} ×1", "own loader ×1"]  # fmt: skip
    assert column(markdown, "state installed by")["upstream"] == [DASH] * 5
    assert column(markdown, "avoided ÷ (8 B × params)")["build"][:3] == [
        "not predicted (extra adopters); avoided 4.00 B/param", "1.0000", "expected 0"]  # fmt: skip
    assert (
        "- state adopters registered at resume: upstream: no state-adoption subsystem; build: "
        f"{FP32}, {PLUGIN} (precision_aware_bf16); {FP32} (dp_reshardable, precision_aware_bf16, moe)"
    ) in markdown
    assert (
        f"- expected saving of precision_aware_bf16: not predicted: adopters {PLUGIN} "
        "handled the state on the build side; the saving is measured, not predicted."
    ) in markdown


def test_old_documents_with_logged_events_merge_with_new_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pa-plugin.json recorded the loader's log events; they still read as who installed the
    state, next to rows that recorded outcomes."""
    new = document([_entry("dp_reshardable", 8.0, _adoption([FP32], FP32, FP32))])
    path = tmp_path / "new.json"
    path.write_text(json.dumps(new))
    argv = [str(RESULTS / "pa-plugin.json"), str(RESULTS / "pa-uninstalled.json"), str(path)]
    assert report_main(argv) == 0
    markdown = capsys.readouterr().out
    assert column(markdown, "state installed by")["build"] == [
        f"{PLUGIN} ×2", "own loader ×2", f"{FP32} ×2"]  # fmt: skip
