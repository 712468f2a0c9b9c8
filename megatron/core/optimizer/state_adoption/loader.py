"""The single entry point ``DistributedOptimizer.load_state_dict`` calls.

It offers the assembled inner state dict to the registered adopters in order. The first
adopter that accepts installs it; if none accepts, if adoption is switched off, or if the
accepting adopter fails while installing, the inner optimizer's own ``load_state_dict``
runs exactly as it would without this module.
"""

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from megatron.core.utils import log_single_rank

from .adopter import StateAdopter, StateAdoptionContext
from .registry import StateAdopterRegistry, default_registry

logger = logging.getLogger(__name__)

DISABLE_ENV_VAR = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
"""Set to 1/true/yes/on to make every load use the inner optimizer's own loader."""


def state_adoption_disabled() -> bool:
    """Return True if the kill switch :data:`DISABLE_ENV_VAR` is set."""
    return os.environ.get(DISABLE_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class _OptimizerSnapshot:
    """The containers of an optimizer's ``state`` and ``param_groups``, for a rollback.

    Tensors are kept by reference; the dicts and lists holding them are copied so that a
    failed adoption can be undone even if it mutated them in place.
    """

    state: Any
    state_entries: List[Tuple[Any, Any, Dict[Any, Any]]]
    param_groups: List[Dict[str, Any]]
    param_group_entries: List[Dict[str, Any]]
    param_lists: List[List[Any]]

    @classmethod
    def capture(cls, optimizer: torch.optim.Optimizer) -> "_OptimizerSnapshot":
        """Record ``optimizer``'s state containers."""
        return cls(
            state=optimizer.state,
            state_entries=[(key, value, dict(value)) for key, value in optimizer.state.items()],
            param_groups=list(optimizer.param_groups),
            param_group_entries=[dict(group) for group in optimizer.param_groups],
            param_lists=[list(group["params"]) for group in optimizer.param_groups],
        )

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put ``optimizer``'s state containers back as they were captured."""
        self.state.clear()
        for key, value, entries in self.state_entries:
            value.clear()
            value.update(entries)
            self.state[key] = value
        for group, entries, params in zip(
            self.param_groups, self.param_group_entries, self.param_lists
        ):
            group.clear()
            group.update(entries)
            group["params"][:] = params
        optimizer.__setstate__({"state": self.state, "param_groups": self.param_groups})


def _copy_containers(state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """Copy the dicts and lists of an optimizer state dict; tensors stay shared."""
    copied = dict(state_dict)
    copied["state"] = {key: dict(value) for key, value in state_dict["state"].items()}
    copied["param_groups"] = [
        {**group, "params": list(group["params"])} for group in state_dict["param_groups"]
    ]
    return copied


def _decline_reason(adopter: StateAdopter, context: StateAdoptionContext) -> Optional[str]:
    """Ask ``adopter``; a check that raises or answers nonsense counts as a decline."""
    try:
        reason: object = adopter.decline_reason(context)
    except Exception as error:
        logger.warning(
            "Optimizer state adopter %r raised in its check and is skipped: %s: %s",
            adopter.name,
            type(error).__name__,
            error,
        )
        return f"check raised {type(error).__name__}: {error}"
    if reason is None or isinstance(reason, str):
        return reason
    logger.warning(
        "Optimizer state adopter %r returned %r from its check instead of None or a reason; "
        "treating it as a decline",
        adopter.name,
        reason,
    )
    return f"check returned {type(reason).__name__} instead of None or a reason"


def _adopt(adopter: StateAdopter, context: StateAdoptionContext) -> Optional[int]:
    """Let ``adopter`` install the state; on any failure roll back and return None."""
    snapshot = _OptimizerSnapshot.capture(context.optimizer)
    try:
        avoided_bytes: object = adopter.adopt(context)
        if isinstance(avoided_bytes, bool) or not isinstance(avoided_bytes, int):
            raise TypeError(f"adopt() returned {avoided_bytes!r} instead of a byte count")
        if avoided_bytes < 0:
            raise ValueError(f"adopt() returned a negative byte count {avoided_bytes}")
    except Exception as error:
        snapshot.restore(context.optimizer)
        logger.warning(
            "Optimizer state adopter %r failed while installing the state (%s: %s); the "
            "optimizer was restored and %s.load_state_dict loads the state instead",
            adopter.name,
            type(error).__name__,
            error,
            type(context.optimizer).__name__,
        )
        return None
    return avoided_bytes


def load_inner_optimizer_state_dict(
    owner: Any, state_dict: Dict[str, Any], registry: Optional[StateAdopterRegistry] = None
) -> None:
    """Load ``state_dict`` into ``owner.optimizer`` through the first accepting adopter.

    Args:
        owner (Any): the ``DistributedOptimizer`` whose inner optimizer is loaded.
        state_dict (Dict[str, Any]): the assembled ``{"state", "param_groups"}`` dict.
        registry (StateAdopterRegistry, optional): the adopters to consult; defaults to
            the process-wide registry.
    """
    optimizer = owner.optimizer
    loader_name = f"{type(optimizer).__name__}.load_state_dict"
    if state_adoption_disabled():
        log_single_rank(
            logger, logging.DEBUG, "%s=1: %s loads the optimizer state", DISABLE_ENV_VAR, loader_name
        )
        optimizer.load_state_dict(state_dict)
        return

    try:
        pristine_state_dict = _copy_containers(state_dict)
    except Exception:  # malformed input: let the optimizer's own loader report it
        optimizer.load_state_dict(state_dict)
        return
    context = StateAdoptionContext.for_owner(owner, state_dict)
    for adopter in (registry or default_registry()).adopters():
        reason = _decline_reason(adopter, context)
        if reason is not None:
            log_single_rank(
                logger, logging.DEBUG, "Optimizer state adopter %r declined: %s", adopter.name, reason
            )
            continue
        avoided_bytes = _adopt(adopter, context)
        if avoided_bytes is not None:
            log_single_rank(
                logger,
                logging.INFO,
                "Optimizer state adopter %r installed the %s state, avoiding %d bytes "
                "(%.1f MiB) of allocation",
                adopter.name,
                type(optimizer).__name__,
                avoided_bytes,
                avoided_bytes / 2**20,
            )
            return
        break

    log_single_rank(
        logger, logging.INFO, "No optimizer state adopter installed the state: %s loads it", loader_name
    )
    optimizer.load_state_dict(pristine_state_dict)
