"""The benchmark's Markdown table and JSON document.

The ``state installed by`` column (which adopter, or the optimizer's own loader, installed the
state on each resume side) and the registered-adopters line appear only when some resume side
recorded ``state_adoption`` (:mod:`.adoption`); documents from before that field render as they
always did, and rows without it show "—" next to rows that have it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.resume_benchmark.adoption import adopters_text, installed_by_text
from benchmarks.resume_benchmark.rank_summary import is_multi_rank_entry

MIB = float(1 << 20)
_DASH = "—"

_COLUMNS = (
    "case",
    "side",
    "megatron-core",
    "params on rank",
    "pre-load baseline MiB",
    "load peak MiB",
    "peak − baseline MiB",
    "B/param over baseline",
    "avoided vs upstream MiB",
    "avoided ÷ (8 B × params)",
    "state installed by",
    "train peak MiB (steps 1–N)",
    "step N+1 peak MiB",
    "load s",
    "restored state equal",
    "next step equal",
)


#: Index of ``state installed by`` in :data:`_COLUMNS` (and in every row before its rank cell).
_ADOPTION_AT = _COLUMNS.index("state installed by")

#: The ratio cell of a build row whose saving is not predicted.
NOT_PREDICTED = "not predicted (extra adopters)"


def _mib(value: Any) -> str:
    return _DASH if value is None else f"{value / MIB:,.1f}"


def _yes(value: Any) -> str:
    if value is None:
        return _DASH
    return "yes" if value else "**NO**"


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _case_cells(entry: Mapping[str, Any]) -> list[list[Any]]:
    """The table rows (as cells) of one single-rank entry."""
    name = entry["case"]
    optimizers = len(entry.get("inner_optimizers") or [])
    if optimizers > 1:
        name = f"{name} ({optimizers} DistributedOptimizers)"
    if entry["status"] != "ok" and "sides" not in entry:
        control = entry.get("control", {})
        params = entry.get("params_on_rank")
        return [_failed_control_cells(name, control, params, entry)]
    control = entry["control"]
    rows = [_control_cells(name, control, entry["params_on_rank"])]
    for label, side in entry["sides"].items():
        rows.append(_side_cells(name, label, side, entry if label == "build" else None))
    return rows


def _failed_control_cells(
    name: str, control: Mapping[str, Any], params: int | None, entry: Mapping[str, Any]
) -> list[Any]:
    """The one row of a case whose control failed or whose format cannot be saved."""
    return [
        name,
        "control",
        control.get("megatron_core", {}).get("version", _DASH),
        _DASH if params is None else f"{params:,}",
        entry.get("detail") or entry["status"],
        *([_DASH] * 6),
        _mib(control.get("train_peak_bytes")),
        *([_DASH] * 4),
    ]


def _control_cells(name: str, control: Mapping[str, Any], params: int) -> list[Any]:
    """The uninterrupted run's row."""
    return [
        name,
        "control (uninterrupted)",
        control["megatron_core"]["version"],
        f"{params:,}",
        *([_DASH] * 7),
        _mib(control["train_peak_bytes"]),
        _mib(control.get("next_step_peak_bytes")),
        _DASH,
        _DASH,
        _DASH,
    ]


def _side_cells(
    name: str,
    label: str,
    side: Mapping[str, Any],
    saving: Mapping[str, Any] | None,
    equal_notes: tuple[str, str] = ("", ""),
) -> list[Any]:
    """A resume row; ``saving`` (build rows only) holds the bytes avoided versus upstream.

    ``equal_notes`` are appended to the two equality cells (multi-rank resharded rows say what
    they compare).
    """
    if side["status"] != "ok":
        status = side["status"] + (f": {side['error']}" if side.get("error") else "")
        return [name, label, _DASH, _DASH, status, *([_DASH] * 11)]
    return [
        name,
        label,
        side["megatron_core"]["version"],
        f"{side['params_on_rank']:,}",
        _mib(side["baseline_bytes"]),
        _mib(side["load_peak_bytes"]),
        _mib(side["load_over_baseline_bytes"]),
        f"{side['load_over_baseline_bytes_per_param']:.2f}",
        _mib(saving.get("bytes_avoided")) if saving is not None else _DASH,
        _ratio_cell(saving, side["params_on_rank"]),
        _installed_cell(side),
        _DASH,
        _mib(side["next_step_peak_bytes"]),
        f"{side['load_seconds']:.2f}",
        _yes(side["restored_state_equal"]) + equal_notes[0],
        _yes(side["next_step_equal"]) + equal_notes[1],
    ]


def _ratio_cell(saving: Mapping[str, Any] | None, params: int) -> str:
    """Avoided ÷ expected; ``expected 0``; or, not predicted, the bytes avoided per parameter."""
    if saving is None:
        return _DASH
    if "bytes_avoided" in saving and saving.get("expected_bytes_avoided") is None:
        per_param = f"{saving['bytes_avoided'] / params:.2f}" if params else _DASH
        return f"{NOT_PREDICTED}; avoided {per_param} B/param"
    if saving.get("expected_bytes_avoided") == 0:
        return "expected 0"
    ratio = saving.get("bytes_avoided_ratio")
    return f"{ratio:.4f}" if ratio is not None else _DASH


