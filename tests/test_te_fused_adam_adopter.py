"""The default adopter: every eligibility rule, adoption by reference, and the fallback.

TE's FusedAdam cannot load without a GPU, so these tests use ``FusedAdamStandIn``, which
reproduces FusedAdam's allocate-and-copy loader (see tests/fused_adam_standin.py).
"""

import types
from typing import Any, Callable, Dict

import pytest
import torch
from builders import (
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
    state_tensors,
    trained_standin,
)
from fused_adam_standin import FusedAdamStandIn

from megatron.core.optimizer.state_adoption import StateAdoptionContext
from megatron.core.optimizer.state_adoption.loader import _load_inner_state
from megatron.core.optimizer.state_adoption.te_fused_adam import (
    _TE_FUSED_ADAM_MODULE,
    TEFusedAdamFP32StateAdopter,
)


def _eligible() -> tuple:
    """A fresh optimizer and a cloned payload from a trained one: MCore's first pass."""
    return fresh_standin(), cloned_state_dict(trained_standin())


def test_accepts_the_standard_fp32_configuration() -> None:
    optimizer, state_dict = _eligible()
    assert standin_adopter().decline_reason(make_context(optimizer, state_dict)) is None


def test_adopt_installs_moments_by_reference_without_allocating() -> None:
    optimizer, state_dict = _eligible()
    incoming = [state_dict["state"][i][k] for i in sorted(state_dict["state"]) for k in ("exp_avg", "exp_avg_sq")]
    expected_values = [t.clone() for t in incoming]
    avoided = standin_adopter().adopt(make_context(optimizer, state_dict))
    installed = state_tensors(optimizer)
    assert [t.data_ptr() for t in installed] == [t.data_ptr() for t in incoming]
    assert all(a is b for a, b in zip(installed, incoming))
    assert optimizer.allocations == 0
    assert_bitwise_equal(installed, expected_values)
    assert avoided == numel_bytes(optimizer, per_element=8)


def test_adopt_installs_group_hyper_parameters_including_step() -> None:
    optimizer, state_dict = _eligible()
    state_dict["param_groups"][1]["lr"] = 0.123
    standin_adopter().adopt(make_context(optimizer, state_dict))
    assert [g["step"] for g in optimizer.param_groups] == [2, 2]
    assert optimizer.param_groups[1]["lr"] == 0.123
    assert optimizer.param_groups[1]["params"][0] is fresh_params_of(optimizer)[2]


def fresh_params_of(optimizer: torch.optim.Optimizer) -> list:
    """The optimizer's parameters in order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def test_adopted_state_matches_te_loader_and_next_step_is_bitwise_equal() -> None:
    trained = trained_standin()
    adopted, by_te = fresh_standin(), fresh_standin()
    standin_adopter().adopt(make_context(adopted, cloned_state_dict(trained)))
    by_te.load_state_dict(cloned_state_dict(trained))
    assert by_te.allocations == 2 * len(fresh_params_of(by_te))
    assert_bitwise_equal(state_tensors(adopted), state_tensors(by_te))
    for optimizer in (adopted, by_te):
        set_grads(fresh_params_of(optimizer), step=2)
        optimizer.step()
    assert_bitwise_equal(fresh_params_of(adopted), fresh_params_of(by_te))
    assert_bitwise_equal(state_tensors(adopted), state_tensors(by_te))


def test_second_pass_readopts_the_optimizers_own_tensors() -> None:
    """MCore's second load hands the optimizer its own current state tensors back."""
    optimizer = trained_standin()
    before = state_tensors(optimizer)
    state_dict = optimizer.state_dict()
    assert standin_adopter().decline_reason(make_context(optimizer, state_dict)) is None
    standin_adopter().adopt(make_context(optimizer, state_dict))
    assert all(a is b for a, b in zip(state_tensors(optimizer), before))
    assert optimizer.allocations == 2 * len(before) // 2  # only the first step's lazy init


