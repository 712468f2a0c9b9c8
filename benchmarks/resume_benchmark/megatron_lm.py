"""The resume benchmark on the user's own training: Megatron-LM's ``pretrain_gpt.py``.

``python -m benchmarks.resume_benchmark megatron-lm --megatron-lm PATH -- ARGS`` runs the user's
``pretrain_gpt.py`` arguments ``ARGS`` unchanged four times, each in fresh processes
(``torch.distributed.run``, ``--nproc-per-node`` ranks), with Megatron-LM's own training loop:

1. ``train`` (build side): to iteration K (``--resume-at``) of ``--train-iters N``, saved as
   ``torch_dist`` and stopped by ``--exit-interval K`` (the scheduler checks that the resume
   asks for the same ``--train-iters``);
2. ``uninterrupted`` (build side): iterations 1..N in one process, no checkpoint;
3. ``resume-upstream`` and 4. ``resume-build``: load iteration K and train to N; with
   ``--deterministic`` each saves iteration N, and the two checkpoints are compared tensor by
   tensor.

Megatron-LM comes from a checkout (``--megatron-lm PATH``) or a git repository and a ref
(``--megatron-lm-git DIR --ref core_r0.19.0``; default: the release branch of the build's
megatron-core). Only its training code is used (everything but ``megatron/core``), put first on
``sys.path``; ``megatron.core`` always comes from the side. Each rank runs under
:mod:`.megatron_lm_probe`, which records the allocator around ``load_checkpoint``, the outcomes
of the state-adoption hooks, and the run's peak. Per-iteration losses are read from the
TensorBoard scalars Megatron writes (``--log-interval 1`` console lines where TensorBoard is
missing; Megatron's console average on the second iteration of a process covers two iterations).

What the client adds to ``ARGS`` and why is printed and recorded in ``notes``: ``--mock-data``
without a data argument, ``--ckpt-format torch_dist`` (``fsdp_dtensor`` is accepted too),
``--eval-iters 0`` (evaluation is not measured), ``--no-gradient-accumulation-fusion`` when Apex's
``fused_weight_gradient_mlp_cuda`` is missing, and a ``make`` first on ``PATH`` that succeeds for
a ``megatron/core/datasets`` directory holding the prebuilt ``helpers_cpp`` and no Makefile
(pip-installed megatron-core; Megatron-LM's start-up runs ``make`` there) and runs the real
``make`` otherwise. Arguments the client owns (iterations, save/load, logging) are refused.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from benchmarks.resume_benchmark.results import installed_by_text
from benchmarks.resume_benchmark.driver import PhaseOutcome, Workspace, report_failure, run_phase
from benchmarks.resume_benchmark.cli import (
    EXIT_CANNOT_RUN,
    EXIT_CRASH,
    cannot_run_message,
    check_cuda,
    prepare_sides,
)
from benchmarks.resume_benchmark.results import eprint, progress, write_json
from benchmarks.resume_benchmark.sides import Side

SCRIPT: Final = "pretrain_gpt.py"
PROBE_MODULE: Final = "benchmarks.resume_benchmark.megatron_lm_probe"
#: What the client tree takes from Megatron-LM: its training code, never ``megatron/core``.
CLIENT_PATHS: Final = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "megatron")
RESUME_SIDES: Final = ("upstream", "build")

#: ``pretrain_gpt.py`` arguments the client sets itself, per phase.
OWNED_ARGUMENTS: Final = frozenset(
    {
        "--train-iters", "--train-samples", "--exit-interval", "--save", "--load",
        "--save-interval", "--tensorboard-dir", "--tensorboard-log-interval", "--log-interval",
        "--finetune", "--no-load-optim", "--no-load-rng", "--ckpt-step", "--deterministic-mode",
    }
)  # fmt: skip
#: Checkpoint formats the client resumes (both ``torch.distributed.checkpoint`` directories):
#: ``torch_dist`` (the default it adds), ``fsdp_dtensor`` (Megatron-FSDP).
CHECKPOINT_FORMATS: Final = ("torch_dist", "fsdp_dtensor")
#: Megatron-LM divides by ``--eval-interval`` even with ``--eval-iters 0``.
EVAL_INTERVAL: Final = 1000
DATA_ARGUMENTS: Final = ("--mock-data", "--data-path", "--train-data-path", "--data-args-path")

_ITERATION_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")
_MEMORY_LINE = re.compile(
    r"\(after (\d+) iterations\) memory \(MB\) \| allocated: [0-9.]+ \| max allocated: ([0-9.]+)"
)
_PARAMETERS_LINE = re.compile(r"number of parameters on \([^)]*\) model parallel rank [^:]*: (\d+)")

_MAKE_SHIM = """#!/bin/sh
# resume benchmark: Megatron-LM runs `make -C <site>/megatron/core/datasets`; a pip-installed
# megatron-core ships the built helpers_cpp and no Makefile there. Nothing to build then.
if [ "$1" = "-C" ] && [ ! -e "$2/Makefile" ] && ls "$2"/helpers_cpp*.so >/dev/null 2>&1; then
  echo "resume benchmark: $2 holds a prebuilt helpers_cpp and no Makefile; nothing to make"
  exit 0
