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

Exit status: 0 every run ran; 1 a run failed; 2 a usage error (the whole command line is checked
before any work, and before CUDA is looked for: each number, each path -- those that must exist,
the directories to write or make --, names and configurations, then how they combine; one line
names the argument at fault) or this machine cannot run the benchmark (no CUDA GPU, too few GPUs,
no Transformer Engine); 3 the sides are wrong (the build is not ``V+stateadoption``, upstream is
not exactly V, or both are the same); 4 with ``--check``, a configuration missed its expectation
(each reason printed).
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
from typing import Any, Final, NoReturn

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
#: Exit status of a usage error (one line naming the argument at fault).
EXIT_USAGE: Final = 2
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


class UsageError(ValueError):
    """A command line the benchmark cannot run; the message is one line naming the argument."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line pointing to ``--help`` (no usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see --help\n")


def _configurations(text: str) -> list[str]:
    try:
        return parse_configurations(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (documented in ``--help``)."""
    parser = _Parser(
        prog="python -m benchmarks.resume_benchmark",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Everything after -- goes to pretrain_gpt.py and replaces --configs/--size.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout")
    source.add_argument(
        "--megatron-lm-git",
        type=Path,
        help="a Megatron-LM git repository: a work tree (its .git is used), a .git directory or a "
        "bare clone",
    )
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
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help=f"wheels, the Megatron-LM clone; made if missing (default {default_cache_dir()})",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="logs, checkpoints; made if missing (default: a temp dir)"
    )
    parser.add_argument(
        "--train-iters", type=int, default=10, help="iterations in all (>= 1; default 10)"
    )
    parser.add_argument(
        "--resume-at",
        type=int,
        default=5,
        help="where the checkpoint is saved and resumed (1 .. --train-iters - 1; default 5)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="--deterministic-mode; the resumes save, and their checkpoints are compared",
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per run (>= 1)")
    parser.add_argument(
        "--worker-timeout", type=float, default=1800.0, help="seconds per run (> 0)"
    )
    parser.add_argument("--json-out", type=Path, help="a file in an existing directory")
    parser.add_argument("--markdown-out", type=Path, help="a file in an existing directory")
    parser.add_argument(
        "--figures-dir", type=Path, help="one PNG per configuration, and figures.md linking them"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 4 unless every configuration meets its expectation",
    )
    parser.add_argument(
        "--check-command-line",
        action="store_true",
        help="only check the command line and exit (0: it would run; 2: one line says why not); "
        "needs no GPU",
    )
    parser.add_argument(
        "--allow-non-stateadoption-build", action="store_true", help=argparse.SUPPRESS
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _nearest_existing(path: Path) -> Path:
    """The nearest ancestor of ``path`` that exists (``/`` at worst)."""
    parent = path.absolute().parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    return parent


def _missing(path: Path, what: str) -> str:
    """Why ``path``, which does not exist, is not there: a file in the way, else ``no such``."""
    blocking = _nearest_existing(path)
    if os.path.isdir(blocking):
        return f"no such {what}"
    if blocking == path.absolute().parent:
        return f"its parent {blocking} is a file, not a directory"
    return f"{blocking} is a file, not a directory"


def _writable(directory: Path | str) -> bool:
    return os.access(directory, os.W_OK | os.X_OK)


def _input_dir_problem(flag: str, path: Path) -> str | None:
    """Why ``path`` is no directory that can be read, or None."""
    if os.path.isdir(path):
        readable = os.access(path, os.R_OK | os.X_OK)
        return None if readable else f"{flag} {path}: the directory is not readable"
    if os.path.lexists(path):
        return f"{flag} {path}: is a file, not a directory"
    return f"{flag} {path}: {_missing(path, 'directory')}"


def _output_problem(
    flag: str, path: Path | None, directory: bool = False, parents: bool = False
) -> str | None:
    """Why ``path`` -- an output file, or with ``directory`` a folder made if missing (with
    ``parents``, its missing parents too) -- cannot be written, or None."""
    if path is None:
        return None
    kind = "directory" if directory else "file"
    if os.path.isdir(path):
        if not directory:
            return f"{flag} {path}: is a directory, not a file"
        return None if _writable(path) else f"{flag} {path}: the directory is not writable"
    if os.path.lexists(path):
        if directory:
            return f"{flag} {path}: is a file, not a directory"
        return None if os.access(path, os.W_OK) else f"{flag} {path}: exists and is not writable"
    parent = path.absolute().parent
    blocking = _nearest_existing(path)
    if not os.path.isdir(blocking):
        return f"{flag} {path}: {_missing(path, kind)}"
    if blocking != parent and not parents:
        return f"{flag} {path}: its parent directory {parent} does not exist"
    if not _writable(blocking):
        if blocking == parent:
            return f"{flag} {path}: its parent directory {parent} is not writable"
        return f"{flag} {path}: cannot be made: {blocking} is not writable"
    return None


def _side_path_problem(flag: str, path: Path | None) -> str | None:
    """Why ``path`` is neither a site (a directory) nor a wheel that can be read, or None."""
    if path is None:
        return None
    if os.path.isdir(path):
        return _input_dir_problem(flag, path)
    if os.path.isfile(path) and path.suffix == ".whl":
        return None if os.access(path, os.R_OK) else f"{flag} {path}: the wheel is not readable"
    if os.path.lexists(path):
        return f"{flag} {path}: neither a directory (a site) nor a wheel (*.whl)"
    return f"{flag} {path}: {_missing(path, 'directory or wheel')}"


def _git(git_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "--git-dir", str(git_dir), *args], capture_output=True, text=True, check=False
    )


def git_directory(path: Path) -> Path:
    """The git directory of ``--megatron-lm-git path``: ``path`` itself (a bare clone or a
    ``.git`` directory) or, for a work tree, its ``.git`` (a directory, or a file naming one).

    Raises:
        UsageError: ``path`` is none of these (or git cannot run).
    """
    flag = "--megatron-lm-git"
    problem = _input_dir_problem(flag, path)
    if problem is not None:
        raise UsageError(problem)
    for candidate in (path, path / ".git"):
        if not os.path.lexists(candidate):
            continue
        try:
            found = _git(candidate, "rev-parse", "--absolute-git-dir")
        except OSError as exc:
            raise UsageError(f"{flag} {path}: git cannot run ({exc})") from None
        if found.returncode == 0:
            return Path(found.stdout.strip())
    raise UsageError(
        f"{flag} {path}: not a git repository (neither a git directory, such as a bare clone or "
        "a work tree's .git, nor a work tree)"
    )


def _positive_integer(flag: str, value: int) -> None:
    if value < 1:
        raise UsageError(f"{flag} {value}: must be a positive integer")


def _raise(problem: str | None) -> None:
    """Raise :class:`UsageError` for ``problem``, if there is one."""
    if problem is not None:
        raise UsageError(problem)


def _cache_dir_used(args: argparse.Namespace) -> bool:
    """Whether the run writes into the cache directory: a wheel to install, upstream to
    download, or Megatron-LM to clone."""
    wheels = [p for p in (args.upstream, args.build) if p is not None and p.suffix == ".whl"]
    clone = args.megatron_lm is None and args.megatron_lm_git is None
    return bool(wheels) or args.upstream is None or clone


def checked_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` checked before any work (no probe, install, download or clone, and no CUDA):
    each number on its own, each path (what must exist exists; what is written or made can be),
    each name, then how the arguments combine. Returns a copy with the paths' ``~`` expanded and
    ``--megatron-lm-git`` the git directory it names.

    Raises:
        UsageError: the first problem, one line naming the argument at fault.
    """
    args = argparse.Namespace(**vars(args))
    for name, value in vars(args).items():
        if isinstance(value, Path):
            setattr(args, name, value.expanduser())
    script_args = script_arguments(args)
    # each number on its own
    _positive_integer("--train-iters", args.train_iters)
    _positive_integer("--resume-at", args.resume_at)
    _positive_integer("--nproc-per-node", args.nproc_per_node)
    timeout = args.worker_timeout
    if not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--worker-timeout {timeout:g}: must be a positive number of seconds")
    # names
    if args.script_args and args.script_args[0] != "--":
        raise UsageError(
            f"{args.script_args[0]}: unexpected argument (pretrain_gpt.py arguments go after --)"
        )
    if args.name is not None:
        if not args.name.strip():
            raise UsageError(f"--name {args.name!r}: must not be empty")
        if "/" in args.name or args.name in (".", ".."):
            raise UsageError(
                f"--name {args.name}: must not contain '/' (it names the run's directory in the "
                "work directory)"
            )
    if args.ref is not None and not args.ref.strip():
        raise UsageError(f"--ref {args.ref!r}: must not be empty")
    # paths
    if args.megatron_lm is not None:
        _raise(_input_dir_problem("--megatron-lm", args.megatron_lm))
        if not (args.megatron_lm / SCRIPT).is_file():
            raise UsageError(
                f"--megatron-lm {args.megatron_lm}: not a Megatron-LM checkout (no {SCRIPT})"
            )
    given_git = args.megatron_lm_git
    if given_git is not None:
        args.megatron_lm_git = git_directory(given_git)
    _raise(_side_path_problem("--upstream", args.upstream))
    _raise(_side_path_problem("--build", args.build))
    if args.cache_dir is not None:
        _raise(_output_problem("--cache-dir", args.cache_dir, directory=True, parents=True))
    elif _cache_dir_used(args):
        default = default_cache_dir()
        problem = _output_problem("--cache-dir", default, directory=True, parents=True)
        if problem is not None:
            raise UsageError(f"{problem} (the default: give --cache-dir)")
    _raise(_output_problem("--work-dir", args.work_dir, directory=True, parents=True))
    _raise(_output_problem("--json-out", args.json_out))
    _raise(_output_problem("--markdown-out", args.markdown_out))
    _raise(_output_problem("--figures-dir", args.figures_dir, directory=True))
    # how they combine
    if args.resume_at >= args.train_iters:
        raise UsageError(
            f"--resume-at {args.resume_at}: must be less than --train-iters {args.train_iters}"
        )
    if args.megatron_lm is not None and args.ref is not None:
        raise UsageError(
            f"--ref {args.ref}: --megatron-lm is a checkout, used as it is; --ref selects a "
            "commit of --megatron-lm-git DIR (or of the release clone)"
        )
    if given_git is not None and args.ref is not None:
        verify = ["rev-parse", "--verify", "--quiet", f"{args.ref}^{{commit}}"]
        if _git(args.megatron_lm_git, *verify).returncode != 0:
            raise UsageError(f"--ref {args.ref}: no such branch, tag or commit in {given_git}")
    if script_args and args.size is not None:
        raise UsageError(
            f"--size {args.size}: sizes the built-in configurations; the pretrain_gpt.py "
            "arguments after -- set the model themselves"
        )
    if args.name is not None and not script_args:
        raise UsageError(
            f"--name {args.name}: names the run of your pretrain_gpt.py arguments after --; the "
            "built-in configurations have their own names"
        )
    if args.configs and script_args:
        raise UsageError(
            "--configs: give --configs or pretrain_gpt.py arguments after --, not both"
        )
    outputs = [p for p in (args.json_out, args.markdown_out) if p is not None]
    if len(outputs) == 2 and os.path.realpath(outputs[0]) == os.path.realpath(outputs[1]):
        raise UsageError(f"--markdown-out {args.markdown_out}: the same file as --json-out")
    try:
        requested_runs(args)  # the pretrain_gpt.py arguments the client refuses
    except ClientUsageError as exc:
        raise UsageError(str(exc)) from None
    return args


def command_line_problem(args: argparse.Namespace) -> str | None:
    """The first reason the command line cannot run (:func:`checked_arguments`), or None."""
    try:
        checked_arguments(args)
    except UsageError as exc:
        return str(exc)
    return None


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
    try:
        args = checked_arguments(parser.parse_args(argv))
    except UsageError as exc:
        parser.error(str(exc))
    if args.check_command_line:
        return EXIT_OK
    requested = requested_runs(args)
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
