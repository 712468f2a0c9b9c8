"""Every rank's results of one case -> its report entry and the ``--check`` verdict.

One rank is N = 1 of the same code. Covers: each rank judged against 8 B x its own optimizer
parameters, the build's load peak against its training peak, bitwise equality per rank (the
gathered state at another data-parallel size), missing or failed ranks, formats that cannot be
saved, and the reasons ``--check`` lists.
"""

from __future__ import annotations

from typing import Any

import pytest
from benchmark_results import MIB, STEP_PEAK, TINY, control, entry, resume

from benchmarks.resume_benchmark.cases import make_case
from benchmarks.resume_benchmark.launch import ParallelLayout
from benchmarks.resume_benchmark.results import merge_rank_digests
from benchmarks.resume_benchmark.summary import case_meets_expectations, summarize_case

PARAMS = [100 * MIB, 100 * MIB]


@pytest.mark.parametrize("ranks", [1, 2])
def test_every_rank_meeting_the_expectation_passes(ranks: int) -> None:
    summary = entry("dp_reshardable", [8.0] * ranks)
    assert summary["status"] == "ok" and case_meets_expectations(summary)
    assert summary["failed_expectations"] == []
    assert [r["rank"] for r in summary["ranks"]] == list(range(ranks))
    for rank in summary["ranks"]:
        assert rank["expected_bytes_avoided"] == 8 * rank["params_on_rank"]
        assert rank["bytes_avoided_ratio"] == pytest.approx(1.0)
        assert rank["load_peak_within_training_peak"] and rank["all_bitwise_equal"]
    assert [s["rank"] for s in summary["rank_sides"]["build"]] == list(range(ranks))
    assert len(summary["controls"]) == ranks and summary["total_params"] == 300 * MIB
    assert summary["parallel"]["nproc_per_node"] == ranks
    assert summary["load_peaks_within_training_peaks"] is True


def test_each_rank_is_judged_against_its_own_parameters() -> None:
    summary = entry("dp_reshardable", [8.0, 8.0], params=[100 * MIB, 60 * MIB])
    assert [r["expected_bytes_avoided"] for r in summary["ranks"]] == [800 * MIB, 480 * MIB]
    assert case_meets_expectations(summary)


def test_one_rank_missing_the_saving_fails_the_case_and_says_why() -> None:
    summary = entry("dp_reshardable", [8.0, 12.0])
    assert summary["status"] == "ok"
    assert summary["ranks"][0]["bytes_avoided_as_expected"]
    assert not summary["ranks"][1]["bytes_avoided_as_expected"]
    assert not summary["bytes_avoided_as_expected"] and not case_meets_expectations(summary)
    assert summary["failed_expectations"] == [
        "rank 1: the build avoided 400.0 MiB at load versus upstream, expected 800.0 MiB "
        "(104,857,600 optimizer params on the rank) within max(1%, 1.0 MiB)"
    ]


def test_a_load_peak_above_the_training_peak_fails_the_case() -> None:
    over = (STEP_PEAK - 500 * MIB) / (100 * MIB) + 0.01  # just above the step's peak
    summary = entry("dp_reshardable", [8.0, 8.0])
    summary_over = entry("dp_reshardable", [8.0, over])
    assert summary_over["ranks"][1]["load_peak_within_training_peak"] is False
    assert summary_over["load_peaks_within_training_peaks"] is False
    assert any("rank 1: the build's load peak" in f for f in summary_over["failed_expectations"])
    assert not case_meets_expectations(summary_over) and case_meets_expectations(summary)


def test_the_precision_aware_fallback_does_not_require_the_load_peak_below_training() -> None:
    summary = entry("precision_aware_bf16", [16.0, 16.0])
    assert [r["expected_bytes_avoided"] for r in summary["ranks"]] == [0, 0]
    assert summary["load_peaks_within_training_peaks"] is None
    assert not summary["ranks"][0]["load_peak_within_training_peak"]  # reported, not required
    assert case_meets_expectations(summary)


def test_one_rank_differing_bitwise_fails_the_case() -> None:
    summary = entry("dp_reshardable", [8.0, 8.0], build_restored=[None, "corrupted"])
    assert summary["ranks"][0]["all_bitwise_equal"] and not summary["ranks"][1]["all_bitwise_equal"]
    assert not summary["rank_sides"]["build"][1]["restored_state_equal"]
    assert summary["failed_expectations"] == ["rank 1: build's restored state is not bitwise equal"]
    assert not case_meets_expectations(summary)