fi
exec {real} "$@"
"""


class ClientUsageError(ValueError):
    """The user's ``pretrain_gpt.py`` arguments cannot be run by the client."""


def _value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``), else None."""
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _flags(args: Sequence[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


def base_arguments(user_args: Sequence[str], apex_fusion: bool) -> tuple[list[str], list[str]]:
    """``user_args`` plus what every phase needs; and one note per addition.

    Args:
        user_args: the user's ``pretrain_gpt.py`` arguments.
        apex_fusion: whether Apex's ``fused_weight_gradient_mlp_cuda`` can be imported.

    Returns:
        The arguments and the notes that tell the user what was added.

    Raises:
        ClientUsageError: for an argument the client owns, or a checkpoint format not in
            :data:`CHECKPOINT_FORMATS`.
    """
    flags = _flags(user_args)
    owned = sorted(flags & OWNED_ARGUMENTS)
    if owned:
        raise ClientUsageError(
            f"{', '.join(owned)}: set by the client (use --train-iters/--resume-at/--deterministic "
            "of the client; it owns saving, loading and logging)"
        )
    ckpt_format = _value(user_args, "--ckpt-format")
    if ckpt_format not in (None, *CHECKPOINT_FORMATS):
        raise ClientUsageError(
            f"--ckpt-format {ckpt_format}: the benchmark resumes {' or '.join(CHECKPOINT_FORMATS)}"
        )
    args, notes = list(user_args), []
    if not flags & set(DATA_ARGUMENTS):
        args.append("--mock-data")
        notes.append("--mock-data added (no data argument given)")
    if ckpt_format is None:
        args += ["--ckpt-format", "torch_dist"]
        notes.append("--ckpt-format torch_dist added")
    if not flags & {"--eval-iters", "--eval-interval"}:
        args += ["--eval-iters", "0", "--eval-interval", str(EVAL_INTERVAL)]
        notes.append(
            f"--eval-iters 0 --eval-interval {EVAL_INTERVAL} added (evaluation is not measured)"
        )
    if "--no-gradient-accumulation-fusion" not in flags and not apex_fusion:
        args.append("--no-gradient-accumulation-fusion")
        notes.append(
            "--no-gradient-accumulation-fusion added: gradient-accumulation fusion needs Apex's "
            "fused_weight_gradient_mlp_cuda, which is not installed"
        )
    args += ["--log-interval", "1", "--tensorboard-log-interval", "1"]
    return args, notes


def phase_arguments(base: Sequence[str], phase: str, plan: RunPlan, directory: Path) -> list[str]:
    """The full ``pretrain_gpt.py`` arguments of ``phase`` (``train``, ``uninterrupted``,
    ``resume-upstream``, ``resume-build``), its files under ``directory``."""
    args = [*base, "--train-iters", str(plan.train_iters)]
    args += ["--tensorboard-dir", str(directory / f"tensorboard-{phase}")]
    if plan.deterministic:
        args.append("--deterministic-mode")
    if phase == "train":
        args += ["--save", str(plan.checkpoint), "--save-interval", str(plan.resume_at)]
        args += ["--exit-interval", str(plan.resume_at)]
    elif phase.startswith("resume-"):
        args += ["--load", str(plan.checkpoint)]
        if plan.deterministic:
            args += ["--save", str(directory / f"saved-{phase}")]
            args += ["--save-interval", str(plan.train_iters)]
    return args


@dataclass(frozen=True)
class RunPlan:
    """Iterations and where the checkpoint goes."""

    train_iters: int
    resume_at: int
    deterministic: bool
    checkpoint: Path

    def __post_init__(self) -> None:
        if not 0 < self.resume_at < self.train_iters:
            raise ClientUsageError(
                f"--resume-at {self.resume_at} must lie in 1..{self.train_iters - 1} "
                f"(--train-iters {self.train_iters})"
            )


def apex_fusion_available() -> bool:
    """Whether Apex's gradient-accumulation fusion kernel is importable here."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def write_make_shim(directory: Path) -> Path:
    """A ``bin/`` with the ``make`` of the module docstring; returns the directory."""
    real = shutil.which("make")
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "make"
    target = f'"{real}"' if real else 'false # no make on PATH:'
    shim.write_text(_MAKE_SHIM.format(real=target))
    shim.chmod(0o755)
    return bin_dir


