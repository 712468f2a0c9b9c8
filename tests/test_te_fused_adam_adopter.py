"""The default adopter: every eligibility rule, the TE releases it knows, the by-reference install.

TE's FusedAdam cannot load without a GPU, so these tests use ``FusedAdamStandIn``, which
reproduces FusedAdam's allocate-and-copy loader (see tests/fused_adam_standin.py). Where TE's
modules are looked up in ``sys.modules``, the test puts a module object there. Loads go through
the real loader with an isolated registry (the ``registry`` fixture: only the stand-in adopter),
so what an adoption installed is what the loader *measured*.

The rules every adopter gets from the loader without asking (load hooks, a ``load_state_dict``
set on the instance, the switches) are the loader's tests, not these.
"""

import sys
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from builders import (
    load_through,
    Owner,
    assert_bitwise_equal,
    cloned_state_dict,
    config_with,
    ddp_config_with,
    fresh_standin,
    make_context,
    numel_bytes,
    set_grads,
    standin_adopter,
    standin_registry,
    state_tensors,
    trained_standin,
)
from fused_adam_standin import FusedAdamStandIn
from packaging.version import Version

from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    StateAdoptionContext,
    StateAdoptionOutcome,
    load_inner_optimizer_state_dict,
)
from megatron.core.optimizer.state_adoption import te_fused_adam
from megatron.core.optimizer.state_adoption.te_fused_adam import (
    TEFusedAdamFP32StateAdopter,
    te_fused_adam_decline_reason,
)
from megatron.core.optimizer.state_adoption.testing import (
    assert_adoption_matches_own_loader,
    assert_check_is_side_effect_free,
)

NAME = TEFusedAdamFP32StateAdopter.name
TE_FUSED_ADAM_MODULE = "transformer_engine.pytorch.optimizers.fused_adam"
#: FusedAdam's methods that allocate, scale or expose state (TE 1.13 to 2.20).
TE_STATE_METHODS = (
    "load_state_dict",
    "state_dict",
    "initialize_state",
    "_initialize_state",
    "set_scaled_state",
    "get_unscaled_state",
    "_apply_scale",
)
OWNER_KWARGS = {"config": config_with(), "ddp_config": ddp_config_with()}


def _eligible() -> Tuple[FusedAdamStandIn, Dict[str, Any]]:
    """A fresh optimizer and a cloned payload from a trained one: MCore's first pass."""
    return fresh_standin(), cloned_state_dict(trained_standin())


