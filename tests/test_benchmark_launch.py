"""Multi-rank support of the resume benchmark, on the CPU (no GPU, no torchrun launch).

Covers the phase command for one rank (unchanged) and several ranks (``torch.distributed.run``),
the validation of the process-layout flags, the refusal of formats that cannot be resumed at
another data-parallel size, the aggregation of per-rank results into a case entry and its report
rows, and that the committed single-rank H200 results still render byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.resume_benchmark import cli
from benchmarks.resume_benchmark.cases import (
    CASE_NAMES,
    PRESETS,
    SHARDING_FORMATS,
    BenchmarkCase,
    make_case,
)
from benchmarks.resume_benchmark.launch import (
    DP_RESHARDABLE_FORMATS,
    LayoutError,
    ParallelLayout,
    rank_result_path,
    refuse_dp_resharding,
    validate_layout,
    worker_command,
)
from benchmarks.resume_benchmark.rank_summary import summarize_multi_rank_case
from benchmarks.resume_benchmark.report import markdown_report, merge_documents
from benchmarks.resume_benchmark.report import main as report_main
from benchmarks.resume_benchmark.results import merge_rank_digests
from benchmarks.resume_benchmark.summary import case_meets_expectations

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "gpu-results"
TINY = PRESETS["tiny"]
MIB = 1 << 20


# --------------------------------------------------------------------------- commands


def test_single_rank_command_is_the_plain_worker_command() -> None:
    command = worker_command("/py", "train", Path("/w/c.result.json"), Path("/w/c.spec.json"), None)
    assert command == [
        "/py",
        "-m",
        "benchmarks.resume_benchmark.worker",
        "--phase",
        "train",
        "--result",
        "/w/c.result.json",
        "--spec",
        "/w/c.spec.json",
    ]
    probe = worker_command("/py", "probe", Path("/w/p.result.json"), None, None)
    assert probe == ["/py", "-m", "benchmarks.resume_benchmark.worker", "--phase", "probe",
                     "--result", "/w/p.result.json"]  # fmt: skip


def test_multi_rank_command_goes_through_torchrun() -> None:
    command = worker_command("/py", "resume", Path("/w/r.result.json"), Path("/w/r.spec.json"), 4)
    assert command[:7] == [
        "/py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
    ]
    assert command[7:] == [
        "benchmarks.resume_benchmark.worker",
        "--phase",
        "resume",
        "--result",
        "/w/r.result.json",
        "--spec",
        "/w/r.spec.json",
    ]


def test_torchrun_accepts_the_launcher_flags() -> None:
    """The installed torch's launcher parses exactly the flags the command uses."""
    from torch.distributed.run import get_args_parser

    command = worker_command(sys.executable, "train", Path("r.json"), Path("s.json"), 2)
    parsed = get_args_parser().parse_args(command[3:])
    assert parsed.standalone and parsed.module and parsed.nproc_per_node == "2"
    assert parsed.training_script == "benchmarks.resume_benchmark.worker"
    assert parsed.training_script_args == ["--phase", "train", "--result", "r.json",
                                           "--spec", "s.json"]  # fmt: skip


def test_rank_result_path() -> None:
    assert rank_result_path(Path("/w/moe.control.result.json"), 3) == Path(
        "/w/moe.control.result.rank3.json"
    )


def test_phase_nproc_and_single_rank_default() -> None:
    layout = ParallelLayout(8, 1, 1, 4)
    assert layout.phase_nproc("train") == 8 and layout.phase_nproc("resume") == 4
    assert layout.resharded and layout.is_multi_rank
    assert not ParallelLayout().is_multi_rank and not ParallelLayout().resharded
    assert ParallelLayout.from_json(layout.to_json()) == layout
    assert layout.to_json()["data_parallel_size"] == 8
    assert ParallelLayout(4, 2, 1, 4).to_json()["data_parallel_size"] == 2
    assert ParallelLayout(4, 1, 2, 4).expert_data_parallel_size(4) == 2


# --------------------------------------------------------------------------- validation


def _cases(*names: str, **kwargs: Any) -> list[BenchmarkCase]:
    return [make_case(n, TINY, **kwargs) for n in names]


def test_default_flags_give_the_single_rank_layout() -> None:
    layout = validate_layout(1, 1, 1, None, _cases(*CASE_NAMES), TINY)
    assert layout == ParallelLayout() and not layout.is_multi_rank


