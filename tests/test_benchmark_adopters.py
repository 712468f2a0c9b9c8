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
from adopters_for_tests import DecliningAdopter
from builders import Owner, cloned_state_dict, fresh_standin, numel_bytes, standin_adopter
from builders import trained_standin

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
from benchmarks.resume_benchmark.rank_summary import summarize_multi_rank_case
from benchmarks.resume_benchmark.report import main as report_main
from benchmarks.resume_benchmark.report import markdown_report
from benchmarks.resume_benchmark.summary import case_meets_expectations, summarize_case
from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    load_inner_optimizer_state_dict,
    registered_state_adopters,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "gpu-results"
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


def _registry(*adopters: Any) -> StateAdopterRegistry:
    registry = StateAdopterRegistry(entry_point_group=None)
    for adopter in adopters:
        registry.register(adopter)
    return registry


def _load(registry: StateAdopterRegistry) -> None:
    """The real loader on a stand-in FusedAdam, as a DistributedOptimizer calls it."""
    load_inner_optimizer_state_dict(
        Owner(fresh_standin()), cloned_state_dict(trained_standin()), registry
    )


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


def test_events_from_the_real_loader() -> None:
    """The loader's own records (child logger, INFO, through log_single_rank) are parsed."""
    with recording_adoption_events() as events:
        _load(_registry(DecliningAdopter("picky"), standin_adopter()))  # DEBUG decline: skipped
        _load(_registry())
    expected_bytes = numel_bytes(fresh_standin())
    assert events == [
        {
            "adopter": FP32,
            "message": f"Optimizer state adopter '{FP32}' installed the FusedAdamStandIn state, "
            f"avoiding {expected_bytes} bytes ({expected_bytes / MIB:.1f} MiB) of allocation",
            "avoided_bytes": expected_bytes,
        },
        {
            "adopter": None,
            "message": "No optimizer state adopter installed the state: "
            "FusedAdamStandIn.load_state_dict loads it",
            "avoided_bytes": None,
        },
    ]
    assert installed_by_text({"events": events}) == f"{FP32} ×1, own loader ×1"


def test_recording_covers_the_block_only_and_always_cleans_up() -> None:
    logger = logging.getLogger(STATE_ADOPTION_LOGGER)
    handlers, level = list(logger.handlers), logger.level
    logger.setLevel(logging.WARNING)  # would drop the loader's INFO records
    try:
        with pytest.raises(RuntimeError, match="load failed"):
            with recording_adoption_events() as events:
                logging.getLogger(STATE_ADOPTION_LOGGER + ".loader").warning("adopter failed")
                logging.getLogger(STATE_ADOPTION_LOGGER + ".loader").info(FALLBACK)
                logging.getLogger("megatron.core.other").info(INSTALLED)  # not the subsystem
                raise RuntimeError("load failed")
        assert [e["message"] for e in events] == [FALLBACK]
        assert logger.handlers == handlers and logger.level == logging.WARNING
        with recording_adoption_events() as later:
            pass
        _load(_registry())  # after the block: not recorded
        assert later == [] and len(events) == 1
    finally:
        logger.setLevel(level)


def test_registered_adopter_names(monkeypatch: pytest.MonkeyPatch) -> None:
    names = registered_adopter_names()
    assert names == [a.name for a in registered_state_adopters()]
    assert FP32 in names
    monkeypatch.setitem(sys.modules, "megatron.core.optimizer.state_adoption", None)
    assert registered_adopter_names() is None  # upstream: no state-adoption subsystem


