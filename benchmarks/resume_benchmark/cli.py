"""Command line of the resume benchmark (``python -m benchmarks.resume_benchmark``).

For every case it trains a Megatron-Core GPT a few steps, saves a ``torch_dist`` checkpoint and
resumes it in fresh processes with this project's ``V+stateadoption`` build and with upstream
megatron-core V (any release V, e.g. 0.16.1, 0.18.2, 0.19.2), on one rank or several
(``--nproc-per-node``, TP, EP, ``--resume-nproc-per-node``; see docs/multi-gpu.md). Per rank it
reports the load peaks, the bytes the build avoids (expected: 8 B x optimizer parameters on the
rank), which adopter installed the state, the training peaks, load times, and whether the
restored state and the next step are bitwise identical to the uninterrupted run.

Exit status: 0 all measurements ran; 1 a phase crashed; 2 this machine cannot run the benchmark
(no CUDA GPU, too few GPUs, no Transformer Engine) or a usage error (argparse; including a
process layout Megatron-Core cannot build); 3 the sides are wrong (the build is not a
``V+stateadoption`` build, upstream is not exactly V, or both are the same); 4 with ``--check``,
a case missed its expectation on some rank (saving, load peak within the training peak, bitwise
equality, the instance-level loader's path).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from benchmarks.resume_benchmark.cases import (
    CASE_NAMES,
    OPT_IN_CASE_NAMES,
    INSTANCE_LOADERS,
    PRESETS,
    BenchmarkCase,
    ModelSize,
    make_case,
)
from benchmarks.resume_benchmark.driver import CaseRun, Workspace, run_case, run_phase
from benchmarks.resume_benchmark.launch import LayoutError, ParallelLayout, validate_layout
from benchmarks.resume_benchmark.report import json_report, markdown_report
from benchmarks.resume_benchmark.results import eprint, one_line, progress
from benchmarks.resume_benchmark.sides import (
    Side,
    SideError,
    build_problem,
    build_release,
    default_cache_dir,
    resolve_build,
    resolve_upstream,
    sides_problem,
    upstream_release,
)
from benchmarks.resume_benchmark.summary import case_meets_expectations

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_WRONG_SIDES = 3
EXIT_EXPECTATION_MISSED = 4
#: Exit status when this machine cannot run the benchmark (no CUDA GPU or no Transformer Engine).
EXIT_CANNOT_RUN: Final = 2

#: First argument that runs the Megatron-LM client (:mod:`.megatron_lm`) instead.
CLIENT_COMMAND = "megatron-lm"

_SIZE_FLAGS = tuple(field.name for field in dataclasses.fields(ModelSize))


# Preflight: cheap checks that decide, before any download or heavy work, whether the benchmark
# can run.

_WHY = (
    "This benchmark measures a GPU memory peak (torch.cuda.max_memory_allocated) while "
    "Transformer Engine's FusedAdam state is restored on a CUDA GPU, so it cannot run here."
)


def cannot_run_message(missing: str) -> str:
    """The single message printed before exiting with :data:`EXIT_CANNOT_RUN`."""
    return f"resume_benchmark: {missing}. {_WHY}"


def check_cuda() -> str | None:
    """``None`` when torch imports and sees a CUDA device, else what is missing."""
    try:
        import torch
    except ImportError as exc:
        return f"PyTorch is not importable ({exc})"
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (CPU-only build)"
        return f"no CUDA device is available (torch {torch.__version__}, CUDA runtime {built})"
    return None


def check_gpu_count(needed: int) -> str | None:
    """``None`` when this node has at least ``needed`` CUDA devices, else what is missing."""
    import torch

    count = torch.cuda.device_count()
    if count < needed:
        return f"{needed} CUDA devices are needed for the requested ranks, {count} are visible"
    return None


def check_transformer_engine(probe: Mapping[str, Any]) -> str | None:
    """``None`` when the build side's worker could import Transformer Engine, else why not."""
    te = probe.get("transformer_engine") or {}
    if te.get("error"):
        return f"Transformer Engine is not importable for the build side ({te['error']})"
    if not probe.get("cuda_available", False):
        return "no CUDA device is available to the worker process"
    return None


