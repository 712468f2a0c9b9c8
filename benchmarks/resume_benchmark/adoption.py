"""Which optimizer state adopters a resume worker had, and which ones installed the state.

The worker records them as the ``state_adoption`` field of its resume result::

    {"adopters": ["te_fused_adam_fp32"],           # registered; None: no state-adoption subsystem
     "events": [{"adopter": "te_fused_adam_fp32",  # None: the optimizer's own loader loaded it
                 "message": "Optimizer state adopter 'te_fused_adam_fp32' installed ...",
                 "avoided_bytes": 8916762624}]}     # None for fallbacks

``events`` are the INFO messages of the ``megatron.core.optimizer.state_adoption`` loggers during
the checkpoint load. The loader logs through ``log_single_rank``: in a multi-rank run only global
rank 0 records events.

Pure Python (no torch, no Megatron at import time).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Final

#: Parent logger of the state-adoption subsystem (its loader logs through a child logger).
STATE_ADOPTION_LOGGER: Final = "megatron.core.optimizer.state_adoption"

#: Start of the loader's message when no adopter installed the state (the fallback).
FALLBACK_PREFIX: Final = "No optimizer state adopter installed the state"

#: How the report names the fallback: the inner optimizer's own ``load_state_dict``.
OWN_LOADER: Final = "own loader"

_INSTALLED = re.compile(
    r"Optimizer state adopter '(?P<adopter>[^']+)' installed .*?avoiding (?P<bytes>\d+) bytes"
)


def parse_adoption_message(message: str) -> dict[str, Any]:
    """One ``events`` item: the installing adopter and the bytes it avoided, if it says so."""
    match = _INSTALLED.match(message)
    return {
        "adopter": match["adopter"] if match else None,
        "message": message,
        "avoided_bytes": int(match["bytes"]) if match else None,
    }


def is_fallback(event: Mapping[str, Any]) -> bool:
    """Whether ``event`` says the optimizer's own loader loaded the state."""
    return event.get("adopter") is None and str(event.get("message", "")).startswith(
        FALLBACK_PREFIX
    )


class AdoptionEventHandler(logging.Handler):
    """Collects the INFO records it is given as :func:`parse_adoption_message` events."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno != logging.INFO:
            return
        try:
            self.events.append(parse_adoption_message(record.getMessage()))
        except Exception:  # noqa: BLE001 - a malformed record must not break the load
            self.handleError(record)


@contextmanager
def recording_adoption_events() -> Iterator[list[dict[str, Any]]]:
    """Collect the state-adoption INFO events logged inside the ``with`` block.

    The handler sits on :data:`STATE_ADOPTION_LOGGER` (child loggers propagate to it), which
    is lowered to INFO for the block if it would drop INFO records; both are undone on exit.
    """
    logger = logging.getLogger(STATE_ADOPTION_LOGGER)
    handler = AdoptionEventHandler()
    old_level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler.events
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def registered_adopter_names() -> list[str] | None:
    """Names of the process-wide registry's adopters; None without a state-adoption subsystem."""
    try:
        from megatron.core.optimizer.state_adoption import registered_state_adopters
    except ImportError:
        return None
    return [str(adopter.name) for adopter in registered_state_adopters()]


def installed_by(state_adoption: Mapping[str, Any] | None) -> Counter[str]:
    """Adopter name (or :data:`OWN_LOADER`) -> how many inner optimizers it loaded."""
    counts: Counter[str] = Counter()
    for event in (state_adoption or {}).get("events") or []:
        if event.get("adopter"):
            counts[str(event["adopter"])] += 1
        elif is_fallback(event):
            counts[OWN_LOADER] += 1
    return counts


def installed_by_text(state_adoption: Mapping[str, Any] | None) -> str | None:
    """E.g. ``te_fused_adam_fp32 ×2, own loader ×1``; None when nothing was recorded."""
    counts = installed_by(state_adoption)
    if not counts:
        return None
    return ", ".join(f"{name} ×{count}" for name, count in counts.items())


def adopters_text(adopters: Sequence[str] | None) -> str:
    """Registered adopters for one line of text (``none``; or the subsystem is missing)."""
    if adopters is None:
        return "no state-adoption subsystem"
    return ", ".join(adopters) if adopters else "none"