def test_valid_multi_rank_layouts() -> None:
    assert validate_layout(2, 1, 1, None, _cases("dp_reshardable"), TINY).resume_nproc_per_node == 2
    assert validate_layout(4, 2, 1, None, _cases("fully_reshardable"), TINY).is_multi_rank
    assert validate_layout(2, 1, 2, None, _cases("moe"), TINY).expert_model_parallel_size == 2
    for fmt in sorted(DP_RESHARDABLE_FORMATS):
        assert validate_layout(2, 1, 1, 4, _cases(fmt), TINY).resharded


@pytest.mark.parametrize(
    ("nproc", "tp", "ep", "resume", "names", "message"),
    [
        (3, 2, 1, None, ("dp_reshardable",), "--nproc-per-node 3 is not divisible by --tensor"),
        (2, 1, 4, None, ("moe",), "not divisible by TP x EP = 1 x 4"),
        (4, 2, 2, 2, ("moe",), "--resume-nproc-per-node 2 is not divisible by TP x EP"),
        (4, 2, 1, 3, ("dp_reshardable",), "--resume-nproc-per-node 3 is not divisible"),
        (0, 1, 1, None, ("dp_reshardable",), "must be at least 1"),
        (2, 0, 1, None, ("dp_reshardable",), "must be at least 1"),
        (8, 8, 1, None, ("dp_reshardable",), "--num-attention-heads 4 is not divisible"),
        (2, 1, 2, None, ("dp_reshardable", "moe"), "applies to the moe case only"),
        (8, 1, 8, None, ("moe",), "--num-experts 4 is not divisible by --expert-model"),
        (2, 1, 1, 4, ("fully_sharded_model_space",), "cannot be resumed at another"),
    ],
)
def test_invalid_layouts_are_refused(
    nproc: int, tp: int, ep: int, resume: int | None, names: tuple[str, ...], message: str
) -> None:
    with pytest.raises(LayoutError, match=message.replace("(", r"\(")):
        validate_layout(nproc, tp, ep, resume, _cases(*names), TINY)


def test_fold_experts_with_expert_parallelism_is_refused() -> None:
    with pytest.raises(LayoutError, match="--moe-fold-experts"):
        validate_layout(2, 1, 2, None, _cases("moe", moe_fold_experts=True), TINY)


def test_resharding_refusal_names_the_format_and_the_alternatives() -> None:
    with pytest.raises(LayoutError) as info:
        refuse_dp_resharding("fully_sharded_model_space", "fully_sharded_model_space")
    text = str(info.value)
    assert "flattened_range" in text
    for fmt in DP_RESHARDABLE_FORMATS:
        assert fmt in text
    for fmt in DP_RESHARDABLE_FORMATS:
        refuse_dp_resharding(fmt, fmt)  # does not raise
    assert set(SHARDING_FORMATS) - DP_RESHARDABLE_FORMATS == {"fully_sharded_model_space"}


