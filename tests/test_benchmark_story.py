"""The whole benchmark story on the CPU: train, save, resume on both sides, compare, report.

The driver, the worker (``worker.main`` per rank), the summary, the report and ``--check`` run
unchanged; only the GPU parts are stand-ins (:mod:`benchmark_fakes`): the load goes through the
real state-adoption loader of the installed build, and upstream's through the inner optimizer's
own ``load_state_dict``, whose copy of the moments the fake device counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark_fakes import (
    FAKE_WORLD,
    install_fake_gpu,
    run_phases_in_process,
    standin_is_te_fused_adam,
)

from benchmarks.resume_benchmark.cases import PRESETS, make_case
from benchmarks.resume_benchmark.driver import CaseRun, Workspace, run_case
from benchmarks.resume_benchmark.launch import ParallelLayout
from benchmarks.resume_benchmark.report import markdown_report
from benchmarks.resume_benchmark.sides import Side
from benchmarks.resume_benchmark.summary import case_meets_expectations

TINY = PRESETS["tiny"]
SIDES = {"upstream": Side("upstream", Path("/up"), "test"), "build": Side("build", None, "test")}


def _run(tmp_path: Path, case_name: str, layout: ParallelLayout, **case_kwargs: Any) -> dict[str, Any]:
    run = CaseRun(Workspace(tmp_path / "work"), SIDES, {"upstream": None, "build": None}, layout,
                  tmp_path / "checkpoints", 60.0)  # fmt: skip
    return run_case(run, make_case(case_name, TINY, **case_kwargs))


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    install_fake_gpu(monkeypatch)
    standin_is_te_fused_adam(monkeypatch)
    return run_phases_in_process(monkeypatch)


@pytest.mark.parametrize("nproc", [1, 2])
def test_story_meets_every_expectation_on_every_rank(
    fake_gpu: list[tuple[str, str, int]], tmp_path: Path, nproc: int
) -> None:
    entry = _run(tmp_path, "dp_reshardable", ParallelLayout(nproc, 1, 1, nproc))
    assert entry["status"] == "ok", entry.get("detail")
    assert fake_gpu == [("train", "build", nproc), ("resume", "upstream", nproc), ("resume", "build", nproc)]
    assert [r["rank"] for r in entry["ranks"]] == list(range(nproc))
    for rank in entry["ranks"]:
        assert rank["expected_bytes_avoided"] == 8 * rank["params_on_rank"]
        assert rank["bytes_avoided"] == rank["expected_bytes_avoided"]
        assert rank["load_peak_within_training_peak"] and rank["all_bitwise_equal"]
    upstream = entry["rank_sides"]["upstream"]
    assert all(not s["load_peak_within_training_peak"] for s in upstream)  # TE's copy on top
    assert entry["failed_expectations"] == [] and case_meets_expectations(entry)
    assert entry["total_params"] == 36  # the fake model, counted once over the ranks
    assert not list((tmp_path / "checkpoints").iterdir())  # the checkpoint is deleted
    for side in entry["rank_sides"].values():  # no CUDA here: recorded as an error, not fatal
        assert all("no CUDA" in s["memory_timeline"]["error"] for s in side)


def test_moe_chains_two_distributed_optimizers_on_every_rank(
    fake_gpu: list[tuple[str, str, int]], tmp_path: Path
) -> None:
    entry = _run(tmp_path, "moe", ParallelLayout(2, 1, 1, 2))
    assert entry["status"] == "ok" and len(entry["inner_optimizers"]) == 2
    assert entry["failed_expectations"] == []
    markdown = markdown_report(_document(entry))
    assert "| moe (2 DistributedOptimizers) [TP 1, EP 1, DP 2] | build | 1 |" in markdown


def test_a_format_that_cannot_be_saved_ends_the_case_after_training(
    fake_gpu: list[tuple[str, str, int]], tmp_path: Path
) -> None:
    entry = _run(tmp_path, "fully_sharded_model_space", ParallelLayout())
    assert entry["status"] == "unsupported" and "flattened_range" in entry["detail"]
    assert fake_gpu == [("train", "build", 1)] and case_meets_expectations(entry)


def test_a_rank_that_crashes_fails_the_case_and_names_the_rank(
    fake_gpu: list[tuple[str, str, int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.resume_benchmark import checkpoint

    load = checkpoint.load_checkpoint

    def crash_on_rank_1(*args: Any, **kwargs: Any) -> None:
        if FAKE_WORLD.current.rank == 1:
            raise RuntimeError("CUDA out of memory on rank 1")
        load(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "load_checkpoint", crash_on_rank_1)
    entry = _run(tmp_path, "dp_reshardable", ParallelLayout(2, 1, 1, 2))
    assert entry["status"] == "error" and not case_meets_expectations(entry)
    assert "upstream rank 1: RuntimeError: CUDA out of memory on rank 1" in entry["detail"]
    assert "build rank 1: RuntimeError: CUDA out of memory on rank 1" in entry["detail"]


def _paths_missing(hand_made: Any, real: Any, at: str = "") -> list[str]:
    """Key paths of ``hand_made`` that ``real`` lacks (lists: compared item by first item;
    fingerprints, maps of tensor names to digests, only by their presence)."""
    if at.endswith("fingerprint"):
        return []
    if isinstance(hand_made, dict):
        if not isinstance(real, dict):
            return [at or "."]
        return [
            missing
            for key, value in hand_made.items()
            for missing in (
                [f"{at}.{key}"] if key not in real else _paths_missing(value, real[key], f"{at}.{key}")
            )
        ]
    if isinstance(hand_made, list) and hand_made and isinstance(hand_made[0], dict):
        return _paths_missing(hand_made[0], real[0] if real else None, f"{at}[0]")
    return []


def test_hand_made_results_have_the_real_workers_shape(
    fake_gpu: list[tuple[str, str, int]], tmp_path: Path
) -> None:
    """Every field of benchmark_results' results (the summary and report tests' input) is one
    the worker writes, so those tests exercise what a GPU run produces."""
    from benchmark_results import control, resume

    from benchmarks.resume_benchmark.launch import rank_result_path
    from benchmarks.resume_benchmark.results import read_json

    _run(tmp_path, "dp_reshardable", ParallelLayout())
    work = tmp_path / "work"
    real = {name: read_json(rank_result_path(work / f"dp_reshardable.{name}.result.json", 0))
            for name in ("control", "resume-upstream", "resume-build")}  # fmt: skip
    assert _paths_missing(control(100), real["control"]) == []
    assert _paths_missing(resume("upstream", 100, 16.0), real["resume-upstream"]) == []
    assert _paths_missing(resume("build", 100, 8.0), real["resume-build"]) == []


def _document(entry: dict[str, Any]) -> dict[str, Any]:
    from test_benchmark_report import document

    return document([entry], ParallelLayout.from_json(entry["parallel"]))


def _cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[int, dict[str, Any], str]:
    """``python -m benchmarks.resume_benchmark`` on the fake GPU: exit status, JSON, Markdown."""
    from benchmarks.resume_benchmark import cli

    monkeypatch.setattr(cli, "check_cuda", lambda: None)
    monkeypatch.setattr(cli, "check_gpu_count", lambda needed: None)
    monkeypatch.setattr(cli, "check_transformer_engine", lambda probe: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # restored after the test
    upstream = tmp_path / "site-upstream"
    upstream.mkdir(exist_ok=True)
    out = tmp_path / "out"
    argv = ["--preset", "tiny", "--upstream", str(upstream), "--work-dir", str(tmp_path / "work"),
            "--checkpoint-root", str(tmp_path / "ckpt"), "--json-out", f"{out}.json",
            "--markdown-out", f"{out}.md", *extra]  # fmt: skip
    status = cli.main(argv)
    return status, json.loads(Path(f"{out}.json").read_text()), Path(f"{out}.md").read_text()


def test_the_command_line_runs_and_checks_every_rank(
    fake_gpu: list[tuple[str, str, int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    status, doc, markdown = _cli(
        tmp_path, monkeypatch, "--cases", "dp_reshardable,moe", "--nproc-per-node", "2",
        "--gpus", "0,1", "--check",
    )  # fmt: skip
    assert status == 0, [c.get("failed_expectations") or c.get("detail") for c in doc["cases"]]
    assert fake_gpu[:2] == [("probe", "build", 1), ("probe", "upstream", 1)]
    assert doc["environment"]["cuda_visible_devices"] == "0,1"
    assert doc["settings"]["parallel"]["nproc_per_node"] == 2
    assert doc["sides"]["upstream"]["version"] == "0.19.2"
    assert [c["status"] for c in doc["cases"]] == ["ok", "ok"]
    assert "- total parameters: dp_reshardable [TP 1, EP 1, DP 2] 36, moe [TP 1, EP 1, DP 2] 36\n" in markdown
    assert "| case | side | rank |" in markdown


def test_check_fails_with_every_reason_when_the_build_does_not_adopt(
    fake_gpu: list[tuple[str, str, int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION", "1")  # the build's kill switch
    status, doc, markdown = _cli(tmp_path, monkeypatch, "--cases", "dp_reshardable", "--check")
    assert status == 4
    (case,) = doc["cases"]
    assert case["status"] == "ok" and len(case["failed_expectations"]) == 2
    err = capsys.readouterr().err
    assert "--check: dp_reshardable: rank 0: the build avoided 0.0 MiB at load versus upstream" in err
    assert "--check: dp_reshardable: rank 0: the build's load peak" in err
    assert "- **expectation missed** by dp_reshardable: rank 0:" in markdown
    assert "own loader ×2" in markdown