class _FakeCuda:
    """Enough of ``torch.cuda`` for the resume and train phases' bookkeeping."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("synchronize", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 500 * MIB)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 600 * MIB)


def _fake_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.resume_benchmark import checkpoint, fingerprint, training

    _FakeCuda(monkeypatch)
    info = {"total_params": 3, "optimizer_params": 1, "inner_optimizers": ["FusedAdam"]}
    monkeypatch.setattr(worker, "_build", lambda case, label, layout: ([], None, dict(info)))
    monkeypatch.setattr(worker, "_next_step", lambda *a: {"loss": 1.0, "peak_bytes": 1})
    monkeypatch.setattr(fingerprint, "fingerprint_state", lambda *a: {"w": "x"})
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda *a: _load(_registry()))
    step = type("Step", (), {"step": 1, "loss": 1.0, "grad_norm": 0.0, "update_successful": True})
    monkeypatch.setattr(training, "train_step", lambda *a: step)


def test_resume_worker_records_the_adopters_and_the_load_events(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from benchmarks.resume_benchmark import checkpoint

    _fake_phases(monkeypatch)
    loads = [_registry(standin_adopter()), _registry()]

    def load_checkpoint(*args: Any) -> None:
        for registry in loads:
            _load(registry)

    monkeypatch.setattr(checkpoint, "load_checkpoint", load_checkpoint)
    _load(_registry())  # before the load: not recorded
    out = worker.run_resume(make_case("moe", TINY), tmp_path, "build")
    record = out["state_adoption"]
    assert record["adopters"] == [a.name for a in registered_state_adopters()]
    assert [(e["adopter"], e["avoided_bytes"] is None) for e in record["events"]] == [
        (FP32, False),
        (None, True),
    ]
    json.dumps(out)  # the result file is JSON


def test_train_worker_records_no_adoption(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_phases(monkeypatch)
    monkeypatch.setattr(worker, "_directory_bytes", lambda path: 0)
    out = worker.run_train(make_case("dp_reshardable", TINY), tmp_path, "control")
    assert out["save"]["ok"] and "state_adoption" not in out


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


def _model(params: int) -> dict[str, Any]:
    return {"optimizer_params": params, "total_params": 3 * params, "inner_optimizers": ["FA"]}


def _control(params: int = PARAMS) -> dict[str, Any]:
    return {
        "megatron_core": {"version": "0.19.2+stateadoption"},
        "model": _model(params),
        "train": {"steps": [{"loss": 3.0}], "peak_bytes": 1000 * MIB},
        "save": {"ok": True, "error": None, "seconds": 1.0, "checkpoint_bytes": 16 * params},
        "post_save_fingerprint": {"w": "saved"},
        "next_step": {"peak_bytes": 900 * MIB, "loss": 3.0, "loss_hex": "0x1.8p+1",
                      "fingerprint": {"w": "next"}},  # fmt: skip
    }


def _event(adopter: str | None) -> dict[str, Any]:
    if adopter is None:
        return parse_adoption_message(FALLBACK)
    return parse_adoption_message(INSTALLED.replace(FP32, adopter))


def _resume(
    label: str,
    bytes_per_param: float,
    adoption: dict[str, Any] | None,
    params: int = PARAMS,
    restored: str = "saved",
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "megatron_core": {"version": "0.19.2" if label == "upstream" else "0.19.2+stateadoption"},
        "model": _model(params),
        "load": {"baseline_bytes": 500 * MIB,
                 "peak_bytes": 500 * MIB + int(bytes_per_param * params),
                 "post_load_allocated_bytes": 500 * MIB, "seconds": 2.0},  # fmt: skip
        "restored_fingerprint": {"w": restored},
        "next_step": {"peak_bytes": 890 * MIB, "loss": 3.0, "loss_hex": "0x1.8p+1",
                      "fingerprint": {"w": "next"}},  # fmt: skip
    }
    if adoption is not None:
        result["state_adoption"] = adoption
    return result


UPSTREAM: dict[str, Any] = {"adopters": None, "events": []}


def _build_adoption(adopters: list[str], *installed: str | None) -> dict[str, Any]:
    return {"adopters": adopters, "events": [_event(a) for a in installed]}


def _entry(
    case: str,
    build_bytes: float,
    build: dict[str, Any] | None,
    upstream: dict[str, Any] | None = UPSTREAM,
    restored: str = "saved",
) -> dict[str, Any]:
    resumed = {
        "upstream": _resume("upstream", 16.0, upstream),
        "build": _resume("build", build_bytes, build, restored=restored),
    }
    return summarize_case(make_case(case, TINY), _control(), resumed)


def test_default_adopter_keeps_the_fixed_expectation() -> None:
    recorded = _entry("dp_reshardable", 8.0, _build_adoption([FP32], FP32))
    old = _entry("dp_reshardable", 8.0, None, upstream=None)  # results without the field
    for entry in (recorded, old):
        assert entry["expected_saving_bytes_per_param"] == 8
        assert entry["expected_bytes_avoided"] == 8 * PARAMS
        assert entry["bytes_avoided_ratio"] == pytest.approx(1.0)
        assert entry["bytes_avoided_as_expected"] is True and case_meets_expectations(entry)
        assert entry["extra_adopters"] == [] and entry["expected_saving_note"] is None
    assert recorded["sides"]["build"]["state_adoption"]["events"][0]["adopter"] == FP32
    assert "state_adoption" not in old["sides"]["build"]
    missed = _entry("dp_reshardable", 12.0, _build_adoption([FP32], FP32))
    assert missed["bytes_avoided_as_expected"] is False and not case_meets_expectations(missed)
    aware = _entry("precision_aware_bf16", 16.0, _build_adoption([FP32], None))
    assert aware["expected_bytes_avoided"] == 0 and case_meets_expectations(aware)


def test_extra_adopter_makes_the_saving_measured_not_predicted() -> None:
    adoption = _build_adoption([FP32, PLUGIN], PLUGIN)
    for case, build_bytes in (("precision_aware_bf16", 12.0), ("dp_reshardable", 16.0)):
        entry = _entry(case, build_bytes, adoption)
        assert entry["status"] == "ok"
        assert entry["expected_saving_bytes_per_param"] is None
        assert entry["expected_bytes_avoided"] is None
        assert entry["bytes_avoided_ratio"] is None
        assert entry["bytes_avoided_as_expected"] is None
        assert entry["bytes_avoided"] == int((16.0 - build_bytes) * PARAMS)  # still reported
        assert entry["extra_adopters"] == [PLUGIN]
        assert entry["expected_saving_note"] == (
            f"not predicted: adopters {PLUGIN} registered on the build side; "
            "the saving is measured, not predicted"
        )
        assert case_meets_expectations(entry)  # status ok and bitwise equal suffice
    corrupted = _entry("precision_aware_bf16", 12.0, adoption, restored="corrupted")
    assert corrupted["all_bitwise_equal"] is False and not case_meets_expectations(corrupted)
    upstream_only = _entry("dp_reshardable", 16.0, UPSTREAM, upstream=adoption)
    assert upstream_only["expected_saving_bytes_per_param"] == 8  # the build side decides


def test_case_meets_expectations_with_no_prediction() -> None:
    base = {"status": "ok", "bytes_avoided_as_expected": None, "all_bitwise_equal": True}
    assert case_meets_expectations({**base, "expected_saving_bytes_per_param": None})
    assert not case_meets_expectations(base)  # predicted, but no verdict: fails as before
    assert not case_meets_expectations({**base, "expected_saving_bytes_per_param": 8})
    assert not case_meets_expectations(
        {**base, "expected_saving_bytes_per_param": None, "all_bitwise_equal": False}
    )
    assert not case_meets_expectations(
        {**base, "expected_saving_bytes_per_param": None, "status": "error"}
    )


def _multi_rank_entry(build: list[dict[str, Any]], build_bytes: float = 12.0) -> dict[str, Any]:
    resumed = {
        "upstream": [_resume("upstream", 16.0, UPSTREAM) for _ in build],
        "build": [_resume("build", build_bytes, b) for b in build],
    }
    controls = [_control() for _ in build]
    layout = ParallelLayout(len(build), 1, 1, len(build))
    return summarize_multi_rank_case(make_case("moe", TINY), layout, controls, resumed)


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


def _document(
    entries: list[dict[str, Any]], parallel: dict[str, Any] | None = None
) -> dict[str, Any]:
    committed = json.loads((RESULTS / "a.json").read_text())
    settings = {**committed["settings"], **({"parallel": parallel} if parallel else {})}
    return {**committed, "settings": settings, "cases": entries}


def _table(markdown: str) -> tuple[list[str], list[list[str]]]:
    rows = [line for line in markdown.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert all(len(c) == len(cells[0]) for c in cells), "ragged table"
    return cells[0], cells[2:]


def _by_side(header: list[str], rows: list[list[str]], column: str) -> dict[str, list[str]]:
    at = header.index(column)
    side = header.index("side")
    found: dict[str, list[str]] = {}
    for row in rows:
        found.setdefault(row[side], []).append(row[at])
    return found


def test_report_shows_who_installed_the_state() -> None:
    aware = _entry("precision_aware_bf16", 12.0, _build_adoption([FP32, PLUGIN], PLUGIN, PLUGIN))
    dense = _entry("dp_reshardable", 8.0, _build_adoption([FP32], FP32))
    fallback = _entry("precision_aware_bf16", 16.0, _build_adoption([FP32], None))
    markdown = markdown_report(_document([aware, dense, fallback]))
    header, rows = _table(markdown)
    at = header.index("state installed by")
    assert header[at - 1] == "avoided ÷ (8 B × params)"
    assert _by_side(header, rows, "state installed by") == {
        "control (uninterrupted)": [DASH] * 3,
        "upstream": [DASH] * 3,
        "build": [f"{PLUGIN} ×2", f"{FP32} ×1", "own loader ×1"],
    }
    assert _by_side(header, rows, "avoided ÷ (8 B × params)")["build"] == [
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


def test_report_multi_rank_rows_say_only_rank_zero_logs() -> None:
    entry = _multi_rank_entry(
        [_build_adoption([FP32, PLUGIN], FP32, PLUGIN), {"adopters": [FP32, PLUGIN], "events": []}]
    )
    markdown = markdown_report(_document([entry], ParallelLayout(2, 1, 1, 2).to_json()))
    header, rows = _table(markdown)
    assert header[:3] == ["case", "side", "rank"]
    assert _by_side(header, rows, "state installed by")["build"] == [
        f"{FP32} ×1, {PLUGIN} ×1",
        f"{DASH} (logged on rank 0)",
    ]
    assert _by_side(header, rows, "avoided ÷ (8 B × params)")["build"] == [
        "not predicted (extra adopters); avoided 4.00 B/param"
    ] * 2
    registered = f"upstream: no state-adoption subsystem; build: {FP32}, {PLUGIN}\n"
    assert f"- state adopters registered at resume: {registered}" in markdown


def test_old_documents_merge_with_new_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = json.loads((RESULTS / "a.json").read_text())
    assert "state installed by" not in markdown_report(old)  # as committed
    new = _document([_entry("precision_aware_bf16", 12.0, _build_adoption([FP32, PLUGIN], PLUGIN))])
    path = tmp_path / "new.json"
    path.write_text(json.dumps(new))
    merged_json = tmp_path / "all.json"
    argv = [str(RESULTS / "a.json"), str(path), str(RESULTS / "b.json"), "--json-out",
            str(merged_json)]  # fmt: skip
    assert report_main(argv) == 0
    header, rows = _table(capsys.readouterr().out)
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
