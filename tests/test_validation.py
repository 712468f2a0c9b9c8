"""The public checks of ``validation`` and the contexts they read.

Each check returns None when its rule holds and a reason that names the rule otherwise; the
reasons are compared exactly where the wording is what an adopter author reads. Real
``torch.optim`` optimizers throughout (SGD for the incoming-state rules, Adam where state is
held and exported).
"""

import dataclasses
import types
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from builders import Owner, config_with, ddp_config_with
from real_optimizers import cloned

from megatron.core.optimizer.state_adoption import StateAdoptionContext, StateExportContext
from megatron.core.optimizer.state_adoption.validation import (
    ExpectedState,
    exported_state_dict_decline_reason,
    first_decline_reason,
    incoming_state_decline_reason,
    installed_state_decline_reason,
    one_entry_per_param_decline_reason,
    owner_decline_reason,
    param_state_pairs,
    state_entry_decline_reason,
)

SHARES = "shares storage with a parameter or another state tensor"


def _sgd(*params: torch.Tensor) -> torch.optim.SGD:
    return torch.optim.SGD(list(params), lr=0.1)


def _params(*sizes: int) -> List[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(size)) for size in sizes]


def _accept_any(param: torch.Tensor) -> Optional[str]:
    return None


def _payload(optimizer: torch.optim.Optimizer, entries: Dict[int, Any]) -> Dict[str, Any]:
    return {"state": entries, "param_groups": optimizer.state_dict()["param_groups"]}


def _moments(*sizes: int, dtype: torch.dtype = torch.float32) -> Dict[int, Dict[str, torch.Tensor]]:
    return {i: {"m": torch.zeros(size, dtype=dtype), "v": torch.zeros(size, dtype=dtype)} for i, size in enumerate(sizes)}


FP32_MV: ExpectedState = {"m": torch.float32, "v": torch.float32}


def _fp32_mv(param: torch.Tensor) -> ExpectedState:
    return FP32_MV


# --- owner modes -----------------------------------------------------------------------------


def _context(**owner_overrides: Any) -> StateAdoptionContext:
    return StateAdoptionContext.for_owner(Owner(_sgd(*_params(2)), **owner_overrides), state_dict={})


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"is_stub_optimizer": True}, "the DistributedOptimizer is a stub"),
        ({"config": None}, "the owner's OptimizerConfig is unknown"),
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
        ({"ddp_config": types.SimpleNamespace()}, "SimpleNamespace has no 'use_megatron_fsdp'"),
    ],
    ids=["stub", "config unknown", "fsdp", "cpu offload", "precision aware",
         "flag missing", "fsdp flag missing"],  # fmt: skip
)
def test_owner_rules_decline_with_their_exact_reasons(overrides: Dict[str, Any], reason: str) -> None:
    assert owner_decline_reason(_context(**overrides)) == reason


def test_owner_rules_default_to_the_fp32_mode() -> None:
    assert owner_decline_reason(_context()) is None


def test_an_owner_without_a_ddp_config_is_a_non_distributed_optimizer_and_fits() -> None:
    """Float16OptimizerWithFloat16Params and FP32Optimizer have no DDP config: their inner
    optimizer holds the whole state of its parameters, which no DDP mode changes."""
    assert owner_decline_reason(_context(ddp_config=None)) is None
    assert owner_decline_reason(_context(ddp_config=None, config=None)) == "the owner's OptimizerConfig is unknown"


def test_the_megatron_fsdp_rule_comes_first() -> None:
    both = _context(ddp_config=ddp_config_with(use_megatron_fsdp=True), config=config_with(optimizer_cpu_offload=True))
    assert owner_decline_reason(both) == "use_megatron_fsdp is set: Megatron-FSDP manages the state"


