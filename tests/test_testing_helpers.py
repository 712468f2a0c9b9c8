"""The public testing helpers accept correct adopters and exporters and catch broken ones.

``testing.assert_adoption_matches_own_loader``, ``assert_export_matches_own_state_dict`` and
``assert_check_is_side_effect_free`` are what a plugin's tests call. Real optimizers: the
FusedAdam stand-in, ``torch.optim.Adam`` (0-d ``step`` tensors) and ``torch.optim.SGD``.
"""

import re
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


class _DropsNoneValues(PyTorchLoaderAdopter):
    """Skips the incoming keys whose value is None, as TE's loader does; PyTorch's keeps them."""

    def adopt(self, context: StateAdoptionContext) -> None:
        super().adopt(context)
        for entry in context.optimizer.state.values():
            for key in [key for key, value in entry.items() if value is None]:
                del entry[key]


def _sgd_payload_with_a_none() -> Dict[str, Any]:
    state_dict = _sgd_payload_with_a_counter()
    state_dict["state"][0]["scale"] = None
    return state_dict


def test_an_adopter_that_leaves_out_state_entries_is_caught_by_name() -> None:
    """The loader accepts the install (a key without a value may be skipped), but the optimizer
    then holds other entries than its own loader gives it, which the helper names."""
    with pytest.raises(
        AssertionError,
        match=re.escape("drops_none: the adopted state has other state entries than the optimizer's own method gives"),
    ):
        assert_adoption_matches_own_loader(_DropsNoneValues("drops_none"), _one_sgd, _sgd_payload_with_a_none)


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


def _pop_a_group_param(state_dict: Dict[str, Any]) -> None:
    state_dict["param_groups"][0]["params"].pop()


def _replace_a_moment(state_dict: Dict[str, Any]) -> None:
    entry = state_dict["state"][0]
    entry["exp_avg"] = entry["exp_avg"].clone()


def _turn_a_params_list_into_a_tuple(state_dict: Dict[str, Any]) -> None:
    group = state_dict["param_groups"][0]
    group["params"] = tuple(group["params"])


@pytest.mark.parametrize(
    "spoil",
    [_pop_a_group_param, _replace_a_moment, _turn_a_params_list_into_a_tuple],
    ids=["pops a group's param id", "replaces a tensor", "turns a params list into a tuple"],
)
def test_a_check_that_changes_the_incoming_state_dict_deep_inside_is_caught(
    spoil: Callable[[Dict[str, Any]], None],
) -> None:
    """A change inside a group's ``params`` list, or a tensor swapped for an equal copy, is a
    change too (the helper compares every container, tensors by identity)."""

    class Spoiling(PyTorchLoaderAdopter):
        def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
            spoil(context.state_dict)  # type: ignore[arg-type]
            return None

    context = StateAdoptionContext(optimizer=fresh_standin(), state_dict=_payload(), **CONFIGS)
    with pytest.raises(AssertionError, match=re.escape("spoiling: its check changed the incoming state dict")):
        assert_check_is_side_effect_free(Spoiling("spoiling"), context)


def _with_stale_state() -> torch.optim.Optimizer:
    """A trained SGD that still holds state for two tensors that are no longer its parameters
    (as after its param groups were replaced), next to its parameters' state."""
    optimizer = trained_sgd()
    for _ in range(2):
        optimizer.state[torch.zeros(3)] = {"momentum_buffer": torch.arange(3.0)}
    return optimizer


def test_a_check_on_an_optimizer_that_holds_stale_state_is_answered() -> None:
    context = StateAdoptionContext(optimizer=_with_stale_state(), state_dict=_sgd_payload(), **CONFIGS)
    assert assert_check_is_side_effect_free(PyTorchLoaderAdopter("sgd"), context) is None


def test_a_check_that_moves_stale_state_onto_a_parameter_is_caught() -> None:
    """Parameter 1's state, parked on a tensor that is no parameter, is put back by the check:
    the same tensors, but now another parameter's state."""
    optimizer = trained_sgd()
    param = optimizer.param_groups[0]["params"][1]
    stale = torch.zeros(1)
    optimizer.state[stale] = optimizer.state.pop(param)

    class Reattaching(PyTorchLoaderAdopter):
        def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
            context.optimizer.state[param] = context.optimizer.state.pop(stale)
            return None

    context = StateAdoptionContext(optimizer=optimizer, state_dict=_sgd_payload(), **CONFIGS)
    with pytest.raises(AssertionError, match=re.escape("reattaching: its check changed the optimizer's state")):
        assert_check_is_side_effect_free(Reattaching("reattaching"), context)