def _parse_cases(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(CASE_NAMES)
    unknown = [n for n in names if n not in CASE_NAMES and n not in OPT_IN_CASE_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown case(s) {', '.join(unknown) or '(none)'}; "
            f"choose from all, {', '.join(CASE_NAMES)} (or, only by name, "
            f"{', '.join(OPT_IN_CASE_NAMES)})"
        )
    return names


def _parse_gpus(text: str) -> str:
    indices = [part.strip() for part in text.split(",")]
    if not indices or not all(i.isdigit() for i in indices) or len(set(indices)) != len(indices):
        raise argparse.ArgumentTypeError(
            f"--gpus takes distinct GPU indices separated by commas (e.g. 0,1), got {text!r}"
        )
    return ",".join(indices)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (documented in ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.resume_benchmark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"On your own training: python -m benchmarks.resume_benchmark {CLIENT_COMMAND} "
        "--help (Megatron-LM's pretrain_gpt.py).",
    )
    parser.add_argument(
        "--cases",
        type=_parse_cases,
        default=list(CASE_NAMES),
        help=f"comma-separated cases or 'all' (default): {', '.join(CASE_NAMES)}; by name "
        f"only: {', '.join(OPT_IN_CASE_NAMES)}",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="model size preset (default: ~1.1 B parameters; 'small': ~0.26 B, for multi-GPU "
        "layouts; 'tiny' for smoke tests, too small for --check)",
    )
    sizes = parser.add_argument_group("model size (override the preset)")
    sizes.add_argument("--hidden-size", type=int)
    sizes.add_argument("--num-layers", type=int)
    sizes.add_argument("--num-attention-heads", type=int)
    sizes.add_argument(
        "--ffn-hidden-size", type=int, help="default: 4 x hidden size when --hidden-size is given"
    )
    sizes.add_argument("--seq-length", type=int)
    sizes.add_argument("--micro-batch-size", type=int)
    sizes.add_argument("--vocab-size", type=int)
    sizes.add_argument("--num-experts", type=int, help="experts per MoE layer (moe case)")
    sizes.add_argument("--moe-router-topk", type=int)
    parser.add_argument(
        "--moe-fold-experts",
        action="store_true",
        help="moe case: keep experts in the dense DistributedOptimizer (Megatron's "
        "one-rank default) instead of a ChainedOptimizer of dense + expert",
    )
    parser.add_argument(
        "--instance-loader",
        choices=INSTANCE_LOADERS,
        help="resume with an instance-level load_state_dict on every inner FusedAdam (both "
        "sides), as Megatron-Bridge's loading context sets one: 'bridge-like' runs PyTorch's "
        "loader only; the build must leave it to that method (no adopter installs the state) "
        "and call it once per load; expected "
        "saving 0 (both sides load by reference). Not with precision_aware_bf16",
    )
    parser.add_argument(
        "--train-steps", type=int, default=2, help="steps before the save (default 2)"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--upstream",
        type=Path,
        help="upstream megatron-core V, the release the build V+stateadoption is made from: a "
        "directory for PYTHONPATH or a .whl (installed with pip --no-deps --target); "
        "default: pip download megatron-core==V",
    )
    parser.add_argument(
        "--build",
        type=Path,
        help="this build: a directory for PYTHONPATH or a .whl; default: the current "
        "environment's megatron-core (must be a V+stateadoption build)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"downloads and installed wheels (default {default_cache_dir()})",
    )
    parser.add_argument(
        "--checkpoint-root",
        type=Path,
        help="where checkpoints go (default /dev/shm when it has room, else the temp dir)",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="worker logs and raw results (default: a new temp dir)"
    )
    parser.add_argument("--json-out", type=Path, help="also write the JSON document here")
    parser.add_argument("--markdown-out", type=Path, help="also write the Markdown report here")
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=1800.0,
        help="seconds before a worker process is killed (default 1800)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 4 unless, on every rank, every measured case shows the expected saving "
        "(where one is predicted), the build's load peak within its training peak (where "
        "required) and bitwise-identical restored state and next step; prints each reason",
    )
    ranks = parser.add_argument_group("ranks (several: torch.distributed.run on this node)")
    ranks.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="ranks (GPUs) for train+save+control and, by default, for each resume (default 1: "
        "plain worker processes, no launcher)",
    )
    ranks.add_argument(
        "--tensor-model-parallel-size", type=int, default=1, help="TP size (default 1)"
    )
    ranks.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="EP size, moe case only (default 1)",
    )
    ranks.add_argument(
        "--resume-nproc-per-node",
        type=int,
        help="ranks for each resume (default: --nproc-per-node); a different value resumes at "
        "another data-parallel size (dp_reshardable, fully_reshardable, dp_zero_gather_scatter)",
    )
    ranks.add_argument(
        "--gpus",
        type=_parse_gpus,
        help="comma-separated GPU indices every worker may use (sets CUDA_VISIBLE_DEVICES), "
        "e.g. 2,3 to leave GPUs 0,1 to another run; default: all visible GPUs",
    )
    # Development only: lets the benchmark's mechanics be tested before the build exists.
    parser.add_argument(
        "--allow-non-stateadoption-build", action="store_true", help=argparse.SUPPRESS
    )
    return parser


