"""The adopter-testing helpers accept correct adopters however they order the state, and
catch the broken ones tests/test_testing_helpers.py does not show.

Written to kill mutants of ``testing.py`` that survived the first mutation run
(docs/mutation-report.md). Real optimizers: the FusedAdam stand-in and ``torch.optim.SGD``.
"""

from typing import Any, Callable, Dict, Optional

import pytest
import torch
from builders import cloned_state_dict, fresh_standin, trained_standin

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import StateAdoptionContext
from megatron.core.optimizer.state_adoption.testing import (
    assert_adoption_matches_own_loader,
    assert_check_is_side_effect_free,
)

CONFIGS = {"config": OptimizerConfig(), "ddp_config": DistributedDataParallelConfig()}


def _payload() -> Dict[str, Any]:
    return cloned_state_dict(trained_standin())


class _ByReference:
    """Accepts everything and installs the incoming tensors with PyTorch's loader."""

    name = "by_reference"

    def __init__(self, returns: Any = 0) -> None:
        self.returns = returns

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: StateAdoptionContext) -> Any:
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
        return self.returns


class _ReversedInsertion(_ByReference):
    """Correct, but fills ``optimizer.state`` last parameter first and each entry's keys reversed."""

    name = "reversed_insertion"

    def adopt(self, context: StateAdoptionContext) -> Any:
        super().adopt(context)
        state = context.optimizer.state
        entries = [(param, dict(state[param])) for param in list(state)]
        state.clear()
        for param, entry in reversed(entries):
            state[param] = {key: entry[key] for key in reversed(list(entry))}
        return 0


def test_a_correct_adopter_may_fill_the_state_in_any_order() -> None:
    assert assert_adoption_matches_own_loader(_ReversedInsertion(), fresh_standin, _payload, CONFIGS) == 0


def _sgd_with_counter() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)


def _sgd_payload() -> Dict[str, Any]:
    """SGD state with a non-tensor value, which PyTorch's loader keeps as it is."""
    state_dict = _sgd_with_counter().state_dict()
    state_dict["state"] = {0: {"momentum_buffer": torch.full((3,), 0.5), "restarts": 3}}
    return state_dict


def test_non_tensor_state_values_are_compared_by_value() -> None:
    assert assert_adoption_matches_own_loader(_ByReference(), _sgd_with_counter, _sgd_payload, CONFIGS) == 0


@pytest.mark.parametrize("returns", [-1, True], ids=["negative", "bool"])
def test_an_adopter_returning_no_byte_count_is_caught(returns: Any) -> None:
    with pytest.raises(AssertionError):
        assert_adoption_matches_own_loader(_ByReference(returns), fresh_standin, _payload, CONFIGS)


class _MutatingCheck(_ByReference):
    def __init__(self, mutate: Callable[[torch.optim.Optimizer], None]) -> None:
        super().__init__()
        self.mutate = mutate

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        self.mutate(context.optimizer)
        return None


def _add_entry(optimizer: torch.optim.Optimizer) -> None:
    param = optimizer.param_groups[0]["params"][0]
    optimizer.state[param]["extra"] = torch.zeros(1)


def _replace_tensor(optimizer: torch.optim.Optimizer) -> None:
    param = optimizer.param_groups[0]["params"][0]
    optimizer.state[param]["exp_avg"] = optimizer.state[param]["exp_avg"].clone()


@pytest.mark.parametrize("mutate", [_add_entry, _replace_tensor], ids=["adds an entry", "replaces a tensor"])
def test_a_check_that_changes_the_state_is_caught(mutate) -> None:
    context = StateAdoptionContext(trained_standin(), _payload(), **CONFIGS)
    with pytest.raises(AssertionError, match="decline_reason changed the optimizer's state"):
        assert_check_is_side_effect_free(_MutatingCheck(mutate), context)


class _ForeignEntry(_ByReference):
    """Also installs state for a tensor that is not a parameter of the optimizer."""

    name = "foreign_entry"

    def adopt(self, context: StateAdoptionContext) -> Any:
        super().adopt(context)
        context.optimizer.state[torch.zeros(1)] = {"exp_avg": torch.zeros(1)}
        return 0


def test_state_for_a_tensor_that_is_no_parameter_is_caught() -> None:
    with pytest.raises(AssertionError, match="the adopted state has other entries than the optimizer's own loader"):
        assert_adoption_matches_own_loader(_ForeignEntry(), fresh_standin, _payload, CONFIGS)


class _TensorisingAdopter(_ByReference):
    """Turns the non-tensor state value into a one-element tensor of the same value."""

    name = "tensorising"

    def adopt(self, context: StateAdoptionContext) -> Any:
        super().adopt(context)
        for entry in context.optimizer.state.values():
            entry["restarts"] = torch.tensor(entry["restarts"])
        return 0


def test_a_number_turned_into_a_tensor_is_not_bitwise_equal() -> None:
    with pytest.raises(AssertionError, match="parameter 0 restarts differs"):
        assert_adoption_matches_own_loader(_TensorisingAdopter(), _sgd_with_counter, _sgd_payload, CONFIGS)
