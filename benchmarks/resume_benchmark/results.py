"""Result files, progress lines, and the state-adoption outcomes a run recorded.

Pure Python (no torch): the driver uses it on any machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, TypedDict, cast

#: Prefix of the progress lines launches print; the driver echoes these lines to its stdout.
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


def eprint(message: str) -> None:
    """Print to stderr (flushed)."""
    print(message, file=sys.stderr, flush=True)


# State adoption records: which optimizer state adopters a resume had, and what each hook point
# did in its load.

#: Hook point of the inner ``load_state_dict`` call (the one that installs the state).
LOAD_HOOK_POINT: Final = "load"

#: How the report names the fallback: the inner optimizer's own ``load_state_dict``.
OWN_LOADER: Final = "own loader"


class OutcomeRecord(TypedDict, total=False):
    """One state-adoption outcome (``AdoptionOutcome.to_json()`` of the build)."""

    hook_point: str | None
    optimizer: str
    adopter: str | None
    method: str
    reused_bytes: int
    allocated_bytes: int
    declines: list[list[str]]
    fallback_reason: str | None
    error: str | None


class AdoptionRecord(TypedDict):
    """What a run's probe recorded of the state adoption: the registered adopters and every
    outcome (both None without the subsystem or its outcome hooks: upstream)."""

    adopters: list[str] | None
    outcomes: list[OutcomeRecord] | None


def _default_registry() -> Any | None:
    """The process-wide ``StateAdopterRegistry`` of this process's ``megatron-core``; None
    without a state-adoption subsystem (upstream)."""
    try:
        from megatron.core.optimizer.state_adoption import default_registry
    except ImportError:
        return None
    return default_registry()


def registered_adopter_names() -> list[str] | None:
    """Names of the process-wide registry's adopters, in the order they are tried (the installed
    plugins loaded); None without a state-adoption subsystem."""
    registry = _default_registry()
    if registry is None:
        return None
    return [str(adopter.name) for adopter in registry.adopters()]


def has_outcome_hooks() -> bool:
    """Whether this process's ``megatron-core`` reports structured outcomes."""
    registry = _default_registry()
    return registry is not None and callable(getattr(registry, "register_outcome_hook", None))


@contextmanager
def recording_outcomes() -> Iterator[list[OutcomeRecord] | None]:
    """Collect the state-adoption outcome of every call inside the ``with`` block.

    Yields the list the outcomes' ``to_json()`` dicts are appended to, or None when this
    ``megatron-core`` has no outcome hooks (upstream). The hook (on the process-wide registry)
    is removed on exit, also when the block raises.
    """
    registry = _default_registry()
    if registry is None or not has_outcome_hooks():
        yield None
        return
    outcomes: list[OutcomeRecord] = []

    def record(outcome: Any) -> None:
        try:
            outcomes.append(cast(OutcomeRecord, outcome.to_json()))
        except Exception as exc:  # noqa: BLE001 - a malformed outcome is recorded as such
            outcomes.append(OutcomeRecord(hook_point=None, adopter=None, error=one_line(exc)))

    handle = registry.register_outcome_hook(record)
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


def installed_by(record: Mapping[str, Any] | None) -> Counter[str]:
    """Adopter name (or :data:`OWN_LOADER`) -> how many inner ``load_state_dict`` calls it
    handled."""
    return Counter(str(o.get("adopter") or OWN_LOADER) for o in load_outcomes(record))


def installed_by_text(record: Mapping[str, Any] | None) -> str | None:
    """E.g. ``te_fused_adam_fp32 ×2``; None when nothing was recorded (upstream)."""
    counts = installed_by(record)
    return ", ".join(f"{name} ×{count}" for name, count in counts.items()) or None