def test_fully_reshardable_is_what_megatron_core_calls_fully_reshardable() -> None:
    """The classification leans on MCore 0.19.2's own list of fully reshardable formats."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    fully = set(DistributedOptimizer.checkpoint_fully_reshardable_formats)
    assert "fully_reshardable" in fully and "dp_reshardable" not in fully
    assert "dp_zero_gather_scatter" not in fully


def test_cli_reports_an_invalid_layout_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--preset", "tiny", "--nproc-per-node", "3", "--tensor-model-parallel-size", "2"])
    assert info.value.code == 2
    assert "--nproc-per-node 3 is not divisible" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["--preset", "tiny", "--nproc-per-node", "2", "--resume-nproc-per-node", "4",
                  "--cases", "fully_sharded_model_space"])  # fmt: skip
    assert info.value.code == 2
    assert "cannot be resumed at another data-parallel size" in capsys.readouterr().err


def test_cli_parses_the_layout_flags() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["--preset", "tiny", "--cases", "moe", "--nproc-per-node", "4",
                              "--expert-model-parallel-size", "2",
                              "--resume-nproc-per-node", "2"])  # fmt: skip
    layout = cli.parse_layout(parser, args, cli.model_size(args))
    assert layout == ParallelLayout(4, 1, 2, 2)
    defaults = parser.parse_args([])
    assert cli.parse_layout(parser, defaults, cli.model_size(defaults)) == ParallelLayout()


# --------------------------------------------------------------------------- aggregation


def _step(fp: str, loss_hex: str = "0x1.8p+1", peak: int = 900 * MIB) -> dict[str, Any]:
    return {"peak_bytes": peak, "loss": float.fromhex(loss_hex), "loss_hex": loss_hex,
            "fingerprint": {"w": fp}}  # fmt: skip


def _model(params: int) -> dict[str, Any]:
    fused_adam = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
    return {"optimizer_params": params, "total_params": 3 * params, "inner_optimizers": [fused_adam]}


def _control(params: int, gathered: dict[str, str] | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "phase": "train",
        "megatron_core": {"version": "0.19.2+stateadoption", "file": "/b/megatron/core"},
        "model": _model(params),
        "train": {"steps": [{"loss": 3.0}], "peak_bytes": 1000 * MIB, "baseline_bytes": 0},
        "save": {"ok": True, "error": None, "seconds": 1.0, "checkpoint_bytes": 16 * params},
        "post_save_fingerprint": {"w": f"saved-{params}"},
        "next_step": _step(f"next-{params}"),
    }
    if gathered is not None:
        result["post_save_gathered_fingerprint"] = gathered
    return result


def _resume(
    label: str,
    params: int,
    bytes_per_param: float,
    fp: str | None = None,
    gathered: dict[str, str] | None = None,
    next_fp: str | None = None,
) -> dict[str, Any]:
    baseline = 500 * MIB
    result: dict[str, Any] = {
        "phase": "resume",
        "megatron_core": {"version": "0.19.2" if label == "upstream" else "0.19.2+stateadoption",
                          "file": f"/{label}/megatron/core"},  # fmt: skip
        "model": _model(params),
        "load": {"baseline_bytes": baseline, "peak_bytes": baseline + int(bytes_per_param * params),
                 "post_load_allocated_bytes": baseline, "seconds": 2.0},  # fmt: skip
        "restored_fingerprint": {"w": fp or f"saved-{params}"},
        "next_step": _step(next_fp or f"next-{params}", peak=890 * MIB),
    }
    if gathered is not None:
        result["restored_gathered_fingerprint"] = gathered
    return result


PARAMS = [100 * MIB, 100 * MIB]


def _same_sharding_entry(build_bytes: list[float], build_fps: list[str | None]) -> dict[str, Any]:
    case = make_case("dp_reshardable", TINY)
    controls = [_control(p) for p in PARAMS]
    resumed = {
        "upstream": [_resume("upstream", p, 16.0) for p in PARAMS],
        "build": [_resume("build", p, b, fp) for p, b, fp in zip(PARAMS, build_bytes, build_fps)],
    }
    return summarize_multi_rank_case(case, ParallelLayout(2, 1, 1, 2), controls, resumed)


def test_every_rank_meeting_the_expectation_passes() -> None:
    entry = _same_sharding_entry([8.0, 8.0], [None, None])
    assert entry["status"] == "ok" and case_meets_expectations(entry)
    assert [r["rank"] for r in entry["ranks"]] == [0, 1]
    for rank in entry["ranks"]:
        assert rank["expected_bytes_avoided"] == 8 * rank["params_on_rank"]
        assert rank["bytes_avoided_ratio"] == pytest.approx(1.0)
        assert rank["all_bitwise_equal"]
    assert [s["rank"] for s in entry["rank_sides"]["build"]] == [0, 1]
    assert len(entry["controls"]) == 2


def test_one_rank_missing_the_saving_fails_the_case() -> None:
    entry = _same_sharding_entry([8.0, 12.0], [None, None])
    assert entry["status"] == "ok"
    assert entry["ranks"][0]["bytes_avoided_as_expected"]
    assert not entry["ranks"][1]["bytes_avoided_as_expected"]
    assert not entry["bytes_avoided_as_expected"] and not case_meets_expectations(entry)


def test_one_rank_differing_bitwise_fails_the_case() -> None:
    entry = _same_sharding_entry([8.0, 8.0], [None, "corrupted"])
    assert entry["ranks"][0]["all_bitwise_equal"] and not entry["ranks"][1]["all_bitwise_equal"]
    assert not entry["rank_sides"]["build"][1]["restored_state_equal"]
    assert not case_meets_expectations(entry)


def test_a_missing_rank_result_is_an_error() -> None:
    case = make_case("dp_reshardable", TINY)
    controls: list[dict[str, Any] | None] = [_control(PARAMS[0]), None]
    entry = summarize_multi_rank_case(case, ParallelLayout(2, 1, 1, 2), controls, {})
    assert entry["status"] == "error" and "rank 1" in entry["detail"]
    resumed = {
        "upstream": [_resume("upstream", p, 16.0) for p in PARAMS],
        "build": [_resume("build", PARAMS[0], 8.0), {"error": "RuntimeError: boom"}],
    }
    entry = summarize_multi_rank_case(
        case, ParallelLayout(2, 1, 1, 2), [_control(p) for p in PARAMS], resumed
    )
    assert entry["status"] == "error" and "build rank 1: RuntimeError: boom" in entry["detail"]
    assert not case_meets_expectations(entry)


def test_unsaveable_format_is_unsupported_on_every_rank() -> None:
    case = make_case("fully_sharded_model_space", TINY)
    controls = [_control(p) for p in PARAMS]
    for c in controls:
        c["save"] = {"ok": False, "error": "CheckpointingException: flattened_range"}
    entry = summarize_multi_rank_case(case, ParallelLayout(2, 1, 1, 2), controls, {})
    assert entry["status"] == "unsupported" and case_meets_expectations(entry)


def _resharded_entry(
    restored_build: list[dict[str, str]], build_next: str | None = None
) -> dict[str, Any]:
    """DP 2 -> 4: the world tensors live on DP rank 0, model shards on every rank."""
    case = make_case("dp_reshardable", TINY)
    world = {"opt0.mp0.gbuf0.torch.float32.exp_avg": "E", "opt0.mp0.group0.hparams": "H"}
    model = {"model.tp0.pp0.chunk0.w": "M"}
    controls = [_control(PARAMS[0], {**model, **world}), _control(PARAMS[1], model)]
    quarter = [50 * MIB] * 4
    upstream_gathered = [{**model, **world}, model, model, model]
    resumed = {
        "upstream": [_resume("upstream", p, 16.0, "other", g, f"up-{r}")
                     for r, (p, g) in enumerate(zip(quarter, upstream_gathered))],
        "build": [_resume("build", p, 8.0, "other", g, build_next or f"up-{r}")
                  for r, (p, g) in enumerate(zip(quarter, restored_build))],
    }  # fmt: skip
    return summarize_multi_rank_case(case, ParallelLayout(2, 1, 1, 4), controls, resumed)


def test_resharded_resume_compares_the_gathered_state() -> None:
    model = {"model.tp0.pp0.chunk0.w": "M"}
    world = {"opt0.mp0.gbuf0.torch.float32.exp_avg": "E", "opt0.mp0.group0.hparams": "H"}
    entry = _resharded_entry([model, {**model, **world}, model, model])
    assert entry["status"] == "ok" and case_meets_expectations(entry), entry.get("detail")
    assert len(entry["ranks"]) == 4 and len(entry["controls"]) == 2
    for rank in entry["ranks"]:
        assert rank["expected_bytes_avoided"] == 8 * 50 * MIB  # params on *that* rank
    build = entry["rank_sides"]["build"][0]
    assert build["restored_state"]["scope"].startswith("gathered")
    assert build["next_step_state"]["reference"].startswith("upstream")
    assert entry["rank_sides"]["upstream"][0]["next_step_equal"] is None


def test_resharded_resume_detects_a_changed_world_tensor() -> None:
    model = {"model.tp0.pp0.chunk0.w": "M"}
    changed = {"opt0.mp0.gbuf0.torch.float32.exp_avg": "X", "opt0.mp0.group0.hparams": "H"}
    entry = _resharded_entry([{**model, **changed}, model, model, model])
    assert not entry["rank_sides"]["build"][0]["restored_state_equal"]
    assert not case_meets_expectations(entry)


def test_resharded_resume_detects_disagreeing_replicas() -> None:
    model = {"model.tp0.pp0.chunk0.w": "M"}
    world = {"opt0.mp0.gbuf0.torch.float32.exp_avg": "E", "opt0.mp0.group0.hparams": "H"}
    entry = _resharded_entry([{**model, **world}, model, {"model.tp0.pp0.chunk0.w": "Z"}, model])
    side = entry["rank_sides"]["build"][0]
    assert not side["restored_state_equal"]
    assert side["restored_state"]["replica_conflicts"] == ["model.tp0.pp0.chunk0.w"]


def test_resharded_build_step_must_match_upstream() -> None:
    model = {"model.tp0.pp0.chunk0.w": "M"}
    world = {"opt0.mp0.gbuf0.torch.float32.exp_avg": "E", "opt0.mp0.group0.hparams": "H"}
    entry = _resharded_entry([{**model, **world}, model, model, model], build_next="diverged")
    assert entry["rank_sides"]["build"][0]["next_step_equal"] is False
    assert not case_meets_expectations(entry)


def test_merge_rank_digests() -> None:
    merged, conflicts = merge_rank_digests([{"a": "1", "b": "2"}, {"b": "2", "c": "3"}])
    assert merged == {"a": "1", "b": "2", "c": "3"} and conflicts == []
    assert merge_rank_digests([{"a": "1"}, {"a": "2"}])[1] == ["a"]


# --------------------------------------------------------------------------- report


def _document(entries: list[dict[str, Any]], parallel: dict[str, Any] | None) -> dict[str, Any]:
    committed = json.loads((RESULTS / "a.json").read_text())
    settings = dict(committed["settings"])
    if parallel is not None:
        settings["parallel"] = parallel
    return {**committed, "settings": settings, "cases": entries}


def _table_rows(markdown: str) -> list[list[str]]:
    rows = [line for line in markdown.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def test_report_has_one_row_per_case_side_and_rank() -> None:
    entry = _same_sharding_entry([8.0, 8.0], [None, None])
    markdown = markdown_report(_document([entry], ParallelLayout(2, 1, 1, 2).to_json()))
    header = [line for line in markdown.splitlines() if line.startswith("| ")][0]
    assert header.startswith("| case | side | rank | megatron-core |")
    rows = _table_rows(markdown)
    assert [(r[1], r[2]) for r in rows] == [
        ("control (uninterrupted)", "0"),
        ("control (uninterrupted)", "1"),
        ("upstream", "0"),
        ("upstream", "1"),
        ("build", "0"),
        ("build", "1"),
    ]
    assert all(r[0] == "dp_reshardable [TP 1, EP 1, DP 2]" for r in rows)
    build = rows[4]
    assert build[4] == f"{100 * MIB:,}"  # params on that rank
    assert build[9] == "800.0" and build[10] == "1.0000"  # avoided MiB, ratio to 8 B x params
    assert build[14:] == ["yes", "yes"]
    assert "2 rank(s) per phase, TP 1, EP 1, DP 2" in markdown


def test_report_marks_what_a_resharded_resume_compares() -> None:
    model = {"model.tp0.pp0.chunk0.w": "M"}
    world = {"opt0.mp0.gbuf0.torch.float32.exp_avg": "E", "opt0.mp0.group0.hparams": "H"}
    entry = _resharded_entry([{**model, **world}, model, model, model])
    markdown = markdown_report(_document([entry], ParallelLayout(2, 1, 1, 4).to_json()))
    rows = _table_rows(markdown)
    assert len(rows) == 2 + 4 + 4
    upstream = [r for r in rows if r[1] == "upstream"][0]
    build = [r for r in rows if r[1] == "build"][0]
    assert upstream[14:] == ["yes (gathered)", "—"]
    assert build[14:] == ["yes (gathered)", "yes (= upstream)"]
    assert rows[0][0] == "dp_reshardable [TP 1, EP 1, DP 2 → 4]"
    assert "resumed on 4 rank(s) (DP 4)" in markdown


def test_single_rank_entries_get_rank_zero_next_to_multi_rank_ones() -> None:
    single = json.loads((RESULTS / "a.json").read_text())["cases"][0]
    multi = _same_sharding_entry([8.0, 8.0], [None, None])
    rows = _table_rows(markdown_report(_document([single, multi], None)))
    assert [r[2] for r in rows[:3]] == ["0", "0", "0"]
    assert len(rows) == 3 + 6


def test_single_rank_report_has_no_rank_column() -> None:
    markdown = markdown_report(json.loads((RESULTS / "a.json").read_text()))
    assert "| case | side | megatron-core |" in markdown and "| rank |" not in markdown
    assert "distributed optimizer, one rank; hidden" in markdown


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


def test_committed_single_rank_results_render_each_run_unchanged() -> None:
    for name in ("a", "b"):
        document = json.loads((RESULTS / f"{name}.json").read_text())
        assert markdown_report(document) == (RESULTS / f"{name}.md").read_text()
        assert merge_documents([document])["cases"] == document["cases"]


def test_gathered_world_tensor_names_do_not_depend_on_the_dp_size() -> None:
    """The names come from MCore's gathered state (buffer, dtype, key), never from a DP rank."""
    import torch

    from benchmarks.resume_benchmark.gathered import _world_tensors

    state = {
        "buckets_coalesced": True,
        0: {torch.float32: {"param": torch.zeros(3), "exp_avg": torch.ones(3), "numel_unpadded": 1}},
    }
    names = [name for name, _ in _world_tensors(state, "opt1.mp0")]
    assert names == ["opt1.mp0.gbuf0.torch.float32.exp_avg", "opt1.mp0.gbuf0.torch.float32.param"]
