"""The record of one call at a hook point: measured, named, logged and handed to the registry's
outcome hooks."""

import logging
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from megatron.core.utils import log_single_rank

from .checks import extent, local, params_of, tensors_of

__all__ = ["AdoptionOutcome"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdoptionOutcome:
    """What one call at a hook point did.

    The byte counts are measured after the call, whoever handled it: the bytes of the resulting
    state held in storage that existed before the call (installed by reference) and in storage
    the call created, each storage counted once. They describe this call only; the two loads of
    one resume follow each other, so their figures do not add up.

    Attributes:
        hook_point (str): ``"load"``, ``"export"``, ``"initialize"`` or ``"read"``.
        optimizer (str): the inner optimizer, e.g. ``"FusedAdam 0x7f3a2c1b (40 params,
            52,428,800 elements)"``, which tells a ChainedOptimizer's optimizers apart.
        adopter (str, optional): the adopter that handled the call; None if the own code did.
        method (str, optional): the own code that ran instead, e.g.
            ``"FusedAdam.load_state_dict"``; None if an adopter handled the call.
        reused_bytes (int): bytes of the result in storage that existed before the call.
        allocated_bytes (int): bytes of the result in storage the call created.
        declines (Tuple[Tuple[str, str], ...]): (adopter, reason) for each adopter asked in vain.
        fallback_reason (str, optional): why the own code ran; None if an adopter handled it.
        error (str, optional): the exception that ended the call (re-raised unchanged).
    """

    hook_point: str
    optimizer: str
    adopter: Optional[str]
    method: Optional[str] = None
    reused_bytes: int = 0
    allocated_bytes: int = 0
    declines: Tuple[Tuple[str, str], ...] = ()
    fallback_reason: Optional[str] = None
    error: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        """Return the outcome as a JSON-ready dict (``declines`` as a list of pairs)."""
        record = asdict(self)
        record["declines"] = [list(decline) for decline in self.declines]
        return record


def describe(optimizer: torch.optim.Optimizer) -> str:
    """Name an inner optimizer so that a ChainedOptimizer's optimizers differ in the logs."""
    name = f"{type(optimizer).__name__} {id(optimizer):#x}"
    try:
        params = params_of(optimizer)
        return f"{name} ({len(params)} params, {sum(local(p).numel() for p in params):,} elements)"
    except Exception:  # a malformed optimizer is reported by its own code
        return name


class Existing:
    """The state's storages before a call, held weakly: the call may free one and reuse its
    address."""

    def __init__(self, *states: Any) -> None:
        places = [(weakref.ref(t), extent(t)) for state in states for t in tensors_of(state)]
        self._storages = [(tensor, place[0]) for tensor, place in places if place is not None]

    def measure(self, state: Any) -> Tuple[int, int]:
        """(bytes in storage alive since before the call, in new storage) of ``state``; each
        storage counted once, by the bytes its tensors span."""
        alive = {
            s
            for ref, s in self._storages
            if (t := ref()) is not None and (extent(t) or (0,))[0] == s
        }
        spans: Dict[int, List[Tuple[int, int]]] = {}
        for place in filter(None, map(extent, tensors_of(state))):
            spans.setdefault(place[0], []).append(place[1:])
        counts = [0, 0]
        for storage, ranges in spans.items():
            reached = 0
            for start, end in sorted(ranges):
                counts[storage not in alive] += max(0, end - max(start, reached))
                reached = max(reached, end)
        return counts[0], counts[1]


def _size(count: int) -> str:
    return f"{count:,} B" if count < 2**20 else f"{count / 2**20:,.1f} MiB"


def log(outcome: AdoptionOutcome, verb: str) -> None:
    """Declines at debug and the result at info on rank 0; errors on every rank."""
    for name, reason in outcome.declines:
        log_single_rank(
            logger, logging.DEBUG, f"Optimizer state adopter {name!r} declined: {reason}"
        )
    sizes = f"{_size(outcome.reused_bytes)} by reference, {_size(outcome.allocated_bytes)} newly allocated"
    what = f"the state of {outcome.optimizer}"
    if outcome.error is not None:
        logger.warning(
            f"Optimizer state {outcome.hook_point} of {outcome.optimizer} raised: {outcome.error}"
        )
    elif outcome.adopter is not None:
        message = f"Optimizer state adopter {outcome.adopter!r} {verb} {what}: {sizes}"
        log_single_rank(logger, logging.INFO, message)
        if outcome.allocated_bytes > 0 and outcome.hook_point in ("load", "export"):
            logger.warning(f"{message}: new memory instead of the tensors it was given")
    else:
        level = logging.INFO if outcome.hook_point == "load" else logging.DEBUG
        log_single_rank(
            logger, level, f"{outcome.method} {verb} {what} ({outcome.fallback_reason}): {sizes}"
        )