def _installed_cell(side: Mapping[str, Any]) -> str:
    """Who installed the state on this resume side, e.g. ``te_fused_adam_fp32 ×2``.

    "—" without events (upstream, results from before the field); a multi-rank build rank
    other than 0 says that only rank 0 logs.
    """
    record = side.get("state_adoption")
    text = installed_by_text(record)
    if text is not None:
        return text
    if record and record.get("adopters") is not None and side.get("rank", 0) != 0:
        return f"{_DASH} (logged on rank 0)"
    return _DASH


def _multi_rank_name(entry: Mapping[str, Any]) -> str:
    """Case name with its optimizer count and layout, e.g. ``moe (2 ...) [TP 1, EP 2, DP 2]``."""
    name = entry["case"]
    optimizers = len(entry.get("inner_optimizers") or [])
    if optimizers > 1:
        name = f"{name} ({optimizers} DistributedOptimizers)"
    par = entry["parallel"]
    dp = f"DP {par['data_parallel_size']}"
    if par["resharded"]:
        dp += f" → {par['resume_data_parallel_size']}"
    return (
        f"{name} [TP {par['tensor_model_parallel_size']}, "
        f"EP {par['expert_model_parallel_size']}, {dp}]"
    )


def _multi_rank_cells(entry: Mapping[str, Any]) -> list[list[Any]]:
    """Rows of a multi-rank entry: control ranks, then upstream ranks, then build ranks.

    Each row carries its rank as a third cell (the table's ``rank`` column).
    """
    name = _multi_rank_name(entry)
    controls = entry.get("controls")
    if controls is None:
        return [_with_rank(_failed_control_cells(name, {}, None, entry), _DASH)]
    if "rank_sides" not in entry:
        return [
            _with_rank(_failed_control_cells(name, c, c["params_on_rank"], entry), c["rank"])
            for c in controls
        ]
    rows = [_with_rank(_control_cells(name, c, c["params_on_rank"]), c["rank"]) for c in controls]
    resharded = entry["parallel"]["resharded"]
    savings = {r["rank"]: r for r in entry.get("ranks") or []}
    for label, per_rank in entry["rank_sides"].items():
        notes = ("", "")
        if resharded:
            notes = (" (gathered)", " (= upstream)" if label == "build" else "")
        for side in per_rank:
            saving = savings.get(side["rank"], {}) if label == "build" else None
            rows.append(_with_rank(_side_cells(name, label, side, saving, notes), side["rank"]))
    return rows


def _with_rank(cells: list[Any], rank: Any) -> list[Any]:
    """``cells`` with ``rank`` inserted after the side cell."""
    return [*cells[:2], rank, *cells[2:]]


def _without(cells: list[Any], index: int) -> list[Any]:
    return [*cells[:index], *cells[index + 1 :]]


def _entry_rows(entry: Mapping[str, Any], with_rank: bool, with_adoption: bool) -> list[str]:
    """Markdown rows of one entry; single-rank entries get rank 0 in a table with ranks."""
    if is_multi_rank_entry(entry):
        rows = _multi_rank_cells(entry)
    else:
        rows = [_with_rank(c, 0) if with_rank else c for c in _case_cells(entry)]
    if not with_adoption:
        rows = [_without(c, _ADOPTION_AT + (1 if with_rank else 0)) for c in rows]
    return [_row(cells) for cells in rows]


