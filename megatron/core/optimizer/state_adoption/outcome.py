"""What each state-adoption hook point did, recorded as a structured outcome.

Every call of :func:`~.loader.load_inner_optimizer_state_dict` and
:func:`~.loader.export_inner_optimizer_state_dict` produces one
:class:`StateAdoptionOutcome` on every rank and hands it to the hooks registered with
:func:`register_outcome_hook`, e.g. to record which adopter installed the state::

    outcomes = []
    handle = register_outcome_hook(outcomes.append)
    ...  # load a checkpoint
    handle.remove()
"""

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from torch.utils.hooks import RemovableHandle

from .registry import _LockedHandleDict

__all__ = ["StateAdoptionOutcome", "register_outcome_hook"]

logger = logging.getLogger(__name__)

_LOAD_HOOK_POINT = "load"
"""The inner ``load_state_dict`` call in ``DistributedOptimizer.load_state_dict``."""

_EXPORT_HOOK_POINT = "export"
"""The inner ``state_dict()`` call in ``DistributedOptimizer.load_state_dict``."""


@dataclass(frozen=True)
class StateAdoptionOutcome:
    """What one call at a hook point did.

    Attributes:
        hook_point (str): ``"load"`` (the inner ``load_state_dict``) or ``"export"`` (the
            inner ``state_dict()``).
        optimizer (str): class name of the inner optimizer.
        adopter (str, optional): name of the adopter that installed (or exported) the
            state; None when the optimizer's own method ran.
        avoided_bytes (int): bytes the optimizer's own method would have allocated and the
            adopter did not; 0 when the own method ran.
        declines (Tuple[Tuple[str, str], ...]): (adopter name, reason) for every adopter
            that was skipped, in the order they were tried.
        fallback_reason (str, optional): why the optimizer's own method ran; None when an
            adopter handled the call.
    """

    hook_point: str
    optimizer: str
    adopter: Optional[str]
    avoided_bytes: int = 0
    declines: Tuple[Tuple[str, str], ...] = ()
    fallback_reason: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        """Return the outcome as a JSON-ready dict (``declines`` as a list of pairs)."""
        return {
            "hook_point": self.hook_point,
            "optimizer": self.optimizer,
            "adopter": self.adopter,
            "avoided_bytes": self.avoided_bytes,
            "declines": [list(decline) for decline in self.declines],
            "fallback_reason": self.fallback_reason,
        }


_LOCK = threading.RLock()
_OUTCOME_HOOKS: _LockedHandleDict[Callable[[StateAdoptionOutcome], None]] = _LockedHandleDict(_LOCK)


def register_outcome_hook(
    hook: Callable[[StateAdoptionOutcome], None], prepend: bool = False
) -> RemovableHandle:
    """Call ``hook(outcome)`` after every load or export through the state-adoption hooks.

    The hook runs on every rank, after the state was installed. A hook that raises is
    logged as a warning and does not affect the load.

    Args:
        hook (Callable[[StateAdoptionOutcome], None]): receives each outcome.
        prepend (bool): if True, call this hook before the already registered ones.

    Returns:
        torch.utils.hooks.RemovableHandle: ``handle.remove()`` unregisters the hook.
    """
    if not callable(hook):
        raise TypeError(f"outcome hook {hook!r} is not callable")
    with _LOCK:
        handle = RemovableHandle(_OUTCOME_HOOKS)
        _OUTCOME_HOOKS[handle.id] = hook
        if prepend:
            _OUTCOME_HOOKS.move_to_end(handle.id, last=False)
    return handle


def _report_outcome(outcome: StateAdoptionOutcome) -> None:
    """Hand ``outcome`` to every registered hook; a hook that raises is logged and skipped."""
    with _LOCK:
        hooks = tuple(_OUTCOME_HOOKS.values())
    for hook in hooks:
        try:
            hook(outcome)
        except Exception as error:  # observing a load must never break it
            logger.warning(
                "Optimizer state adoption outcome hook %r raised %s: %s",
                hook,
                type(error).__name__,
                error,
            )
