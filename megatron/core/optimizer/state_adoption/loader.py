"""The two functions ``DistributedOptimizer.load_state_dict`` calls.

:func:`export_inner_optimizer_state_dict` stands where it reads the inner optimizer's state
dict, :func:`load_inner_optimizer_state_dict` where it loads the assembled state into the
inner optimizer. Each offers the call to the registered adopters in order; the first that
accepts handles it. If none accepts, if adoption is switched off, or if the accepting
adopter fails, the inner optimizer's own ``state_dict``/``load_state_dict`` runs exactly as
it would without this module. Neither ever bypasses a ``state_dict``/``load_state_dict``
set on the optimizer *instance* (e.g. by a wrapper), because upstream would call it.
"""

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TypeVar

import torch

from megatron.core.utils import log_single_rank

from .adopter import StateAdoptionContext, StateExportContext, StateExporter
from .outcome import _EXPORT_HOOK_POINT, _LOAD_HOOK_POINT, StateAdoptionOutcome, _report_outcome
from .registry import _DEFAULT_REGISTRY, StateAdopterRegistration, _StateAdopterRegistry
from .settings import (
    _DISABLE_ENV_VAR,
    _DISABLED_ADOPTERS_ENV_VAR,
    _adoption_switched_off,
    _disabled_adopter_names,
)
from .validation import _param_groups_decline_reason, instance_method_decline_reason

__all__ = ["export_inner_optimizer_state_dict", "load_inner_optimizer_state_dict"]

logger = logging.getLogger(__name__)

_Context = TypeVar("_Context", StateAdoptionContext, StateExportContext)


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


def _ask(name: str, check: Callable[[_Context], object], context: _Context) -> Optional[str]:
    """Run an adopter's check; one that raises or answers nonsense counts as a decline."""
    try:
        reason = check(context)
    except Exception as error:
        logger.warning(
            "Optimizer state adopter %r raised in its check and is skipped: %s: %s",
            name,
            type(error).__name__,
            error,
        )
        return f"check raised {type(error).__name__}: {error}"
    if reason is None or isinstance(reason, str):
        return reason
    logger.warning(
        "Optimizer state adopter %r returned %r from its check instead of None or a reason; "
        "treating it as a decline",
        name,
        reason,
    )
    return f"check returned {type(reason).__name__} instead of None or a reason"


def _byte_count_problem(count: object, method: str) -> Optional[str]:
    """Why ``count`` (returned by ``method``) is not a non-negative int, or None."""
    if isinstance(count, bool) or not isinstance(count, int):
        return f"{method}() returned {count!r} instead of a byte count"
    if count < 0:
        return f"{method}() returned a negative byte count {count}"
    return None


def _install(
    registration: StateAdopterRegistration, context: StateAdoptionContext
) -> Optional[int]:
    """Let the adopter install the state; on any failure roll back and return None."""
    snapshot = _OptimizerSnapshot.capture(context.optimizer)
    try:
        avoided_bytes: object = registration.adopter.adopt(context)
        problem = _byte_count_problem(avoided_bytes, "adopt")
        if problem is not None:
            raise TypeError(problem)
    except Exception as error:
        snapshot.restore(context.optimizer)
        logger.warning(
            "Optimizer state adopter %r failed while installing the state (%s: %s); the "
            "optimizer was restored and %s.load_state_dict loads the state instead",
            registration.name,
            type(error).__name__,
            error,
            type(context.optimizer).__name__,
        )
        return None
    assert isinstance(avoided_bytes, int)
    return avoided_bytes


