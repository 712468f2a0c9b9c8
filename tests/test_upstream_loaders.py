"""Every loader upstream would call still runs, and the TE generations get the right rules.

Upstream MCore ends ``DistributedOptimizer.load_state_dict`` with
``self.optimizer.load_state_dict(...)``, which resolves a ``load_state_dict`` set on the
*instance* before the class's. Megatron-Bridge 0.6.2's memory-efficient FP32 loading sets one
(``types.MethodType`` on each inner FusedAdam) while a checkpoint loads, and so can a user's
wrapper or a debugging shim. ``install_instance_loader`` below is our own emulation of that
pattern: it installs the state with PyTorch's loader only, by reference, as such a shim would.

TE's FusedAdam cannot load without a GPU: ``FusedAdamStandIn`` reproduces its loading,
including the differences between TE releases that the default adopter depends on
(``te_release``; see docs/te-releases.md).
"""

import sys
import types
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from adopters_for_tests import PyTorchLoaderAdopter
from builders import (
    Owner,
    assert_bitwise_equal,
    cloned_state_dict,
    fresh_standin,
    make_context,
    numel_bytes,
    standin_adopter,
    state_tensors,
    trained_standin,
)
from fused_adam_standin import FusedAdamStandIn

from megatron.core.optimizer.state_adoption import StateExportContext
from megatron.core.optimizer.state_adoption.loader import _export_inner_state, _load_inner_state
from megatron.core.optimizer.state_adoption.registry import _StateAdopterRegistry
from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter
from megatron.core.optimizer.state_adoption.validation import instance_method_decline_reason


def install_instance_loader(optimizer: torch.optim.Optimizer, calls: List[Dict[str, Any]]) -> None:
    """Set an instance-level ``load_state_dict`` that records its calls and loads by reference."""

    def load_state_dict(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        calls.append(state_dict)
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]


def test_instance_loader_runs_once_with_upstreams_content_and_nothing_is_adopted(
    registry: _StateAdopterRegistry,
) -> None:
    optimizer = fresh_standin()
    calls: List[Dict[str, Any]] = []
    install_instance_loader(optimizer, calls)
    payload = cloned_state_dict(trained_standin())
    incoming = [payload["state"][i][k] for i in sorted(payload["state"]) for k in ("exp_avg", "exp_avg_sq")]
    outcome = _load_inner_state(Owner(optimizer), payload, registry)
    assert len(calls) == 1 and calls[0] is payload  # the dict the caller assembled, as upstream
    assert outcome.adopter is None
    ((name, reason),) = outcome.declines
    assert name == "te_fused_adam_fp32"
    assert reason == "the FusedAdamStandIn instance has its own load_state_dict (set on the instance, e.g. by a wrapper), which upstream calls"
    assert outcome.fallback_reason == reason
    assert optimizer.allocations == 0  # the shim's by-reference load, not TE's copy
    assert all(a is b for a, b in zip(state_tensors(optimizer), incoming))


def test_removing_the_instance_loader_makes_adoption_happen_again(registry: _StateAdopterRegistry) -> None:
    optimizer = fresh_standin()
    calls: List[Dict[str, Any]] = []
    install_instance_loader(optimizer, calls)
    _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    del optimizer.load_state_dict
    outcome = _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    assert len(calls) == 1
    assert outcome.adopter == "te_fused_adam_fp32" and outcome.avoided_bytes == numel_bytes(optimizer)


def test_the_loader_enforces_the_rule_for_adopters_that_forget_it(empty_registry: _StateAdopterRegistry, caplog) -> None:
    permissive = PyTorchLoaderAdopter("permissive")  # accepts any optimizer, never checks the instance
    empty_registry.register(permissive)
    optimizer = fresh_standin()
    calls: List[Dict[str, Any]] = []
    install_instance_loader(optimizer, calls)
    with caplog.at_level("WARNING", logger="megatron.core.optimizer.state_adoption"):
        outcome = _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), empty_registry)
    assert permissive.adopted == [] and len(calls) == 1
    assert outcome.declines[0][0] == "permissive"
    assert outcome.declines[0][1].startswith("accepted, but not used: the FusedAdamStandIn instance has its own load_state_dict")
    assert "'permissive' accepted although" in caplog.text