def test_post_hooks_run_as_pytorch_runs_them() -> None:
    optimizer, state_dict = _eligible()
    calls = []
    optimizer.register_load_state_dict_post_hook(lambda opt: calls.append(len(opt.state)))
    assert standin_adopter().decline_reason(make_context(optimizer, state_dict)) is None
    standin_adopter().adopt(make_context(optimizer, state_dict))
    assert calls == [len(fresh_params_of(optimizer))]


def test_check_has_no_side_effects() -> None:
    optimizer, state_dict = _eligible()
    groups_before = [dict(g) for g in optimizer.param_groups]
    standin_adopter().decline_reason(make_context(optimizer, state_dict))
    assert len(optimizer.state) == 0 and optimizer.allocations == 0
    assert [dict(g) for g in optimizer.param_groups] == groups_before


# --- one case per eligibility rule ---------------------------------------------------------


def _with_state(mutate: Callable[[Dict[str, Any], FusedAdamStandIn], None]) -> Callable[[], tuple]:
    """A case whose incoming state dict (or optimizer) is changed by ``mutate``."""

    def build() -> tuple:
        optimizer, state_dict = _eligible()
        mutate(state_dict, optimizer)
        return make_context(optimizer, state_dict), standin_adopter()

    return build


def _with_owner(**overrides: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        optimizer, state_dict = _eligible()
        return make_context(optimizer, state_dict, **overrides), standin_adopter()

    return build


def _with_optimizer(factory: Callable[[], torch.optim.Optimizer], adopter=None) -> Callable[[], tuple]:
    def build() -> tuple:
        optimizer = factory()
        state_dict = cloned_state_dict(trained_standin())
        return make_context(optimizer, state_dict), adopter or standin_adopter()

    return build


def _moment(index: int, key: str, value: Callable[[torch.Tensor], Any]) -> Callable:
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
    return lambda: subclass([p for g in fresh_standin().param_groups for p in g["params"]])


def _without(attribute: str) -> Callable[[], torch.optim.Optimizer]:
    def factory() -> torch.optim.Optimizer:
        optimizer = fresh_standin()
        delattr(optimizer, attribute)
        return optimizer

    return factory


def _store_param_remainders() -> torch.optim.Optimizer:
    optimizer = fresh_standin()
    optimizer.store_param_remainders = True
    return optimizer


def _with_pre_hook() -> torch.optim.Optimizer:
    optimizer = fresh_standin()
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: None)
    return optimizer


def _param_changed(change: Callable[[torch.optim.Optimizer], None]) -> Callable[[], torch.optim.Optimizer]:
    def factory() -> torch.optim.Optimizer:
        optimizer = fresh_standin()
        change(optimizer)
        return optimizer

    return factory


def _replace_param(value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.optim.Optimizer], None]:
    def change(optimizer: torch.optim.Optimizer) -> None:
        optimizer.param_groups[0]["params"][0] = value(optimizer.param_groups[0]["params"][0])

    return change