def params_of(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The optimizer's parameters in order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def _incoming_moments(state_dict: Dict[str, Any]) -> List[torch.Tensor]:
    """The incoming moments in parameter order, then key order (as ``state_tensors``)."""
    return [state_dict["state"][i][k] for i in sorted(state_dict["state"]) for k in ("exp_avg", "exp_avg_sq")]


# --- adoption by reference, measured by the loader --------------------------------------------


def test_accepts_the_standard_fp32_configuration() -> None:
    optimizer, state_dict = _eligible()
    assert assert_check_is_side_effect_free(standin_adopter(), make_context(optimizer, state_dict)) is None
    assert optimizer.allocations == 0 and len(optimizer.state) == 0


@pytest.mark.parametrize(
    "owner",
    [{"ddp_config": None}, {"ddp_config": ddp_config_with(use_megatron_fsdp=True)}],
    ids=["non-distributed owner (no DDP config)", "Megatron-FSDP owner"],
)
def test_accepts_fp32_moments_at_every_call_site(owner: Dict[str, Any]) -> None:
    """FP32Optimizer/Float16OptimizerWithFloat16Params (no DDP config) and Megatron-FSDP hand
    the loader the same FP32 moments; whether they are DTensors is a rule of their own."""
    optimizer, state_dict = _eligible()
    assert standin_adopter().decline_reason(make_context(optimizer, state_dict, **owner)) is None


def test_the_loader_measures_moments_installed_by_reference(registry: StateAdopterRegistry) -> None:
    """Hole 6: the saving was the adopter's claim; the loader now measures it from storage
    identity (8 B x params installed by reference, none allocated) and names the optimizer."""
    optimizer, state_dict = _eligible()
    incoming = _incoming_moments(state_dict)
    expected_values = [t.clone() for t in incoming]
    outcome = load_through(optimizer, state_dict, registry)
    assert (outcome.hook_point, outcome.adopter, outcome.method, outcome.error) == ("load", NAME, None, None)
    assert outcome.reused_bytes == numel_bytes(optimizer, per_element=8)
    assert outcome.allocated_bytes == 0 and outcome.declines == () and outcome.fallback_reason is None
    assert outcome.optimizer.startswith(f"FusedAdamStandIn {id(optimizer):#x} (4 params, ")
    installed = state_tensors(optimizer)
    assert all(a is b for a, b in zip(installed, incoming)) and len(installed) == len(incoming)
    assert optimizer.allocations == 0
    assert_bitwise_equal(installed, expected_values)


def test_the_stand_ins_own_loader_is_measured_as_a_second_copy(empty_registry: StateAdopterRegistry) -> None:
    """The problem being solved, seen through the same measurement: TE's loader allocates
    every moment again (8 B per parameter) while the caller still holds the incoming ones."""
    optimizer, state_dict = _eligible()
    outcome = load_through(optimizer, state_dict, empty_registry)
    assert (outcome.adopter, outcome.method) == (None, "FusedAdamStandIn.load_state_dict")
    assert outcome.reused_bytes == 0
    assert outcome.allocated_bytes == numel_bytes(optimizer, per_element=8)
    assert optimizer.allocations == 2 * len(params_of(optimizer))


def test_adoption_matches_the_stand_ins_own_loader_and_its_next_step(registry: StateAdopterRegistry) -> None:
    trained = trained_standin()
    adopted, by_te = fresh_standin(), fresh_standin()
    assert load_through(adopted, cloned_state_dict(trained), registry).adopter == NAME
    by_te.load_state_dict(cloned_state_dict(trained))
    assert by_te.allocations == 2 * len(params_of(by_te)) and adopted.allocations == 0
    assert_bitwise_equal(state_tensors(adopted), state_tensors(by_te))
    assert [{k: v for k, v in g.items() if k != "params"} for g in adopted.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in by_te.param_groups
    ]
    for optimizer in (adopted, by_te):
        set_grads(params_of(optimizer), step=2)
        optimizer.step()
    assert_bitwise_equal(params_of(adopted), params_of(by_te))
    assert_bitwise_equal(state_tensors(adopted), state_tensors(by_te))


def test_the_public_conformance_helper_accepts_the_adopter() -> None:
    trained = trained_standin()
    outcome = assert_adoption_matches_own_loader(
        standin_adopter(), fresh_standin, lambda: cloned_state_dict(trained), OWNER_KWARGS
    )
    assert outcome.adopter == NAME and outcome.allocated_bytes == 0
    assert outcome.reused_bytes == numel_bytes(fresh_standin(), per_element=8)


def test_adoption_installs_group_hyper_parameters_including_step(registry: StateAdopterRegistry) -> None:
    optimizer, state_dict = _eligible()
    state_dict["param_groups"][1]["lr"] = 0.123
    load_through(optimizer, state_dict, registry)
    assert [g["step"] for g in optimizer.param_groups] == [2, 2]
    assert optimizer.param_groups[1]["lr"] == 0.123
    assert optimizer.param_groups[1]["params"][0] is params_of(optimizer)[2]


def test_second_pass_readopts_the_optimizers_own_tensors(registry: StateAdopterRegistry) -> None:
    """MCore's second load hands the optimizer its own current state tensors back: they existed
    before the call, so they count as reused."""
    optimizer = trained_standin()
    before = state_tensors(optimizer)
    lazy_allocations = optimizer.allocations  # the first step's
    outcome = load_through(optimizer, optimizer.state_dict(), registry)
    assert outcome.adopter == NAME and outcome.allocated_bytes == 0
    assert outcome.reused_bytes == numel_bytes(optimizer, per_element=8)
    assert all(a is b for a, b in zip(state_tensors(optimizer), before))
    assert optimizer.allocations == lazy_allocations == len(before)


def test_adopt_itself_runs_only_pytorchs_loader() -> None:
    """``adopt`` returns nothing (the loader measures) and skips TE's re-allocation."""
    optimizer, state_dict = _eligible()
    incoming = _incoming_moments(state_dict)
    assert standin_adopter().adopt(make_context(optimizer, state_dict)) is None  # type: ignore[func-returns-value]
    assert all(a is b for a, b in zip(state_tensors(optimizer), incoming)) and optimizer.allocations == 0


def test_a_te_module_that_is_loaded_is_where_the_class_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``fused_adam_class``, the adopter finds TE's FusedAdam among the imported modules
    (here: a module object standing in) and never imports TE itself."""
    fake_module = types.ModuleType(TE_FUSED_ADAM_MODULE)
    fake_module.FusedAdam = FusedAdamStandIn  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, TE_FUSED_ADAM_MODULE, fake_module)
    context = make_context(*_eligible())
    assert TEFusedAdamFP32StateAdopter(te_version="2.20.0").decline_reason(context) == (
        "parameter 0: is on cpu, not on cuda"
    )
    assert TEFusedAdamFP32StateAdopter(param_device_type="cpu", te_version="2.20.0").decline_reason(context) is None


def test_a_fused_adam_attribute_that_is_not_a_class_counts_as_te_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module whose ``FusedAdam`` is, e.g., a factory function is not TE's optimizer module."""
    module = types.ModuleType(TE_FUSED_ADAM_MODULE)
    module.FusedAdam = lambda *args, **kwargs: FusedAdamStandIn(*args, **kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, TE_FUSED_ADAM_MODULE, module)
    adopter = TEFusedAdamFP32StateAdopter(param_device_type="cpu")
    assert adopter.decline_reason(make_context(*_eligible())) == "Transformer Engine's FusedAdam is not loaded"


def test_the_adopter_shows_its_class_and_name() -> None:
    """What a listing of the registrations (or a registry error) prints for it."""
    shown = "TEFusedAdamFP32StateAdopter(name='te_fused_adam_fp32')"
    assert repr(TEFusedAdamFP32StateAdopter()) == repr(standin_adopter()) == shown
    (registration,) = StateAdopterRegistry(built_in=(standin_adopter(),), entry_point_group=None).registrations()
    assert f"adopter={shown}" in repr(registration)


def test_context_for_owner_reads_the_owner() -> None:
    optimizer, state_dict = _eligible()
    owner = Owner(optimizer, is_stub_optimizer=True)
    context = StateAdoptionContext.for_owner(owner, state_dict=state_dict)
    assert context.optimizer is optimizer and context.config is owner.config
    assert context.ddp_config is owner.ddp_config and context.is_stub_optimizer is True
    assert context.state_dict is state_dict


# --- one case per eligibility rule --------------------------------------------------------------

Case = Callable[[], Tuple[StateAdoptionContext, TEFusedAdamFP32StateAdopter]]


def _with_state(mutate: Callable[[Dict[str, Any], FusedAdamStandIn], None]) -> Case:
    """A case whose incoming state dict (or optimizer) is changed by ``mutate``."""

    def build() -> Tuple[StateAdoptionContext, TEFusedAdamFP32StateAdopter]:
        optimizer, state_dict = _eligible()
        mutate(state_dict, optimizer)
        return make_context(optimizer, state_dict), standin_adopter()

    return build


def _with_owner(**overrides: Any) -> Case:
    def build() -> Tuple[StateAdoptionContext, TEFusedAdamFP32StateAdopter]:
        optimizer, state_dict = _eligible()
        return make_context(optimizer, state_dict, **overrides), standin_adopter()

    return build


def _with_optimizer(
    factory: Callable[[], torch.optim.Optimizer], adopter: Optional[TEFusedAdamFP32StateAdopter] = None
) -> Case:
    def build() -> Tuple[StateAdoptionContext, TEFusedAdamFP32StateAdopter]:
        state_dict = cloned_state_dict(trained_standin())
        return make_context(factory(), state_dict), adopter or standin_adopter()

    return build


def _moment(index: int, key: str, value: Callable[[torch.Tensor], Any]) -> Callable[[Dict[str, Any], Any], None]:
    def mutate(state_dict: Dict[str, Any], optimizer: FusedAdamStandIn) -> None:
        state_dict["state"][index][key] = value(state_dict["state"][index][key])

    return mutate


def _views_of_one_buffer(state_dict: Dict[str, Any], optimizer: FusedAdamStandIn) -> None:
    """Parameters 2 and 3 get exp_avg views of one flat buffer."""
    buffer = torch.zeros(7 + 33)
    state_dict["state"][2]["exp_avg"] = buffer[:7]
    state_dict["state"][3]["exp_avg"] = buffer[7:]


class _TaggedTensor(torch.Tensor):
    """A tensor subclass, as DTensor or TE's QuantizedTensor are."""


def _overriding(method: str) -> Callable[[], torch.optim.Optimizer]:
    subclass = type("Sub", (FusedAdamStandIn,), {method: lambda self, *a, **k: None})
    return lambda: subclass(params_of(fresh_standin()))


def _instance_with_own(method: str) -> Callable[[], torch.optim.Optimizer]:
    def factory() -> torch.optim.Optimizer:
        optimizer = fresh_standin()
        setattr(optimizer, method, types.MethodType(getattr(FusedAdamStandIn, method, lambda self: None), optimizer))
        return optimizer

    return factory


def _changed(change: Callable[[FusedAdamStandIn], None]) -> Callable[[], torch.optim.Optimizer]:
    def factory() -> torch.optim.Optimizer:
        optimizer = fresh_standin()
        change(optimizer)
        return optimizer

    return factory


def _replace_param(value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[FusedAdamStandIn], None]:
    def change(optimizer: FusedAdamStandIn) -> None:
        optimizer.param_groups[0]["params"][0] = value(optimizer.param_groups[0]["params"][0])

    return change


def _dtype_map(**dtypes: Any) -> Callable[[FusedAdamStandIn], None]:
    def change(optimizer: FusedAdamStandIn) -> None:
        optimizer.name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, **dtypes}

    return change