def prepare_client(
    checkout: Path | None, git_dir: Path | None, ref: str, dest: Path
) -> tuple[str, str | None]:
    """Copy Megatron-LM's training code (:data:`CLIENT_PATHS`, no ``megatron/core``) to ``dest``.

    Returns:
        Where it came from, for the report, and the release (``0.19``) its own
        ``megatron/core/package_info.py`` names (None: not found).
    """
    dest.mkdir(parents=True, exist_ok=True)
    if checkout is not None:
        release = tree_release(checkout)
        for name in CLIENT_PATHS:
            source = checkout / name
            if source.is_dir():
                shutil.copytree(
                    source, dest / name, ignore=_ignore_core(source), dirs_exist_ok=True
                )
            elif source.is_file():
                shutil.copy2(source, dest / name)
        origin = f"checkout {checkout.resolve()}"
    else:
        assert git_dir is not None
        git = ["git", "--git-dir", str(git_dir)]
        commit = subprocess.run(
            [*git, "rev-parse", f"{ref}^{{commit}}"], capture_output=True, text=True, check=True
        ).stdout.strip()
        archive = subprocess.run(
            [*git, "archive", "--format=tar", commit, *CLIENT_PATHS],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
        release = tree_release(dest)
        shutil.rmtree(dest / "megatron" / "core", ignore_errors=True)
        origin = f"{git_dir} {ref} ({commit[:12]})"
    if not (dest / SCRIPT).is_file():
        raise ClientUsageError(f"no {SCRIPT} in Megatron-LM {origin}")
    return origin, release


def tree_release(root: Path) -> str | None:
    """``MAJOR.MINOR`` from a Megatron-LM tree's ``megatron/core/package_info.py``."""
    info = root / "megatron" / "core" / "package_info.py"
    text = info.read_text() if info.is_file() else ""
    parts = [re.search(rf"^{name} = (\d+)$", text, re.M) for name in ("MAJOR", "MINOR")]
    return ".".join(m[1] for m in parts if m) if all(parts) else None


def release_note(release: str | None, build_version: str) -> str | None:
    """A warning when the Megatron-LM tree is not of the build's ``MAJOR.MINOR`` release."""
    if release == major_minor(build_version):
        return None
    found = f"release {release}" if release else "an unknown release"
    return (
        f"WARNING: the Megatron-LM training code is of {found}, the build is megatron-core "
        f"{build_version}: use Megatron-LM's {release_branch(build_version)} branch"
    )


def _ignore_core(root: Path) -> Any:
    def ignore(directory: str, names: list[str]) -> list[str]:
        return ["core"] if Path(directory) == root and root.name == "megatron" else []

    return ignore


def major_minor(version: str) -> str:
    """``MAJOR.MINOR`` of a megatron-core version (``0.19.2+stateadoption`` -> ``0.19``)."""
    return ".".join(version.split("+")[0].split(".")[:2])


def release_branch(version: str) -> str:
    """Megatron-LM's release branch for megatron-core ``version`` (``0.19.2+x`` -> core_r0.19.0)."""
    return f"core_r{major_minor(version)}.0"


def script_arguments(args: argparse.Namespace) -> list[str]:
    """The ``pretrain_gpt.py`` arguments of the parsed client command line (after ``--``)."""
    return [a for a in args.script_args if a != "--"]


def console_losses(log_text: str) -> dict[int, str]:
    """Iteration -> Megatron's printed ``lm loss`` (as printed) from a console log."""
    return {int(m[1]): m[2] for m in _ITERATION_LINE.finditer(log_text)}


def first_memory_report(log_text: str) -> tuple[int, float] | None:
    """The first ``(after N iterations) memory`` report: N and its "max allocated" in MiB."""
    match = _MEMORY_LINE.search(log_text)
    return (int(match[1]), float(match[2])) if match else None


def parameter_count(log_text: str) -> int | None:
    """Megatron's "number of parameters" on this model-parallel rank."""
    match = _PARAMETERS_LINE.search(log_text)
    return int(match[1]) if match else None


def tensorboard_losses(directory: Path) -> dict[int, float] | None:
    """Iteration -> ``lm loss`` scalar Megatron wrote; None without TensorBoard or events."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return None
    if not directory.is_dir():
        return None
    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    if "lm loss" not in accumulator.Tags().get("scalars", []):
        return None
    return {int(event.step): float(event.value) for event in accumulator.Scalars("lm loss")}


@dataclass
class PhaseRecord:
    """What one run of ``pretrain_gpt.py`` measured: the probe record of the rank whose load
    rose highest over its baseline (``peak_rank``), every rank's rise, and rank 0's console."""

    phase: str
    side: str
    exit_code: int
    seconds: float
    log: str
    load: dict[str, Any] | None = None
    max_allocated_bytes: int | None = None
    first_memory_report: tuple[int, float] | None = None
    losses: dict[int, float | str] = field(default_factory=dict)
    loss_source: str = "console"
    parameters: int | None = None
    installed_by: str | None = None
    outcomes: list[dict[str, Any]] | None = None
    peak_rank: int = 0
    rank_load_peaks: list[int | None] = field(default_factory=list)
    modules: dict[str, str | None] = field(default_factory=dict)

    @property
    def load_peak_over_baseline(self) -> int | None:
        """The allocator peak inside ``load_checkpoint`` over its starting level."""
        return load_rise(self.load)


def load_rise(load: Mapping[str, Any] | None) -> int | None:
    """A probe's load peak over the level the load began at (None: no load, or no new peak)."""
    if not load or load.get("peak_bytes") is None:
        return None
    return int(load["peak_bytes"]) - int(load["baseline_bytes"])


def phase_record(phase: str, side: str, outcome: PhaseOutcome, tensorboard: Path) -> PhaseRecord:
    """Every rank's probe record and the console log of one run, parsed."""
    text = outcome.log.read_text(errors="replace")
    ranks: list[dict[str, Any]] = [r or {} for r in outcome.results] or [{}]
    rises = [load_rise(r.get("load")) for r in ranks]
    peak_rank = max(range(len(ranks)), key=lambda r: (rises[r] or -1, -r))
    result = ranks[peak_rank]
    peaks = [int(r["max_allocated_bytes"]) for r in ranks if r.get("max_allocated_bytes")]
    exact = tensorboard_losses(tensorboard)
    losses: dict[int, float | str] = dict(exact) if exact else dict(console_losses(text))
    adoption: dict[str, Any] = result.get("state_adoption") or {}
    return PhaseRecord(
        phase=phase,
        side=side,
        exit_code=outcome.returncode,
        seconds=round(outcome.seconds, 1),
        log=str(outcome.log),
        load=result.get("load"),
        max_allocated_bytes=max(peaks) if peaks else None,
        first_memory_report=first_memory_report(text),
        losses=losses,
        loss_source="tensorboard" if exact else "console",
        parameters=parameter_count(text),
        installed_by=installed_by_text(adoption) if phase.startswith("resume-") else None,
        outcomes=adoption.get("outcomes"),
        peak_rank=peak_rank,
        rank_load_peaks=rises,
        modules=result.get("modules") or {},
    )


def module_problems(record: PhaseRecord, client: Path, side: Side) -> list[str]:
    """Where a run took ``megatron.training`` from outside the client tree, or ``megatron.core``
    from outside its side's site (empty: as intended)."""
    training, core = (record.modules.get(n) for n in ("megatron.training", "megatron.core"))
    problems = []
    if training and not Path(training).resolve().is_relative_to(client.resolve()):
        problems.append(f"{record.phase} ran megatron.training from {training}, not {client}")
    site = side.pythonpath
    if core and site is not None and not Path(core).resolve().is_relative_to(site.resolve()):
        problems.append(f"{record.phase} ran megatron.core from {core}, not {site}")
    return [f"WARNING: {p}" for p in problems]


def loss_differences(
    expected: Mapping[int, float | str], actual: Mapping[int, float | str], iterations: range
) -> list[str]:
    """Iterations whose loss differs (or is missing), e.g. ``7: 10.3 != 10.4``."""
    return [
        f"{i}: {expected.get(i)} != {actual.get(i)}"
        for i in iterations
        if i not in expected or i not in actual or expected[i] != actual[i]
    ]


@dataclass
class CheckpointComparison:
    """Two ``torch_dist`` checkpoints compared tensor by tensor."""

    differences: list[str]
    tensors: int = 0
    bytes: int = 0


def compare_torch_dist(
    first: Path, second: Path, batch_bytes: int = 1 << 31
) -> CheckpointComparison:
    """The tensors that differ between two ``torch_dist`` checkpoints (bitwise) or that only one
    holds, and how many tensors and bytes were compared; read on the CPU with
    ``torch.distributed.checkpoint``, at most ``batch_bytes`` at a time. Non-tensor entries are
    compared by name only."""
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = [
        FileSystemReader(str(p)).read_metadata().state_dict_metadata for p in (first, second)
    ]
    compared = CheckpointComparison(sorted(set(metadata[0]) ^ set(metadata[1])))
    shared = [
        (key, meta)
        for key, meta in metadata[0].items()
        if isinstance(meta, TensorStorageMetadata) and key in metadata[1]
    ]
    while shared:
        batch: list[tuple[str, TensorStorageMetadata]] = []
        size = 0
        while shared and (not batch or size < batch_bytes):
            key, meta = shared.pop()
            batch.append((key, meta))
            size += meta.size.numel() * meta.properties.dtype.itemsize
        compared.tensors += len(batch)
        compared.bytes += size
        tensors = []
        for path in (first, second):
            state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in batch}
            load(state, storage_reader=FileSystemReader(str(path)), no_dist=True)
            tensors.append(state)
        compared.differences += [
            k for k, _ in batch if not torch.equal(tensors[0][k], tensors[1][k])
        ]
    compared.differences.sort()
    return compared


