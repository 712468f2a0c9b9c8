"""What one call at a state-adoption hook point did, as a structured record.

Every call of :func:`~.loader.load_inner_optimizer_state_dict` and
:func:`~.loader.export_inner_optimizer_state_dict` ends in one :class:`StateAdoptionOutcome`
on every rank -- also when the optimizer's own method raises -- which is returned (or, for an
export, recorded) and handed to the hooks registered with
:func:`~.registry.register_outcome_hook`.
"""

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

__all__ = ["StateAdoptionOutcome"]


@dataclass(frozen=True)
class StateAdoptionOutcome:
    """What one load or export of one inner optimizer did.

    The byte counts are *measured* after the call from storage identity, whoever installed
    the state: ``reused_bytes`` are state tensors that existed before the call (the incoming
    tensors or the optimizer's previous state, i.e. installed by reference), ``allocated_bytes``
    state tensors the call created. They describe this call only: the two loads of one resume
    happen one after the other, so their figures must not be added up; the peak a resume
    avoids is at most the largest one.

    Attributes:
        hook_point (str): ``"load"`` (the inner ``load_state_dict``) or ``"export"`` (the
            inner ``state_dict()``).
        optimizer (str): the inner optimizer, e.g. ``"FusedAdam 0x7f3a2c1b (40 params,
            52,428,800 elements)"``, which tells a ChainedOptimizer's dense and expert
            optimizers apart.
        adopter (str, optional): the adopter that installed (or exported) the state; None when
            the optimizer's own method ran.
        method (str, optional): the own method that ran instead, e.g.
            ``"FusedAdam.load_state_dict"``, or ``"load_state_dict set on the instance"``
            (e.g. Megatron-Bridge's loader); None when an adopter handled the call.
        reused_bytes (int): bytes of the resulting state held in tensors that existed before
            the call.
        allocated_bytes (int): bytes of the resulting state held in tensors the call made.
        declines (Tuple[Tuple[str, str], ...]): (adopter name, reason) for every adopter that
            was skipped, in the order they were tried.
        fallback_reason (str, optional): why the own method ran; None when an adopter did.
        error (str, optional): the exception the own method raised (re-raised unchanged);
            the byte counts are then 0.
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
