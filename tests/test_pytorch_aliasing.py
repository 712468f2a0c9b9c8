"""The saving rests on PyTorch's loader keeping the incoming tensors; the installed torch must.

``torch.optim.Optimizer.load_state_dict`` casts each state tensor with ``value.to(dtype=...,
device=...)``, which returns the tensor itself when dtype and device already match. The
default adopter runs only that loader, so it installs the moments by reference. PyTorch issue
196083 may make the loader copy instead; these tests run against the INSTALLED torch so that a
torch upgrade that does so fails loudly here instead of silently removing the saving.
"""

import logging
from typing import Callable

import pytest
import torch
from adopters_for_tests import CopyingAdopter
from builders import Owner, cloned_state_dict, fresh_standin, numel_bytes, standin_registry, trained_standin
from real_optimizers import cloned, fresh_adam, fresh_sgd, params_of, trained

from megatron.core.optimizer.state_adoption import StateAdopterRegistry, load_inner_optimizer_state_dict

LOGGER = "megatron.core.optimizer.state_adoption"


def _removed_the_saving(what: str) -> str:
    return (
        f"torch {torch.__version__}: {what}. A PyTorch upgrade removed the by-reference install "
        "that optimizer state adoption relies on (see PyTorch issue 196083): the default adopter "
        "no longer saves the 8 bytes per parameter; revisit adopter.adopt before shipping this torch"
    )


@pytest.mark.parametrize(
    "make_optimizer",
    [fresh_sgd, fresh_adam, fresh_standin],
    ids=["SGD with momentum", "Adam", "FusedAdam stand-in"],
)
def test_pytorchs_loader_keeps_matching_tensors_by_identity(make_optimizer: Callable[[], torch.optim.Optimizer]) -> None:
    """Hole 7: PyTorch may stop aliasing: its loader must keep every matching-dtype/device tensor."""
    optimizer = make_optimizer()
    state_dict = cloned(trained(make_optimizer).state_dict())
    torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    assert len(optimizer.state) == len(ids) > 0
    for state_id, param in zip(ids, params_of(optimizer)):
        for key, incoming in state_dict["state"][state_id].items():
            installed = optimizer.state[param][key]
            assert installed is incoming, _removed_the_saving(
                f"torch.optim.Optimizer.load_state_dict copied {key} of parameter {state_id} of "
                f"{type(optimizer).__name__} instead of keeping the incoming tensor"
            )


def test_the_default_adopters_outcome_measures_the_saving() -> None:
    """Hole 7: with the installed torch the default adopter reuses 8 B per parameter element."""
    optimizer = fresh_standin()
    outcome = load_inner_optimizer_state_dict(
        Owner(optimizer), cloned_state_dict(trained_standin()), registry=standin_registry()
    )
    assert outcome.adopter == "te_fused_adam_fp32", outcome
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (numel_bytes(optimizer), 0), _removed_the_saving(
        f"the default adopter's install reused {outcome.reused_bytes} B and allocated "
        f"{outcome.allocated_bytes} B instead of reusing {numel_bytes(optimizer)} B"
    )


def test_an_install_that_copies_is_reported_and_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """Hole 7: when the install copies (what a copying torch would do), the outcome says so and a
    WARNING names the adopter."""
    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(CopyingAdopter())
    optimizer = fresh_standin()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outcome = load_inner_optimizer_state_dict(Owner(optimizer), cloned_state_dict(trained_standin()), registry=registry)
    assert outcome.adopter == "copying" and outcome.allocated_bytes > 0 and outcome.reused_bytes == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'copying'" in warnings[0] and "newly allocated" in warnings[0] and outcome.optimizer in warnings[0]


def test_a_single_copied_byte_is_measured_and_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """The smallest copy counts: one parameter of one FP8 element, whose moment is one
    byte, installed as a copy, is 1 B newly allocated and a WARNING."""
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float8_e4m3fn), requires_grad=False)
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    payload = {
        "state": {0: {"momentum_buffer": torch.zeros(1, dtype=torch.float8_e4m3fn)}},
        "param_groups": optimizer.state_dict()["param_groups"],
    }
    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(CopyingAdopter())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outcome = load_inner_optimizer_state_dict(Owner(optimizer), payload, registry=registry)
    assert outcome.adopter == "copying" and (outcome.reused_bytes, outcome.allocated_bytes) == (0, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'copying'" in warnings[0] and " 1 B of newly allocated" in warnings[0]
