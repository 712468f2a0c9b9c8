"""The benchmark's Markdown table and JSON document, and merging the documents of several runs.

One row per case, side and rank: the control's ranks, then upstream's, then the build's. A
``rank`` column and the layout in the case cell (e.g. ``moe (2 DistributedOptimizers) [TP 1,
EP 2, DP 2]``) appear only when some case ran on more than one rank. Optional columns appear
only when some row has their value: ``state installed by`` (a resume recorded
``state_adoption``) and ``load peak ≤ step N+1 peak``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.resume_benchmark.results import adopters_text, installed_by_text, load_outcomes
from benchmarks.resume_benchmark.launch import ParallelLayout

MIB = float(1 << 20)
_DASH = "—"

_CASE, _SIDE, _RANK = "case", "side", "rank"
_VERSION, _PARAMS, _BASELINE = "megatron-core", "params on rank", "pre-load baseline MiB"
_PEAK, _OVER, _PER_PARAM = "load peak MiB", "peak − baseline MiB", "B/param over baseline"
_AVOIDED, _RATIO = "avoided vs upstream MiB", "avoided ÷ (8 B × params)"
_INSTALLED, _TRAIN_PEAK = "state installed by", "train peak MiB (steps 1–N)"
_STEP_PEAK, _WITHIN = "step N+1 peak MiB", "load peak ≤ step N+1 peak"
_LOAD_S, _RESTORED, _NEXT = "load s", "restored state equal", "next step equal"

#: Every column, in table order.
_COLUMNS = (
    _CASE, _SIDE, _RANK, _VERSION, _PARAMS, _BASELINE, _PEAK, _OVER, _PER_PARAM, _AVOIDED,
    _RATIO, _INSTALLED, _TRAIN_PEAK, _STEP_PEAK, _WITHIN, _LOAD_S, _RESTORED, _NEXT,
)  # fmt: skip

#: Columns shown only when some row has a value for them.
_OPTIONAL = frozenset({_RANK, _INSTALLED, _WITHIN})

#: The ratio cell of a build row whose saving is not predicted.
NOT_PREDICTED = "not predicted (extra adopters)"

Row = dict[str, Any]


def _mib(value: Any) -> str:
    return _DASH if value is None else f"{value / MIB:,.1f}"


def _yes(value: Any) -> str:
    if value is None:
        return _DASH
    return "yes" if value else "**NO**"


def _markdown_row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _layout(entry: Mapping[str, Any]) -> ParallelLayout:
    return ParallelLayout.from_json(entry["parallel"])


def _layout_text(entry: Mapping[str, Any]) -> str:
    """`` [TP 1, EP 2, DP 2 → 1]`` for an entry on several ranks; empty on one rank."""
    if _layout(entry).single_rank:
        return ""
    par = entry["parallel"]
    dp = f"DP {par['data_parallel_size']}"
    if par["resharded"]:
        dp += f" → {par['resume_data_parallel_size']}"
    return (
        f" [TP {par['tensor_model_parallel_size']}, EP {par['expert_model_parallel_size']}, {dp}]"
    )


def _case_name(entry: Mapping[str, Any]) -> str:
    """The case cell: name, DistributedOptimizer count when chained, the instance-level loader
    when one was installed, layout on several ranks."""
    notes = []
    optimizers = len(entry.get("inner_optimizers") or [])
    if optimizers > 1:
        notes.append(f"{optimizers} DistributedOptimizers")
    if entry.get("instance_loader"):
        notes.append(f"{entry['instance_loader']} instance loader")
    name = str(entry["case"]) + (f" ({', '.join(notes)})" if notes else "")
    return name + _layout_text(entry)


def _failed_control_row(
    name: str, control: Mapping[str, Any], params: int | None, entry: Mapping[str, Any]
) -> Row:
    """The row of a control rank that failed or whose format cannot be saved."""
    return {
        _CASE: name,
        _SIDE: "control",
        _RANK: control.get("rank", _DASH),
        _VERSION: control.get("megatron_core", {}).get("version", _DASH),
        _PARAMS: _DASH if params is None else f"{params:,}",
        _BASELINE: entry.get("detail") or entry["status"],
        _TRAIN_PEAK: _mib(control.get("train_peak_bytes")),
    }


def _control_row(name: str, control: Mapping[str, Any]) -> Row:
    """The uninterrupted run's row of one rank."""
    return {
        _CASE: name,
        _SIDE: "control (uninterrupted)",
        _RANK: control["rank"],
        _VERSION: control["megatron_core"]["version"],
        _PARAMS: f"{control['params_on_rank']:,}",
        _TRAIN_PEAK: _mib(control["train_peak_bytes"]),
        _STEP_PEAK: _mib(control.get("next_step_peak_bytes")),
    }


def _side_row(
    name: str,
    label: str,
    side: Mapping[str, Any],
    saving: Mapping[str, Any] | None,
    equal_notes: tuple[str, str],
) -> Row:
    """A resume row; ``saving`` (build rows only) holds the bytes avoided versus upstream.

    ``equal_notes`` are appended to the two equality cells (resharded rows say what they
    compare).
    """
    row: Row = {_CASE: name, _SIDE: label, _RANK: side["rank"]}
    if side["status"] != "ok":
        status = side["status"] + (f": {side['error']}" if side.get("error") else "")
        return {**row, _BASELINE: status}
    params = side["params_on_rank"]
    row.update(
        {
            _VERSION: side["megatron_core"]["version"],
            _PARAMS: f"{params:,}",
            _BASELINE: _mib(side["baseline_bytes"]),
            _PEAK: _mib(side["load_peak_bytes"]),
            _OVER: _mib(side["load_over_baseline_bytes"]),
            _PER_PARAM: f"{side['load_over_baseline_bytes_per_param']:.2f}",
            _AVOIDED: _mib(saving.get("bytes_avoided")) if saving is not None else _DASH,
            _RATIO: _ratio_cell(saving, params),
            _STEP_PEAK: _mib(side["next_step_peak_bytes"]),
            _LOAD_S: f"{side['load_seconds']:.2f}",
            _RESTORED: _yes(side["restored_state_equal"]) + equal_notes[0],
            _NEXT: _yes(side["next_step_equal"]) + equal_notes[1],
        }
    )
    calls = side["instance_loader"]["calls"] if "instance_loader" in side else None
    if "state_adoption" in side or calls is not None:
        row[_INSTALLED] = installed_by_text(side.get("state_adoption"), calls) or _DASH
    if "load_peak_within_training_peak" in side:
        row[_WITHIN] = _yes(side["load_peak_within_training_peak"])
    return row


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


