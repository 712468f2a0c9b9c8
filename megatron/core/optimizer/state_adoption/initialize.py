"""The function Megatron-FSDP's ``DistributedOptimizer`` calls to create the state a checkpoint
is read into.

:func:`initialize_inner_optimizer_state` stands where ``DistributedOptimizer`` (Megatron-FSDP,
``fsdp_dtensor`` format) creates its inner optimizer's state before loading. Upstream does that
with a dummy ``step()`` on zero gradients, so a gradient for every parameter (4 bytes per FP32
parameter) is held on top of the new state; once TE's loader no longer copies the moments, that
is the load's peak. The first registered :class:`~.adopter.StateInitializer` that accepts
creates the state instead. The owner's own initialisation runs, exactly as without this module,
when

* adoption is switched off (the same switches as the other hook points);
* the inner optimizer already holds state (the dummy step would step it), or has ``step`` hooks
  or a ``step`` set on the instance (the dummy step would run them);
* no initializer accepts, or the accepting one fails or leaves a parameter without state (the
  optimizer is restored first).

Every call ends in a :class:`~.outcome.StateAdoptionOutcome` (hook point ``"initialize"``)
with the bytes of state it created (and of state that existed before, if any).
"""

import logging
from dataclasses import replace
from typing import Any, Callable, List, Mapping, Optional, Tuple

import torch
from torch.optim import optimizer as torch_optimizer_module

from .adopter import StateExportContext, StateInitializer
from .loader import (
    _INITIALIZE,
    _ask,
    _describe,
    _disabled_adopter_names,
    _Existing,
    _existing_storages,
    _finish,
    _measure,
    _OptimizerSnapshot,
    _outcome_if_interrupted,
    _switched_off_reason,
)
from .outcome import StateAdoptionOutcome
from .registry import StateAdopterRegistry, default_registry
from .validation import _local_tensor

__all__ = ["initialize_inner_optimizer_state"]

logger = logging.getLogger(__name__)