def test_megatron_fsdp_fits_only_an_adopter_that_asks_for_it() -> None:
    fsdp = _context(ddp_config=ddp_config_with(use_megatron_fsdp=True))
    assert owner_decline_reason(fsdp) == "use_megatron_fsdp is set: Megatron-FSDP manages the state"
    assert owner_decline_reason(fsdp, megatron_fsdp=True) is None
    assert owner_decline_reason(_context(), megatron_fsdp=True) is None  # and the other modes still
    offloaded = _context(ddp_config=ddp_config_with(use_megatron_fsdp=True), config=config_with(optimizer_cpu_offload=True))
    assert owner_decline_reason(offloaded, megatron_fsdp=True) == "optimizer_cpu_offload is set: the optimizer is CPU-offloaded"
    assert owner_decline_reason(_context(), precision_aware=True) == "use_precision_aware_optimizer is not set"
    aware = types.SimpleNamespace(optimizer_cpu_offload=False, use_precision_aware_optimizer=True)
    assert owner_decline_reason(_context(config=aware), precision_aware=True) is None


def test_owner_rules_read_an_export_context_alike() -> None:
    owner = Owner(_sgd(*_params(2)), is_stub_optimizer=True)
    assert owner_decline_reason(StateExportContext.for_owner(owner)) == "the DistributedOptimizer is a stub"
    assert owner_decline_reason(StateExportContext.for_owner(Owner(owner.optimizer))) is None


# --- chaining checks -------------------------------------------------------------------------


def test_first_decline_reason_stops_at_the_first_reason() -> None:
    ran: List[str] = []

    def check(name: str, reason: Optional[str]) -> Callable[[], Optional[str]]:
        return lambda: (ran.append(name), reason)[1]

    assert first_decline_reason([check("a", None), check("b", "b fails"), check("c", "c fails")]) == "b fails"
    assert ran == ["a", "b"]
    assert first_decline_reason([check("d", None)]) is None and first_decline_reason([]) is None


# --- groups and one entry per parameter ------------------------------------------------------


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda sd: sd.pop("param_groups"), "the state dict lacks a 'state' mapping or a 'param_groups' list"),
        (lambda sd: sd.__setitem__("param_groups", tuple(sd["param_groups"])),
         "the state dict lacks a 'state' mapping or a 'param_groups' list"),
        (lambda sd: sd.pop("state"), "the state dict lacks a 'state' mapping or a 'param_groups' list"),
        (lambda sd: sd["param_groups"][0].pop("params"), "param group 0 of the state dict has no 'params' list"),
        (lambda sd: sd["param_groups"].append({"params": []}), "the state dict has 2 param groups, the optimizer 1"),
        (lambda sd: sd["param_groups"][0]["params"].append(2),
         "param group 0 has 3 params in the state dict, 2 in the optimizer"),
        (lambda sd: sd["state"].pop(1), "parameter 1: has no incoming state"),
        (lambda sd: sd["state"].__setitem__(7, {}), "the incoming state does not hold exactly one entry per parameter"),
    ],
    ids=["no groups", "groups not a list", "no state", "group without params", "group count", "group size",
         "missing entry", "extra entry"],  # fmt: skip
)
def test_structure_reasons_are_exact(change: Callable[[Dict[str, Any]], Any], reason: str) -> None:
    optimizer = _sgd(*_params(2, 3))
    state_dict = _payload(optimizer, _moments(2, 3))
    assert one_entry_per_param_decline_reason(optimizer, state_dict, _accept_any) is None
    change(state_dict)
    assert one_entry_per_param_decline_reason(optimizer, state_dict, _accept_any) == reason


@pytest.mark.parametrize("state_dict", [None, [], "state"], ids=["None", "a list", "a str"])
def test_a_state_dict_that_is_not_a_mapping_is_declined_not_raised(state_dict: Any) -> None:
    """A check never raises on a malformed state dict: it declines, so the own loader runs and
    raises as upstream would."""
    optimizer = _sgd(*_params(2))
    assert one_entry_per_param_decline_reason(optimizer, state_dict, _accept_any) == (
        "the state dict lacks a 'state' mapping or a 'param_groups' list"
    )