def _no_entry(state_dict: Dict[str, Any]) -> None:
    state_dict["state"][0] = None


def _no_groups(state_dict: Dict[str, Any]) -> None:
    state_dict["param_groups"] = [None, None]


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (_no_entry, "parameter 0: the incoming state is a NoneType, not a dict"),
        (_no_groups, "param group 0 of the state dict has no 'params' list"),
    ],
    ids=["an entry that is no dict", "groups that are no dicts"],
)
def test_a_check_of_a_malformed_state_dict_is_answered(spoil: Callable[[Dict[str, Any]], None], reason: str) -> None:
    """The helper copies a malformed state dict as far as it is well formed, so the check's
    decline reaches the caller."""
    state_dict = _payload()
    spoil(state_dict)
    context = StateAdoptionContext(optimizer=fresh_standin(), state_dict=state_dict, **CONFIGS)
    assert assert_check_is_side_effect_free(standin_adopter(), context) == reason


def test_a_check_that_changes_an_incoming_group_in_place_is_caught() -> None:
    class Retuning(PyTorchLoaderAdopter):
        def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
            context.state_dict["param_groups"][1]["lr"] = 1.0
            return None

    context = StateAdoptionContext(optimizer=fresh_standin(), state_dict=_payload(), **CONFIGS)
    with pytest.raises(AssertionError, match=re.escape("retuning: its check changed the incoming state dict")):
        assert_check_is_side_effect_free(Retuning("retuning"), context)


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


class _Repacking(dict):  # type: ignore[type-arg]
    """An export that, when its state is first read, replaces the optimizer's held tensors by
    copies (the export's entries are the held entry dicts, so it holds the copies too)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(pytorch_state_dict(optimizer))
        self.optimizer = optimizer
        self.repacked = False

    def __getitem__(self, key: str) -> Any:
        if key == "state" and not self.repacked:
            self.repacked = True
            for entry in self.optimizer.state.values():
                for name in entry:
                    entry[name] = entry[name].clone()
        return super().__getitem__(key)


def test_an_export_that_changes_the_optimizer_only_when_read_is_caught() -> None:
    """The loader compares the optimizer before and after ``export_state_dict``; an export
    that changes it later, when the check reads it, is caught by the helper."""
    with pytest.raises(AssertionError, match=re.escape("repacking: exporting changed the optimizer's state")):
        assert_export_matches_own_state_dict(Exporter("repacking", _Repacking), trained_sgd)


class _VersionedSGD(torch.optim.SGD):
    """An SGD whose own ``state_dict()`` adds what its held state lacks: a format version in
    every group (which its loader keeps) and doubled momentum buffers (which it does not undo)."""

    def __init__(self, *args: Any, version_groups: bool = True, double: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.version_groups, self.double = version_groups, double

    def state_dict(self) -> Dict[str, Any]:
        state_dict = super().state_dict()
        if self.version_groups:
            state_dict["param_groups"] = [dict(group, format=2) for group in state_dict["param_groups"]]
        if self.double:
            state_dict["state"] = {
                key: {name: value * 2 for name, value in entry.items()} for key, entry in state_dict["state"].items()
            }
        return state_dict


def _trained_versioned_sgd(**kwargs: Any) -> Callable[[], torch.optim.Optimizer]:
    def make() -> torch.optim.Optimizer:
        params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.arange(4.0))]
        optimizer = _VersionedSGD(params, lr=0.1, momentum=0.9, **kwargs)
        for param in params:
            param.grad = torch.ones_like(param)
        optimizer.step()
        return optimizer

    return make


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "held: the export, loaded, has other param-group hyper-parameters"),
        ({"version_groups": False, "double": True}, "held: parameter 0 momentum_buffer differs"),
    ],
    ids=["other hyper-parameters", "other values"],
)
def test_an_export_of_the_held_state_that_loads_unlike_the_own_state_dict_is_caught(
    kwargs: Dict[str, Any], message: str
) -> None:
    """The export is the held state (so the loader uses it), but the optimizer's own
    ``state_dict()`` differs from the held state in a way its loader does not undo."""
    with pytest.raises(AssertionError, match=re.escape(message)):
        assert_export_matches_own_state_dict(Exporter("held", pytorch_state_dict), _trained_versioned_sgd(**kwargs))