def test_a_missing_rank_result_is_an_error() -> None:
    case = make_case("dp_reshardable", TINY)
    layout = ParallelLayout(2, 1, 1, 2)
    summary = summarize_case(case, layout, [control(PARAMS[0]), None], {})
    assert summary["status"] == "error" and "train+save+control rank 1: no result" in summary["detail"]
    resumed = {
        "upstream": [resume("upstream", p, 16.0) for p in PARAMS],
        "build": [resume("build", PARAMS[0], 8.0), {"error": "RuntimeError: boom"}],
    }
    summary = summarize_case(case, layout, [control(p) for p in PARAMS], resumed)
    assert summary["status"] == "error" and "build rank 1: RuntimeError: boom" in summary["detail"]
    assert not case_meets_expectations(summary)
    missing = summarize_case(case, layout, [control(p) for p in PARAMS], {"upstream": resumed["upstream"]})
    assert "build rank 0: not run" in missing["detail"]


def test_unsaveable_format_is_unsupported_on_every_rank() -> None:
    case = make_case("fully_sharded_model_space", TINY)
    controls = [control(p, saved=False) for p in PARAMS]
    summary = summarize_case(case, ParallelLayout(2, 1, 1, 2), controls, {})
    assert summary["status"] == "unsupported" and case_meets_expectations(summary)
    assert "flattened_range" in summary["detail"] and len(summary["controls"]) == 2


MODEL = {"model.tp0.pp0.chunk0.w": "M"}
WORLD = {"opt0.mp0.gbuf0.torch.float32.exp_avg": "E", "opt0.mp0.group0.hparams": "H"}


def _resharded(restored_build: list[dict[str, str]], build_next: str | None = None) -> dict[str, Any]:
    """DP 2 -> 4: the world tensors live on DP rank 0, model shards on every rank."""
    case = make_case("dp_reshardable", TINY)
    controls = [control(PARAMS[0], {**MODEL, **WORLD}), control(PARAMS[1], MODEL)]
    quarter = [50 * MIB] * 4
    upstream_gathered = [{**MODEL, **WORLD}, MODEL, MODEL, MODEL]
    resumed = {
        "upstream": [resume("upstream", p, 16.0, "other", g, f"up-{r}")
                     for r, (p, g) in enumerate(zip(quarter, upstream_gathered))],
        "build": [resume("build", p, 8.0, "other", g, build_next or f"up-{r}")
                  for r, (p, g) in enumerate(zip(quarter, restored_build))],
    }  # fmt: skip
    return summarize_case(case, ParallelLayout(2, 1, 1, 4), controls, resumed)


def test_resharded_resume_compares_the_gathered_state() -> None:
    summary = _resharded([MODEL, {**MODEL, **WORLD}, MODEL, MODEL])
    assert summary["status"] == "ok" and case_meets_expectations(summary), summary.get("detail")
    assert len(summary["ranks"]) == 4 and len(summary["controls"]) == 2
    for rank in summary["ranks"]:
        assert rank["expected_bytes_avoided"] == 8 * 50 * MIB  # params on *that* rank
    build = summary["rank_sides"]["build"][0]
    assert build["restored_state"]["scope"].startswith("gathered")
    assert build["next_step_state"]["reference"].startswith("upstream")
    assert summary["rank_sides"]["upstream"][0]["next_step_equal"] is None


def test_resharded_resume_detects_a_changed_world_tensor() -> None:
    changed = {**WORLD, "opt0.mp0.gbuf0.torch.float32.exp_avg": "X"}
    summary = _resharded([{**MODEL, **changed}, MODEL, MODEL, MODEL])
    assert not summary["rank_sides"]["build"][0]["restored_state_equal"]
    assert not case_meets_expectations(summary)


def test_resharded_resume_detects_disagreeing_replicas() -> None:
    summary = _resharded([{**MODEL, **WORLD}, MODEL, {"model.tp0.pp0.chunk0.w": "Z"}, MODEL])
    side = summary["rank_sides"]["build"][0]
    assert not side["restored_state_equal"]
    assert side["restored_state"]["replica_conflicts"] == ["model.tp0.pp0.chunk0.w"]


def test_resharded_build_step_must_match_upstream() -> None:
    summary = _resharded([{**MODEL, **WORLD}, MODEL, MODEL, MODEL], build_next="diverged")
    assert summary["rank_sides"]["build"][0]["next_step_equal"] is False
    assert "rank 0: build's step N+1 is not bitwise equal" in summary["failed_expectations"]
    assert not case_meets_expectations(summary)


def test_merge_rank_digests() -> None:
    merged, conflicts = merge_rank_digests([{"a": "1", "b": "2"}, {"b": "2", "c": "3"}])
    assert merged == {"a": "1", "b": "2", "c": "3"} and conflicts == []
    assert merge_rank_digests([{"a": "1"}, {"a": "2"}])[1] == ["a"]


def test_check_requires_the_verdict_of_the_summary() -> None:
    assert case_meets_expectations({"status": "unsupported"})
    assert not case_meets_expectations({"status": "error", "detail": "x"})
    assert not case_meets_expectations({"status": "ok"})  # no verdict: fails
    assert not case_meets_expectations({"status": "ok", "failed_expectations": ["rank 0: x"]})
    assert case_meets_expectations({"status": "ok", "failed_expectations": []})
