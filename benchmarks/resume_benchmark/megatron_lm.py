"""One configuration of the resume benchmark in Megatron-LM's own ``pretrain_gpt.py``.

:func:`run_client` runs ``pretrain_gpt.py`` with one configuration's arguments (a built-in one
of :mod:`.configs`, or the user's after ``--``) unchanged four times, each in fresh processes
(``torch.distributed.run``, ``--nproc-per-node`` ranks), with Megatron-LM's own training loop:

1. ``train`` (build side): to iteration K (``--resume-at``) of ``--train-iters N``, saved as
   ``torch_dist`` and stopped by ``--exit-interval K`` (the scheduler checks that the resume
   asks for the same ``--train-iters``);
2. ``uninterrupted`` (build side): iterations 1..N in one process, no checkpoint;
3. ``resume-upstream`` and 4. ``resume-build``: load iteration K and train to N; with
   ``--deterministic`` each saves iteration N, and the two checkpoints are compared tensor by
   tensor.

Megatron-LM comes from a checkout (``--megatron-lm PATH``), a git repository and a ref
(``--megatron-lm-git DIR --ref core_r0.19.0``; default: the release branch of the build's
megatron-core) or a shallow clone of that branch (:func:`clone_release`). Only its training
code is used (everything but ``megatron/core``), put first on ``sys.path``; ``megatron.core``
always comes from the side. Each rank runs under
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

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from benchmarks.resume_benchmark.driver import PhaseOutcome, Workspace, report_failure, run_phase
from benchmarks.resume_benchmark.megatron_lm_probe import LoadRecord
from benchmarks.resume_benchmark.results import OutcomeRecord, installed_by_text, progress
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
        found = subprocess.run(
            [*git, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
            capture_output=True,
            text=True,
            check=False,
        )
        if found.returncode != 0:
            raise ClientUsageError(f"no branch, tag or commit {ref} in {git_dir} (give --ref)")
        commit = found.stdout.strip()
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


#: Where :func:`clone_release` fetches Megatron-LM from.
MEGATRON_LM_URL: Final = "https://github.com/NVIDIA/Megatron-LM.git"


def clone_release(cache_dir: Path, ref: str) -> Path:
    """A shallow bare clone of Megatron-LM's branch ``ref`` under ``cache_dir`` (reused when
    present); its git directory, for :func:`prepare_client`.

    Raises:
        ClientUsageError: when git cannot clone (no network: give a checkout instead).
    """
    git_dir = cache_dir / f"Megatron-LM-{ref}.git"
    if (git_dir / "HEAD").is_file():
        return git_dir
    progress(f"cloning Megatron-LM {ref} from {MEGATRON_LM_URL} into {git_dir}")
    cloned = subprocess.run(
        ["git", "clone", "--bare", "--depth", "1", "--branch", ref, MEGATRON_LM_URL, str(git_dir)],
        capture_output=True,
        text=True,
    )
    if cloned.returncode != 0:
        shutil.rmtree(git_dir, ignore_errors=True)
        raise ClientUsageError(
            f"could not clone Megatron-LM {ref} ({cloned.stderr.strip().splitlines()[-1:]}); "
            "give a checkout with --megatron-lm DIR or a repository with --megatron-lm-git DIR"
        )
    return git_dir


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
    load: LoadRecord | None = None
    max_allocated_bytes: int | None = None
    first_memory_report: tuple[int, float] | None = None
    losses: dict[int, float | str] = field(default_factory=dict)
    loss_source: str = "console"
    parameters: int | None = None
    installed_by: str | None = None
    outcomes: list[OutcomeRecord] | None = None
    peak_rank: int = 0
    rank_load_peaks: list[int | None] = field(default_factory=list)
    modules: dict[str, str | None] = field(default_factory=dict)

    @property
    def load_peak_over_baseline(self) -> int | None:
        """The allocator peak inside ``load_checkpoint`` over its starting level."""
        return load_rise(self.load)


def load_rise(load: LoadRecord | None) -> int | None:
    """A probe's load peak over the level the load began at (None: no load, or no new peak)."""
    peak = (load or {}).get("peak_bytes")
    return None if load is None or peak is None else peak - load["baseline_bytes"]


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
    adoption = result.get("state_adoption") or {}
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


_OPTIMIZER_ELEMENTS = re.compile(r"\(\d+ params, ([\d,]+) elements\)$")


def optimizer_elements(outcomes: Sequence[OutcomeRecord] | None) -> int | None:
    """Elements of the inner optimizers whose loads the outcomes name (each counted once):
    the optimizer state a rank holds, e.g. 1/DP of the model with the distributed optimizer."""
    described = {str(o.get("optimizer")) for o in outcomes or [] if o.get("hook_point") == "load"}
    counts = [m[1] for m in map(_OPTIMIZER_ELEMENTS.search, described) if m]
    return sum(int(c.replace(",", "")) for c in counts) if counts else None


