"""Which optimizer state adopters a resume worker had, and what each hook point did in its load.

Every resume rank records the ``state_adoption`` field of its result::

    {"adopters": ["te_fused_adam_fp32"],      # registered; None: no state-adoption subsystem
     "outcomes": [{"hook_point": "load",      # one per call: "load" (the inner load_state_dict)
                                              # or "export" (the inner state_dict())
                   "optimizer": "FusedAdam 0x7f3a2c1b (40 params, 557,297,664 elements)",
                   "adopter": "te_fused_adam_fp32",  # None: the optimizer's own method ran
                   "method": None,            # the own method that ran instead, e.g.
                                              # "FusedAdam.load_state_dict" or "load_state_dict
                                              # set on the FusedAdam instance"
                   "reused_bytes": 4458381312,  # state held in tensors that existed before
                                                # the call (installed by reference)
                   "allocated_bytes": 0,      # state held in tensors the call allocated
                   "declines": [],            # [adopter name, reason] of each adopter skipped
                   "fallback_reason": None,   # why the own method ran
                   "error": None}]}           # what the own method raised (then re-raised)

``outcomes`` are the subsystem's :class:`StateAdoptionOutcome` records (``to_json()``) handed
to an outcome hook registered around the load and removed after it, on every rank. The byte
counts are measured by the subsystem after each call, per call: the two load passes of one
resume happen one after the other, so their figures are not to be added up. ``None``:
upstream (no ``megatron.core.optimizer.state_adoption``) or a build without outcome hooks.

Results written by earlier builds carry ``avoided_bytes`` (the adopter's claim) instead of
``reused_bytes``/``allocated_bytes``/``method``/``error``, and a class name as ``optimizer``;
nothing here reads those fields, so both shapes render alike.

Pure Python (no torch, no Megatron at import time).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Final

from benchmarks.resume_benchmark.results import one_line

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
            declines = "; ".join(f"{name}: {reason}" for name, reason in outcome.get("declines") or [])
            return f"{outcome.get('fallback_reason')}" + (f" ({declines})" if declines else "")
    return None


def adopters_text(adopters: Sequence[str] | None) -> str:
    """Registered adopters for one line of text (``none``; or the subsystem is missing)."""
    if adopters is None:
        return "no state-adoption subsystem"
    return ", ".join(adopters) if adopters else "none"