def test_a_declined_parameter_is_named_by_its_position() -> None:
    params = _params(2, 3, 4)
    optimizer = _sgd(*params)
    state_dict = _payload(optimizer, _moments(2, 3, 4))

    def only_small(param: torch.Tensor) -> Optional[str]:
        return None if param.numel() < 4 else f"has {param.numel()} elements"

    assert one_entry_per_param_decline_reason(optimizer, state_dict, only_small) == "parameter 2: has 4 elements"


def test_param_state_pairs_pairs_as_pytorchs_loader() -> None:
    """Incoming ids pair with the optimizer's parameters by position, group by group; a
    parameter without incoming state is skipped."""
    params = _params(2, 3, 4)
    optimizer = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=0.1)
    state_dict = optimizer.state_dict()
    state_dict["param_groups"][0]["params"] = [7, 3]
    state_dict["param_groups"][1]["params"] = [5]
    state_dict["state"] = {3: {"m": "second"}, 5: {"m": "third"}}
    pairs = list(param_state_pairs(optimizer, state_dict))
    assert [(index, param is params[index], entry) for index, param, entry in pairs] == [
        (1, True, {"m": "second"}),
        (2, True, {"m": "third"}),
    ]


# --- one pass over the parameters ------------------------------------------------------------


def _several_problems() -> Any:
    """Parameter 1 has an FP64 moment, parameter 2 is declined by the parameter rule and
    parameter 3 has no state; there is an entry for no parameter too."""
    params = _params(2, 3, 4, 5)
    optimizer = _sgd(*params)
    entries = _moments(2, 3, 4)
    entries[1]["v"] = entries[1]["v"].double()
    entries[9] = {"m": torch.zeros(1)}
    return params, optimizer, _payload(optimizer, entries)


def test_validate_in_one_pass_reports_the_first_parameters_problem() -> None:
    """The first problem in parameter order wins, whichever rule it breaks; the state-level
    count rule comes last."""
    params, optimizer, state_dict = _several_problems()

    def decline_the_third(param: torch.Tensor) -> Optional[str]:
        return "is the third" if param is params[2] else None

    assert incoming_state_decline_reason(optimizer, state_dict, decline_the_third, _fp32_mv) == (
        "parameter 1: v is torch.float64, not torch.float32"
    )
    state_dict["state"][1]["v"] = torch.zeros(3)
    assert incoming_state_decline_reason(optimizer, state_dict, decline_the_third, _fp32_mv) == (
        "parameter 2: is the third"
    )
    assert incoming_state_decline_reason(optimizer, state_dict, _accept_any, _fp32_mv) == (
        "parameter 3: has no incoming state"
    )
    state_dict["state"][3] = {"m": torch.zeros(5), "v": torch.zeros(5)}
    assert incoming_state_decline_reason(optimizer, state_dict, _accept_any, _fp32_mv) == (
        "the incoming state does not hold exactly one entry per parameter"
    )
    del state_dict["state"][9]
    assert incoming_state_decline_reason(optimizer, state_dict, _accept_any, _fp32_mv) is None


def test_a_shared_storage_is_found_in_the_same_pass() -> None:
    """Parameter 2's moment aliases parameter 0's; parameter 1's problem comes first."""
    params, optimizer, state_dict = _several_problems()
    buffer = torch.zeros(2 + 4)
    state_dict["state"][0]["m"], state_dict["state"][2]["m"] = buffer[:2], buffer[2:]
    assert incoming_state_decline_reason(optimizer, state_dict, _accept_any, _fp32_mv).startswith("parameter 1: ")
    state_dict["state"][1]["v"] = torch.zeros(3)
    assert incoming_state_decline_reason(optimizer, state_dict, _accept_any, _fp32_mv) == f"parameter 2: m {SHARES}"


