"""The exported adopter-testing helpers accept a correct adopter and catch broken ones."""

from typing import Any, Optional

import pytest
import torch
from builders import cloned_state_dict, fresh_standin, standin_adopter, trained_standin

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import StateAdoptionContext
from megatron.core.optimizer.state_adoption.testing import (
    assert_adoption_matches_own_loader,
    assert_check_is_side_effect_free,
)

CONFIGS = {"config": OptimizerConfig(), "ddp_config": DistributedDataParallelConfig()}


def _payload() -> dict:
    return cloned_state_dict(trained_standin())


def test_default_adopter_passes() -> None:
    avoided = assert_adoption_matches_own_loader(standin_adopter(), fresh_standin, _payload, CONFIGS)
    assert avoided == 8 * sum(p.numel() for g in fresh_standin().param_groups for p in g["params"])


class _CopyingAdopter:
    """Installs copies instead of the incoming tensors (correct values, no saving)."""

    name = "copying"

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: StateAdoptionContext) -> int:
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
        for state in context.optimizer.state.values():
            for key in state:
                state[key] = state[key].clone()
        return 0


class _WrongValuesAdopter(_CopyingAdopter):
    name = "wrong_values"

    def adopt(self, context: StateAdoptionContext) -> int:
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
        next(iter(context.optimizer.state.values()))["exp_avg"].add_(1)
        return 0


class _MutatingCheckAdopter(_CopyingAdopter):
    name = "mutating_check"

    def decline_reason(self, context: StateAdoptionContext) -> Any:
        context.optimizer.param_groups[0]["lr"] = 1.0
        return None


@pytest.mark.parametrize(
    "adopter, message",
    [
        (_CopyingAdopter(), "was copied"),
        (_WrongValuesAdopter(), "differs"),
        (_MutatingCheckAdopter(), "changed the optimizer's param groups"),
    ],
)
def test_broken_adopters_are_caught(adopter: Any, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        assert_adoption_matches_own_loader(adopter, fresh_standin, _payload, CONFIGS)


def test_side_effect_free_check_returns_the_answer() -> None:
    context = StateAdoptionContext(fresh_standin(master_weights=True), _payload(), **CONFIGS)
    assert "master_weights" in assert_check_is_side_effect_free(standin_adopter(), context)