def model_size(args: argparse.Namespace) -> ModelSize:
    """The preset with any size flags applied."""
    size = PRESETS[args.preset]
    overrides = {k: getattr(args, k) for k in _SIZE_FLAGS if getattr(args, k) is not None}
    if "hidden_size" in overrides and "ffn_hidden_size" not in overrides:
        overrides["ffn_hidden_size"] = 4 * overrides["hidden_size"]
    size = dataclasses.replace(size, **overrides)
    if size.hidden_size % size.num_attention_heads:
        raise SystemExit(
            f"--hidden-size {size.hidden_size} is not divisible by {size.num_attention_heads} heads"
        )
    return size


def make_cases(args: argparse.Namespace, size: ModelSize) -> list[BenchmarkCase]:
    """The :class:`BenchmarkCase` of every name in ``--cases``."""
    return [
        make_case(
            name,
            size,
            train_steps=args.train_steps,
            seed=args.seed,
            moe_fold_experts=args.moe_fold_experts,
            instance_loader=args.instance_loader,
        )
        for name in args.cases
    ]


def parse_layout(
    parser: argparse.ArgumentParser, args: argparse.Namespace, size: ModelSize
) -> ParallelLayout:
    """The validated process layout; a usage error (exit status 2) when it is invalid."""
    try:
        return validate_layout(
            args.nproc_per_node,
            args.tensor_model_parallel_size,
            args.expert_model_parallel_size,
            args.resume_nproc_per_node,
            make_cases(args, size),
            size,
        )
    except LayoutError as exc:
        parser.error(str(exc))


def _probe(workspace: Workspace, side: Side) -> dict[str, Any]:
    outcome = run_phase(workspace, side, "probe", f"probe-{side.label}", None, 600.0)
    if outcome.results[0] is None:
        raise SideError(f"probe of the {side.label} side failed; see {outcome.log}")
    return outcome.results[0]


def prepare_sides(
    args: argparse.Namespace, workspace: Workspace
) -> tuple[dict[str, Side], dict[str, dict[str, Any]]] | int:
    """Both sides and their probes, or the exit status that ends the run."""
    cache_dir = args.cache_dir or default_cache_dir()
    dev_mode = bool(args.allow_non_stateadoption_build)
    try:
        sides: dict[str, Side] = {"build": resolve_build(args.build, cache_dir)}
        probes = {"build": _probe(workspace, sides["build"])}
        missing = check_transformer_engine(probes["build"])
        if missing is not None:
            eprint(cannot_run_message(missing))
            return EXIT_CANNOT_RUN
        build_info = probes["build"]["megatron_core"]
        problem = build_problem(build_info, dev_mode)
        if problem is not None:
            eprint(f"resume_benchmark: refusing to run: {problem}")
            return EXIT_WRONG_SIDES
        release = upstream_release(build_info)
        progress(f"build side: megatron-core {build_info['version']}; upstream must be {release}")
        sides["upstream"] = resolve_upstream(args.upstream, cache_dir, release)
        probes["upstream"] = _probe(workspace, sides["upstream"])
    except SideError as exc:
        eprint(f"resume_benchmark: {exc}")
        return EXIT_CRASH
    problem = sides_problem(
        probes["upstream"]["megatron_core"], probes["build"]["megatron_core"], dev_mode
    )
    if problem is not None:
        eprint(f"resume_benchmark: refusing to run: {problem}")
        return EXIT_WRONG_SIDES
    if dev_mode and build_release(probes["build"]["megatron_core"]["version"]) is None:
        banner = "!" * 100
        eprint(
            f"{banner}\nWARNING: development mode: the build side is megatron-core "
            f"{probes['build']['megatron_core']['version']} (not +stateadoption). The numbers "
            f"below test the benchmark's mechanics only.\n{banner}"
        )
    if not probes["build"]["megatron_core"].get("has_outcome_hooks"):
        eprint(
            "resume_benchmark: WARNING: the build side's megatron-core has no "
            "register_outcome_hook, so no rank records which adopter installed the state "
            "(the 'state installed by' column stays empty)"
        )
    for label in ("upstream", "build"):
        info = probes[label]["megatron_core"]
        progress(
            f"{label}: megatron-core {info['version']} from {info['file']} ({sides[label].source})"
        )
    return sides, probes