def _exported(
    registration: StateAdopterRegistration, exporter: StateExporter, context: StateExportContext
) -> Optional[Tuple[Dict[str, Any], int]]:
    """Let the exporter supply the state dict; on any failure roll back and return None."""
    optimizer = context.optimizer
    snapshot = _OptimizerSnapshot.capture(optimizer)
    try:
        exported: object = exporter.export_state_dict(context)
        if not (isinstance(exported, tuple) and len(exported) == 2):
            raise TypeError("export_state_dict() did not return (state dict, byte count)")
        state_dict, avoided_bytes = exported
        problem = _byte_count_problem(avoided_bytes, "export_state_dict")
        if problem is None and not isinstance(state_dict, dict):
            problem = f"export_state_dict() returned a {type(state_dict).__name__}, not a dict"
        if problem is None:
            problem = _param_groups_decline_reason(optimizer, state_dict)
        if problem is not None:
            raise TypeError(problem)
    except Exception as error:
        snapshot.restore(optimizer)
        logger.warning(
            "Optimizer state adopter %r failed to export the state (%s: %s); %s.state_dict "
            "is used instead",
            registration.name,
            type(error).__name__,
            error,
            type(optimizer).__name__,
        )
        return None
    return state_dict, avoided_bytes


def _fallback_reason(
    declines: List[Tuple[str, str]], instance_reason: Optional[str], failure: Optional[str]
) -> str:
    """Why the optimizer's own method runs, in one phrase."""
    if failure is not None:
        return failure
    if instance_reason is not None:
        return instance_reason
    return "every adopter declined" if declines else "no adopter is registered"


def _finish(outcome: StateAdoptionOutcome, level: int) -> StateAdoptionOutcome:
    """Log ``outcome`` for people (rank 0) and hand it to the outcome hooks (every rank)."""
    for name, reason in outcome.declines:
        log_single_rank(
            logger, logging.DEBUG, "Optimizer state adopter %r declined: %s", name, reason
        )
    verb = "installed" if outcome.hook_point == _LOAD_HOOK_POINT else "exported"
    if outcome.adopter is not None:
        log_single_rank(
            logger,
            level,
            "Optimizer state adopter %r %s the %s state, avoiding %d bytes (%.1f MiB) of "
            "allocation",
            outcome.adopter,
            verb,
            outcome.optimizer,
            outcome.avoided_bytes,
            outcome.avoided_bytes / 2**20,
        )
    else:
        method = "load_state_dict" if outcome.hook_point == _LOAD_HOOK_POINT else "state_dict"
        log_single_rank(
            logger,
            level,
            "No optimizer state adopter %s the state (%s): %s.%s runs",
            verb,
            outcome.fallback_reason,
            outcome.optimizer,
            method,
        )
    _report_outcome(outcome)
    return outcome


def _skip_reason(
    registration: StateAdopterRegistration,
    check: Callable[[_Context], object],
    context: _Context,
    instance_reason: Optional[str],
) -> Optional[str]:
    """Why ``registration``'s adopter is skipped for ``context``, or None to use it."""
    if registration.name in _disabled_adopter_names():
        return f"disabled by {_DISABLED_ADOPTERS_ENV_VAR}"
    reason = _ask(registration.name, check, context)
    if reason is None and instance_reason is not None:
        logger.warning(
            "Optimizer state adopter %r accepted although %s; the instance's method runs",
            registration.name,
            instance_reason,
        )
        return f"accepted, but not used: {instance_reason}"
    return reason


def _load_inner_state(
    owner: Any, state_dict: Dict[str, Any], registry: _StateAdopterRegistry
) -> StateAdoptionOutcome:
    """:func:`load_inner_optimizer_state_dict` with the adopters of ``registry``."""
    optimizer = owner.optimizer
    optimizer_name = type(optimizer).__name__
    if _adoption_switched_off():
        optimizer.load_state_dict(state_dict)
        return _finish(
            StateAdoptionOutcome(
                _LOAD_HOOK_POINT, optimizer_name, None, fallback_reason=f"{_DISABLE_ENV_VAR} is set"
            ),
            logging.DEBUG,
        )
    instance_reason = instance_method_decline_reason(optimizer, "load_state_dict")
    context = StateAdoptionContext.for_owner(owner, state_dict)
    declines: List[Tuple[str, str]] = []
    failure: Optional[str] = None
    own_loader_input = state_dict
    for registration in registry.registrations():
        reason = _skip_reason(
            registration, registration.adopter.decline_reason, context, instance_reason
        )
        if reason is None:
            try:
                pristine = _copy_containers(state_dict)
            except Exception as error:  # malformed input: the own loader reports it
                reason = f"the state dict cannot be copied for a rollback: {error!r}"
        if reason is not None:
            declines.append((registration.name, reason))
            continue
        avoided_bytes = _install(registration, context)
        if avoided_bytes is not None:
            return _finish(
                StateAdoptionOutcome(
                    _LOAD_HOOK_POINT,
                    optimizer_name,
                    registration.name,
                    avoided_bytes,
                    tuple(declines),
                ),
                logging.INFO,
            )
        failure = f"adopter {registration.name!r} failed while installing the state"
        own_loader_input = pristine
        break
    optimizer.load_state_dict(own_loader_input)
    reason = _fallback_reason(declines, instance_reason, failure)
    return _finish(
        StateAdoptionOutcome(
            _LOAD_HOOK_POINT, optimizer_name, None, declines=tuple(declines), fallback_reason=reason
        ),
        logging.INFO,
    )