DECLINE_CASES = {
    "stub owner": (_with_owner(is_stub_optimizer=True), "is a stub"),
    "config unknown": (_with_owner(config=None), "is unknown"),
    "megatron fsdp": (_with_owner(ddp_config=ddp_config_with(use_megatron_fsdp=True)), "use_megatron_fsdp is set"),
    "cpu offload": (_with_owner(config=config_with(optimizer_cpu_offload=True)), "optimizer_cpu_offload is set"),
    "precision aware": (
        _with_owner(config=types.SimpleNamespace(optimizer_cpu_offload=False, use_precision_aware_optimizer=True)),
        "use_precision_aware_optimizer is set",
    ),
    "config API drift": (
        _with_owner(config=types.SimpleNamespace(optimizer_cpu_offload=False)),
        "has no 'use_precision_aware_optimizer'",
    ),
    "TE absent": (
        _with_optimizer(fresh_standin, TEFusedAdamFP32StateAdopter()),
        "Transformer Engine's FusedAdam is not loaded",
    ),
    "not FusedAdam": (
        _with_optimizer(lambda: torch.optim.Adam([p for g in fresh_standin().param_groups for p in g["params"]])),
        "the inner optimizer is Adam, not FusedAdam",
    ),
    **{
        f"subclass overrides {method}": (_with_optimizer(_overriding(method)), f"overrides FusedAdam.{method}")
        for method in ("load_state_dict", "state_dict", "_initialize_state", "set_scaled_state", "get_unscaled_state")
    },
    "load pre-hook": (_with_optimizer(_with_pre_hook), "pre-hook is registered"),
    "master weights": (_with_optimizer(lambda: fresh_standin(master_weights=True)), "master_weights is set"),
    "param remainders": (_with_optimizer(_store_param_remainders), "store_param_remainders is set"),
    "bf16 exp_avg": (_with_optimizer(lambda: fresh_standin(exp_avg_dtype=torch.bfloat16)), "keeps exp_avg in torch.bfloat16"),
    "fp16 exp_avg_sq": (
        _with_optimizer(lambda: fresh_standin(exp_avg_sq_dtype=torch.float16)),
        "keeps exp_avg_sq in torch.float16",
    ),
    "TE API drift: master_weights": (_with_optimizer(_without("master_weights")), "has no 'master_weights'"),
    "TE API drift: dtype map": (_with_optimizer(_without("name_to_dtype_map")), "has no 'name_to_dtype_map'"),
    "param on cpu, cuda required": (
        _with_optimizer(fresh_standin, standin_adopter(param_device_type="cuda")),
        "parameter 0: is on cpu, not on cuda",
    ),
    "bf16 param": (
        _with_optimizer(_param_changed(_replace_param(lambda p: torch.nn.Parameter(p.detach().bfloat16())))),
        "parameter 0: is torch.bfloat16",
    ),
    "tensor-subclass param": (
        _with_optimizer(_param_changed(_replace_param(lambda p: p.detach().as_subclass(_TaggedTensor)))),
        "parameter 0: is a _TaggedTensor",
    ),
    "group count": (
        _with_state(lambda sd, o: sd["param_groups"].pop()),
        "the state dict has 1 param groups, the optimizer 2",
    ),
    "group size": (
        _with_state(lambda sd, o: sd["param_groups"][0]["params"].pop()),
        "param group 0 has 1 params in the state dict, 2 in the optimizer",
    ),
    "no state list": (_with_state(lambda sd, o: sd.pop("state")), "lacks a 'state' mapping"),
    "param without state": (
        _with_state(lambda sd, o: sd["state"].pop(3)),
        "exactly one entry per parameter",
    ),
    "state for unknown param": (
        _with_state(lambda sd, o: sd["state"].__setitem__(99, sd["state"][0])),
        "exactly one entry per parameter",
    ),
    "extra step key": (
        _with_state(lambda sd, o: sd["state"][1].__setitem__("step", torch.tensor(2.0))),
        "parameter 1: the incoming state has keys ['exp_avg', 'exp_avg_sq', 'step']",
    ),
    "extra master_param key": (
        _with_state(lambda sd, o: sd["state"][1].__setitem__("master_param", sd["state"][1]["exp_avg"].clone())),
        "keys ['exp_avg', 'exp_avg_sq', 'master_param']",
    ),
    "missing exp_avg_sq": (
        _with_state(lambda sd, o: sd["state"][2].pop("exp_avg_sq")),
        "parameter 2: the incoming state has keys ['exp_avg']",
    ),
    "state not a dict": (
        _with_state(lambda sd, o: sd["state"].__setitem__(0, [1, 2])),
        "parameter 0: the incoming state is a list",
    ),
    **{
        f"{dtype} exp_avg": (
            _with_state(_moment(0, "exp_avg", lambda t, d=dtype: t.to(d))),
            f"parameter 0: exp_avg is {dtype}, not torch.float32",
        )
        for dtype in (torch.bfloat16, torch.float16, torch.float64)
    },
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
        "parameter 0: exp_avg is a _TaggedTensor",
    ),
    "quantized moment": (
        _with_state(_moment(0, "exp_avg", lambda t: torch.quantize_per_tensor(t, 0.1, 0, torch.qint8))),
        "parameter 0: exp_avg is quantized",
    ),
    "sparse moment": (
        _with_state(_moment(0, "exp_avg", lambda t: t.to_sparse())),
        "parameter 0: exp_avg has layout torch.sparse_coo",
    ),
    "moments share storage": (
        _with_state(lambda sd, o: sd["state"][0].__setitem__("exp_avg_sq", sd["state"][0]["exp_avg"])),
        "parameter 0: exp_avg_sq shares storage",
    ),
    "moment aliases a parameter": (
        _with_state(lambda sd, o: sd["state"][2].__setitem__("exp_avg", fresh_params_of(o)[2].detach())),
        "parameter 2: exp_avg shares storage",
    ),
    "moment aliases another parameter's moment": (
        _with_state(_views_of_one_buffer),
        "parameter 3: exp_avg shares storage",
    ),
}