def test_each_parameter_rule_runs_once_per_parameter_in_order() -> None:
    params = _params(2, 3, 4, 5)
    optimizer = _sgd(*params)
    state_dict = _payload(optimizer, _moments(2, 3, 4, 5))
    ruled: List[torch.Tensor] = []
    expected: List[torch.Tensor] = []

    def param_rule(param: torch.Tensor) -> Optional[str]:
        ruled.append(param)
        return None

    def expected_state(param: torch.Tensor) -> ExpectedState:
        expected.append(param)
        return FP32_MV

    assert incoming_state_decline_reason(optimizer, state_dict, param_rule, expected_state) is None
    assert [id(p) for p in ruled] == [id(p) for p in expected] == [id(p) for p in params]


def test_the_pass_stops_at_the_first_problem() -> None:
    params, optimizer, state_dict = _several_problems()
    ruled: List[torch.Tensor] = []

    def param_rule(param: torch.Tensor) -> Optional[str]:
        ruled.append(param)
        return None

    assert incoming_state_decline_reason(optimizer, state_dict, param_rule, _fp32_mv).startswith("parameter 1: ")
    assert [id(p) for p in ruled] == [id(p) for p in params[:2]]
    ruled.clear()
    state_dict["param_groups"][0]["params"].pop()
    assert incoming_state_decline_reason(optimizer, state_dict, param_rule, _fp32_mv) == (
        "param group 0 has 3 params in the state dict, 4 in the optimizer"
    )
    assert ruled == []  # the groups are checked before any parameter


# --- one state entry -------------------------------------------------------------------------


def test_state_entry_rules_name_the_state_they_read() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    seen: set = set()
    assert state_entry_decline_reason(param, [1], FP32_MV, seen, label="held") == (
        "the held state is a list, not a dict"
    )
    assert state_entry_decline_reason(param, {"m": torch.zeros(3)}, FP32_MV, seen) == (
        "the incoming state has keys ['m'], not ['m', 'v']"
    )
    entry = {"m": torch.zeros(3), "v": torch.zeros(3)}
    assert state_entry_decline_reason(param, entry, FP32_MV, seen) is None
    assert seen == {t.untyped_storage().data_ptr() for t in entry.values()}
    assert state_entry_decline_reason(param, dict(entry), FP32_MV, seen) == f"m {SHARES}"


def _storage_reason(params: List[torch.Tensor], entries: Dict[int, Dict[str, torch.Tensor]]) -> Optional[str]:
    optimizer = _sgd(*params)
    dtypes = {key: tensor.dtype for key, tensor in entries[0].items()}
    return incoming_state_decline_reason(optimizer, _payload(optimizer, entries), _accept_any, lambda p: dtypes)


def _uint8_param(size: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(size, dtype=torch.uint8), requires_grad=False)


def test_a_one_byte_moment_aliasing_a_one_byte_parameter_is_declined() -> None:
    param = _uint8_param(1)
    assert _storage_reason([param], {0: {"m": param.detach()}}) == f"parameter 0: m {SHARES}"


def test_two_one_byte_moments_sharing_a_storage_are_declined() -> None:
    moment = torch.zeros(1, dtype=torch.uint8)
    assert _storage_reason([_uint8_param(1)], {0: {"m": moment, "v": moment}}) == f"parameter 0: v {SHARES}"


def test_a_moment_in_another_part_of_a_parameters_storage_is_declined() -> None:
    """Storages are compared, not data pointers: a disjoint view of the parameter's buffer
    still shares its storage."""
    buffer = torch.zeros(8)
    param = torch.nn.Parameter(buffer[:4])
    assert _storage_reason([param], {0: {"m": buffer[4:], "v": torch.zeros(4)}}) == f"parameter 0: m {SHARES}"