_MIB = float(1 << 20)


def markdown(document: Mapping[str, Any]) -> str:
    """The client's report table and notes."""
    plan, records = document["plan"], document["phases"]
    control = records.get("uninterrupted") or {}
    params = control.get("parameters")
    training_peak = control.get("max_allocated_bytes")
    mode = "yes" if plan["deterministic"] else "no"
    lines = [
        f"Megatron-LM `{SCRIPT}` from {document['megatron_lm']}; iterations "
        f"1..{plan['train_iters']}, resumed at {plan['resume_at']}; deterministic mode: {mode}; parameters (rank 0): "
        + (f"{params:,}" if params else "unknown"),
        "",
        "| side | load peak over pre-load, MiB | B/param | max allocated after iteration "
        f"{plan['resume_at'] + 1} (Megatron), MiB | ≤ uninterrupted training peak | losses "
        f"{plan['resume_at'] + 1}..{plan['train_iters']} equal | state installed by |",
        "|---|---|---|---|---|---|---|",
    ]
    for side in RESUME_SIDES:
        record = records.get(f"resume-{side}") or {}
        peak = record.get("load_peak_over_baseline")
        report = record.get("first_memory_report")
        within = None if not report or not training_peak else report[1] * _MIB <= training_peak
        differences = document["loss_differences"].get(side)
        if not record:
            lines.append(
                f"| {side} | " + " | ".join(["run failed (see the logs)"] + ["n/a"] * 5) + " |"
            )
            continue
        cells = [
            side,
            f"{peak / _MIB:,.1f}" if peak is not None else "n/a",
            f"{peak / params:.2f}" if peak is not None and params else "n/a",
            f"{report[1]:,.1f}" if report else "n/a",
            {None: "n/a", True: "yes", False: "no"}[within],
            "n/a" if differences is None else "**no**" if differences else "yes",
            record.get("installed_by") or "own loader (no outcomes recorded)",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if training_peak:
        lines.append(f"\nUninterrupted run's training peak: {training_peak / _MIB:,.1f} MiB.")
    for side in RESUME_SIDES:
        rises = (records.get(f"resume-{side}") or {}).get("rank_load_peaks") or []
        if len(rises) > 1:
            shown = ", ".join("n/a" if r is None else f"{r / _MIB:,.1f}" for r in rises)
            lines.append(
                f"{side}: load peak over pre-load per rank, MiB: {shown} (the table: the highest)."
            )
    saved, counted = document.get("checkpoint_differences"), document.get("checkpoint_compared")
    if saved is not None:
        verdict = (
            "identical, tensor by tensor" if not saved else f"{len(saved)} differ: {saved[:5]}"
        )
        if counted:
            verdict += (
                f" ({counted['tensors']:,} tensors, {counted['bytes'] / _MIB:,.1f} MiB compared)"
            )
        lines.append(
            f"Checkpoints saved at iteration {plan['train_iters']} by the two resumes: {verdict}."
        )
    lines += ["", "What the client added:", *(f"- {note}" for note in document["notes"])]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The client's command line (its own arguments; ``pretrain_gpt.py``'s follow ``--``)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.resume_benchmark megatron-lm",
        description="Resume Megatron-LM's pretrain_gpt.py with upstream and with the build.",
        epilog="Everything after -- goes to pretrain_gpt.py.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout")
    source.add_argument("--megatron-lm-git", type=Path, help="a Megatron-LM git directory")
    parser.add_argument("--ref", help="with --megatron-lm-git (default: the build's core_rX.Y.0)")
    parser.add_argument("--upstream", type=Path, help="upstream megatron-core: DIR or WHEEL")
    parser.add_argument("--build", type=Path, help="the build: DIR or WHEEL (default: installed)")
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--work-dir", type=Path, help="logs, TensorBoard, checkpoints")
    parser.add_argument("--train-iters", type=int, default=10)
    parser.add_argument("--resume-at", type=int, default=5)
    parser.add_argument("--deterministic", action="store_true", help="--deterministic-mode")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--worker-timeout", type=float, default=1800.0)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--markdown-out", type=Path)
    parser.add_argument(
        "--allow-non-stateadoption-build", action="store_true", help=argparse.SUPPRESS
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def _launch(
    workspace: Workspace, side: Side, phase: str, args: Sequence[str], client: Path,
    env: Mapping[str, str], nproc: int, timeout: float,
) -> PhaseOutcome:  # fmt: skip
    result = workspace.path(f"{phase}.result.json")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(nproc), "-m", PROBE_MODULE, "--client", str(client), "--result", str(result),
        SCRIPT, *args,
    ]  # fmt: skip
    progress(f"megatron-lm {phase} ({side.label} side, {nproc} rank(s))")
    outcome = run_phase(
        workspace, side, phase, phase, None, timeout, nproc, command=command, env=env
    )
    if not outcome.ok:
        report_failure(outcome, f"megatron-lm {phase}")
    return outcome