def test_the_kill_switch_calls_the_instance_loader_once(registry: _StateAdopterRegistry, monkeypatch) -> None:
    monkeypatch.setenv("MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION", "1")
    optimizer = fresh_standin()
    calls: List[Dict[str, Any]] = []
    install_instance_loader(optimizer, calls)
    payload = cloned_state_dict(trained_standin())
    _load_inner_state(Owner(optimizer), payload, registry)
    assert calls == [payload] and calls[0] is payload


class _PermissiveExporter(PyTorchLoaderAdopter):
    """Also exports PyTorch's state dict, for any optimizer, without checking the instance."""

    def __init__(self) -> None:
        super().__init__("permissive_exporter")
        self.exports = 0

    def export_decline_reason(self, context: StateExportContext) -> Optional[str]:
        return None

    def export_state_dict(self, context: StateExportContext) -> Tuple[Dict[str, Any], int]:
        self.exports += 1
        return torch.optim.Optimizer.state_dict(context.optimizer), 0


def test_an_instance_state_dict_is_never_bypassed_by_an_exporter(empty_registry: _StateAdopterRegistry) -> None:
    exporter = _PermissiveExporter()
    empty_registry.register(exporter)
    optimizer = trained_standin()
    sentinel = {"state": {}, "param_groups": []}
    calls: List[int] = []

    def state_dict(self: torch.optim.Optimizer) -> Dict[str, Any]:
        calls.append(1)
        return sentinel

    optimizer.state_dict = types.MethodType(state_dict, optimizer)  # type: ignore[method-assign]
    assert _export_inner_state(Owner(optimizer), empty_registry) is sentinel
    assert calls == [1] and exporter.exports == 0
    del optimizer.state_dict
    exported = _export_inner_state(Owner(optimizer), empty_registry)
    assert exporter.exports == 1 and exported["param_groups"] == optimizer.state_dict()["param_groups"]


@pytest.mark.parametrize("method", ["get_unscaled_state", "set_scaled_state", "_initialize_state", "state_dict"])
def test_any_instance_level_te_state_method_is_declined(method: str) -> None:
    """E.g. a wrapper that stages state through its own get_unscaled_state on the instance."""
    optimizer = fresh_standin()
    context = make_context(optimizer, cloned_state_dict(trained_standin()))
    assert standin_adopter().decline_reason(context) is None
    optimizer.__dict__[method] = getattr(optimizer, method)
    assert standin_adopter().decline_reason(context) == (
        f"the FusedAdamStandIn instance has its own {method} (set on the instance, e.g. by a "
        "wrapper), which upstream calls"
    )


@pytest.mark.parametrize("method", ["load_state_dict", "state_dict"])
def test_instance_method_check(method: str) -> None:
    optimizer = fresh_standin()
    assert instance_method_decline_reason(optimizer, method) is None
    optimizer.__dict__[method] = lambda *args: None
    reason = instance_method_decline_reason(optimizer, method)
    assert reason is not None and f"has its own {method}" in reason
    assert instance_method_decline_reason(optimizer, "step") is None


# --- Transformer Engine generations -------------------------------------------------------