def test_zero_element_tensors_share_nothing() -> None:
    """Empty tensors have no storage address to share (PyTorch reports 0 for all of them), and
    an empty view of a buffer aliases none of the buffer's elements."""
    buffer = torch.zeros(8)
    empty_view_param = torch.nn.Parameter(buffer[0:0])
    other_param = torch.nn.Parameter(torch.ones(4))
    entries = {0: {"m": torch.zeros(0), "v": torch.zeros(0)}, 1: {"m": buffer[0:4], "v": torch.zeros(4)}}
    assert _storage_reason([empty_view_param, other_param], entries) is None


# --- an export is the held state -------------------------------------------------------------


def _trained_adam(*sizes: int, groups: int = 1) -> torch.optim.Adam:
    params = _params(*sizes)
    cut = len(params) // groups if groups > 1 else len(params)
    param_groups = [{"params": params[:cut]}] + ([{"params": params[cut:], "lr": 0.5}] if groups > 1 else [])
    optimizer = torch.optim.Adam(param_groups, lr=1e-3)
    for step in range(2):
        for param in params:
            param.grad = torch.full_like(param, 0.1 * (step + 1))
        optimizer.step()
    return optimizer


def test_the_optimizers_own_state_dict_is_an_acceptable_export() -> None:
    """PyTorch's ``state_dict()`` packs the held tensors (Adam's 0-d ``step`` included)."""
    optimizer = _trained_adam(3, 3, 4, groups=2)
    assert exported_state_dict_decline_reason(optimizer, optimizer.state_dict()) is None
    fresh = torch.optim.Adam(_params(2))
    assert exported_state_dict_decline_reason(fresh, fresh.state_dict()) is None


def test_hole_1_an_export_with_an_empty_state_is_refused() -> None:
    """Hole 1: an export with the right param_groups but an empty "state" is not the held state."""
    optimizer = _trained_adam(3, 3)
    exported = optimizer.state_dict()
    exported["state"] = {}
    assert exported_state_dict_decline_reason(optimizer, exported) == (
        "it has state for 0 ids ([]), the optimizer holds state for ids [0, 1] (2)"
    )


def test_hole_1_an_export_with_state_permuted_across_parameters_is_refused() -> None:
    """Hole 1: state entries swapped between two parameters of the same shape are not the
    held tensors of either, though keys, shapes, dtypes and devices all match."""
    optimizer = _trained_adam(3, 3)
    exported = optimizer.state_dict()
    exported["state"] = {0: exported["state"][1], 1: exported["state"][0]}
    reason = exported_state_dict_decline_reason(optimizer, exported)
    assert reason is not None and reason.endswith("of parameter 0 is not the held tensor (a copy, or another parameter's state)")


def _exported(change: Callable[[Dict[str, Any], torch.optim.Optimizer], Any]) -> Optional[str]:
    optimizer = _trained_adam(3, 3, 4, groups=2)
    exported = optimizer.state_dict()
    # torch.optim packs the held entry dicts themselves: change copies, not the held state
    exported["state"] = {state_id: dict(entry) for state_id, entry in exported["state"].items()}
    change(exported, optimizer)
    return exported_state_dict_decline_reason(optimizer, exported)