@pytest.mark.parametrize("case", sorted(DECLINE_CASES))
def test_declines_with_reason(case: str) -> None:
    build, expected_reason = DECLINE_CASES[case]
    context, adopter = build()
    reason = adopter.decline_reason(context)
    assert reason is not None and expected_reason in reason, reason


def test_te_module_loaded_but_optimizer_is_not_te(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TE's module imported (here: a module object standing in), the class is found there."""
    fake_module = types.ModuleType(_TE_FUSED_ADAM_MODULE)
    fake_module.FusedAdam = FusedAdamStandIn
    monkeypatch.setitem(__import__("sys").modules, _TE_FUSED_ADAM_MODULE, fake_module)
    optimizer, state_dict = _eligible()
    context = make_context(optimizer, state_dict)
    cuda_adopter = TEFusedAdamFP32StateAdopter()
    assert cuda_adopter.decline_reason(context) == "parameter 0: is on cpu, not on cuda"
    assert TEFusedAdamFP32StateAdopter(param_device_type="cpu").decline_reason(context) is None


@pytest.mark.parametrize("case", ["master weights", "bf16 exp_avg", "moments share storage", "stub owner"])
def test_declined_state_is_loaded_by_the_optimizers_own_loader(case: str, registry) -> None:
    build, _ = DECLINE_CASES[case]
    context, _ = build()
    optimizer = context.optimizer
    owner = Owner(optimizer, context.config, context.ddp_config, context.is_stub_optimizer)
    _load_inner_state(owner, dict(context.state_dict), registry)
    assert optimizer.allocations == sum(len(s) for s in context.state_dict["state"].values())
    incoming = context.state_dict["state"]
    for index, param in enumerate(fresh_params_of(optimizer)):
        for key, value in incoming[index].items():
            assert optimizer.state[param][key] is not value
            installed = optimizer.state[param][key]
            assert torch.equal(installed, value.to(installed.dtype))


def test_declined_per_param_step_reaches_te_loader_which_raises_as_upstream(registry) -> None:
    """A per-parameter 'step' (MCore adds one without Apex/TE) is not TE's format: TE raises."""
    build, _ = DECLINE_CASES["extra step key"]
    context, _ = build()
    with pytest.raises(KeyError, match="step"):
        context.optimizer.load_state_dict(cloned := {**context.state_dict})
    optimizer = fresh_standin()
    with pytest.raises(KeyError, match="step"):
        _load_inner_state(Owner(optimizer), cloned, registry)


def test_context_for_owner_reads_the_owner() -> None:
    optimizer, state_dict = _eligible()
    owner = Owner(optimizer)
    context = StateAdoptionContext.for_owner(owner, state_dict)
    assert context.optimizer is optimizer and context.config is owner.config
    assert context.ddp_config is owner.ddp_config and context.is_stub_optimizer is False