GENERATIONS: Dict[str, Tuple[Tuple[int, int], Optional[str], Optional[str]]] = {
    # stand-in release, the version string the adopter sees, expected decline (None: adopt)
    "TE 1.13 (no remainder mode)": ((1, 13), "1.13.0", None),
    "TE 1.14 (no remainder mode)": ((1, 13), "1.14.0+3b2a7b0", None),
    "TE 2.0 (no remainder mode)": ((2, 0), "2.0.0", None),
    "TE 2.1": ((2, 1), "2.1.0", None),
    "TE 2.20": ((2, 20), "2.20.2", None),
    "no remainder attribute, TE 2.1 says it": ((2, 0), "2.1.0", "which Transformer Engine 2.1.0 always sets"),
    "no remainder attribute, 2.1 dev build": ((2, 0), "2.1.0.dev0+e536954", "which Transformer Engine 2.1.0.dev0+e536954 always sets"),
    "no remainder attribute, TE 2.20 says it": ((2, 0), "2.20.2", "always sets"),
    "no remainder attribute, release unknown": ((2, 0), None, "the Transformer Engine release is unknown (None)"),
    "no remainder attribute, unparseable": ((2, 0), "main", "the Transformer Engine release is unknown ('main')"),
    "no remainder attribute, TE 1.12": ((2, 0), "1.12.0", "Transformer Engine 1.12.0 predates 1.13"),
}


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_each_te_generation_gets_the_right_decision_and_bytes(generation: str) -> None:
    release, version, expected = GENERATIONS[generation]
    adopter = TEFusedAdamFP32StateAdopter(FusedAdamStandIn, param_device_type="cpu", te_version=version)
    optimizer, by_te = fresh_standin(te_release=release), fresh_standin(te_release=release)
    assert hasattr(optimizer, "store_param_remainders") == (release >= (2, 1))
    payload = cloned_state_dict(trained_standin())
    registry = _StateAdopterRegistry(entry_point_group=None)
    registry.register(adopter)
    outcome = _load_inner_state(Owner(optimizer), payload, registry)
    by_te.load_state_dict(cloned_state_dict(trained_standin()))
    assert_bitwise_equal(state_tensors(optimizer), state_tensors(by_te))
    if expected is None:
        assert outcome.adopter == "te_fused_adam_fp32", outcome
        assert outcome.avoided_bytes == numel_bytes(optimizer) and optimizer.allocations == 0
    else:
        assert outcome.adopter is None and expected in outcome.declines[0][1], outcome
        assert optimizer.allocations == len(state_tensors(optimizer)) > 0


@pytest.mark.parametrize("version", [None, "2.0.0", "2.20.2", "garbage"])
def test_a_present_remainder_flag_decides_whatever_the_version(version: Optional[str]) -> None:
    adopter = TEFusedAdamFP32StateAdopter(FusedAdamStandIn, param_device_type="cpu", te_version=version)
    context = make_context(fresh_standin(), cloned_state_dict(trained_standin()))
    assert adopter.decline_reason(context) is None
    context.optimizer.store_param_remainders = True  # type: ignore[attr-defined]
    assert adopter.decline_reason(context) == "FusedAdam.store_param_remainders is set"


def test_the_version_defaults_to_the_imported_transformer_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    adopter = TEFusedAdamFP32StateAdopter(FusedAdamStandIn, param_device_type="cpu")
    context = make_context(fresh_standin(te_release=(2, 0)), cloned_state_dict(trained_standin()))
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    assert "release is unknown" in (adopter.decline_reason(context) or "")
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.0.0"))
    assert adopter.decline_reason(context) is None
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(__version__="2.20.2"))
    assert "always sets" in (adopter.decline_reason(context) or "")


def test_te_1_13_loader_fails_on_a_none_value_and_so_does_the_build() -> None:
    """A None state value is not adopted (exact keys with tensors), so TE's own error surfaces."""
    def payload() -> Dict[str, Any]:
        state_dict = cloned_state_dict(trained_standin())
        state_dict["state"][0]["exp_avg"] = None
        return state_dict

    adopter = TEFusedAdamFP32StateAdopter(FusedAdamStandIn, param_device_type="cpu", te_version="1.13.0")
    registry = _StateAdopterRegistry(entry_point_group=None)
    registry.register(adopter)
    with pytest.raises(AttributeError) as upstream:
        fresh_standin(te_release=(1, 13)).load_state_dict(payload())
    with pytest.raises(AttributeError) as ours:
        _load_inner_state(Owner(fresh_standin(te_release=(1, 13))), payload(), registry)
    assert str(ours.value) == str(upstream.value)