OWNER_CASES = {
    "stub owner": (_with_owner(is_stub_optimizer=True), "the DistributedOptimizer is a stub"),
    "config unknown": (_with_owner(config=None), "the owner's OptimizerConfig is unknown"),
    "cpu offload": (
        _with_owner(config=config_with(optimizer_cpu_offload=True)),
        "optimizer_cpu_offload is set: the optimizer is CPU-offloaded",
    ),
    "precision aware": (
        _with_owner(config=types.SimpleNamespace(optimizer_cpu_offload=False, use_precision_aware_optimizer=True)),
        "use_precision_aware_optimizer is set: the optimizer is precision-aware",
    ),
    "config API drift": (
        _with_owner(config=types.SimpleNamespace(optimizer_cpu_offload=False)),
        "SimpleNamespace has no 'use_precision_aware_optimizer'",
    ),
}

OPTIMIZER_CASES = {
    "TE absent": (
        _with_optimizer(fresh_standin, TEFusedAdamFP32StateAdopter()),
        "Transformer Engine's FusedAdam is not loaded",
    ),
    "not FusedAdam": (
        _with_optimizer(lambda: torch.optim.Adam(params_of(fresh_standin()))),
        "the inner optimizer is Adam, not FusedAdam",
    ),
    **{
        f"subclass overrides {method}": (_with_optimizer(_overriding(method)), f"Sub overrides FusedAdam.{method}")
        for method in TE_STATE_METHODS
    },
    **{
        f"instance has its own {method}": (
            _with_optimizer(_instance_with_own(method)),
            f"the FusedAdamStandIn instance has its own {method}",
        )
        for method in TE_STATE_METHODS
    },
    "master weights": (_with_optimizer(lambda: fresh_standin(master_weights=True)), "FusedAdam.master_weights is set"),
    "TE API drift: master_weights": (
        _with_optimizer(_changed(lambda o: delattr(o, "master_weights"))),
        "FusedAdam has no 'master_weights' attribute",
    ),
    "param remainders": (
        _with_optimizer(_changed(lambda o: setattr(o, "store_param_remainders", True))),
        "FusedAdam.store_param_remainders is set",
    ),
    "bf16 exp_avg": (
        _with_optimizer(lambda: fresh_standin(exp_avg_dtype=torch.bfloat16)),
        "FusedAdam keeps exp_avg in torch.bfloat16, not torch.float32",
    ),
    "fp16 exp_avg_sq": (
        _with_optimizer(lambda: fresh_standin(exp_avg_sq_dtype=torch.float16)),
        "FusedAdam keeps exp_avg_sq in torch.float16, not torch.float32",
    ),
    "dtype map without exp_avg_sq": (
        _with_optimizer(_changed(lambda o: o.name_to_dtype_map.pop("exp_avg_sq"))),
        "FusedAdam keeps exp_avg_sq in None, not torch.float32",
    ),
    "dtype map entry equal to but not torch.float32": (
        _with_optimizer(_changed(_dtype_map(exp_avg="torch.float32"))),
        "FusedAdam keeps exp_avg in torch.float32, not torch.float32",
    ),
    "TE API drift: no dtype map": (
        _with_optimizer(_changed(lambda o: delattr(o, "name_to_dtype_map"))),
        "FusedAdam has no 'name_to_dtype_map'",
    ),
    "dtype map not a mapping": (
        _with_optimizer(_changed(lambda o: setattr(o, "name_to_dtype_map", [("exp_avg", torch.float32)]))),
        "FusedAdam has no 'name_to_dtype_map'",
    ),
}

