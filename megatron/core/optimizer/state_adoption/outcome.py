"""The record of one call at a hook point, handed to the registry's outcome hooks."""

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

__all__ = ["AdoptionOutcome"]


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
