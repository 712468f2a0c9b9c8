"""The resume benchmark's Markdown report and the merging of several runs' documents.

The committed H200 results (``docs/gpu-results/*.json``, written before the one-path entry
shape) must render byte for byte as committed; current entries render through the same code on
one rank (no rank column, as before) and on several (a rank column, the layout in the case
cell, the model total in the header).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_results import MIB, RESULTS, TINY, column, control, document, entry, resume, table

from benchmarks.resume_benchmark.cases import make_case
from benchmarks.resume_benchmark.launch import ParallelLayout
from benchmarks.resume_benchmark.report import main as report_main
from benchmarks.resume_benchmark.report import markdown_report, merge_documents
from benchmarks.resume_benchmark.summary import summarize_case

COMMITTED = ("a", "b", "all", "pa-plugin", "pa-uninstalled")
#: Session 9's documents: the current entry shape, with outcomes of the build of that time
#: (``avoided_bytes``, the class name as ``optimizer``, no ``method``/``reused_bytes``).
SESSION9 = tuple(sorted(p.stem for p in (RESULTS / "session9").glob("*.json")))
DASH = "—"


@pytest.mark.parametrize("name", COMMITTED + tuple(f"session9/{n}" for n in SESSION9))
def test_committed_results_render_unchanged(name: str) -> None:
    stored = json.loads((RESULTS / f"{name}.json").read_text())
    assert markdown_report(stored) == (RESULTS / f"{name}.md").read_text()
    assert merge_documents([stored])["cases"] == stored["cases"]


def test_session9_documents_hold_outcomes_of_the_earlier_build() -> None:
    """What the test above renders: old outcome records, which must keep rendering."""
    assert len(SESSION9) >= 10
    stored = json.loads((RESULTS / "session9" / "dp2.json").read_text())
    outcome = stored["cases"][0]["rank_sides"]["build"][0]["state_adoption"]["outcomes"][0]
    assert "avoided_bytes" in outcome and "reused_bytes" not in outcome and "method" not in outcome


def test_converted_old_documents_carry_outcomes_with_the_current_fields() -> None:
    """The documents written before the current entry shape were converted once: their logged
    events are outcomes with the current outcome's fields, the adopter's claimed bytes as
    reused, the rest unrecorded (None)."""
    from megatron.core.optimizer.state_adoption import StateAdoptionOutcome

    fields = set(StateAdoptionOutcome("load", "FusedAdam", None).to_json())
    for name in ("a", "b", "all", "pa-plugin", "pa-uninstalled"):
        stored = json.loads((RESULTS / f"{name}.json").read_text())
        assert all("parallel" in entry and "sides" not in entry for entry in stored["cases"]), name
    stored = json.loads((RESULTS / "pa-plugin.json").read_text())
    (build,) = stored["cases"][0]["rank_sides"]["build"]
    outcomes = build["state_adoption"]["outcomes"]
    assert outcomes and all(set(o) == fields for o in outcomes)
    assert all(o["allocated_bytes"] is None and o["method"] is None for o in outcomes)
    assert any(o["adopter"] and o["reused_bytes"] > 0 for o in outcomes)


def test_committed_results_still_merge_to_the_committed_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    md, js = tmp_path / "all.md", tmp_path / "all.json"
    argv = [str(RESULTS / "a.json"), str(RESULTS / "b.json"), "--markdown-out", str(md),
            "--json-out", str(js)]  # fmt: skip
    assert report_main(argv) == 0
    assert capsys.readouterr().out == (RESULTS / "all.md").read_text()
    assert md.read_bytes() == (RESULTS / "all.md").read_bytes()
    assert js.read_bytes() == (RESULTS / "all.json").read_bytes()


def test_one_rank_renders_as_before_plus_the_load_peak_column() -> None:
    markdown = markdown_report(document([entry("dp_reshardable", [8.0])]))
    header, rows = table(markdown)
    committed_header, _ = table((RESULTS / "a.md").read_text())
    assert [c for c in header if c != "load peak ≤ step N+1 peak"] == committed_header
    assert [r[0] for r in rows] == ["dp_reshardable"] * 3  # no layout in the case cell
    assert "distributed optimizer, one rank; hidden" in markdown
    assert "- total parameters: dp_reshardable 314,572,800\n" in markdown
    assert column(markdown, "load peak ≤ step N+1 peak") == {
        "control (uninterrupted)": [DASH], "upstream": ["**NO**"], "build": ["yes"]}  # fmt: skip
    assert column(markdown, "avoided ÷ (8 B × params)")["build"] == ["1.0000"]


def test_several_ranks_have_one_row_per_case_side_and_rank() -> None:
    markdown = markdown_report(document([entry("dp_reshardable", [8.0, 8.0])], ParallelLayout(2, 1, 1, 2)))
    header, rows = table(markdown)
    assert header[:4] == ["case", "side", "rank", "megatron-core"]
    assert [(r[1], r[2]) for r in rows] == [
        ("control (uninterrupted)", "0"), ("control (uninterrupted)", "1"),
        ("upstream", "0"), ("upstream", "1"), ("build", "0"), ("build", "1"),
    ]  # fmt: skip
    assert all(r[0] == "dp_reshardable [TP 1, EP 1, DP 2]" for r in rows)
    build = rows[4]
    assert build[header.index("params on rank")] == f"{100 * MIB:,}"
    assert build[header.index("avoided vs upstream MiB")] == "800.0"
    assert build[header.index("avoided ÷ (8 B × params)")] == "1.0000"
    assert build[-2:] == ["yes", "yes"]
    assert "2 rank(s) per phase, TP 1, EP 1, DP 2" in markdown
    assert "- total parameters: dp_reshardable [TP 1, EP 1, DP 2] 314,572,800\n" in markdown


def test_report_marks_what_a_resharded_resume_compares() -> None:
    model = {"model.tp0.pp0.chunk0.w": "M"}
    world = {"opt0.mp0.gbuf0.torch.float32.exp_avg": "E"}
    controls = [control(100 * MIB, {**model, **world})]
    resumed = {
        "upstream": [resume("upstream", 50 * MIB, 16.0, "x", g) for g in ({**model, **world}, model)],
        "build": [resume("build", 50 * MIB, 8.0, "x", g) for g in ({**model, **world}, model)],
    }
    layout = ParallelLayout(1, 1, 1, 2)
    summary = summarize_case(make_case("dp_zero_gather_scatter", TINY), layout, controls, resumed)
    markdown = markdown_report(document([summary], layout))
    _, rows = table(markdown)
    assert len(rows) == 1 + 2 + 2 and rows[0][0] == "dp_zero_gather_scatter [TP 1, EP 1, DP 1 → 2]"
    assert [r[-2:] for r in rows if r[1] == "upstream"] == [["yes (gathered)", DASH]] * 2
    assert [r[-2:] for r in rows if r[1] == "build"] == [["yes (gathered)", "yes (= upstream)"]] * 2
    assert "resumed on 2 rank(s) (DP 2)" in markdown


def test_committed_single_rank_entries_get_rank_zero_next_to_several_ranks() -> None:
    single = json.loads((RESULTS / "a.json").read_text())["cases"][0]
    several = entry("dp_reshardable", [8.0, 8.0])
    _, rows = table(markdown_report(document([single, several])))
    assert [r[2] for r in rows[:3]] == ["0", "0", "0"] and len(rows) == 3 + 6


def test_missed_expectations_are_listed_above_the_table() -> None:
    markdown = markdown_report(document([entry("dp_reshardable", [8.0, 12.0])]))
    assert (
        "- **expectation missed** by dp_reshardable [TP 1, EP 1, DP 2]: rank 1: the build avoided "
        "400.0 MiB"
    ) in markdown
    assert "expectation missed" not in markdown_report(document([entry("dp_reshardable", [8.0])]))


def test_failed_and_unsupported_cases_render_their_control_rows() -> None:
    case = make_case("fully_sharded_model_space", TINY)
    unsupported = summarize_case(
        case, ParallelLayout(2, 1, 1, 2), [control(100 * MIB, saved=False)] * 2, {}
    )
    crashed = {"case": "moe", "parallel": ParallelLayout(2, 1, 1, 2).to_json(), "status": "error",
               "detail": "driver: RuntimeError: boom"}  # fmt: skip
    _, rows = table(markdown_report(document([unsupported, crashed], ParallelLayout(2, 1, 1, 2))))
    assert [(r[1], r[2]) for r in rows] == [("control", "0"), ("control", "1"), ("control", DASH)]
    assert rows[0][5].startswith("unsupported: CheckpointingException")
    assert rows[2][5] == "driver: RuntimeError: boom"