def _copy_one(sd: Dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    sd["state"][2]["exp_avg"] = sd["state"][2]["exp_avg"].clone()


def _renumber(sd: Dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    sd["param_groups"][1]["params"] = [1, 5]
    sd["state"][5] = sd["state"].pop(2)


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda sd, o: sd.__setitem__("extra", 1), "it is not a dict with exactly 'state' and 'param_groups' (got "
                                                   "['extra', 'param_groups', 'state'])"),
        (lambda sd, o: sd.__setitem__("param_groups", tuple(sd["param_groups"])),
         "'param_groups' is not a list or 'state' is not a mapping"),
        (lambda sd, o: sd["param_groups"].pop(), "it has 1 param groups, the optimizer 2"),
        (_renumber, "param group 1 does not list the parameter ids [1, 2]"),
        (lambda sd, o: sd["param_groups"][1].__setitem__("lr", 0.25), "param group 1 has lr=0.25, the optimizer 0.5"),
        (lambda sd, o: sd["param_groups"][0].pop("betas"), "param group 0 has keys"),
        (lambda sd, o: sd["state"].pop(1), "it has state for 2 ids"),
        (_copy_one, "exp_avg of parameter 2 is not the held tensor (a copy, or another parameter's state)"),
        (lambda sd, o: sd["state"][0].__setitem__("exp_avg", sd["state"][0]["exp_avg"].double()),
         "exp_avg of parameter 0 has dtype torch.float64, the held state torch.float32"),
        (lambda sd, o: sd["state"][0].pop("exp_avg_sq"), "the state of parameter 0 has keys ['exp_avg', 'step']"),
        (lambda sd, o: sd["state"][0].__setitem__("extra", 1), "the state of parameter 0 has keys"),
        (lambda sd, o: sd["state"][0].__setitem__("step", sd["state"][0]["step"].item()),
         "step of parameter 0 is a float, not the held Tensor"),
    ],
    ids=["extra key", "groups not a list", "group count", "ids renumbered", "hyper-parameter", "group keys",
         "state missing", "copied tensor", "converted tensor", "key missing", "key added", "value not a tensor"],  # fmt: skip
)
def test_an_export_that_differs_from_the_held_state_is_refused(change: Callable[..., Any], reason: str) -> None:
    found = _exported(change)
    assert found is not None and found.startswith(reason), found


def test_an_alias_of_the_held_tensor_is_the_held_tensor() -> None:
    """Identity is not required: the same storage, offset and strides suffice (e.g. a view)."""
    assert _exported(lambda sd, o: sd["state"][0].__setitem__("exp_avg", sd["state"][0]["exp_avg"].view(3))) is None
    assert _exported(lambda sd, o: sd["state"][0].__setitem__("exp_avg", sd["state"][0]["exp_avg"][1:])) == (
        "exp_avg of parameter 0 has shape torch.Size([2]), the held state torch.Size([3])"
    )


def test_non_tensor_state_must_equal_the_held_value() -> None:
    """A non-tensor held value (here a plain float) must be exported equal, and of its type."""
    optimizer = _trained_adam(3)
    param = optimizer.param_groups[0]["params"][0]
    optimizer.state[param]["scale"] = 0.5
    exported = optimizer.state_dict()
    assert exported_state_dict_decline_reason(optimizer, exported) is None
    exported["state"][0] = {**exported["state"][0], "scale": 0.25}
    assert exported_state_dict_decline_reason(optimizer, exported) == "scale of parameter 0 is 0.25"
    exported["state"][0]["scale"] = torch.tensor(0.5)
    assert exported_state_dict_decline_reason(optimizer, exported) == "scale of parameter 0 is tensor(0.5000)"


def test_state_for_a_parameter_without_held_state_is_refused() -> None:
    optimizer = torch.optim.Adam(_params(2, 3), lr=1e-3)
    exported = optimizer.state_dict()
    exported["state"] = {1: {"step": torch.tensor(1.0)}}
    assert exported_state_dict_decline_reason(optimizer, exported) == (
        "it has state for 1 ids (['1']), the optimizer holds state for ids [] (0)"
    )


def test_an_export_that_is_not_a_mapping_is_refused_with_no_keys_listed() -> None:
    optimizer = _trained_adam(3)
    for exported in (None, [optimizer.state_dict()]):
        assert exported_state_dict_decline_reason(optimizer, exported) == (
            "it is not a dict with exactly 'state' and 'param_groups' (got None)"
        )


def test_a_state_entry_that_is_not_a_mapping_is_refused_and_shown_as_it_is() -> None:
    assert _exported(lambda sd, o: sd["state"].__setitem__(0, None)) == (
        "the state of parameter 0 has keys None, the held ['exp_avg', 'exp_avg_sq', 'step']"
    )