def _entry_rows(entry: Mapping[str, Any]) -> list[Row]:
    """Rows of one (current-shape) entry: control ranks, then upstream's, then the build's."""
    name = _case_name(entry)
    controls = entry.get("controls")
    if controls is None:
        return [_failed_control_row(name, {}, None, entry)]
    if "rank_sides" not in entry:
        return [_failed_control_row(name, c, c["params_on_rank"], entry) for c in controls]
    rows = [_control_row(name, c) for c in controls]
    resharded = entry["parallel"]["resharded"]
    savings = {r["rank"]: r for r in entry.get("ranks") or []}
    for label, per_rank in entry["rank_sides"].items():
        notes = (" (gathered)", " (= upstream)" if label == "build" else "") if resharded else ("", "")
        for side in per_rank:
            saving = savings.get(side["rank"], {}) if label == "build" else None
            rows.append(_side_row(name, label, side, saving, notes))
    return rows


def _resume_sides(entry: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """``(side label, side record)`` of every resume rank of one (current-shape) entry."""
    return [(label, s) for label, per_rank in (entry.get("rank_sides") or {}).items() for s in per_rank]


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


def _instance_loader_lines(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the instance-level loader was, and what the build did with it: the reasons its
    adopters declined (builds that asked them) and the own method that ran and why (builds
    whose outcomes name it, which leave such an instance to its method without asking)."""
    lines = []
    for entry in cases:
        if not entry.get("instance_loader"):
            continue
        builds = [s for label, s in _resume_sides(entry) if label == "build"]
        loads = [o for side in builds for o in load_outcomes(side.get("state_adoption"))]
        reasons = sorted(
            {f"{name}: {reason}" for o in loads for name, reason in o.get("declines") or []}
        )
        ran = sorted(
            {f"{o['method']} ({o.get('fallback_reason')})" for o in loads
             if o.get("method") and not o.get("adopter")}
        )  # fmt: skip
        parts = [] if ran and not reasons else [
            "build declines: " + ("; ".join(reasons) or "none recorded")
        ]
        parts += ["build ran " + "; ".join(ran)] if ran else []
        lines.append(
            f"- {_case_name(entry)}: a {entry['instance_loader']} instance-level load_state_dict "
            "(PyTorch's loader only) was set on every inner FusedAdam for each resume's load, both "
            "sides; " + "; ".join(parts)
        )
    return lines


def _check_lines(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per case that ``--check`` fails, with every reason."""
    return [
        f"- **expectation missed** by {_case_name(entry)}: " + "; ".join(entry["failed_expectations"])
        for entry in cases
        if entry.get("failed_expectations")
    ]


def _ranks_text(settings: Mapping[str, Any]) -> str:
    """``one rank``, or the run's layout."""
    par = settings.get("parallel")
    if not par or ParallelLayout.from_json(par).single_rank:
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


def _table(cases: Sequence[Mapping[str, Any]]) -> list[str]:
    """The Markdown table: every row, the columns that have a value somewhere."""
    rows = [row for entry in cases for row in _entry_rows(entry)]
    with_rank = any(not _layout(e).single_rank for e in cases)
    columns = [
        c
        for c in _COLUMNS
        if c not in _OPTIONAL
        or (c == _RANK and with_rank)
        or (c != _RANK and any(c in row for row in rows))
    ]
    lines = ["", _markdown_row(columns), _markdown_row(["---"] * len(columns))]
    lines += [_markdown_row(row.get(c, _DASH) for c in columns) for row in rows]
    return lines


def markdown_report(document: Mapping[str, Any]) -> str:
    """Render the JSON document as Markdown: environment, settings, notes and one table."""
    env = document["environment"]
    settings = document["settings"]
    cases = document["cases"]
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
            f"{c['case']}{_layout_text(c)} {c['total_params']:,}"
            for c in cases
            if "total_params" in c
        ),
        "- baseline = `memory_allocated()` just before the load; load peak = "
        "`max_memory_allocated()` over the whole load; expected saving = 8 B × parameters on the "
        "rank (one FP32 Adam moment pair), 0 for the precision-aware fallback.",
    ]
    lines += _adoption_lines(cases)
    if settings.get("dev_mode_build_is_not_stateadoption"):
        lines.append(
            "- **WARNING: development mode -- the build side is NOT the +stateadoption build; "
            "the comparison measures nothing about the product.**"
        )
    lines += _instance_loader_lines(cases)
    lines += _check_lines(cases)
    lines += _table(cases)
    lines.append("")
    return "\n".join(lines)


def json_report(document: Mapping[str, Any]) -> str:
    """The JSON document as text."""
    return json.dumps(document, indent=2) + "\n"


def merge_documents(documents: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One document from several runs (e.g. ``--cases`` split over calls): cases concatenated.

    Environment, sides and settings come from the first document; each case keeps the
    workspace it ran in (and, in the current shape, its layout).
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