_GLOBAL_STEP_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def _own_initialization_reason(owner: Any, optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why the own initialisation must run without consulting initializers, or None.

    Hook registries that cannot be inspected count as registered hooks.
    """
    reason = _switched_off_reason(getattr(owner, "config", None))
    if reason is not None:
        return reason
    if len(optimizer.state) > 0:
        return "the inner optimizer already holds state, which the own initialisation steps"
    if "step" in getattr(optimizer, "__dict__", {}):
        return (
            f"the {type(optimizer).__name__} instance has its own step (set on the instance, "
            "e.g. by a wrapper), which the own initialisation calls"
        )
    for kind in ("pre", "post"):
        hooks = getattr(optimizer, f"_optimizer_step_{kind}_hooks", None)
        if not isinstance(hooks, Mapping):
            return f"the optimizer's step {kind}-hooks cannot be inspected"
        if len(hooks) > 0:
            return f"a step {kind}-hook is registered, which the own initialisation runs"
    for name in _GLOBAL_STEP_HOOKS:
        hooks = getattr(torch_optimizer_module, name, None)
        if not isinstance(hooks, Mapping) or len(hooks) > 0:
            return (
                "global optimizer step hooks are registered (or cannot be inspected), which the "
                "own initialisation runs"
            )
    return None


def _initialized_state_problem(
    optimizer: torch.optim.Optimizer, snapshot: _OptimizerSnapshot
) -> Optional[str]:
    """What an initializer got wrong that every initialisation gets right, or None.

    The param groups are the captured ones with their parameters and hyper-parameters, except
    ``step``, which an optimizer's first step may create or advance (TE keeps its counter there,
    and the own initialisation steps too); every parameter whose local shard is not empty has a
    state entry of at least one tensor; nothing else has state.
    """
    groups = optimizer.param_groups
    if len(groups) != len(snapshot.param_groups) or any(
        group is not captured or set(group) - {"step"} != set(entries) - {"step"}
        or any(group[key] is not value for key, value in entries.items() if key not in ("params", "step"))
        or len(group["params"]) != len(params)
        or any(a is not b for a, b in zip(group["params"], params))
        for group, captured, entries, params in zip(
            groups, snapshot.param_groups, snapshot.param_group_entries, snapshot.param_lists
        )
    ):  # fmt: skip
        return "the param groups changed"
    params = [param for group in snapshot.param_lists for param in group]
    known = {id(param) for param in params}
    if any(not isinstance(key, torch.Tensor) or id(key) not in known for key in optimizer.state):
        return "there is state for something that is no parameter of the optimizer"
    for index, param in enumerate(params):
        entry = optimizer.state.get(param)
        if _local_tensor(param).numel() == 0:
            continue
        if not isinstance(entry, Mapping) or not any(
            isinstance(value, torch.Tensor) for value in entry.values()
        ):
            return f"parameter {index} has no state"
    return None


def _initialize(
    registration: Any, initializer: StateInitializer, context: StateExportContext
) -> Optional[str]:
    """Let the initializer create the state and check it; on any failure roll back and say why."""
    optimizer = context.optimizer
    snapshot = _OptimizerSnapshot.capture(optimizer)
    try:
        initializer.initialize_state(context)
        problem = _initialized_state_problem(optimizer, snapshot)
        if problem is not None:
            raise RuntimeError(f"the initialized state is incomplete: {problem}")
    except BaseException as error:
        snapshot.restore(optimizer)
        if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: restored, re-raised
            raise
        # As in the loader: restored, the own initialisation then does what upstream does.
        logger.warning(
            "Optimizer state adopter %r failed to initialize the state (%s: %s); the optimizer "
            "was restored and the own initialisation runs instead",
            registration.name,
            type(error).__name__,
            error,
        )
        return f"adopter {registration.name!r} failed to initialize the state"
    return None


def _initialized_by_adopter(
    registry: StateAdopterRegistry, owner: Any, existing: _Existing, declines: List[Tuple[str, str]]
) -> Tuple[Optional[StateAdoptionOutcome], str]:
    """Offer the initialisation to the initializers in order; the first that accepts creates it."""
    optimizer = owner.optimizer
    registrations = registry.registrations()
    disabled = _disabled_adopter_names(registrations)
    context = StateExportContext.for_owner(owner)
    for registration in registrations:
        initializer = registration.adopter
        if not isinstance(initializer, StateInitializer):
            continue
        decline = _ask(registration, initializer.initialize_decline_reason, context, disabled)
        if decline is not None:
            declines.append((registration.name, decline))
            continue
        failure = _initialize(registration, initializer, context)
        if failure is not None:
            return None, failure
        reused, allocated = _measure(optimizer.state, existing)
        outcome = StateAdoptionOutcome(
            _INITIALIZE,
            _describe(optimizer),
            registration.name,
            reused_bytes=reused,
            allocated_bytes=allocated,
            declines=tuple(declines),
        )
        return _finish(registry, outcome), ""
    if declines:
        return None, "every state initializer declined"
    return None, "no registered adopter is a state initializer"


def initialize_inner_optimizer_state(
    owner: Any,
    own_initialization: Callable[[], None],
    registry: Optional[StateAdopterRegistry] = None,
) -> StateAdoptionOutcome:
    """Create ``owner.optimizer``'s state for loading, by the first accepting initializer.

    Args:
        owner (Any): the Megatron-FSDP ``DistributedOptimizer`` whose inner optimizer's state is
            created.
        own_initialization (Callable[[], None]): what the owner does without this module (its
            dummy step on zero gradients); runs whenever no initializer does.
        registry (StateAdopterRegistry, optional): the adopters to consult; defaults to the
            process-wide registry.

    Returns:
        StateAdoptionOutcome: which initializer created the state, or that the own
        initialisation did and why (also handed to the outcome hooks).
    """
    registry = default_registry() if registry is None else registry
    optimizer = owner.optimizer
    existing = _existing_storages(optimizer.state)
    declines: List[Tuple[str, str]] = []
    reason = _own_initialization_reason(owner, optimizer)
    if reason is None:
        with _outcome_if_interrupted(registry, _INITIALIZE, optimizer, declines):
            outcome, reason = _initialized_by_adopter(registry, owner, existing, declines)
        if outcome is not None:
            return outcome
    own = StateAdoptionOutcome(
        _INITIALIZE,
        _describe(optimizer),
        None,
        method=getattr(own_initialization, "__qualname__", repr(own_initialization)),
        declines=tuple(declines),
        fallback_reason=reason,
    )
    try:
        own_initialization()
    except BaseException as error:  # recorded, then re-raised unchanged
        _finish(registry, replace(own, error=f"{type(error).__name__}: {error}"))
        raise
    reused, allocated = _measure(optimizer.state, existing)
    return _finish(registry, replace(own, reused_bytes=reused, allocated_bytes=allocated))
