"""The default adopter's rules with their exact reasons, and its guards around TE's module.

Written to kill the mutants that survived the first mutation run (docs/mutation-report.md).
TE's FusedAdam is reproduced by ``FusedAdamStandIn`` (tests/fused_adam_standin.py); where
TE's modules are looked up in ``sys.modules``, the test puts a module object there.
"""

import sys
import types
from typing import Optional

import pytest
import torch
from builders import cloned_state_dict, fresh_standin, make_context, standin_adopter, trained_standin
from fused_adam_standin import FusedAdamStandIn

from megatron.core.optimizer.state_adoption.te_fused_adam import (
    _TE_FUSED_ADAM_MODULE,
    TEFusedAdamFP32StateAdopter,
)


def _reason(optimizer: torch.optim.Optimizer, adopter: Optional[TEFusedAdamFP32StateAdopter] = None) -> Optional[str]:
    context = make_context(optimizer, cloned_state_dict(trained_standin()))
    return (adopter or standin_adopter()).decline_reason(context)


def _without(attribute: str) -> torch.optim.Optimizer:
    optimizer = fresh_standin()
    delattr(optimizer, attribute)
    return optimizer


@pytest.mark.parametrize(
    "make_optimizer, reason",
    [
        (lambda: _without("master_weights"), "FusedAdam has no 'master_weights' attribute"),
        (lambda: fresh_standin(master_weights=True), "FusedAdam.master_weights is set"),
        (lambda: _without("name_to_dtype_map"), "FusedAdam has no 'name_to_dtype_map'"),
        (
            lambda: fresh_standin(exp_avg_sq_dtype=torch.bfloat16),
            "FusedAdam keeps exp_avg_sq in torch.bfloat16, not torch.float32",
        ),
    ],
    ids=["no master_weights", "master weights", "no dtype map", "bf16 exp_avg_sq"],
)
def test_each_fp32_setting_declines_with_its_exact_reason(make_optimizer, reason: str) -> None:
    assert _reason(make_optimizer()) == reason


def test_a_release_before_1_13_declines_with_its_exact_reason() -> None:
    adopter = TEFusedAdamFP32StateAdopter(FusedAdamStandIn, param_device_type="cpu", te_version="1.12.0")
    assert _reason(fresh_standin(te_release=(2, 0)), adopter) == (
        "Transformer Engine 1.12.0 predates 1.13, the first release whose FusedAdam this adopter knows"
    )


def test_a_fused_adam_attribute_that_is_not_a_class_counts_as_te_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module whose ``FusedAdam`` is, e.g., a factory function is not TE's optimizer module."""
    module = types.ModuleType(_TE_FUSED_ADAM_MODULE)
    module.FusedAdam = lambda *args, **kwargs: FusedAdamStandIn(*args, **kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, _TE_FUSED_ADAM_MODULE, module)
    adopter = TEFusedAdamFP32StateAdopter(param_device_type="cpu")
    assert _reason(fresh_standin(), adopter) == "Transformer Engine's FusedAdam is not loaded"


def test_a_te_version_that_is_not_a_string_counts_as_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__=(2, 0)))
    adopter = TEFusedAdamFP32StateAdopter(FusedAdamStandIn, param_device_type="cpu")
    assert _reason(fresh_standin(te_release=(2, 0)), adopter) == (
        "FusedAdam has no 'store_param_remainders' attribute and the Transformer Engine release "
        "is unknown (None)"
    )


def test_adopt_refuses_when_pytorchs_loader_did_not_keep_a_moment() -> None:
    """``adopt`` checks that the moments were installed by reference before it reports savings:
    a moment PyTorch's loader casts (here FP64 for an FP32 parameter) is a copy."""
    optimizer, state_dict = fresh_standin(), cloned_state_dict(trained_standin())
    state_dict["state"][1]["exp_avg_sq"] = state_dict["state"][1]["exp_avg_sq"].double()
    with pytest.raises(RuntimeError) as refused:
        standin_adopter().adopt(make_context(optimizer, state_dict))
    assert str(refused.value) == "PyTorch's loader did not keep exp_avg_sq of parameter 1 by reference"