PARAM_CASES = {
    "param on cpu, cuda required": (
        _with_optimizer(fresh_standin, standin_adopter(param_device_type="cuda")),
        "parameter 0: is on cpu, not on cuda",
    ),
    "bf16 param": (
        _with_optimizer(_changed(_replace_param(lambda p: torch.nn.Parameter(p.detach().bfloat16())))),
        "parameter 0: is torch.bfloat16, not torch.float32",
    ),
    "fp64 param": (
        _with_optimizer(_changed(_replace_param(lambda p: torch.nn.Parameter(p.detach().double())))),
        "parameter 0: is torch.float64, not torch.float32",
    ),
    "tensor-subclass param": (
        _with_optimizer(_changed(_replace_param(lambda p: p.detach().as_subclass(_TaggedTensor)))),
        "parameter 0: is a _TaggedTensor, not a plain tensor or a DTensor of one",
    ),
}

INCOMING_CASES = {
    "group count": (
        _with_state(lambda sd, o: sd["param_groups"].pop()),
        "the state dict has 1 param groups, the optimizer 2",
    ),
    "group size": (
        _with_state(lambda sd, o: sd["param_groups"][0]["params"].pop()),
        "param group 0 has 1 params in the state dict, 2 in the optimizer",
    ),
    "group without params": (
        _with_state(lambda sd, o: sd["param_groups"][1].pop("params")),
        "param group 1 of the state dict has no 'params' list",
    ),
    "no state": (
        _with_state(lambda sd, o: sd.pop("state")),
        "the state dict lacks a 'state' mapping or a 'param_groups' list",
    ),
    "state not a mapping": (
        _with_state(lambda sd, o: sd.__setitem__("state", list(sd["state"].values()))),
        "the state dict lacks a 'state' mapping or a 'param_groups' list",
    ),
    "param without state": (_with_state(lambda sd, o: sd["state"].pop(3)), "parameter 3: has no incoming state"),
    "state for unknown param": (
        _with_state(lambda sd, o: sd["state"].__setitem__(99, sd["state"][0])),
        "the incoming state does not hold exactly one entry per parameter",
    ),
    "extra step key": (
        _with_state(lambda sd, o: sd["state"][1].__setitem__("step", torch.tensor(2.0))),
        "parameter 1: the incoming state has keys ['exp_avg', 'exp_avg_sq', 'step'], not ['exp_avg', 'exp_avg_sq']",
    ),
    "extra master_param key": (
        _with_state(lambda sd, o: sd["state"][1].__setitem__("master_param", sd["state"][1]["exp_avg"].clone())),
        "parameter 1: the incoming state has keys ['exp_avg', 'exp_avg_sq', 'master_param']",
    ),
    "missing exp_avg_sq": (
        _with_state(lambda sd, o: sd["state"][2].pop("exp_avg_sq")),
        "parameter 2: the incoming state has keys ['exp_avg'], not ['exp_avg', 'exp_avg_sq']",
    ),
    "state not a dict": (
        _with_state(lambda sd, o: sd["state"].__setitem__(0, [1, 2])),
        "parameter 0: the incoming state is a list, not a dict",
    ),
    **{
        f"{dtype} exp_avg": (
            _with_state(_moment(0, "exp_avg", lambda t, d=dtype: t.to(d))),
            f"parameter 0: exp_avg is {dtype}, not torch.float32",
        )
        for dtype in (torch.bfloat16, torch.float16, torch.float64)
    },
    "moment not a tensor": (
        _with_state(_moment(0, "exp_avg_sq", lambda t: t.tolist())),
        "parameter 0: exp_avg_sq is a list, not a plain torch.Tensor",
    ),
    "moment on another device": (
        _with_state(_moment(1, "exp_avg_sq", lambda t: torch.empty(t.shape, device="meta"))),
        "parameter 1: exp_avg_sq is on meta, the parameter on cpu",
    ),
    "moment of wrong shape": (
        _with_state(_moment(1, "exp_avg", lambda t: t.flatten())),
        "parameter 1: exp_avg has shape (128,), the parameter (16, 8)",
    ),
    "non-contiguous moment": (
        _with_state(_moment(1, "exp_avg", lambda t: t.t().contiguous().t())),
        "parameter 1: exp_avg is not contiguous",
    ),
    "moment requiring grad": (
        _with_state(_moment(0, "exp_avg", lambda t: t.clone().requires_grad_())),
        "parameter 0: exp_avg requires grad",
    ),
    "tensor-subclass moment (DTensor-like)": (
        _with_state(_moment(0, "exp_avg", lambda t: t.as_subclass(_TaggedTensor))),
        "parameter 0: exp_avg is a _TaggedTensor, not a plain torch.Tensor",
    ),
    "quantized moment": (
        _with_state(_moment(0, "exp_avg", lambda t: torch.quantize_per_tensor(t, 0.1, 0, torch.qint8))),
        "parameter 0: exp_avg is quantized",
    ),
    "sparse moment": (
        _with_state(_moment(0, "exp_avg", lambda t: t.to_sparse())),
        "parameter 0: exp_avg has layout torch.sparse_coo, not torch.strided",
    ),
    "moments share storage": (
        _with_state(lambda sd, o: sd["state"][0].__setitem__("exp_avg_sq", sd["state"][0]["exp_avg"])),
        "parameter 0: exp_avg_sq shares storage with a parameter or another state tensor",
    ),
    "moment aliases a parameter": (
        _with_state(lambda sd, o: sd["state"][2].__setitem__("exp_avg", params_of(o)[2].detach())),
        "parameter 2: exp_avg shares storage with a parameter or another state tensor",
    ),
    "moment aliases another parameter's moment": (
        _with_state(_views_of_one_buffer),
        "parameter 3: exp_avg shares storage with a parameter or another state tensor",
    ),
}