def test_the_ids_a_state_mismatch_names_are_the_first_eight() -> None:
    """With many parameters the reason lists the first eight ids of each side, and the counts."""
    optimizer = _trained_adam(*([2] * 10))
    exported = optimizer.state_dict()
    exported["state"] = {state_id: entry for state_id, entry in exported["state"].items() if state_id != 9}
    assert exported_state_dict_decline_reason(optimizer, exported) == (
        "it has state for 9 ids (['0', '1', '2', '3', '4', '5', '6', '7']), the optimizer holds state "
        "for ids [0, 1, 2, 3, 4, 5, 6, 7] (10)"
    )


def test_an_equal_copy_of_a_hyper_parameter_is_the_held_one() -> None:
    """Hyper-parameters are compared by value (a checkpointed group holds copies)."""
    optimizer = _trained_adam(3, 3, 4, groups=2)
    exported = optimizer.state_dict()
    held_betas = optimizer.param_groups[1]["betas"]
    exported["param_groups"][1]["betas"] = tuple(list(held_betas))
    assert exported["param_groups"][1]["betas"] is not held_betas
    assert exported_state_dict_decline_reason(optimizer, exported) is None


def test_a_hyper_parameter_without_a_usable_equality_is_not_the_held_one() -> None:
    """A list of tensors has no truth value for ==: a copy of it counts as different."""
    optimizer = _trained_adam(3)
    optimizer.param_groups[0]["scales"] = [torch.tensor([1.0, 2.0])]
    exported = optimizer.state_dict()
    assert exported_state_dict_decline_reason(optimizer, exported) is None  # the held list itself
    exported["param_groups"][0]["scales"] = [torch.tensor([1.0, 2.0])]
    assert exported_state_dict_decline_reason(optimizer, exported) == (
        "param group 0 has scales=[tensor([1., 2.])], the optimizer [tensor([1., 2.])]"
    )


def test_any_empty_tensor_of_the_held_dtype_shape_and_device_is_the_held_empty_tensor() -> None:
    """An empty parameter (an empty shard) has empty moments: there is no data to alias, so
    another empty tensor, even an empty view of some buffer, is accepted in their place."""
    optimizer = _trained_adam(3, 0)
    exported = optimizer.state_dict()
    exported["state"][1] = {**exported["state"][1], "exp_avg": torch.zeros(4)[4:]}
    assert exported_state_dict_decline_reason(optimizer, exported) is None


def test_a_copied_one_byte_state_tensor_is_not_the_held_tensor() -> None:
    optimizer = _trained_adam(3)
    optimizer.state[optimizer.param_groups[0]["params"][0]]["found_inf"] = torch.tensor(False)
    exported = optimizer.state_dict()
    assert exported_state_dict_decline_reason(optimizer, exported) is None
    exported["state"][0] = {**exported["state"][0], "found_inf": torch.tensor(False)}
    assert exported_state_dict_decline_reason(optimizer, exported) == (
        "found_inf of parameter 0 is not the held tensor (a copy, or another parameter's state)"
    )


def test_state_held_for_a_tensor_that_is_no_parameter_is_not_part_of_an_export() -> None:
    """Stale state (for a tensor no longer among the parameters) has no id to export under;
    the check leaves it out instead of failing on it."""
    optimizer = _trained_adam(3, 3)
    exported = optimizer.state_dict()
    optimizer.state[torch.zeros(3)] = {"exp_avg": torch.zeros(3)}
    assert exported_state_dict_decline_reason(optimizer, exported) is None


# --- an install is what every loader leaves right --------------------------------------------


def _install(
    change: Callable[[torch.optim.Optimizer, Dict[str, Any]], Any] = lambda optimizer, sd: None,
) -> Optional[str]:
    """Install a trained Adam's state dict into a fresh one with PyTorch's loader, let
    ``change`` spoil the result (or the state dict as given), and check the install."""
    state_dict = cloned(_trained_adam(3, 3, 4, groups=2).state_dict())
    optimizer = _trained_adam(3, 3, 4, groups=2)
    optimizer.state.clear()
    params = [list(group["params"]) for group in optimizer.param_groups]
    torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    change(optimizer, state_dict)
    return installed_state_decline_reason(optimizer, state_dict, params)


