"""The resume benchmark's state-adoption record, on the CPU (no GPU).

Covers what a resume worker records (the registered adopters, and the loader's INFO messages
during the load, fed through the real ``load_inner_optimizer_state_dict``), the expectation
(fixed with the default adopters, not predicted with others on the build side), ``--check``
with an expectation that is not predicted, and the report's ``state installed by`` column --
also for documents written before the field existed.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmark_results import RESULTS, column, document, entry, table

from benchmarks.resume_benchmark import worker
from benchmarks.resume_benchmark.adoption import (
    STATE_ADOPTION_LOGGER,
    installed_by_text,
    parse_adoption_message,
    recording_adoption_events,
    registered_adopter_names,
)
from benchmarks.resume_benchmark.cases import (
    DEFAULT_ADOPTERS,
    PRESETS,
    extra_adopters,
    make_case,
)
from benchmarks.resume_benchmark.launch import ParallelLayout
from benchmarks.resume_benchmark.report import main as report_main
from benchmarks.resume_benchmark.report import markdown_report
from benchmarks.resume_benchmark.summary import case_meets_expectations
from megatron.core.optimizer.state_adoption import registered_state_adopters

TINY = PRESETS["tiny"]
MIB = 1 << 20
PARAMS = 100 * MIB
PLUGIN = "te_fused_adam_precision_aware"
FP32 = "te_fused_adam_fp32"
DASH = "—"

INSTALLED = (
    "Optimizer state adopter 'te_fused_adam_fp32' installed the FusedAdam state, avoiding "
    "8916762624 bytes (8503.7 MiB) of allocation"
)
FALLBACK = "No optimizer state adopter installed the state: FusedAdam.load_state_dict loads it"


# --------------------------------------------------------------------------- worker record


def test_parse_the_loader_messages() -> None:
    assert parse_adoption_message(INSTALLED) == {
        "adopter": FP32,
        "message": INSTALLED,
        "avoided_bytes": 8916762624,
    }
    assert parse_adoption_message(FALLBACK) == {
        "adopter": None,
        "message": FALLBACK,
        "avoided_bytes": None,
    }


def test_registered_adopter_names(monkeypatch: pytest.MonkeyPatch) -> None:
    names = registered_adopter_names()
    assert names == [a.name for a in registered_state_adopters()]
    assert FP32 in names
    monkeypatch.setitem(sys.modules, "megatron.core.optimizer.state_adoption", None)
    assert registered_adopter_names() is None  # upstream: no state-adoption subsystem


# --------------------------------------------------------------------------- expectation


def test_expectation_depends_on_extra_adopters_only() -> None:
    dense, aware = make_case("dp_reshardable", TINY), make_case("precision_aware_bf16", TINY)
    assert DEFAULT_ADOPTERS == (FP32,)
    for adopters in (None, [], [FP32], (FP32, FP32)):
        assert extra_adopters(adopters) == ()
        assert dense.expected_saving_given(adopters) == 8 == dense.expected_saving_bytes_per_param
        assert aware.expected_saving_given(adopters) == 0 == aware.expected_saving_bytes_per_param
    assert extra_adopters([PLUGIN, FP32, PLUGIN]) == (PLUGIN,)
    assert dense.expected_saving_given([FP32, PLUGIN]) is None
    assert aware.expected_saving_given([PLUGIN]) is None


def _event(adopter: str | None) -> dict[str, Any]:
    if adopter is None:
        return parse_adoption_message(FALLBACK)
    return parse_adoption_message(INSTALLED.replace(FP32, adopter))


UPSTREAM: dict[str, Any] = {"adopters": None, "events": []}


def _build_adoption(adopters: list[str], *installed: str | None) -> dict[str, Any]:
    return {"adopters": adopters, "events": [_event(a) for a in installed]}


def _entry(
    case: str,
    build_bytes: float,
    build: dict[str, Any] | None,
    upstream: dict[str, Any] | None = UPSTREAM,
    restored: str | None = None,
) -> dict[str, Any]:
    return entry(case, [build_bytes], [PARAMS], [restored], [build], upstream)


def test_default_adopter_keeps_the_fixed_expectation() -> None:
    recorded = _entry("dp_reshardable", 8.0, _build_adoption([FP32], FP32))
    old = _entry("dp_reshardable", 8.0, None, upstream=None)  # results without the field
    for summary in (recorded, old):
        rank = summary["ranks"][0]
        assert summary["expected_saving_bytes_per_param"] == 8
        assert rank["expected_bytes_avoided"] == 8 * PARAMS
        assert rank["bytes_avoided_ratio"] == pytest.approx(1.0)
        assert summary["bytes_avoided_as_expected"] is True and case_meets_expectations(summary)
        assert summary["extra_adopters"] == [] and summary["expected_saving_note"] is None
    assert recorded["rank_sides"]["build"][0]["state_adoption"]["events"][0]["adopter"] == FP32
    assert "state_adoption" not in old["rank_sides"]["build"][0]
    missed = _entry("dp_reshardable", 12.0, _build_adoption([FP32], FP32))
    assert missed["bytes_avoided_as_expected"] is False and not case_meets_expectations(missed)
    aware = _entry("precision_aware_bf16", 16.0, _build_adoption([FP32], None))
    assert aware["ranks"][0]["expected_bytes_avoided"] == 0 and case_meets_expectations(aware)


def test_extra_adopter_makes_the_saving_measured_not_predicted() -> None:
    adoption = _build_adoption([FP32, PLUGIN], PLUGIN)
    for case, build_bytes in (("precision_aware_bf16", 12.0), ("dp_reshardable", 16.0)):
        summary = _entry(case, build_bytes, adoption)
        rank = summary["ranks"][0]
        assert summary["status"] == "ok"
        assert summary["expected_saving_bytes_per_param"] is None
        assert rank["expected_bytes_avoided"] is None
        assert rank["bytes_avoided_ratio"] is None
        assert summary["bytes_avoided_as_expected"] is None
        assert rank["bytes_avoided"] == int((16.0 - build_bytes) * PARAMS)  # still reported
        assert summary["extra_adopters"] == [PLUGIN]
        assert summary["expected_saving_note"] == (
            f"not predicted: adopters {PLUGIN} registered on the build side; "
            "the saving is measured, not predicted"
        )
        assert case_meets_expectations(summary)  # status ok and bitwise equal suffice
    corrupted = _entry("precision_aware_bf16", 12.0, adoption, restored="corrupted")
    assert corrupted["all_bitwise_equal"] is False and not case_meets_expectations(corrupted)
    upstream_only = _entry("dp_reshardable", 16.0, UPSTREAM, upstream=adoption)
    assert upstream_only["expected_saving_bytes_per_param"] == 8  # the build side decides


def _multi_rank_entry(build: list[dict[str, Any]], build_bytes: float = 12.0) -> dict[str, Any]:
    return entry("moe", [build_bytes] * len(build), build_adoption=build, upstream_adoption=UPSTREAM)


def test_multi_rank_extra_adopters_propagate_per_rank() -> None:
    rank0 = _build_adoption([FP32, PLUGIN], FP32, PLUGIN)
    rank1 = {"adopters": [FP32, PLUGIN], "events": []}  # the loader logs on rank 0 only
    entry = _multi_rank_entry([rank0, rank1])
    assert entry["expected_saving_bytes_per_param"] is None and entry["extra_adopters"] == [PLUGIN]
    assert entry["bytes_avoided_as_expected"] is None and case_meets_expectations(entry)
    assert [r["expected_bytes_avoided"] for r in entry["ranks"]] == [None, None]
    assert [r["bytes_avoided_as_expected"] for r in entry["ranks"]] == [None, None]
    assert [s["state_adoption"] for s in entry["rank_sides"]["build"]] == [rank0, rank1]
    default = _multi_rank_entry([_build_adoption([FP32], FP32)] * 2, build_bytes=8.0)
    assert default["expected_saving_bytes_per_param"] == 8
    assert default["ranks"][0]["expected_bytes_avoided"] == 8 * PARAMS
    assert default["bytes_avoided_as_expected"] is True and case_meets_expectations(default)
    short = _multi_rank_entry([_build_adoption([FP32], FP32)] * 2, build_bytes=12.0)
    assert short["bytes_avoided_as_expected"] is False and not case_meets_expectations(short)


# --------------------------------------------------------------------------- report


def test_report_shows_who_installed_the_state() -> None:
    aware = _entry("precision_aware_bf16", 12.0, _build_adoption([FP32, PLUGIN], PLUGIN, PLUGIN))
    dense = _entry("dp_reshardable", 8.0, _build_adoption([FP32], FP32))
    fallback = _entry("precision_aware_bf16", 16.0, _build_adoption([FP32], None))
    markdown = markdown_report(document([aware, dense, fallback]))
    header, rows = table(markdown)
    at = header.index("state installed by")
    assert header[at - 1] == "avoided ÷ (8 B × params)"
    assert column(markdown, "state installed by") == {
        "control (uninterrupted)": [DASH] * 3,
        "upstream": [DASH] * 3,
        "build": [f"{PLUGIN} ×2", f"{FP32} ×1", "own loader ×1"],
    }
    assert column(markdown, "avoided ÷ (8 B × params)")["build"] == [
        "not predicted (extra adopters); avoided 4.00 B/param",
        "1.0000",
        "expected 0",
    ]
    assert (
        "- state adopters registered at resume: upstream: no state-adoption subsystem; build: "
        f"{FP32}, {PLUGIN} (precision_aware_bf16); {FP32} (dp_reshardable, precision_aware_bf16)"
    ) in markdown
    assert (
        f"- expected saving of precision_aware_bf16: not predicted: adopters {PLUGIN} "
        "registered on the build side; the saving is measured, not predicted."
    ) in markdown


def test_report_multi_rank_rows_show_each_ranks_record() -> None:
    summary = _multi_rank_entry(
        [_build_adoption([FP32, PLUGIN], FP32, PLUGIN), {"adopters": [FP32, PLUGIN], "events": []}]
    )
    markdown = markdown_report(document([summary], ParallelLayout(2, 1, 1, 2)))
    header, rows = table(markdown)
    assert header[:3] == ["case", "side", "rank"]
    assert column(markdown, "state installed by")["build"] == [
        f"{FP32} ×1, {PLUGIN} ×1",
        DASH,
    ]
    assert column(markdown, "avoided ÷ (8 B × params)")["build"] == [
        "not predicted (extra adopters); avoided 4.00 B/param"
    ] * 2
    registered = f"upstream: no state-adoption subsystem; build: {FP32}, {PLUGIN}\n"
    assert f"- state adopters registered at resume: {registered}" in markdown


def test_old_documents_merge_with_new_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = json.loads((RESULTS / "a.json").read_text())
    assert "state installed by" not in markdown_report(old)  # as committed
    new = document([_entry("precision_aware_bf16", 12.0, _build_adoption([FP32, PLUGIN], PLUGIN))])
    path = tmp_path / "new.json"
    path.write_text(json.dumps(new))
    merged_json = tmp_path / "all.json"
    argv = [str(RESULTS / "a.json"), str(path), str(RESULTS / "b.json"), "--json-out",
            str(merged_json)]  # fmt: skip
    assert report_main(argv) == 0
    header, rows = table(capsys.readouterr().out)
    installed = header.index("state installed by")
    case = header.index("case")
    not_predicted = "not predicted (extra adopters); avoided 4.00 B/param"
    old_rows = [r for r in rows if r[installed - 1] != not_predicted]
    assert len(old_rows) == len(rows) - 1
    assert {r[installed] for r in old_rows} == {DASH}
    new_build = [r for r in rows if r not in old_rows][0]
    assert new_build[case] == "precision_aware_bf16" and new_build[installed] == f"{PLUGIN} ×1"
    merged = json.loads(merged_json.read_text())
    assert len(merged["cases"]) == len(old["cases"]) + 1 + len(
        json.loads((RESULTS / "b.json").read_text())["cases"]
    )