DECLINE_CASES = {**OWNER_CASES, **OPTIMIZER_CASES, **PARAM_CASES, **INCOMING_CASES}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("case", sorted(DECLINE_CASES))
def test_declines_with_the_reason_that_names_the_rule(case: str) -> None:
    build, expected_reason = DECLINE_CASES[case]
    context, adopter = build()
    if _well_formed(context.state_dict):
        reason = assert_check_is_side_effect_free(adopter, context)
    else:  # the helper snapshots the incoming entries, which these cases do not have
        reason = adopter.decline_reason(context)
    assert reason is not None and reason.startswith(expected_reason), reason


def _well_formed(state_dict: Any) -> bool:
    state = state_dict.get("state")
    return isinstance(state, dict) and all(isinstance(entry, dict) for entry in state.values())


def test_the_optimizer_rules_also_hold_for_the_public_class_check() -> None:
    """``te_fused_adam_decline_reason`` is the class/instance rule alone, for plugin authors."""
    assert te_fused_adam_decline_reason(fresh_standin(), FusedAdamStandIn) is None
    assert te_fused_adam_decline_reason(fresh_standin()) == "Transformer Engine's FusedAdam is not loaded"
    assert te_fused_adam_decline_reason(_overriding("_apply_scale")(), FusedAdamStandIn) == (
        "Sub overrides FusedAdam._apply_scale"
    )
    assert te_fused_adam_decline_reason(_instance_with_own("set_scaled_state")(), FusedAdamStandIn) == (
        "the FusedAdamStandIn instance has its own set_scaled_state"
    )