def _export_inner_state(owner: Any, registry: _StateAdopterRegistry) -> Dict[str, Any]:
    """:func:`export_inner_optimizer_state_dict` with the adopters of ``registry``."""
    optimizer = owner.optimizer
    optimizer_name = type(optimizer).__name__
    if _adoption_switched_off():
        own: Dict[str, Any] = optimizer.state_dict()
        _finish(
            StateAdoptionOutcome(
                _EXPORT_HOOK_POINT,
                optimizer_name,
                None,
                fallback_reason=f"{_DISABLE_ENV_VAR} is set",
            ),
            logging.DEBUG,
        )
        return own
    instance_reason = instance_method_decline_reason(optimizer, "state_dict")
    context = StateExportContext.for_owner(owner)
    declines: List[Tuple[str, str]] = []
    failure: Optional[str] = None
    for registration in registry.registrations():
        exporter = registration.adopter
        if not isinstance(exporter, StateExporter):
            continue
        reason = _skip_reason(
            registration, exporter.export_decline_reason, context, instance_reason
        )
        if reason is not None:
            declines.append((registration.name, reason))
            continue
        exported = _exported(registration, exporter, context)
        if exported is not None:
            state_dict, avoided_bytes = exported
            _finish(
                StateAdoptionOutcome(
                    _EXPORT_HOOK_POINT,
                    optimizer_name,
                    registration.name,
                    avoided_bytes,
                    tuple(declines),
                ),
                logging.INFO,
            )
            return state_dict
        failure = f"adopter {registration.name!r} failed to export the state"
        break
    own = optimizer.state_dict()
    reason = _fallback_reason(declines, instance_reason, failure)
    _finish(
        StateAdoptionOutcome(
            _EXPORT_HOOK_POINT,
            optimizer_name,
            None,
            declines=tuple(declines),
            fallback_reason=reason,
        ),
        logging.DEBUG,
    )
    return own


def load_inner_optimizer_state_dict(owner: Any, state_dict: Dict[str, Any]) -> StateAdoptionOutcome:
    """Load ``state_dict`` into ``owner.optimizer`` through the first accepting adopter.

    Args:
        owner (Any): the ``DistributedOptimizer`` whose inner optimizer is loaded.
        state_dict (Dict[str, Any]): the assembled ``{"state", "param_groups"}`` dict.

    Returns:
        StateAdoptionOutcome: which adopter installed the state, or why the optimizer's own
        ``load_state_dict`` did (also handed to the outcome hooks).
    """
    return _load_inner_state(owner, state_dict, _DEFAULT_REGISTRY)


def export_inner_optimizer_state_dict(owner: Any) -> Dict[str, Any]:
    """Return ``owner.optimizer``'s state dict, from the first accepting exporter.

    Args:
        owner (Any): the ``DistributedOptimizer`` whose inner optimizer's state dict is read.

    Returns:
        Dict[str, Any]: the exporter's state dict, or ``owner.optimizer.state_dict()``.
    """
    return _export_inner_state(owner, _DEFAULT_REGISTRY)
