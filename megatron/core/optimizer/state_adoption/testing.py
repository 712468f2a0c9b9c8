"""Helpers for testing a state adopter against the optimizer's own loader.

An adopter is correct when, for every state dict it accepts, the optimizer ends up exactly as
its own ``load_state_dict`` would leave it, and when its check changes nothing. These helpers
assert both with real optimizers; use them in an adopter package's tests::

    from megatron.core.optimizer.state_adoption.testing import (
        assert_adoption_matches_own_loader,
        assert_check_is_side_effect_free,
    )
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .adopter import StateAdopter, StateAdoptionContext
from .validation import _optimizer_params

__all__ = ["assert_adoption_matches_own_loader", "assert_check_is_side_effect_free"]


def _state_snapshot(optimizer: torch.optim.Optimizer) -> List[Tuple[int, str, Any]]:
    """(parameter position, key, value) for every state entry, tensors by identity."""
    positions = {id(p): index for index, p in enumerate(_optimizer_params(optimizer))}
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
    if isinstance(left, torch.Tensor) or isinstance(
        right, torch.Tensor
    ):  # a tensor equals only a tensor
        return (
            isinstance(left, torch.Tensor)
            and isinstance(right, torch.Tensor)
            and left.dtype == right.dtype
            and left.shape == right.shape
            and bool(
                torch.equal(
                    left.contiguous().view(torch.uint8), right.contiguous().view(torch.uint8)
                )
            )
        )
    return bool(left == right)


def assert_check_is_side_effect_free(
    adopter: StateAdopter, context: StateAdoptionContext
) -> Optional[str]:
    """Call ``adopter.decline_reason(context)`` and assert it changed nothing.

    Args:
        adopter (StateAdopter): the adopter under test.
        context (StateAdoptionContext): the context to check.

    Returns:
        Optional[str]: the adopter's answer.
    """
    optimizer = context.optimizer
    state_before = _state_snapshot(optimizer)
    groups_before = _groups_without_params(optimizer)
    params_before = [list(group["params"]) for group in optimizer.param_groups]
    incoming_before = {k: dict(v) for k, v in context.state_dict["state"].items()}
    answer = adopter.decline_reason(context)
    after = _state_snapshot(optimizer)
    assert len(after) == len(state_before) and all(
        a[:2] == b[:2] and a[2] is b[2] for a, b in zip(after, state_before)
    ), f"{adopter.name}: decline_reason changed the optimizer's state"
    assert (
        _groups_without_params(optimizer) == groups_before
    ), f"{adopter.name}: decline_reason changed the optimizer's param groups"
    assert [list(g["params"]) for g in optimizer.param_groups] == params_before
    assert {
        k: dict(v) for k, v in context.state_dict["state"].items()
    } == incoming_before, f"{adopter.name}: decline_reason changed the incoming state dict"
    return answer


def assert_adoption_matches_own_loader(
    adopter: StateAdopter,
    make_optimizer: Callable[[], torch.optim.Optimizer],
    make_state_dict: Callable[[], Dict[str, Any]],
    context_kwargs: Optional[Dict[str, Any]] = None,
) -> int:
    """Adopt into one fresh optimizer, load with its own loader into another, compare.

    Asserts that the adopter accepts without side effects, that the adopted state holds the
    incoming tensors themselves, and that state and param-group hyper-parameters are bitwise
    equal to what the optimizer's own ``load_state_dict`` produces.

    Args:
        adopter (StateAdopter): the adopter under test.
        make_optimizer (Callable[[], torch.optim.Optimizer]): builds identical fresh optimizers.
        make_state_dict (Callable[[], Dict[str, Any]]): builds identical incoming state dicts.
        context_kwargs (Dict[str, Any], optional): extra ``StateAdoptionContext`` fields
            (``config``, ``ddp_config``, ...).

    Returns:
        int: the bytes the adopter reported as avoided.
    """
    adopted_optimizer, incoming = make_optimizer(), make_state_dict()
    context = StateAdoptionContext(adopted_optimizer, incoming, **(context_kwargs or {}))
    reason = assert_check_is_side_effect_free(adopter, context)
    assert reason is None, f"{adopter.name} declined: {reason}"
    incoming_tensors = {
        (state_id, key): value
        for state_id, entries in incoming["state"].items()
        for key, value in entries.items()
    }
    avoided = adopter.adopt(context)
    assert isinstance(avoided, int) and not isinstance(avoided, bool) and avoided >= 0

    loaded_optimizer = make_optimizer()
    loaded_optimizer.load_state_dict(make_state_dict())
    adopted_state, loaded_state = _state_snapshot(adopted_optimizer), _state_snapshot(
        loaded_optimizer
    )
    assert [e[:2] for e in adopted_state] == [
        e[:2] for e in loaded_state
    ], f"{adopter.name}: the adopted state has other entries than the optimizer's own loader"
    for (position, key, mine), (_, _, theirs) in zip(adopted_state, loaded_state):
        assert _bitwise_equal(mine, theirs), f"{adopter.name}: parameter {position} {key} differs"
    assert _groups_without_params(adopted_optimizer) == _groups_without_params(loaded_optimizer)
    ids = [i for group in incoming["param_groups"] for i in group["params"]]
    for state_id, param in zip(ids, _optimizer_params(adopted_optimizer)):
        for key, value in adopted_optimizer.state[param].items():
            offered = incoming_tensors.get((state_id, key))
            if isinstance(offered, torch.Tensor) and offered.dtype == value.dtype:
                assert value is offered, f"{adopter.name}: parameter {state_id} {key} was copied"
    return avoided