def test_an_instance_set_te_state_method_runs_in_the_own_loader(registry: StateAdopterRegistry) -> None:
    """A wrapper's ``set_scaled_state`` on the instance is what TE's loader calls for every
    moment; the adopter declines, so it runs as upstream runs it."""
    optimizer, state_dict = _eligible()
    calls: List[str] = []

    def set_scaled_state(self: FusedAdamStandIn, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
        calls.append(name)
        FusedAdamStandIn.set_scaled_state(self, param, name, value)

    optimizer.set_scaled_state = types.MethodType(set_scaled_state, optimizer)  # type: ignore[method-assign]
    outcome = load_through(optimizer, state_dict, registry)
    assert outcome.adopter is None and outcome.method == "FusedAdamStandIn.load_state_dict"
    assert outcome.declines == ((NAME, "the FusedAdamStandIn instance has its own set_scaled_state"),)
    assert calls == ["exp_avg", "exp_avg_sq"] * len(params_of(optimizer))


@pytest.mark.parametrize(
    "case", ["master weights", "bf16 exp_avg", "moments share storage", "stub owner", "param remainders"]
)
def test_declined_state_is_loaded_by_the_optimizers_own_loader(case: str, registry: StateAdopterRegistry) -> None:
    build, expected_reason = DECLINE_CASES[case]
    context, _ = build()
    optimizer = context.optimizer
    owner = Owner(optimizer, context.config, context.ddp_config, context.is_stub_optimizer)
    outcome = load_inner_optimizer_state_dict(owner, dict(context.state_dict), registry=registry)
    assert outcome.adopter is None and outcome.fallback_reason == "every adopter declined"
    assert [name for name, _ in outcome.declines] == [NAME]
    assert outcome.declines[0][1].startswith(expected_reason)
    incoming = context.state_dict["state"]
    assert optimizer.allocations == sum(len(s) for s in incoming.values())
    assert outcome.reused_bytes == 0 and outcome.allocated_bytes == sum(
        t.nbytes for s in optimizer.state.values() for t in s.values()
    )
    for index, param in enumerate(params_of(optimizer)):
        for key, value in incoming[index].items():
            installed = optimizer.state[param][key]
            assert installed is not value
            assert torch.equal(installed, value.to(installed.dtype))


def test_declined_per_param_step_reaches_te_loader_which_raises_as_upstream(registry: StateAdopterRegistry) -> None:
    """A per-parameter 'step' (MCore adds one without Apex/TE) is not TE's format: TE raises,
    exactly as upstream, and the outcome records the error."""
    build, _ = DECLINE_CASES["extra step key"]
    context, _ = build()
    with pytest.raises(KeyError, match="step"):
        fresh_standin().load_state_dict(cloned_state_dict_of(context))
    outcomes: List[StateAdoptionOutcome] = []
    registry.register_outcome_hook(outcomes.append)
    with pytest.raises(KeyError, match="step"):
        load_through(fresh_standin(), cloned_state_dict_of(context), registry)
    (outcome,) = outcomes
    assert outcome.adopter is None and outcome.error is not None and outcome.error.startswith("KeyError")
    assert outcome.declines[0][0] == NAME and "'step'" in outcome.declines[0][1]


def cloned_state_dict_of(context: StateAdoptionContext) -> Dict[str, Any]:
    """A copy of the context's state dict (containers copied, tensors cloned)."""
    return {
        "state": {k: {n: v.clone() for n, v in s.items()} for k, s in context.state_dict["state"].items()},
        "param_groups": [dict(g, params=list(g["params"])) for g in context.state_dict["param_groups"]],
    }


# --- Transformer Engine releases ----------------------------------------------------------------

#: A FusedAdam without ``store_param_remainders`` (TE 1.13, 1.14 and 2.0 have none).
WITHOUT_REMAINDERS = (2, 0)


def _release_reason(te_version: Optional[str], te_release: Tuple[int, int] = WITHOUT_REMAINDERS) -> Optional[str]:
    adopter = TEFusedAdamFP32StateAdopter(FusedAdamStandIn, param_device_type="cpu", te_version=te_version)
    context = make_context(fresh_standin(te_release=te_release), cloned_state_dict(trained_standin()))
    return adopter.decline_reason(context)


@pytest.mark.parametrize(
    "te_version", ["1.13.0", "1.13.0.dev0", "1.13.0rc1", "1.14.0+abc123", "2.0.0", "2.0.0.post1", "2.0.0.dev0+cu12"]
)
def test_a_release_without_remainder_mode_may_lack_the_attribute(te_version: str) -> None:
    """1.13 (dev builds included) to 2.0 have no ``store_param_remainders``: absent means off."""
    assert _release_reason(te_version) is None


@pytest.mark.parametrize("te_version", ["2.1.0", "2.1.0.dev0", "2.1.0rc0", "2.1.0.dev0+d4a2b1c", "2.20.0", "3.0"])
def test_a_release_with_remainder_mode_must_have_the_attribute(te_version: str) -> None:
    """From 2.1 on (2.1's dev builds included) TE always sets it: a FusedAdam without it is not
    one the adopter knows."""
    assert _release_reason(te_version) == (
        f"FusedAdam has no 'store_param_remainders' attribute, which Transformer Engine "
        f"{Version(te_version)} always sets"
    )


@pytest.mark.parametrize("te_version", ["1.12.0", "1.12.99+local", "1.0", "0.0.0"])
def test_a_release_before_1_13_declines(te_version: str) -> None:
    assert _release_reason(te_version) == (
        f"Transformer Engine {Version(te_version)} predates 1.13, the first release whose FusedAdam "
        "this adopter knows"
    )


def test_dev_builds_compare_as_their_release() -> None:
    """The boundaries are the first dev builds: 1.13.0.dev0 is 1.13, 1.12's last build is not."""
    assert _release_reason("1.13.0.dev0") is None
    assert _release_reason("1.12.0.post9") is not None
    assert _release_reason("2.1.0.dev0") is not None
    assert _release_reason("2.0.99") is None


@pytest.mark.parametrize("te_version", ["2.20.0", "1.12.0", "2.0.0"])
def test_a_fused_adam_with_remainders_off_is_accepted_in_its_releases(te_version: str) -> None:
    """With the attribute present and False, the release does not matter (TE set it)."""
    assert _release_reason(te_version, te_release=(2, 20)) is None


def test_the_default_release_is_megatron_cores_te_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``te_version`` the adopter asks ``megatron.core.utils.get_te_version()`` at check
    time; where TE is not installed that is 0.0.0, which predates 1.13."""
    asked: List[str] = []

    def get_te_version(release: str) -> Callable[[], Version]:
        return lambda: (asked.append(release), Version(release))[1]

    for release, accepted in (("2.0.0", True), ("2.1.0.dev0", False), ("0.0.0", False)):
        monkeypatch.setattr(te_fused_adam, "get_te_version", get_te_version(release))
        assert (_release_reason(None) is None) is accepted, release
    assert asked == ["2.0.0", "2.1.0.dev0", "0.0.0"]


@pytest.mark.parametrize("te_version", ["banana", "2.x", "(2, 0)"])
def test_an_invalid_te_version_is_a_decline_and_the_own_loader_runs(
    te_version: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A version string that is not a version leaves the release unknown: without
    ``store_param_remainders`` that declines, quietly, and TE's loader runs."""
    adopter = TEFusedAdamFP32StateAdopter(FusedAdamStandIn, param_device_type="cpu", te_version=te_version)
    optimizer = fresh_standin(te_release=WITHOUT_REMAINDERS)
    outcome = load_through(optimizer, cloned_state_dict(trained_standin()), standin_registry(adopter))
    assert outcome.adopter is None and outcome.method == "FusedAdamStandIn.load_state_dict"
    assert outcome.declines == (
        (
            NAME,
            "FusedAdam has no 'store_param_remainders' attribute and the Transformer Engine "
            "release is unknown",
        ),
    )
    assert optimizer.allocations == 2 * len(params_of(optimizer))
    assert "raised in its check" not in caplog.text
