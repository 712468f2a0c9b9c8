"""Worker result files, progress lines, and bitwise comparison of fingerprints.

Pure Python (no torch): the driver uses it on any machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypedDict

from benchmarks.resume_benchmark.memory_timeline import Timeline

#: Prefix of the progress lines workers print; the driver echoes these lines to its stdout.
PROGRESS_MARKER = "[resume-benchmark]"


def progress(message: str) -> None:
    """Print one timestamped progress line (flushed)."""
    stamp = time.strftime("%H:%M:%S")
    print(f"{PROGRESS_MARKER} {stamp} {message}", flush=True)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (temporary file + rename)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from ``path``."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def one_line(exc: BaseException) -> str:
    """``ExceptionType: message`` on a single line (for tables and JSON)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


#: SHA-256 digest per tensor or record name (see :mod:`.fingerprint`).
Digests = dict[str, str]


class StepRecord(TypedDict, total=False):
    """One training step: loss (and its exact ``float.hex``); step N+1 also its memory and state."""

    step: int
    loss: float
    loss_hex: str
    grad_norm: float | None
    update_successful: bool
    baseline_bytes: int
    peak_bytes: int
    fingerprint: Digests


class ModelRecord(TypedDict):
    """The model and optimizer a worker built, counted on its rank."""

    total_params: int
    model_params_on_rank: int
    optimizer_params: int
    inner_optimizers: list[str]
    build_seconds: float


class TrainRecord(TypedDict):
    """The training steps before the save."""

    steps: list[StepRecord]
    baseline_bytes: int
    peak_bytes: int
    seconds: float


class SaveRecord(TypedDict, total=False):
    """The ``torch_dist`` save (``ok`` False: the format cannot be saved, ``error`` says why)."""

    ok: bool
    error: str | None
    seconds: float
    checkpoint_bytes: int


class LoadRecord(TypedDict):
    """The load: allocated bytes before, the peak, after, and its duration."""

    baseline_bytes: int
    peak_bytes: int
    post_load_allocated_bytes: int
    seconds: float


class StateAdoptionRecord(TypedDict):
    """The registered adopters and every hook-point outcome (None: no subsystem or hooks)."""

    adopters: list[str] | None
    outcomes: list[dict[str, Any]] | None


class WorkerResult(TypedDict, total=False):
    """One rank's result file of a ``train`` or ``resume`` phase (``error``: the phase failed)."""

    phase: str
    case: str
    side: str
    error: str
    megatron_core: dict[str, Any]
    model: ModelRecord
    rank: dict[str, int]
    train: TrainRecord
    save: SaveRecord
    next_step: StepRecord
    load: LoadRecord
    memory_timeline: Timeline | dict[str, str]
    state_adoption: StateAdoptionRecord
    instance_loader: dict[str, Any]
    post_save_fingerprint: Digests
    post_save_gathered_fingerprint: Digests
    restored_fingerprint: Digests
    restored_gathered_fingerprint: Digests


@dataclass(frozen=True)
class DigestComparison:
    """Result of comparing two fingerprints name by name."""

    equal: bool
    compared: int
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def to_json(self, limit: int = 20) -> dict[str, Any]:
        """Summary for the JSON report (at most ``limit`` names per list)."""
        return {
            "equal": self.equal,
            "compared": self.compared,
            "mismatched_count": len(self.mismatched),
            "mismatched": self.mismatched[:limit],
            "missing": self.missing[:limit],
            "unexpected": self.unexpected[:limit],
        }


def compare_digests(expected: Mapping[str, str], actual: Mapping[str, str]) -> DigestComparison:
    """Compare two fingerprints: equal when the same names map to the same digests."""
    missing = sorted(set(expected) - set(actual))
    unexpected = sorted(set(actual) - set(expected))
    common = [name for name in expected if name in actual]
    mismatched = [name for name in common if expected[name] != actual[name]]
    equal = not missing and not unexpected and not mismatched and bool(expected)
    return DigestComparison(equal, len(common), mismatched, missing, unexpected)


def merge_rank_digests(parts: Sequence[Mapping[str, str]]) -> tuple[dict[str, str], list[str]]:
    """Union of several ranks' fingerprints, and the names whose digests differ between ranks.

    Ranks holding the same replicated shard report it under the same name; a conflict means
    replicas that should be identical are not.
    """
    merged: dict[str, str] = {}
    conflicts: set[str] = set()
    for part in parts:
        for name, digest in part.items():
            if merged.setdefault(name, digest) != digest:
                conflicts.add(name)
    return merged, sorted(conflicts)


def eprint(message: str) -> None:
    """Print to stderr (flushed)."""
    print(message, file=sys.stderr, flush=True)


# State adoption records: which optimizer state adopters a resume worker had, and what each hook
# point did in its load.