@dataclass(frozen=True)
class ClientSetup:
    """What every configuration of one invocation shares: the sides, the Megatron-LM training
    code (``client``, described by ``origin``), the ``make`` shim and the launch settings."""

    sides: Mapping[str, Side]
    client: Path
    origin: str
    notes: tuple[str, ...]
    bin_dir: Path
    nproc: int
    timeout_s: float


def prepare_setup(
    sides: Mapping[str, Side],
    build_version: str,
    source: tuple[Path | None, Path | None, str | None],
    workspace: Workspace,
    nproc: int,
    timeout_s: float,
) -> ClientSetup:
    """Copy the client tree, write the ``make`` shim, and note both (and a release mismatch).

    Args:
        sides: ``upstream`` and ``build``.
        build_version: the build's megatron-core version (it names the default release branch).
        source: a checkout, or a git directory and a ref (None: :func:`release_branch`).
        workspace: where the tree and the shim go.
        nproc: ranks per launch; timeout_s: seconds per launch.
    """
    checkout, git_dir, ref = source
    client = workspace.path("megatron-lm-client")
    origin, release = prepare_client(
        checkout, git_dir, ref or release_branch(build_version), client
    )
    notes = [note] if (note := release_note(release, build_version)) else []
    bin_dir = write_make_shim(workspace.root)
    notes.append(f"`make` on PATH from {bin_dir}: succeeds for a prebuilt helpers_cpp directory")
    return ClientSetup(sides, client, origin, tuple(notes), bin_dir, nproc, timeout_s)


def _launch(
    setup: ClientSetup, workspace: Workspace, label: str, phase: str, args: Sequence[str]
) -> PhaseOutcome:
    result = workspace.path(f"{phase}.result.json")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--tee", "3",
        "--nproc-per-node", str(setup.nproc), "-m", PROBE_MODULE, "--client", str(setup.client),
        "--result", str(result), SCRIPT, *args,
    ]  # fmt: skip
    progress(f"{workspace.root.name} {phase} ({label} side, {setup.nproc} rank(s))")
    env = {"PATH": f"{setup.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    outcome = run_phase(
        workspace, setup.sides[label], phase, command, setup.timeout_s, setup.nproc, env
    )
    if not outcome.ok:
        report_failure(outcome, f"{workspace.root.name} {phase}")
    return outcome


def run_client(
    setup: ClientSetup, workspace: Workspace, plan: RunPlan, script_args: Sequence[str]
) -> dict[str, Any]:
    """The four runs of one configuration and their comparison: the run's JSON document.

    Args:
        setup: the sides, the client tree and the launch settings.
        workspace: this configuration's logs, TensorBoard files and checkpoints.
        plan: iterations and the checkpoint directory.
        script_args: the ``pretrain_gpt.py`` arguments (:func:`base_arguments` adds to them).

    Raises:
        ClientUsageError: for arguments the client cannot run (:func:`base_arguments`).
    """
    base, added = base_arguments(script_args, apex_fusion_available())
    notes = [*added, *setup.notes]
    for note in added:
        progress(f"{workspace.root.name}: {note}")
    records: dict[str, PhaseRecord] = {}
    phases = [("train", "build"), ("uninterrupted", "build")]
    phases += [(f"resume-{side}", side) for side in RESUME_SIDES]
    for phase, label in phases:
        phase_args = phase_arguments(base, phase, plan, workspace.root)
        outcome = _launch(setup, workspace, label, phase, phase_args)
        records[phase] = phase_record(phase, label, outcome, workspace.path(f"tensorboard-{phase}"))
        for problem in module_problems(records[phase], setup.client, setup.sides[label]):
            progress(f"{workspace.root.name}: {problem}")
            notes.append(problem)
        if phase == "train" and not outcome.ok:
            break
    after = range(plan.resume_at + 1, plan.train_iters + 1)
    control = records.get("uninterrupted")
    document: dict[str, Any] = {
        "megatron_lm": setup.origin,
        "script_args": list(script_args),
        "plan": {**asdict(plan), "checkpoint": str(plan.checkpoint)},
        "notes": notes,
        "sides": {label: side.to_json() for label, side in setup.sides.items()},
        "phases": {
            name: {**asdict(r), "load_peak_over_baseline": r.load_peak_over_baseline}
            for name, r in records.items()
        },
        "loss_differences": {
            side: loss_differences(control.losses, records[f"resume-{side}"].losses, after)
            for side in RESUME_SIDES
            if control is not None and control.exit_code == 0 and f"resume-{side}" in records
        },
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
    for checkpoint in (plan.checkpoint, *(workspace.path(f"saved-{p}") for p, _ in phases[2:])):
        shutil.rmtree(checkpoint, ignore_errors=True)  # each is the size of the training state
    return document


def failed_phases(document: Mapping[str, Any]) -> list[str]:
    """The runs of a configuration's document that did not exit 0, or that never ran."""
    phases = document.get("phases") or {}
    expected = ["train", "uninterrupted", *(f"resume-{side}" for side in RESUME_SIDES)]
    return [p for p in expected if (phases.get(p) or {}).get("exit_code", 1) != 0]