def _resume_sides(entry: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """``(side label, side record)`` of every resume side (every rank) of one entry."""
    if "rank_sides" in entry:
        return [(label, s) for label, per_rank in entry["rank_sides"].items() for s in per_rank]
    return list((entry.get("sides") or {}).items())


def _shows_adoption(cases: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any resume side recorded ``state_adoption`` (the column and line appear)."""
    return any("state_adoption" in s for e in cases for _, s in _resume_sides(e))


def _adoption_lines(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    """The registered adopters per side (with the cases when runs differ) and the cases whose
    saving is not predicted."""
    registered: dict[str, dict[str, list[str]]] = {}
    for entry in cases:
        for label, side in _resume_sides(entry):
            if "state_adoption" in side:
                text = adopters_text(side["state_adoption"].get("adopters"))
                names = registered.setdefault(label, {}).setdefault(text, [])
                if entry["case"] not in names:
                    names.append(entry["case"])
    parts = []
    for label, texts in registered.items():
        if len(texts) == 1:
            parts.append(f"{label}: {next(iter(texts))}")
        else:
            parts.append(
                f"{label}: " + "; ".join(f"{t} ({', '.join(c)})" for t, c in texts.items())
            )
    lines = ["- state adopters registered at resume: " + "; ".join(parts)] if parts else []
    notes: dict[str, list[str]] = {}
    for entry in cases:
        if entry.get("expected_saving_note"):
            notes.setdefault(entry["expected_saving_note"], []).append(entry["case"])
    lines += [f"- expected saving of {', '.join(c)}: {note}." for note, c in notes.items()]
    return lines


def _ranks_text(settings: Mapping[str, Any]) -> str:
    """``one rank`` (single-rank runs, as before) or the multi-rank layout."""
    par = settings.get("parallel")
    if not par:
        return "one rank"
    text = (
        f"{par['nproc_per_node']} rank(s) per phase, TP {par['tensor_model_parallel_size']}, "
        f"EP {par['expert_model_parallel_size']}, DP {par['data_parallel_size']}"
    )
    if par["resharded"]:
        text += (
            f", resumed on {par['resume_nproc_per_node']} rank(s) "
            f"(DP {par['resume_data_parallel_size']})"
        )
    return text


def markdown_report(document: Mapping[str, Any]) -> str:
    """Render the JSON document as Markdown: environment, settings and one table."""
    env = document["environment"]
    settings = document["settings"]
    lines = [
        "# Checkpoint-resume memory: upstream megatron-core vs. the state-adoption build",
        "",
        f"- GPU: {env.get('gpu_name')} (driver {env.get('driver')}); "
        f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}); "
        f"Transformer Engine {env.get('transformer_engine')}; Python {env.get('python')}",
    ]
    for label, side in document["sides"].items():
        lines.append(
            f"- {label}: megatron-core {side.get('version')} from `{side.get('file')}` "
            f"({side.get('source')})"
        )
    size = settings["size"]
    lines += [
        f"- model: GPT, local layer spec, BF16, distributed optimizer, {_ranks_text(settings)}; "
        "hidden "
        f"{size['hidden_size']}, {size['num_layers']} layers, {size['num_attention_heads']} heads, "
        f"FFN {size['ffn_hidden_size']}, vocab {size['vocab_size']}, seq {size['seq_length']}, "
        f"micro-batch {size['micro_batch_size']}; MoE case: {size['num_experts']} experts, "
        f"top-{size['moe_router_topk']}; {settings['train_steps']} training steps before the save",
        "- total parameters: "
        + ", ".join(
            f"{c['case']} {c['total_params']:,}" for c in document["cases"] if "total_params" in c
        ),
        "- baseline = `memory_allocated()` just before the load; load peak = "
        "`max_memory_allocated()` over the whole load; expected saving = 8 B × parameters on the "
        "rank (one FP32 Adam moment pair), 0 for the precision-aware fallback.",
    ]
    with_adoption = _shows_adoption(document["cases"])
    lines += _adoption_lines(document["cases"])
    if settings.get("dev_mode_build_is_not_stateadoption"):
        lines.append(
            "- **WARNING: development mode -- the build side is NOT the +stateadoption build; "
            "the comparison measures nothing about the product.**"
        )
    with_rank = any(is_multi_rank_entry(e) for e in document["cases"])
    columns = list(_COLUMNS) if with_adoption else _without(list(_COLUMNS), _ADOPTION_AT)
    columns = _with_rank(columns, "rank") if with_rank else columns
    lines += ["", _row(columns), _row(["---"] * len(columns))]
    for entry in document["cases"]:
        lines += _entry_rows(entry, with_rank, with_adoption)
    lines.append("")
    return "\n".join(lines)


def json_report(document: Mapping[str, Any]) -> str:
    """The JSON document as text."""
    return json.dumps(document, indent=2) + "\n"


def merge_documents(documents: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One document from several runs (e.g. ``--cases`` split over calls): cases concatenated.

    Environment, sides and settings come from the first document; each case keeps the
    workspace it ran in.
    """
    if not documents:
        raise ValueError("nothing to merge")
    merged = dict(documents[0])
    merged["cases"] = [case for doc in documents for case in doc["cases"]]
    merged["settings"] = {
        **documents[0]["settings"],
        "cases": [case["case"] for case in merged["cases"]],
        "merged_from_runs": len(documents),
    }
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.resume_benchmark.report A.json B.json ...``: merge and render."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.resume_benchmark.report",
        description="Merge JSON documents of several benchmark runs and print one Markdown report.",
    )
    parser.add_argument("documents", nargs="+", type=Path, help="--json-out files of earlier runs")
    parser.add_argument("--json-out", type=Path, help="write the merged JSON document here")
    parser.add_argument("--markdown-out", type=Path, help="write the Markdown report here")
    args = parser.parse_args(argv)
    merged = merge_documents([json.loads(path.read_text()) for path in args.documents])
    markdown = markdown_report(merged)
    if args.json_out:
        args.json_out.write_text(json_report(merged))
    if args.markdown_out:
        args.markdown_out.write_text(markdown)
    sys.stdout.write(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