def _run_one(run: CaseRun, case: BenchmarkCase) -> dict[str, Any]:
    """One case's entry; a driver error becomes an ``error`` entry instead of ending the run."""
    try:
        entry = run_case(run, case)
    except Exception as exc:  # noqa: BLE001 - one broken case must not hide the others
        progress(f"{case.name}: driver error: {one_line(exc)}")
        entry = {
            "case": case.name,
            "parallel": run.layout.to_json(),
            "status": "error",
            "detail": f"driver: {one_line(exc)}",
        }
    progress(
        f"{case.name}: {entry['status']}" + (f" ({entry['detail']})" if entry.get("detail") else "")
    )
    return entry


def _document(
    args: argparse.Namespace,
    size: ModelSize,
    layout: ParallelLayout,
    sides: dict[str, Side],
    probes: dict[str, dict[str, Any]],
    workspace: Workspace,
    entries: list[dict[str, Any]],
    wall_seconds: float,
) -> dict[str, Any]:
    """The JSON document of the run."""
    build_probe = probes["build"]
    return {
        "environment": {
            "gpu_name": build_probe.get("gpu_name"),
            "driver": build_probe.get("driver"),
            "torch": build_probe.get("torch"),
            "torch_cuda": build_probe.get("torch_cuda"),
            "transformer_engine": (build_probe.get("transformer_engine") or {}).get("version"),
            "python": build_probe.get("python"),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        },
        "sides": {
            label: {
                **sides[label].to_json(),
                **probes[label]["megatron_core"],
                "transformer_engine": (probes[label].get("transformer_engine") or {}).get(
                    "version"
                ),
            }
            for label in ("upstream", "build")
        },
        "settings": {
            "preset": args.preset,
            "size": dataclasses.asdict(size),
            "train_steps": args.train_steps,
            "seed": args.seed,
            "moe_fold_experts": args.moe_fold_experts,
            "instance_loader": args.instance_loader,
            "cases": args.cases,
            "dev_mode_build_is_not_stateadoption": bool(args.allow_non_stateadoption_build)
            and build_release(probes["build"]["megatron_core"]["version"]) is None,
            "workspace": str(workspace.root),
            "cases_wall_seconds": wall_seconds,
            "parallel": layout.to_json(),
        },
        "cases": entries,
    }


def _exit_status(check: bool, entries: list[dict[str, Any]]) -> int:
    """:data:`EXIT_CRASH` if a case crashed; with ``check``, :data:`EXIT_EXPECTATION_MISSED`
    (each reason printed) unless every case met its expectation; else :data:`EXIT_OK`."""
    if any(e["status"] == "error" for e in entries):
        for entry in entries:
            if entry["status"] == "error":
                eprint(f"resume_benchmark: {entry['case']} failed: {entry.get('detail')}")
        return EXIT_CRASH
    missed = [e for e in entries if not case_meets_expectations(e)]
    if check and missed:
        for entry in missed:
            for reason in entry.get("failed_expectations") or [entry.get("detail")]:
                eprint(f"resume_benchmark: --check: {entry['case']}: {reason}")
        return EXIT_EXPECTATION_MISSED
    return EXIT_OK


def exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (e.g. from ``timeout``) ends the run like Ctrl-C: the running phase's process
    group (its own session) is killed on the way out instead of outliving the driver."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring for exit statuses."""
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    parser = build_parser()
    args = parser.parse_args(argv)
    size = model_size(args)
    layout = parse_layout(parser, args, size)
    if args.gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus  # before CUDA is initialised here
    missing = check_cuda()
    if missing is None:
        missing = check_gpu_count(layout.gpus_needed)
    if missing is not None:
        eprint(cannot_run_message(missing))
        return EXIT_CANNOT_RUN
    workspace = Workspace(args.work_dir or Path(tempfile.mkdtemp(prefix="resume-benchmark-")))
    progress(f"workspace (logs, raw results): {workspace.root}")
    prepared = prepare_sides(args, workspace)
    if isinstance(prepared, int):
        return prepared
    sides, probes = prepared
    run = CaseRun(
        workspace=workspace,
        sides=sides,
        expected_files={label: probes[label]["megatron_core"]["file"] for label in sides},
        layout=layout,
        checkpoint_root=args.checkpoint_root,
        timeout_s=args.worker_timeout,
    )
    started = time.perf_counter()
    entries = [_run_one(run, case) for case in make_cases(args, size)]
    document = _document(
        args, size, layout, sides, probes, workspace, entries, time.perf_counter() - started
    )
    markdown = markdown_report(document)
    text = json_report(document)
    print(text, flush=True)
    print(markdown, flush=True)
    if args.markdown_out:
        args.markdown_out.write_text(markdown)
    if args.json_out:
        args.json_out.write_text(text)
    return _exit_status(args.check, entries)


if __name__ == "__main__":
    sys.exit(main())