def main(argv: Sequence[str] | None = None) -> int:
    """Run the four phases and print the report; 0 when every phase ran, else 1 (2: usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    missing = check_cuda()
    if missing is not None:
        eprint(cannot_run_message(missing))
        return EXIT_CANNOT_RUN
    workspace = Workspace(args.work_dir or Path(tempfile.mkdtemp(prefix="megatron-lm-resume-")))
    try:
        plan = RunPlan(args.train_iters, args.resume_at, args.deterministic, workspace.path("ckpt"))
        base, notes = base_arguments(script_arguments(args), apex_fusion_available())
    except ClientUsageError as exc:
        parser.error(str(exc))
    prepared = prepare_sides(args, workspace)
    if isinstance(prepared, int):
        return prepared
    return run_client(args, workspace, *prepared, plan, base, notes)


def run_client(
    args: argparse.Namespace,
    workspace: Workspace,
    sides: Mapping[str, Side],
    probes: Mapping[str, Mapping[str, Any]],
    plan: RunPlan,
    base: Sequence[str],
    notes: list[str],
) -> int:
    """The four runs, the report and its files; 0 when every run exited 0, else 1.

    Args:
        args: the client's parsed command line.
        workspace: logs, TensorBoard files and checkpoints.
        sides: ``upstream`` and ``build``; probes: the build's ``megatron_core`` record.
        plan: iterations and the checkpoint directory.
        base: the ``pretrain_gpt.py`` arguments every run gets (:func:`base_arguments`).
        notes: what was added to them, for the report.
    """
    ref = args.ref or release_branch(probes["build"]["megatron_core"]["version"])
    client = workspace.path("megatron-lm-client")
    origin, release = prepare_client(args.megatron_lm, args.megatron_lm_git, ref, client)
    mismatch = release_note(release, probes["build"]["megatron_core"]["version"])
    if mismatch:
        notes.append(mismatch)
    bin_dir = write_make_shim(workspace.root)
    notes.append(f"`make` on PATH from {bin_dir}: succeeds for a prebuilt helpers_cpp directory")
    for note in notes:
        progress(f"megatron-lm: {note}")
    env_extra = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    records: dict[str, PhaseRecord] = {}
    phases = [("train", "build"), ("uninterrupted", "build")]
    phases += [(f"resume-{side}", side) for side in RESUME_SIDES]
    for phase, label in phases:
        phase_args = phase_arguments(base, phase, plan, workspace.root)
        outcome = _launch(
            workspace, sides[label], phase, phase_args, client, env_extra,
            args.nproc_per_node, args.worker_timeout,
        )  # fmt: skip
        records[phase] = phase_record(phase, label, outcome, workspace.path(f"tensorboard-{phase}"))
        for problem in module_problems(records[phase], client, sides[label]):
            progress(f"megatron-lm: {problem}")
            notes.append(problem)
        if phase == "train" and not outcome.ok:
            break
    after = range(plan.resume_at + 1, plan.train_iters + 1)
    control = records.get("uninterrupted")
    differences = {
        side: loss_differences(control.losses, records[f"resume-{side}"].losses, after)
        for side in RESUME_SIDES
        if control is not None and control.exit_code == 0 and f"resume-{side}" in records
    }
    document: dict[str, Any] = {
        "megatron_lm": origin,
        "script_args": script_arguments(args),
        "plan": {**asdict(plan), "checkpoint": str(plan.checkpoint)},
        "notes": notes,
        "sides": {label: side.to_json() for label, side in sides.items()},
        "phases": {
            name: {**asdict(r), "load_peak_over_baseline": r.load_peak_over_baseline}
            for name, r in records.items()
        },
        "loss_differences": differences,
        "checkpoint_differences": None,
    }
    saved = [
        workspace.path(f"saved-resume-{s}") / f"iter_{plan.train_iters:07d}" for s in RESUME_SIDES
    ]
    if plan.deterministic and not all(path.is_dir() for path in saved):
        notes.append("checkpoints not compared: a resume saved none (see its log)")
    elif plan.deterministic:
        comparison = compare_torch_dist(saved[0], saved[1])
        document["checkpoint_differences"] = comparison.differences
        document["checkpoint_compared"] = {"tensors": comparison.tensors, "bytes": comparison.bytes}
    text = markdown(document)
    print(text, flush=True)
    if args.json_out:
        write_json(args.json_out, document)
    if args.markdown_out:
        args.markdown_out.write_text(text)
    for checkpoint in (plan.checkpoint, *(workspace.path(f"saved-{p}") for p, _ in phases[2:])):
        shutil.rmtree(checkpoint, ignore_errors=True)  # each is the size of the training state
    failed = [name for name, r in records.items() if r.exit_code != 0]
    if failed:
        eprint(f"megatron-lm: runs failed: {', '.join(failed)} (logs in {workspace.root})")
        return EXIT_CRASH
    return 0
