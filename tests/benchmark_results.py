"""Hand-made worker results of the resume benchmark, and readers of its report, for tests.

Each result has the shape the worker writes (``test_benchmark_story`` checks these shapes
against the real worker's results); the numbers are chosen by the test: ``bytes_per_param`` is
the load peak over the baseline per optimizer parameter (16 for TE's loader, 8 with adoption).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.resume_benchmark.cases import PRESETS, make_case
from benchmarks.resume_benchmark.launch import ParallelLayout
from benchmarks.resume_benchmark.summary import summarize_case

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "gpu-results"
MIB = 1 << 20
TINY = PRESETS["tiny"]
BUILD_VERSION = "0.19.2+stateadoption"
UPSTREAM_VERSION = "0.19.2"
FUSED_ADAM = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
#: The training peak (step N+1) of every resume: above 8 B/param over the baseline, below 16.
STEP_PEAK = 500 * MIB + 12 * 100 * MIB


def step(fingerprint: str, loss_hex: str = "0x1.8p+1", peak: int = STEP_PEAK) -> dict[str, Any]:
    return {
        "step": 3,
        "loss": float.fromhex(loss_hex),
        "loss_hex": loss_hex,
        "grad_norm": 0.5,
        "update_successful": True,
        "baseline_bytes": 500 * MIB,
        "peak_bytes": peak,
        "fingerprint": {"w": fingerprint},
    }


def model(params: int, optimizers: int = 1) -> dict[str, Any]:
    return {
        "total_params": 3 * params,
        "model_params_on_rank": 3 * params,
        "optimizer_params": params,
        "inner_optimizers": [FUSED_ADAM] * optimizers,
        "build_seconds": 1.0,
    }


def control(params: int, gathered: Mapping[str, str] | None = None, saved: bool = True) -> dict[str, Any]:
    """A train+save+control rank's result."""
    result: dict[str, Any] = {
        "phase": "train",
        "case": "dp_reshardable",
        "side": "control",
        "megatron_core": {"version": BUILD_VERSION, "file": "/b/megatron/core/__init__.py"},
        "model": model(params),
        "train": {"steps": [{"loss": 3.0}], "baseline_bytes": 0, "peak_bytes": STEP_PEAK,
                  "seconds": 1.0},  # fmt: skip
        "save": {"ok": True, "error": None, "seconds": 1.0, "checkpoint_bytes": 16 * params},
        "post_save_fingerprint": {"w": f"saved-{params}"},
        "next_step": step(f"next-{params}"),
    }
    if not saved:
        result["save"] = {"ok": False, "error": "CheckpointingException: flattened_range"}
        del result["post_save_fingerprint"], result["next_step"]
    if gathered is not None:
        result["post_save_gathered_fingerprint"] = dict(gathered)
    return result


def resume(
    label: str,
    params: int,
    bytes_per_param: float,
    restored: str | None = None,
    gathered: Mapping[str, str] | None = None,
    next_fingerprint: str | None = None,
    adoption: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A resume rank's result (``adoption``: its ``state_adoption`` record, if any)."""
    baseline = 500 * MIB
    upstream = label == "upstream"
    result: dict[str, Any] = {
        "phase": "resume",
        "case": "dp_reshardable",
        "side": label,
        "megatron_core": {"version": UPSTREAM_VERSION if upstream else BUILD_VERSION,
                          "file": f"/{label}/megatron/core/__init__.py"},  # fmt: skip
        "model": model(params),
        "load": {"baseline_bytes": baseline, "peak_bytes": baseline + int(bytes_per_param * params),
                 "post_load_allocated_bytes": baseline + 8 * params, "seconds": 2.0},  # fmt: skip
        "restored_fingerprint": {"w": restored or f"saved-{params}"},
        "next_step": step(next_fingerprint or f"next-{params}"),
    }
    if gathered is not None:
        result["restored_gathered_fingerprint"] = dict(gathered)
    if adoption is not None:
        result["state_adoption"] = dict(adoption)
    return result


def entry(
    case_name: str,
    build_bytes: Sequence[float],
    params: Sequence[int] | None = None,
    build_restored: Sequence[str | None] | None = None,
    build_adoption: Sequence[Mapping[str, Any] | None] | None = None,
    upstream_adoption: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A case on ``len(build_bytes)`` ranks at the same sharding, summarised."""
    ranks = len(build_bytes)
    params = params or [100 * MIB] * ranks
    restored = build_restored or [None] * ranks
    adoption = build_adoption or [None] * ranks
    resumed = {
        "upstream": [resume("upstream", p, 16.0, adoption=upstream_adoption) for p in params],
        "build": [
            resume("build", p, b, restored=f, adoption=a)
            for p, b, f, a in zip(params, build_bytes, restored, adoption)
        ],
    }
    layout = ParallelLayout(ranks, 1, 1, ranks)
    return summarize_case(make_case(case_name, TINY), layout, [control(p) for p in params], resumed)


def document(entries: list[dict[str, Any]], parallel: ParallelLayout | None = None) -> dict[str, Any]:
    """A document around ``entries`` (environment and sides of the committed run)."""
    committed = json.loads((RESULTS / "a.json").read_text())
    settings = {**committed["settings"], "parallel": (parallel or ParallelLayout()).to_json()}
    return {**committed, "settings": settings, "cases": entries}


def table(markdown: str) -> tuple[list[str], list[list[str]]]:
    """The header and body cells of the report's table (which must not be ragged)."""
    rows = [line for line in markdown.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert all(len(c) == len(cells[0]) for c in cells), "ragged table"
    return cells[0], cells[2:]


def column(markdown: str, name: str) -> dict[str, list[str]]:
    """The cells of column ``name`` by side, in row order."""
    header, rows = table(markdown)
    at, side = header.index(name), header.index("side")
    found: dict[str, list[str]] = {}
    for row in rows:
        found.setdefault(row[side], []).append(row[at])
    return found
