"""The benchmark's Markdown table and JSON document."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

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
    "train peak MiB (steps 1–N)",
    "step N+1 peak MiB",
    "load s",
    "restored state equal",
    "next step equal",
)


def _mib(value: Any) -> str:
    return _DASH if value is None else f"{value / MIB:,.1f}"


def _yes(value: Any) -> str:
    if value is None:
        return _DASH
    return "yes" if value else "**NO**"


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _case_rows(entry: Mapping[str, Any]) -> list[str]:
    name = entry["case"]
    optimizers = len(entry.get("inner_optimizers") or [])
    if optimizers > 1:
        name = f"{name} ({optimizers} DistributedOptimizers)"
    if entry["status"] != "ok" and "sides" not in entry:
        control = entry.get("control", {})
        params = entry.get("params_on_rank")
        return [
            _row(
                [
                    name,
                    "control",
                    control.get("megatron_core", {}).get("version", _DASH),
                    _DASH if params is None else f"{params:,}",
                    entry.get("detail") or entry["status"],
                    *([_DASH] * 5),
                    _mib(control.get("train_peak_bytes")),
                    *([_DASH] * 4),
                ]
            )
        ]
    control = entry["control"]
    rows = [
        _row(
            [
                name,
                "control (uninterrupted)",
                control["megatron_core"]["version"],
                f"{entry['params_on_rank']:,}",
                *([_DASH] * 6),
                _mib(control["train_peak_bytes"]),
                _mib(control.get("next_step_peak_bytes")),
                _DASH,
                _DASH,
                _DASH,
            ]
        )
    ]
    for label, side in entry["sides"].items():
        if side["status"] != "ok":
            status = side["status"] + (f": {side['error']}" if side.get("error") else "")
            rows.append(_row([name, label, _DASH, _DASH, status, *([_DASH] * 10)]))
            continue
        is_build = label == "build"
        ratio = entry.get("bytes_avoided_ratio") if is_build else None
        expected_zero = is_build and entry.get("expected_bytes_avoided") == 0
        rows.append(
            _row(
                [
                    name,
                    label,
                    side["megatron_core"]["version"],
                    f"{side['params_on_rank']:,}",
                    _mib(side["baseline_bytes"]),
                    _mib(side["load_peak_bytes"]),
                    _mib(side["load_over_baseline_bytes"]),
                    f"{side['load_over_baseline_bytes_per_param']:.2f}",
                    _mib(entry.get("bytes_avoided")) if is_build else _DASH,
                    "expected 0"
                    if expected_zero
                    else (f"{ratio:.4f}" if ratio is not None else _DASH),
                    _DASH,
                    _mib(side["next_step_peak_bytes"]),
                    f"{side['load_seconds']:.2f}",
                    _yes(side["restored_state_equal"]),
                    _yes(side["next_step_equal"]),
                ]
            )
        )
    return rows


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
        f"- model: GPT, local layer spec, BF16, distributed optimizer, one rank; hidden "
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
    if settings.get("dev_mode_build_is_not_stateadoption"):
        lines.append(
            "- **WARNING: development mode -- the build side is NOT the +stateadoption build; "
            "the comparison measures nothing about the product.**"
        )
    lines += ["", _row(_COLUMNS), _row(["---"] * len(_COLUMNS))]
    for entry in document["cases"]:
        lines += _case_rows(entry)
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
