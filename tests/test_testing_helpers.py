"""The public testing helpers accept correct adopters and exporters and catch broken ones.

``testing.assert_adoption_matches_own_loader``, ``assert_export_matches_own_state_dict`` and
``assert_check_is_side_effect_free`` are what a plugin's tests call. Real optimizers: the
FusedAdam stand-in, ``torch.optim.Adam`` (0-d ``step`` tensors) and ``torch.optim.SGD``.
"""

from typing import Any, Callable, Dict, Optional

import pytest
import torch
from adopters_for_tests import CopyingAdopter, Exporter, PyTorchLoaderAdopter, pytorch_state_dict
from builders import cloned_state_dict, fresh_standin, numel_bytes, standin_adopter, trained_standin
from real_optimizers import cloned, fresh_adam, fresh_sgd, trained_adam, trained_sgd

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import StateAdoptionContext, StateExportContext
from megatron.core.optimizer.state_adoption.testing import (
    assert_adoption_matches_own_loader,
    assert_check_is_side_effect_free,
    assert_export_matches_own_state_dict,
)

CONFIGS = {"config": OptimizerConfig(), "ddp_config": DistributedDataParallelConfig()}


def _payload() -> Dict[str, Any]:
    return cloned_state_dict(trained_standin())


def _adam_payload() -> Dict[str, Any]:
    return cloned(trained_adam().state_dict())


def _sgd_payload() -> Dict[str, Any]:
    return cloned(trained_sgd().state_dict())


# --- assert_adoption_matches_own_loader ---------------------------------------------------


def test_the_default_adopter_passes_and_its_saving_is_returned() -> None:
    outcome = assert_adoption_matches_own_loader(standin_adopter(), fresh_standin, _payload, CONFIGS)
    assert outcome.adopter == "te_fused_adam_fp32"
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (numel_bytes(fresh_standin()), 0)


def test_an_adopter_of_adam_passes_with_its_0_d_step_tensors() -> None:
    """Hole 8: the helper works with a real torch.optim.Adam (0-d ``step`` tensors) and an
    adopter that installs with PyTorch's loader."""
    assert _adam_payload()["state"][0]["step"].dim() == 0
    outcome = assert_adoption_matches_own_loader(PyTorchLoaderAdopter("adam"), fresh_adam, _adam_payload)
    assert outcome.adopter == "adam" and (outcome.reused_bytes, outcome.allocated_bytes) == (200, 0)


def test_an_adopter_of_sgd_passes() -> None:
    """Hole 8: and with SGD with momentum."""
    outcome = assert_adoption_matches_own_loader(PyTorchLoaderAdopter("sgd"), fresh_sgd, _sgd_payload)
    assert outcome.adopter == "sgd" and outcome.reused_bytes == 4 * 23


class _ReversedInsertion(PyTorchLoaderAdopter):
    """Correct, but fills ``optimizer.state`` last parameter first and each entry's keys reversed."""

    def adopt(self, context: StateAdoptionContext) -> None:
        super().adopt(context)
        state = context.optimizer.state
        entries = [(param, dict(state[param])) for param in list(state)]
        state.clear()
        for param, entry in reversed(entries):
            state[param] = {key: entry[key] for key in reversed(list(entry))}


def test_a_correct_adopter_may_fill_the_state_in_any_order() -> None:
    outcome = assert_adoption_matches_own_loader(_ReversedInsertion("reversed"), fresh_standin, _payload, CONFIGS)
    assert outcome.adopter == "reversed"


def _one_sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)


def _sgd_payload_with_a_counter() -> Dict[str, Any]:
    """SGD state with a non-tensor value, which PyTorch's loader keeps as it is."""
    state_dict = _one_sgd().state_dict()
    state_dict["state"] = {0: {"momentum_buffer": torch.full((3,), 0.5), "restarts": 3}}
    return state_dict


def test_non_tensor_state_values_are_compared_by_value() -> None:
    outcome = assert_adoption_matches_own_loader(PyTorchLoaderAdopter("by_value"), _one_sgd, _sgd_payload_with_a_counter)
    assert outcome.adopter == "by_value"


class _CopiesAfterwards(PyTorchLoaderAdopter):
    """Installs copies instead of the incoming tensors (correct values, no saving)."""

    def adopt(self, context: StateAdoptionContext) -> None:
        super().adopt(context)
        for state in context.optimizer.state.values():
            for key in state:
                state[key] = state[key].clone()


class _WrongValues(PyTorchLoaderAdopter):
    def adopt(self, context: StateAdoptionContext) -> None:
        super().adopt(context)
        next(iter(context.optimizer.state.values()))["exp_avg"].add_(1)


class _MutatingCheck(PyTorchLoaderAdopter):
    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        context.optimizer.param_groups[0]["lr"] = 1.0
        return None


class _Tensorising(PyTorchLoaderAdopter):
    """Turns the non-tensor state value into a one-element tensor of the same value."""

    def adopt(self, context: StateAdoptionContext) -> None:
        super().adopt(context)
        for entry in context.optimizer.state.values():
            entry["restarts"] = torch.tensor(entry["restarts"])


class _Declining(PyTorchLoaderAdopter):
    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return "not today"


