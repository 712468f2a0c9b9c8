"""The public checks of ``validation`` and the contexts of ``adopter`` in detail.

Written to kill mutants that survived the first mutation run (docs/mutation-report.md):
exact reasons, defaults, one-byte and zero-byte tensors in the storage-sharing rule, and
owners that lack optional attributes. Real ``torch.optim`` optimizers throughout.
"""

import types
from typing import Any, Dict, List, Optional

import pytest
import torch
from builders import Owner, config_with, ddp_config_with

from megatron.core.optimizer.state_adoption import StateAdoptionContext, StateExportContext
from megatron.core.optimizer.state_adoption.validation import (
    incoming_state_decline_reason,
    instance_method_decline_reason,
    load_hooks_decline_reason,
    one_entry_per_param_decline_reason,
    owner_decline_reason,
)


def _sgd(*params: torch.Tensor) -> torch.optim.SGD:
    return torch.optim.SGD(list(params), lr=0.1)


def _context(**owner_overrides: Any) -> StateAdoptionContext:
    return StateAdoptionContext.for_owner(Owner(_sgd(torch.nn.Parameter(torch.ones(2))), **owner_overrides), {})


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"is_stub_optimizer": True}, "the DistributedOptimizer is a stub"),
        ({"ddp_config": None}, "the owner's OptimizerConfig or DistributedDataParallelConfig is unknown"),
        (
            {"ddp_config": ddp_config_with(use_megatron_fsdp=True)},
            "use_megatron_fsdp is set: Megatron-FSDP manages the state",
        ),
        (
            {"config": config_with(optimizer_cpu_offload=True)},
            "optimizer_cpu_offload is set: the optimizer is CPU-offloaded",
        ),
        (
            {"config": types.SimpleNamespace(optimizer_cpu_offload=False, use_precision_aware_optimizer=True)},
            "use_precision_aware_optimizer is set: the optimizer is precision-aware",
        ),
        (
            {"config": types.SimpleNamespace(optimizer_cpu_offload=False)},
            "SimpleNamespace has no 'use_precision_aware_optimizer'",
        ),
    ],
    ids=["stub", "config unknown", "fsdp", "cpu offload", "precision aware", "flag missing"],
)
def test_owner_rules_decline_with_their_exact_reasons(overrides: Dict[str, Any], reason: str) -> None:
    assert owner_decline_reason(_context(**overrides)) == reason


def test_owner_rules_default_to_the_fp32_mode() -> None:
    assert owner_decline_reason(_context()) is None
    assert owner_decline_reason(_context(), precision_aware=True) == "use_precision_aware_optimizer is not set"


def test_an_object_without_instance_dict_has_no_instance_method() -> None:
    class Slotted:
        __slots__ = ()

    assert instance_method_decline_reason(Slotted(), "load_state_dict") is None  # type: ignore[arg-type]


def test_load_hook_reasons_are_exact() -> None:
    optimizer = _sgd(torch.nn.Parameter(torch.ones(2)))
    optimizer.register_load_state_dict_post_hook(lambda opt: None)
    assert load_hooks_decline_reason(optimizer) is None
    assert load_hooks_decline_reason(optimizer, allow_post_hooks=False) == (
        "a load_state_dict post-hook is registered and may rewrite the state"
    )
    del optimizer._optimizer_load_state_dict_pre_hooks
    assert load_hooks_decline_reason(optimizer) == "the optimizer's load_state_dict pre-hooks cannot be inspected"


def _accept_any(param: torch.Tensor) -> Optional[str]:
    return None


def _payload(optimizer: torch.optim.Optimizer, entries: Dict[int, Any]) -> Dict[str, Any]:
    return {"state": entries, "param_groups": optimizer.state_dict()["param_groups"]}


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda sd: sd.pop("param_groups"), "the state dict lacks a 'state' mapping or a 'param_groups' list"),
        (lambda sd: sd["param_groups"][0].pop("params"), "param group 0 of the state dict has no 'params' list"),
        (lambda sd: sd["state"].pop(1), "the incoming state does not hold exactly one entry per parameter"),
    ],
    ids=["no groups", "group without params", "missing entry"],
)
def test_structure_reasons_are_exact(change, reason: str) -> None:
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    optimizer = _sgd(*params)
    state_dict = _payload(optimizer, {0: {"m": torch.zeros(2)}, 1: {"m": torch.zeros(3)}})
    change(state_dict)
    assert one_entry_per_param_decline_reason(optimizer, state_dict, _accept_any) == reason


def _uint8_param(size: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(size, dtype=torch.uint8), requires_grad=False)


def _storage_reason(params: List[torch.Tensor], entries: Dict[int, Dict[str, torch.Tensor]]) -> Optional[str]:
    optimizer = _sgd(*params)
    dtypes = {key: tensor.dtype for key, tensor in entries[0].items()}
    return incoming_state_decline_reason(optimizer, _payload(optimizer, entries), _accept_any, lambda p: dtypes)


def test_a_one_byte_moment_aliasing_a_one_byte_parameter_is_declined() -> None:
    param = _uint8_param(1)
    reason = _storage_reason([param], {0: {"m": param.detach()}})
    assert reason == "parameter 0: m shares storage with a parameter or another state tensor"


def test_two_one_byte_moments_sharing_a_storage_are_declined() -> None:
    moment = torch.zeros(1, dtype=torch.uint8)
    reason = _storage_reason([_uint8_param(1)], {0: {"m": moment, "v": moment}})
    assert reason == "parameter 0: v shares storage with a parameter or another state tensor"


def test_zero_element_tensors_share_nothing() -> None:
    """Empty tensors have no storage address to share (PyTorch reports 0 for all of them), and
    an empty view of a buffer aliases none of the buffer's elements."""
    buffer = torch.zeros(8)
    empty_view_param = torch.nn.Parameter(buffer[0:0])
    other_param = torch.nn.Parameter(torch.ones(4))
    entries = {
        0: {"m": torch.zeros(0), "v": torch.zeros(0)},
        1: {"m": buffer[0:4], "v": torch.zeros(4)},
    }
    assert _storage_reason([empty_view_param, other_param], entries) is None


def test_a_context_for_an_owner_without_optional_attributes() -> None:
    optimizer = _sgd(torch.nn.Parameter(torch.ones(2)))
    context = StateExportContext.for_owner(types.SimpleNamespace(optimizer=optimizer))
    assert context == StateExportContext(optimizer, config=None, ddp_config=None, is_stub_optimizer=False)
