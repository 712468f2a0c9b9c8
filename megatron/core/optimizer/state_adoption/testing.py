"""Helpers for testing a state adopter or exporter against the optimizer's own methods.

An adopter is correct when, for every state dict it accepts, the optimizer ends up exactly as
its own ``load_state_dict`` would leave it, and when its check changes nothing; an exporter
when its export is the held state and loads into the same bits as the own ``state_dict()``.
These helpers assert that with real optimizers, running each call through the loader with a
registry that holds only the adopter under test (a :class:`~.registry.StateAdopterRegistry`
without entry-point discovery, which plugin tests can build the same way)::

    from megatron.core.optimizer.state_adoption.testing import (
        assert_adoption_matches_own_loader,
        assert_check_is_side_effect_free,
        assert_export_matches_own_state_dict,
    )
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from .adopter import StateAdopter, StateAdoptionContext, StateExportContext, StateExporter
from .loader import export_inner_optimizer_state_dict, load_inner_optimizer_state_dict
from .outcome import StateAdoptionOutcome
from .registry import StateAdopterRegistry

__all__ = [
    "assert_adoption_matches_own_loader",
    "assert_check_is_side_effect_free",
    "assert_export_matches_own_state_dict",
]


@dataclass
class _Owner:
    """What the loader reads of a ``DistributedOptimizer``."""

    optimizer: torch.optim.Optimizer
    config: Any = None
    ddp_config: Any = None
    is_stub_optimizer: bool = False


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _state_snapshot(optimizer: torch.optim.Optimizer) -> List[Tuple[int, str, Any]]:
    """(parameter position, key, value) for every state entry, tensors by identity."""
    positions = {id(p): index for index, p in enumerate(_params(optimizer))}
    return sorted(
        (
            (positions.get(id(param), -1), str(key), value)
            for param, entries in optimizer.state.items()
            for key, value in entries.items()
        ),
        key=lambda entry: entry[:2],
    )


def _groups_without_params(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _bitwise_equal(left: Any, right: Any) -> bool:
    """Equal bits for tensors (of any shape, 0-d included), ``==`` for anything else."""
    if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
        if not (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor)):
            return False  # a tensor equals only a tensor
        return (
            left.dtype == right.dtype
            and left.shape == right.shape
            and bool(
                torch.equal(
                    left.detach().contiguous().reshape(-1).view(torch.uint8),
                    right.detach().contiguous().reshape(-1).view(torch.uint8),
                )
            )
        )
    return bool(left == right)


def _assert_same_state(
    name: str, mine: torch.optim.Optimizer, theirs: torch.optim.Optimizer, what: str
) -> None:
    """Assert two optimizers hold bitwise-equal state and equal group hyper-parameters."""
    my_state, their_state = _state_snapshot(mine), _state_snapshot(theirs)
    assert [e[:2] for e in my_state] == [
        e[:2] for e in their_state
    ], f"{name}: {what} has other state entries than the optimizer's own method gives"
    for (position, key, my_value), (_, _, their_value) in zip(my_state, their_state):
        assert _bitwise_equal(my_value, their_value), f"{name}: parameter {position} {key} differs"
    assert _groups_without_params(mine) == _groups_without_params(
        theirs
    ), f"{name}: {what} has other param-group hyper-parameters"


def _containers(value: Any) -> Any:
    """``value`` with every container copied and every tensor replaced by its identity, to
    compare a state dict before and after a check (a malformed one as far as it goes)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, Mapping):
        return {key: _containers(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_containers(item) for item in value], type(value)
    return value


def assert_check_is_side_effect_free(
    adopter: Union[StateAdopter, StateExporter],
    context: Union[StateAdoptionContext, StateExportContext],
) -> Optional[str]:
    """Run the adopter's check for ``context`` and assert it changed nothing.

    For a :class:`StateAdoptionContext` that is ``decline_reason``, for a plain
    :class:`StateExportContext` ``export_decline_reason``.

    Args:
        adopter (StateAdopter or StateExporter): the adopter under test.
        context (StateAdoptionContext or StateExportContext): the context to check.

    Returns:
        Optional[str]: the adopter's answer.
    """
    optimizer = context.optimizer
    state_before = _state_snapshot(optimizer)
    groups_before = _groups_without_params(optimizer)
    params_before = [list(group["params"]) for group in optimizer.param_groups]
    incoming = context.state_dict if isinstance(context, StateAdoptionContext) else None
    incoming_before = _containers(incoming)
    if isinstance(context, StateAdoptionContext):
        assert isinstance(adopter, StateAdopter), f"{adopter!r} is not a state adopter"
        answer = adopter.decline_reason(context)
    else:
        assert isinstance(adopter, StateExporter), f"{adopter!r} is not a state exporter"
        answer = adopter.export_decline_reason(context)
    after = _state_snapshot(optimizer)
    assert len(after) == len(state_before) and all(
        a[:2] == b[:2] and a[2] is b[2] for a, b in zip(after, state_before)
    ), f"{adopter.name}: its check changed the optimizer's state"
    assert (
        _groups_without_params(optimizer) == groups_before
    ), f"{adopter.name}: its check changed the optimizer's param groups"
    assert [list(g["params"]) for g in optimizer.param_groups] == params_before
    assert (
        _containers(incoming) == incoming_before
    ), f"{adopter.name}: its check changed the incoming state dict"
    return answer


def _registry_of(adopter: Union[StateAdopter, StateExporter]) -> StateAdopterRegistry:
    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(adopter)  # type: ignore[arg-type]  # an exporter is an adopter too
    return registry


def assert_adoption_matches_own_loader(
    adopter: StateAdopter,
    make_optimizer: Callable[[], torch.optim.Optimizer],
    make_state_dict: Callable[[], Dict[str, Any]],
    context_kwargs: Optional[Dict[str, Any]] = None,
) -> StateAdoptionOutcome:
    """Adopt into one fresh optimizer, load with its own loader into another, compare.

    Asserts that the adopter accepts without side effects, that the loader (with only this
    adopter registered) lets it install the state, that every incoming tensor it kept is the
    incoming tensor itself, and that state and param-group hyper-parameters are bitwise equal
    to what the optimizer's own ``load_state_dict`` produces.

    Args:
        adopter (StateAdopter): the adopter under test.
        make_optimizer (Callable[[], torch.optim.Optimizer]): builds identical fresh optimizers.
        make_state_dict (Callable[[], Dict[str, Any]]): builds identical incoming state dicts.
        context_kwargs (Dict[str, Any], optional): the owner's ``config``, ``ddp_config``
            and ``is_stub_optimizer``.

    Returns:
        StateAdoptionOutcome: the load's outcome, with the bytes measured as installed by
        reference and as newly allocated.
    """
    owner = _Owner(make_optimizer(), **(context_kwargs or {}))
    incoming = make_state_dict()
    context = StateAdoptionContext.for_owner(owner, state_dict=incoming)
    reason = assert_check_is_side_effect_free(adopter, context)
    assert reason is None, f"{adopter.name} declined: {reason}"
    offered = {
        (state_id, key): value
        for state_id, entries in incoming["state"].items()
        for key, value in entries.items()
    }
    outcome = load_inner_optimizer_state_dict(owner, incoming, registry=_registry_of(adopter))
    assert outcome.adopter == adopter.name, f"{adopter.name} did not install: {outcome}"

    loaded_optimizer = make_optimizer()
    loaded_optimizer.load_state_dict(make_state_dict())
    _assert_same_state(adopter.name, owner.optimizer, loaded_optimizer, "the adopted state")
    ids = [i for group in incoming["param_groups"] for i in group["params"]]
    for state_id, param in zip(ids, _params(owner.optimizer)):
        for key, value in owner.optimizer.state[param].items():
            given = offered.get((state_id, key))
            if isinstance(given, torch.Tensor) and given.dtype == value.dtype:
                assert value is given, f"{adopter.name}: parameter {state_id} {key} was copied"
    return outcome


def assert_export_matches_own_state_dict(
    exporter: StateExporter,
    make_optimizer: Callable[[], torch.optim.Optimizer],
    context_kwargs: Optional[Dict[str, Any]] = None,
) -> StateAdoptionOutcome:
    """Export from an optimizer that holds state and compare with its own ``state_dict()``.

    Asserts that the exporter accepts without side effects; that the loader (with only this
    exporter registered) uses its export, which therefore passed the check against the held
    state; that exporting changed nothing; and that the export and the own ``state_dict()``,
    each loaded with the own loader into an identical fresh optimizer, give bitwise-equal state.

    Args:
        exporter (StateExporter): the exporter under test.
        make_optimizer (Callable[[], torch.optim.Optimizer]): builds identical optimizers that
            hold state (e.g. after a step).
        context_kwargs (Dict[str, Any], optional): the owner's ``config``, ``ddp_config``
            and ``is_stub_optimizer``.

    Returns:
        StateAdoptionOutcome: the export's outcome.
    """
    owner = _Owner(make_optimizer(), **(context_kwargs or {}))
    context = StateExportContext.for_owner(owner)
    reason = assert_check_is_side_effect_free(exporter, context)
    assert reason is None, f"{exporter.name} declined to export: {reason}"
    before = _state_snapshot(owner.optimizer)
    outcomes: List[StateAdoptionOutcome] = []
    registry = _registry_of(exporter)
    registry.register_outcome_hook(outcomes.append)
    exported = export_inner_optimizer_state_dict(owner, registry=registry)
    assert [o.adopter for o in outcomes] == [exporter.name], f"export not used: {outcomes}"
    after = _state_snapshot(owner.optimizer)
    assert [a[:2] for a in after] == [b[:2] for b in before] and all(
        a[2] is b[2] for a, b in zip(after, before)
    ), f"{exporter.name}: exporting changed the optimizer's state"

    from_export, from_own = make_optimizer(), make_optimizer()
    from_export.load_state_dict(exported)
    from_own.load_state_dict(make_optimizer().state_dict())
    _assert_same_state(exporter.name, from_export, from_own, "the export, loaded,")
    return outcomes[0]
