"""Command line of the resume benchmark (``python -m benchmarks.resume_benchmark``).

It runs Megatron-LM's own ``pretrain_gpt.py`` (:mod:`.megatron_lm`) four times per
configuration, each in fresh processes: train to ``--resume-at`` and save, the uninterrupted
run, and the resume with upstream megatron-core V and with this project's ``V+stateadoption``
build. The configurations are the built-in ones (:mod:`.configs`, ``--configs``, at
``--size``) or your own arguments after ``--``. It prints a table and writes JSON, Markdown and
one memory-timeline figure per configuration.

Megatron-LM's training code comes from ``--megatron-lm DIR`` (a checkout), ``--megatron-lm-git
DIR`` (a repository; ``--ref``, default the build's release branch ``core_rX.Y.0``), or, with
neither, a shallow clone of that branch from GitHub into ``--cache-dir``.

Exit status: 0 every run ran; 1 a run failed; 2 a usage error (the command line is checked before
any work: paths that must exist, output directories, numbers, configurations; one line says why)
or this machine cannot run the benchmark (no CUDA GPU, too few GPUs, no Transformer Engine); 3
the sides are wrong (the build is
not ``V+stateadoption``, upstream is not exactly V, or both are the same); 4 with ``--check``, a
configuration missed its expectation (each reason printed).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from benchmarks.resume_benchmark.configs import (
    CONFIGURATIONS,
    DEFAULT_CONFIGURATIONS,
    SIZES,
    parse_configurations,
)
from benchmarks.resume_benchmark.driver import Workspace, run_phase
from benchmarks.resume_benchmark.figures import markdown_images, write_figures
from benchmarks.resume_benchmark.megatron_lm import (
    SCRIPT,
    ClientSetup,
    ClientUsageError,
    RunPlan,
    base_arguments,
    clone_release,
    failed_phases,
    prepare_setup,
    release_branch,
    run_client,
)
from benchmarks.resume_benchmark.report import expectation_problems, markdown_report, summary_table
from benchmarks.resume_benchmark.results import eprint, progress, write_json
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

EXIT_OK: Final = 0
EXIT_CRASH: Final = 1
#: Exit status when this machine cannot run the benchmark (no CUDA GPU or no Transformer Engine).
EXIT_CANNOT_RUN: Final = 2
EXIT_WRONG_SIDES: Final = 3
EXIT_EXPECTATION_MISSED: Final = 4

#: The model size of the built-in configurations without ``--size``.
DEFAULT_SIZE: Final = "1b"

_WHY = (
    "This benchmark measures a GPU memory peak (torch.cuda.max_memory_allocated) while "
    "Transformer Engine's FusedAdam state is restored on a CUDA GPU, so it cannot run here."
)


def cannot_run_message(missing: str) -> str:
    """The single message printed before exiting with :data:`EXIT_CANNOT_RUN`."""
    return f"resume_benchmark: {missing}. {_WHY}"


def check_cuda(needed: int = 1) -> str | None:
    """``None`` when torch imports and sees ``needed`` CUDA devices, else what is missing."""
    try:
        import torch
    except ImportError as exc:
        return f"PyTorch is not importable ({exc})"
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (CPU-only build)"
        return f"no CUDA device is available (torch {torch.__version__}, CUDA runtime {built})"
    if torch.cuda.device_count() < needed:
        return f"{needed} CUDA devices are needed, {torch.cuda.device_count()} are visible"
    return None


def check_transformer_engine(probe: Mapping[str, Any]) -> str | None:
    """``None`` when the build side could import Transformer Engine, else why not."""
    te = probe.get("transformer_engine") or {}
    if te.get("error"):
        return f"Transformer Engine is not importable for the build side ({te['error']})"
    if not probe.get("cuda_available", False):
        return "no CUDA device is available to the build side's processes"
    return None


def _configurations(text: str) -> list[str]:
    try:
        return parse_configurations(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (documented in ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.resume_benchmark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Everything after -- goes to pretrain_gpt.py and replaces --configs/--size.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout")
    source.add_argument("--megatron-lm-git", type=Path, help="a Megatron-LM git repository")
    parser.add_argument(
        "--ref", help="with --megatron-lm-git: branch or commit (default: the build's core_rX.Y.0)"
    )
    parser.add_argument(
        "--configs",
        type=_configurations,
        help=f"'all' (alone) or comma-separated, each once: {', '.join(CONFIGURATIONS)} "
        f"(default: {', '.join(DEFAULT_CONFIGURATIONS)}, the ones measured on an H200)",
    )
    parser.add_argument(
        "--size",
        choices=list(SIZES),
        help=f"of the built-in configurations (default: {DEFAULT_SIZE})",
    )
    parser.add_argument(
        "--name",
        help="with arguments after --: the run's name in the report (default: 'your arguments')",
    )
    parser.add_argument(
        "--upstream", type=Path, help="upstream megatron-core V: DIR or WHEEL (default: pip)"
    )
    parser.add_argument(
        "--build", type=Path, help="the build: DIR or WHEEL (default: this environment's)"
    )
    parser.add_argument("--cache-dir", type=Path, help=f"default {default_cache_dir()}")
    parser.add_argument("--work-dir", type=Path, help="logs, checkpoints (default: a temp dir)")
    parser.add_argument("--train-iters", type=int, default=10)
    parser.add_argument("--resume-at", type=int, default=5)
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="--deterministic-mode; the resumes save, and their checkpoints are compared",
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per run (>= 1)")
    parser.add_argument(
        "--worker-timeout", type=float, default=1800.0, help="seconds per run (> 0)"
    )
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--markdown-out", type=Path)
    parser.add_argument(
        "--figures-dir", type=Path, help="one PNG per configuration, and figures.md linking them"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 4 unless every configuration meets its expectation",
    )
    parser.add_argument(
        "--allow-non-stateadoption-build", action="store_true", help=argparse.SUPPRESS
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _output_problem(flag: str, path: Path | None, directory: bool = False) -> str | None:
    """Why ``path`` (an output file, or with ``directory`` a folder made if missing) cannot be
    written at the end of the run, or None."""
    if path is None:
        return None
    if directory and path.is_dir():
        return None if os.access(path, os.W_OK) else f"{flag} {path}: the directory is not writable"
    if path.exists() and (directory or path.is_dir()):
        kind = "a directory" if directory else "a file"
        return f"{flag} {path}: exists and is not {kind}"
    parent = path.absolute().parent
    if not parent.is_dir():
        return f"{flag} {path}: its parent directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"{flag} {path}: its parent directory {parent} is not writable"
    return None


def _side_path_problem(flag: str, path: Path | None) -> str | None:
    if path is None or path.is_dir() or (path.is_file() and path.suffix == ".whl"):
        return None
    if not path.exists():
        return f"{flag} {path}: no such directory or wheel"
    return f"{flag} {path}: neither a directory (a site) nor a wheel (*.whl)"


def _git_problem(git_dir: Path, ref: str | None) -> str | None:
    """Why ``git_dir`` is no git repository, or ``ref`` no commit in it; None when both are."""
    if not git_dir.is_dir():
        return f"--megatron-lm-git {git_dir}: no such directory"
    git = ["git", "--git-dir", str(git_dir)]
    try:
        found = subprocess.run([*git, "rev-parse", "--git-dir"], capture_output=True, check=False)
    except OSError as exc:
        return f"--megatron-lm-git {git_dir}: git cannot run ({exc})"
    if found.returncode != 0:
        hint = " (a work tree: give its .git directory)" if (git_dir / ".git").exists() else ""
        return f"--megatron-lm-git {git_dir}: not a git directory{hint}"
    if ref is not None:
        verify = [*git, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"]
        if subprocess.run(verify, capture_output=True, check=False).returncode != 0:
            return f"--ref {ref}: no such branch, tag or commit in {git_dir}"
    return None


def command_line_problem(args: argparse.Namespace) -> str | None:
    """The first reason the command line cannot run, found before any work (no probe, no
    install, no download), or None. Each is one line; ``main`` exits 2 with it."""
    script_args = script_arguments(args)
    checks: list[str | None] = []
    if args.megatron_lm is not None:
        if not args.megatron_lm.is_dir():
            checks.append(f"--megatron-lm {args.megatron_lm}: no such directory")
        elif not (args.megatron_lm / SCRIPT).is_file():
            checks.append(
                f"--megatron-lm {args.megatron_lm}: not a Megatron-LM checkout (no {SCRIPT})"
            )
        if args.ref is not None:
            checks.append(
                f"--ref {args.ref}: --megatron-lm is a checkout, used as it is; --ref selects a "
                "commit of --megatron-lm-git DIR (or of the release clone)"
            )
    if args.megatron_lm_git is not None:
        checks.append(_git_problem(args.megatron_lm_git, args.ref))
    if script_args and args.size is not None:
        checks.append(
            f"--size {args.size}: sizes the built-in configurations; the pretrain_gpt.py "
            "arguments after -- set the model themselves"
        )
    if args.name is not None and not script_args:
        checks.append(
            f"--name {args.name}: names the run of your pretrain_gpt.py arguments after --; the "
            "built-in configurations have their own names"
        )
    if args.nproc_per_node < 1:
        checks.append(f"--nproc-per-node {args.nproc_per_node}: must be at least 1")
    timeout = args.worker_timeout
    if not (math.isfinite(timeout) and timeout > 0):
        checks.append(f"--worker-timeout {timeout:g}: must be a positive number of seconds")
    checks += [
        _side_path_problem("--upstream", args.upstream),
        _side_path_problem("--build", args.build),
        _output_problem("--json-out", args.json_out),
        _output_problem("--markdown-out", args.markdown_out),
        _output_problem("--figures-dir", args.figures_dir, directory=True),
    ]
    if args.work_dir is not None and args.work_dir.exists() and not args.work_dir.is_dir():
        checks.append(f"--work-dir {args.work_dir}: exists and is not a directory")
    return next((problem for problem in checks if problem is not None), None)


def _probe(workspace: Workspace, side: Side) -> dict[str, Any]:
    result = workspace.path(f"probe-{side.label}.result.json")
    command = [sys.executable, "-m", "benchmarks.resume_benchmark.side_probe", "--result"]
    outcome = run_phase(workspace, side, f"probe-{side.label}", [*command, str(result)], 600.0)
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
        eprint(
            "WARNING: development mode: the build side is megatron-core "
            f"{probes['build']['megatron_core']['version']} (not +stateadoption); the numbers "
            "test the benchmark's mechanics only"
        )
    for label in ("upstream", "build"):
        info = probes[label]["megatron_core"]
        progress(
            f"{label}: megatron-core {info['version']} from {info['file']} ({sides[label].source})"
        )
    return sides, probes


def script_arguments(args: argparse.Namespace) -> list[str]:
    """The ``pretrain_gpt.py`` arguments given after ``--`` (empty: the built-in configurations)."""
    return [a for a in args.script_args if a != "--"]


def requested_runs(args: argparse.Namespace) -> list[tuple[dict[str, str | None], list[str]]]:
    """``(configuration record, pretrain_gpt.py arguments)`` per run: the user's arguments after
    ``--`` (one run), else each of ``--configs`` at ``--size``.

    Raises:
        ClientUsageError: ``--configs`` together with arguments after ``--``.
    """
    script_args = script_arguments(args)
    if script_args:
        if args.configs:
            raise ClientUsageError("give --configs or pretrain_gpt.py arguments after --, not both")
        base_arguments(script_args, apex_fusion=True)  # refuses what the client cannot run
        record = {"name": args.name or "your arguments", "description": None, "expectation": None}
        return [(record, script_args)]
    return [
        (
            {
                "name": name,
                "description": CONFIGURATIONS[name].description,
                "expectation": CONFIGURATIONS[name].expectation.name,
                "upstream_divergence": CONFIGURATIONS[name].upstream_divergence,
            },
            CONFIGURATIONS[name].script_arguments(args.size or DEFAULT_SIZE),
        )
        for name in args.configs or DEFAULT_CONFIGURATIONS
    ]


def _document(
    args: argparse.Namespace,
    sides: Mapping[str, Side],
    probes: Mapping[str, Mapping[str, Any]],
    runs: list[dict[str, Any]],
) -> dict[str, Any]:
    build = probes["build"]
    return {
        "environment": {
            key: build.get(key) for key in ("gpu_name", "driver", "torch", "torch_cuda", "python")
        }
        | {"transformer_engine": (build.get("transformer_engine") or {}).get("version")},
        "sides": {
            label: {**sides[label].to_json(), **probes[label]["megatron_core"]}
            for label in ("upstream", "build")
        },
        "size": None if script_arguments(args) else args.size or DEFAULT_SIZE,
        "nproc_per_node": args.nproc_per_node,
        "runs": runs,
    }


def _run_all(
    setup: ClientSetup, workspace: Workspace, args: argparse.Namespace, requested: list[Any]
) -> list[dict[str, Any]]:
    runs = []
    for configuration, script_args in requested:
        name = str(configuration["name"]).replace(" ", "-")
        space = Workspace(workspace.path(name))
        plan = RunPlan(args.train_iters, args.resume_at, args.deterministic, space.path("ckpt"))
        run = {"configuration": configuration, **run_client(setup, space, plan, script_args)}
        failed = failed_phases(run)
        progress(f"{name}: " + (f"failed: {', '.join(failed)}" if failed else "done"))
        runs.append(run)
    return runs


def exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (e.g. from ``timeout``) ends the run like Ctrl-C: the running launch's process
    group (its own session) is killed on the way out instead of outliving the driver."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring for exit statuses."""
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        requested = requested_runs(args)
        RunPlan(args.train_iters, args.resume_at, args.deterministic, Path("."))
    except ClientUsageError as exc:
        parser.error(str(exc))
    problem = command_line_problem(args)
    if problem is not None:
        parser.error(problem)
    missing = check_cuda(args.nproc_per_node)
    if missing is not None:
        eprint(cannot_run_message(missing))
        return EXIT_CANNOT_RUN
    workspace = Workspace(args.work_dir or Path(tempfile.mkdtemp(prefix="resume-benchmark-")))
    progress(f"workspace (logs, results): {workspace.root}")
    prepared = prepare_sides(args, workspace)
    if isinstance(prepared, int):
        return prepared
    sides, probes = prepared
    version = probes["build"]["megatron_core"]["version"]
    ref = args.ref or release_branch(version)
    try:
        git_dir = args.megatron_lm_git
        if args.megatron_lm is None and git_dir is None:
            git_dir = clone_release(args.cache_dir or default_cache_dir(), ref)
        source = (args.megatron_lm, git_dir, ref)
        setup = prepare_setup(
            sides, version, source, workspace, args.nproc_per_node, args.worker_timeout
        )
        runs = _run_all(setup, workspace, args, requested)
    except ClientUsageError as exc:
        eprint(f"resume_benchmark: {exc}")
        return EXIT_CANNOT_RUN
    document = _document(args, sides, probes, runs)
    if args.json_out:  # first: what the other outputs re-render from
        write_json(args.json_out, document)
    print("\n".join(summary_table(document)), flush=True)
    if args.markdown_out:
        args.markdown_out.write_text(markdown_report(document))
    if args.figures_dir:
        args.figures_dir.mkdir(parents=True, exist_ok=True)
        written = write_figures([document], args.figures_dir)
        images = markdown_images(written, args.figures_dir)
        (args.figures_dir / "figures.md").write_text("".join(f"{line}\n\n" for line in images))
    failed = [
        f"{run['configuration']['name']}: {', '.join(failed_phases(run))}"
        for run in runs
        if failed_phases(run)
    ]
    if failed:
        eprint(f"resume_benchmark: runs failed: {'; '.join(failed)} (logs in {workspace.root})")
        return EXIT_CRASH
    missed = [problem for run in runs for problem in expectation_problems(run)]
    if args.check and missed:
        for problem in missed:
            eprint(f"resume_benchmark: --check: {problem}")
        return EXIT_EXPECTATION_MISSED
    return EXIT_OK