#: Hook point of the inner ``load_state_dict`` call (the one that installs the state).
LOAD_HOOK_POINT: Final = "load"

#: How the report names the fallback: the inner optimizer's own ``load_state_dict``.
OWN_LOADER: Final = "own loader"

#: How the report names the fallback when an instance-level loader was installed (then the
#: optimizer's own ``load_state_dict`` is that instance method).
INSTANCE_LOADER: Final = "instance loader"


def registered_adopter_names() -> list[str] | None:
    """Names of the process-wide registry's adopters; None without a state-adoption subsystem."""
    try:
        from megatron.core.optimizer.state_adoption import registered_state_adopters
    except ImportError:
        return None
    return [str(registration.name) for registration in registered_state_adopters()]


def has_outcome_hooks() -> bool:
    """Whether this process's ``megatron-core`` reports structured outcomes."""
    try:
        from megatron.core.optimizer.state_adoption import register_outcome_hook  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def recording_outcomes() -> Iterator[list[dict[str, Any]] | None]:
    """Collect the state-adoption outcome of every call inside the ``with`` block.

    Yields the list the outcomes' ``to_json()`` dicts are appended to, or None when this
    ``megatron-core`` has no outcome hooks (upstream). The hook is removed on exit, also when
    the block raises.
    """
    try:
        from megatron.core.optimizer.state_adoption import register_outcome_hook
    except ImportError:
        yield None
        return
    outcomes: list[dict[str, Any]] = []

    def record(outcome: Any) -> None:
        try:
            outcomes.append(outcome.to_json())
        except Exception as exc:  # noqa: BLE001 - a malformed outcome is recorded as such
            outcomes.append({"hook_point": None, "adopter": None, "error": one_line(exc)})

    handle = register_outcome_hook(record)
    try:
        yield outcomes
    finally:
        handle.remove()


def load_outcomes(record: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The outcomes of the inner ``load_state_dict`` calls in a ``state_adoption`` record."""
    outcomes = (record or {}).get("outcomes") or []
    return [o for o in outcomes if o.get("hook_point") == LOAD_HOOK_POINT]


def adopters_that_handled(records: Iterable[Mapping[str, Any] | None]) -> list[str] | None:
    """Adopters that handled any call (load or export) in ``records``, in order; where a record
    has no outcomes, the adopters it registered. None when no record has either."""
    names: dict[str, None] = {}
    recorded = False
    for record in records:
        record = record or {}
        outcomes = record.get("outcomes")
        if outcomes is not None:
            recorded = True
            names.update(dict.fromkeys(str(o["adopter"]) for o in outcomes if o.get("adopter")))
        elif record.get("adopters") is not None:
            recorded = True
            names.update(dict.fromkeys(record["adopters"]))
    return list(names) if recorded else None


def installed_by(record: Mapping[str, Any] | None, instance_loader: bool = False) -> Counter[str]:
    """Adopter name (or the fallback: :data:`OWN_LOADER`, or :data:`INSTANCE_LOADER` when an
    instance-level loader was installed) -> how many inner ``load_state_dict`` calls it handled."""
    fallback = INSTANCE_LOADER if instance_loader else OWN_LOADER
    return Counter(str(o.get("adopter") or fallback) for o in load_outcomes(record))


def installed_by_text(
    record: Mapping[str, Any] | None, instance_loader_calls: int | None = None
) -> str | None:
    """E.g. ``te_fused_adam_fp32 ×2``, ``instance loader ×2``; None when nothing was recorded.

    ``instance_loader_calls``: how often an instance-level loader ran on this rank (None: none
    was installed). Without outcomes (upstream) that count is all there is to show; with them,
    a count that differs from the fallbacks is appended, so a mismatch cannot hide.
    """
    instance = instance_loader_calls is not None
    counts = installed_by(record, instance)
    if not counts:
        return f"{INSTANCE_LOADER} ×{instance_loader_calls}" if instance else None
    text = ", ".join(f"{name} ×{count}" for name, count in counts.items())
    if instance and counts[INSTANCE_LOADER] != instance_loader_calls:
        text += f" (instance loader ran ×{instance_loader_calls})"
    return text


def fallback_text(record: Mapping[str, Any] | None) -> str | None:
    """Why the first inner ``load_state_dict`` call that fell back did, with each decline."""
    for outcome in load_outcomes(record):
        if not outcome.get("adopter"):
            pairs = outcome.get("declines") or []
            declines = "; ".join(f"{name}: {reason}" for name, reason in pairs)
            return f"{outcome.get('fallback_reason')}" + (f" ({declines})" if declines else "")
    return None


def adopters_text(adopters: Sequence[str] | None) -> str:
    """Registered adopters for one line of text (``none``; or the subsystem is missing)."""
    if adopters is None:
        return "no state-adoption subsystem"
    return ", ".join(adopters) if adopters else "none"