@pytest.mark.parametrize(
    "adopter, make_optimizer, make_state_dict, message",
    [
        (_CopiesAfterwards("copies"), fresh_standin, _payload, "was copied"),
        (CopyingAdopter(), fresh_adam, _adam_payload, "was copied"),
        (_WrongValues("wrong_values"), fresh_standin, _payload, "differs"),
        (_MutatingCheck("mutating_check"), fresh_standin, _payload, "its check changed the optimizer's param groups"),
        (_Tensorising("tensorising"), _one_sgd, _sgd_payload_with_a_counter, "parameter 0 restarts differs"),
        (_Declining("declining"), fresh_standin, _payload, "declining declined: not today"),
    ],
    ids=["copies afterwards", "copies on install", "wrong values", "mutating check", "number turned tensor", "declines"],
)
def test_broken_adopters_are_caught(adopter: Any, make_optimizer: Callable, make_state_dict: Callable, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        assert_adoption_matches_own_loader(adopter, make_optimizer, make_state_dict, CONFIGS)


def test_an_install_the_loader_undoes_is_caught() -> None:
    """State for a tensor that is no parameter: the loader rolls it back, so the adopter did
    not install, which the helper reports."""

    class ForeignEntry(PyTorchLoaderAdopter):
        def adopt(self, context: StateAdoptionContext) -> None:
            super().adopt(context)
            context.optimizer.state[torch.zeros(1)] = {"exp_avg": torch.zeros(1)}

    with pytest.raises(AssertionError, match="foreign_entry did not install"):
        assert_adoption_matches_own_loader(ForeignEntry("foreign_entry"), fresh_standin, _payload, CONFIGS)


# --- assert_check_is_side_effect_free -----------------------------------------------------


def test_a_side_effect_free_check_returns_the_answer() -> None:
    context = StateAdoptionContext(optimizer=fresh_standin(master_weights=True), state_dict=_payload(), **CONFIGS)
    assert assert_check_is_side_effect_free(standin_adopter(), context) == "FusedAdam.master_weights is set"


class _StateMutatingCheck(PyTorchLoaderAdopter):
    def __init__(self, mutate: Callable[[torch.optim.Optimizer], None]) -> None:
        super().__init__("state_mutating")
        self.mutate = mutate

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        self.mutate(context.optimizer)
        return None


def _add_entry(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state[optimizer.param_groups[0]["params"][0]]["extra"] = torch.zeros(1)


def _replace_tensor(optimizer: torch.optim.Optimizer) -> None:
    entry = optimizer.state[optimizer.param_groups[0]["params"][0]]
    entry["exp_avg"] = entry["exp_avg"].clone()


@pytest.mark.parametrize("mutate", [_add_entry, _replace_tensor], ids=["adds an entry", "replaces a tensor"])
def test_a_check_that_changes_the_state_is_caught(mutate: Callable[[torch.optim.Optimizer], None]) -> None:
    context = StateAdoptionContext(optimizer=trained_standin(), state_dict=_payload(), **CONFIGS)
    with pytest.raises(AssertionError, match="its check changed the optimizer's state"):
        assert_check_is_side_effect_free(_StateMutatingCheck(mutate), context)


def test_a_check_that_changes_the_incoming_state_dict_is_caught() -> None:
    class Popping(PyTorchLoaderAdopter):
        def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
            context.state_dict["state"][0].pop("exp_avg")
            return None

    context = StateAdoptionContext(optimizer=fresh_standin(), state_dict=_payload(), **CONFIGS)
    with pytest.raises(AssertionError, match="its check changed the incoming state dict"):
        assert_check_is_side_effect_free(Popping("popping"), context)


def test_an_export_context_runs_the_export_check() -> None:
    exporter = Exporter("exporter", pytorch_state_dict, decline="nothing to export")
    context = StateExportContext(optimizer=trained_adam())
    assert assert_check_is_side_effect_free(exporter, context) == "nothing to export"
    assert exporter.checks == 1


# --- assert_export_matches_own_state_dict -------------------------------------------------


@pytest.mark.parametrize("make_optimizer", [trained_adam, trained_sgd, trained_standin], ids=["Adam", "SGD", "stand-in"])
def test_a_correct_exporter_passes(make_optimizer: Callable[[], torch.optim.Optimizer]) -> None:
    outcome = assert_export_matches_own_state_dict(Exporter("held", pytorch_state_dict), make_optimizer, CONFIGS)
    assert outcome.hook_point == "export" and outcome.adopter == "held" and outcome.allocated_bytes == 0


def _copying_export(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    state_dict = pytorch_state_dict(optimizer)
    state_dict["state"] = {k: {n: v.clone() for n, v in e.items()} for k, e in state_dict["state"].items()}
    return state_dict


def _permuting_export(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    state_dict = pytorch_state_dict(optimizer)
    state = dict(state_dict["state"])
    state[0], state[2] = state[2], state[0]  # parameters 0 and 2 have the same shape
    return {**state_dict, "state": state}


def _mutating_export(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    optimizer.param_groups[0]["lr"] = 7.0
    return pytorch_state_dict(optimizer)


@pytest.mark.parametrize(
    "export", [_copying_export, _permuting_export, _mutating_export], ids=["copies", "permutes", "changes the optimizer"]
)
def test_a_broken_exporter_is_caught(export: Callable[[torch.optim.Optimizer], Dict[str, Any]]) -> None:
    with pytest.raises(AssertionError, match="export not used"):
        assert_export_matches_own_state_dict(Exporter("broken", export), trained_adam, CONFIGS)


def test_a_declining_exporter_is_caught() -> None:
    with pytest.raises(AssertionError, match="broken declined to export: not now"):
        assert_export_matches_own_state_dict(Exporter("broken", pytorch_state_dict, decline="not now"), trained_adam)


def test_an_export_check_that_changes_the_optimizer_is_caught() -> None:
    class Mutating(Exporter):
        def export_decline_reason(self, context: StateExportContext) -> Optional[str]:
            context.optimizer.param_groups[1]["lr"] = 3.0
            return None

    with pytest.raises(AssertionError, match="its check changed the optimizer's param groups"):
        assert_export_matches_own_state_dict(Mutating("mutating", pytorch_state_dict), trained_adam)