def _first_state(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    return optimizer.state[optimizer.param_groups[0]["params"][0]]


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda o, sd: None, None),
        (lambda o, sd: o.param_groups[0]["params"].append(torch.zeros(1)),
         "the param groups do not hold the optimizer's parameters"),
        (lambda o, sd: o.param_groups[1]["params"].__setitem__(0, torch.nn.Parameter(torch.ones(3))),
         "the param groups do not hold the optimizer's parameters"),
        (lambda o, sd: sd["param_groups"][0]["params"].append(9),
         "the state dict's param groups do not match the optimizer's"),
        (lambda o, sd: o.param_groups[1].__setitem__("lr", 0.25), "param group 1 does not have the state dict's lr"),
        (lambda o, sd: o.param_groups[0].pop("betas"), "param group 0 does not have the state dict's betas"),
        (lambda o, sd: o.state.__setitem__(torch.zeros(3), {"exp_avg": torch.zeros(3)}),
         "there is state for a tensor that is no parameter of the optimizer"),
        (lambda o, sd: sd["state"].pop(2), "parameter 2 has state, the state dict none"),
        (lambda o, sd: o.state.pop(o.param_groups[1]["params"][0]), "parameter 1 has no state"),
        (lambda o, sd: _first_state(o).pop("exp_avg"),
         "the state of parameter 0 has keys ['exp_avg_sq', 'step'], the state dict ['exp_avg', 'exp_avg_sq', 'step']"),
        (lambda o, sd: _first_state(o).__setitem__("extra", torch.zeros(1)),
         "the state of parameter 0 has keys ['exp_avg', 'exp_avg_sq', 'extra', 'step'], the state dict "
         "['exp_avg', 'exp_avg_sq', 'step']"),
    ],
    ids=["as installed", "a parameter added", "a parameter replaced", "state dict groups", "hyper-parameter changed",
         "hyper-parameter missing", "state for no parameter", "state without incoming state", "state missing",
         "key missing", "key added"],  # fmt: skip
)
def test_an_install_that_breaks_what_every_loader_keeps_is_named_exactly(
    change: Callable[[torch.optim.Optimizer, Dict[str, Any]], Any], reason: Optional[str]
) -> None:
    assert _install(change) == reason


def test_an_install_may_skip_the_keys_whose_incoming_value_is_none() -> None:
    """TE's loader skips None values: such a key may be absent after the install, or present."""

    def give_none(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        state_dict["state"][0]["scale"] = None

    assert _install(give_none) is None

    def give_none_and_install_it(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        give_none(optimizer, state_dict)
        _first_state(optimizer)["scale"] = None

    assert _install(give_none_and_install_it) is None


# --- the contexts ----------------------------------------------------------------------------


def test_a_context_for_an_owner_without_optional_attributes() -> None:
    optimizer = _sgd(*_params(2))
    context = StateExportContext.for_owner(types.SimpleNamespace(optimizer=optimizer))
    assert context == StateExportContext(optimizer=optimizer, config=None, ddp_config=None, is_stub_optimizer=False)


def test_contexts_are_frozen_keyword_only_and_the_adoption_one_extends_the_export_one() -> None:
    optimizer = _sgd(*_params(2))
    context = StateAdoptionContext.for_owner(Owner(optimizer), state_dict={"state": {}, "param_groups": []})
    assert isinstance(context, StateExportContext)
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.optimizer = optimizer  # type: ignore[misc]
    with pytest.raises(TypeError):
        StateExportContext(optimizer)  # type: ignore[misc]
    with pytest.raises(TypeError):
        StateAdoptionContext(optimizer=optimizer)  # type: ignore[call-arg]
