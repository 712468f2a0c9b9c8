"""Fail-safety: misbehaving adopters never leave an optimizer half-loaded or crash a load."""

import logging

import pytest
import torch
from adopters_for_tests import (
    GarbageAdoptAdopter,
    GarbageCheckAdopter,
    HalfInstallingAdopter,
    PyTorchLoaderAdopter,
    RaisingCheckAdopter,
)
from builders import (
    Owner,
    assert_bitwise_equal,
    cloned_state_dict,
    fresh_standin,
    state_tensors,
    trained_standin,
)

from megatron.core.optimizer.state_adoption.loader import _load_inner_state
from megatron.core.optimizer.state_adoption.registry import _StateAdopterRegistry

LOGGER = "megatron.core.optimizer.state_adoption"


def _reference_state() -> list:
    """The state TE's own loader produces for the standard payload."""
    reference = fresh_standin()
    reference.load_state_dict(cloned_state_dict(trained_standin()))
    return state_tensors(reference)


@pytest.mark.parametrize("adopter", [RaisingCheckAdopter("raising"), GarbageCheckAdopter("garbage")])
def test_a_bad_check_is_a_logged_decline(empty_registry: _StateAdopterRegistry, adopter, caplog) -> None:
    later = PyTorchLoaderAdopter("later")
    empty_registry.register(adopter)
    empty_registry.register(later)
    optimizer = fresh_standin()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), empty_registry)
    assert len(later.adopted) == 1
    assert f"{adopter.name!r}" in caplog.text
    assert_bitwise_equal(state_tensors(optimizer), _reference_state())


@pytest.mark.parametrize("mutate_incoming", [False, True], ids=["raises", "mutates-then-raises"])
def test_adopter_failing_half_way_is_rolled_back_then_own_loader_runs(
    empty_registry: _StateAdopterRegistry, mutate_incoming: bool, caplog
) -> None:
    later = PyTorchLoaderAdopter("later")
    empty_registry.register(HalfInstallingAdopter(mutate_incoming=mutate_incoming))
    empty_registry.register(later)
    optimizer = fresh_standin()
    state_dict = cloned_state_dict(trained_standin())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _load_inner_state(Owner(optimizer), state_dict, empty_registry)
    assert "failed while installing the state (RuntimeError: failed half-way)" in caplog.text
    assert later.checked == []  # fall back to the optimizer's own loader, not the next adopter
    assert optimizer.allocations == len(state_tensors(optimizer)) == 8
    assert all("bogus" not in s for s in optimizer.state.values())
    assert len(optimizer.param_groups) == 2 and optimizer.param_groups[0]["lr"] == 1e-3
    assert_bitwise_equal(state_tensors(optimizer), _reference_state())


def test_rollback_restores_previous_state_exactly() -> None:
    """Before the fallback runs, state and groups are exactly as before the adoption."""
    from megatron.core.optimizer.state_adoption.loader import _OptimizerSnapshot

    optimizer = trained_standin()
    state_before = {p: dict(s) for p, s in optimizer.state.items()}
    group_objects = list(optimizer.param_groups)
    groups_before = [dict(g) for g in optimizer.param_groups]
    snapshot = _OptimizerSnapshot.capture(optimizer)
    with pytest.raises(RuntimeError):
        HalfInstallingAdopter().adopt(
            __import__("builders").make_context(optimizer, cloned_state_dict(trained_standin()))
        )
    snapshot.restore(optimizer)
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]
    assert optimizer.param_groups == groups_before
    assert all(a is b for a, b in zip(optimizer.param_groups, group_objects))
    assert set(optimizer.state) == set(state_before)
    for param, entries in state_before.items():
        assert optimizer.state[param].keys() == entries.keys()
        assert all(optimizer.state[param][k] is v for k, v in entries.items())


@pytest.mark.parametrize("result", [None, "many", -1, True, 3.5])
def test_adopt_returning_garbage_is_rolled_back(empty_registry: _StateAdopterRegistry, result, caplog) -> None:
    empty_registry.register(GarbageAdoptAdopter(result))
    optimizer = fresh_standin()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), empty_registry)
    assert "failed while installing" in caplog.text
    assert optimizer.allocations == 8  # the optimizer's own loader ran
    assert_bitwise_equal(state_tensors(optimizer), _reference_state())


def _drop_last_param(state_dict: dict) -> dict:
    state_dict["param_groups"][1]["params"].pop()
    return state_dict


@pytest.mark.parametrize(
    "corrupt, error",
    [
        (_drop_last_param, ValueError),
        (lambda sd: {**sd, "param_groups": sd["param_groups"][:1]}, ValueError),
        (lambda sd: {"state": sd["state"]}, KeyError),
    ],
    ids=["fewer params", "fewer groups", "no param_groups"],
)
def test_upstream_errors_are_still_raised_identically(registry: _StateAdopterRegistry, corrupt, error) -> None:
    with pytest.raises(error) as upstream:
        fresh_standin().load_state_dict(corrupt(cloned_state_dict(trained_standin())))
    optimizer = fresh_standin()
    with pytest.raises(error) as ours:
        _load_inner_state(Owner(optimizer), corrupt(cloned_state_dict(trained_standin())), registry)
    assert str(ours.value) == str(upstream.value)


def test_adopter_result_is_identical_whichever_pass(registry: _StateAdopterRegistry) -> None:
    """Two loads in a row (scaffold, then payload) and a load after training all adopt."""
    optimizer = fresh_standin()
    _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    first = state_tensors(optimizer)
    _load_inner_state(Owner(optimizer), optimizer.state_dict(), registry)
    assert all(a is b for a, b in zip(state_tensors(optimizer), first))
    assert optimizer.allocations == 0
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    _load_inner_state(Owner(optimizer), optimizer.state_dict(), registry)
    assert all(a is b for a, b in zip(state_tensors(optimizer), first)) and optimizer.allocations == 0
