"""The read hook point: what a precision-aware ``dp_reshardable`` checkpoint is read into.

Upstream builds the sharded state dict of a precision-aware DistributedOptimizer for loading
with ``get_unscaled_state`` for every state tensor: an FP32 copy of each BF16 moment, which the
checkpoint is read into and which ``set_scaled_state`` converts into the held tensor after the
read. These tests run the installed megatron-core's own ``_get_main_param_and_optimizer_states``
and ``_set_main_param_and_optimizer_states`` (:mod:`mcore_owners`) inside
``reading_optimizer_state``, as ``sharded_param_state_dp_reshardable`` does in the build, on the
CPU stand-in for TE's FusedAdam (which reproduces ``get_unscaled_state``/``set_scaled_state``,
TE's FP32 assertion included). The read itself is ``target.copy_(checkpoint_value)``: what
``torch_dist`` does with each target (it needs CUDA; the GPU report measures the real read).

Like the other routing tests, CI runs these against every supported release: on unpatched
upstream nothing consults a provider, so the tests that expect held targets fail.
"""

import logging
import types
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from adopters_for_tests import HeldMomentReadTargets, RaisingCheckAdopter
from builders import assert_bitwise_equal, make_params, make_standin
from fused_adam_standin import FusedAdamStandIn
from mcore_owners import CpuPrecisionAwareDistributedOptimizer, precision_aware_owner

from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    StateAdoptionOutcome,
    reading_optimizer_state,
    register_state_adopter,
    store_read_optimizer_state,
    unscaled_state_or_read_target,
)

MOMENTS = ("exp_avg", "exp_avg_sq")
Targets = List[Dict[str, torch.Tensor]]


def _owner(**config_changes: Any) -> CpuPrecisionAwareDistributedOptimizer:
    """A precision-aware owner whose FusedAdam holds BF16 moments and int16 master remainders,
    as the scaffold pass of a resume leaves it."""
    optimizer = make_standin(
        make_params(0, dtype=torch.bfloat16),
        master_weights=True,
        store_param_remainders=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    )
    return precision_aware_owner(optimizer, **config_changes)


def _params(owner: Any) -> List[torch.Tensor]:
    return [p for group in owner.optimizer.param_groups for p in group["params"]]


def _checkpoint(owner: Any, seed: int = 5) -> List[Dict[str, torch.Tensor]]:
    """What a precision-aware checkpoint holds per parameter: FP32 moments (with values BF16
    rounds), int16 master remainders."""
    generator = torch.Generator().manual_seed(seed)
    values = []
    for param in _params(owner):
        entry = {key: torch.randn(param.shape, generator=generator) / 3 for key in MOMENTS}
        entry["param"] = torch.randint(-(2**15), 2**15 - 1, param.shape, generator=generator, dtype=torch.int16)
        values.append(entry)
    return values


def _build_targets(owner: Any, registry: StateAdopterRegistry, is_loading: bool = True) -> Targets:
    """The sharded state dict's tensors, as ``sharded_param_state_dp_reshardable`` gets them."""
    with reading_optimizer_state(owner, is_loading, registry=registry):
        return [owner._get_main_param_and_optimizer_states(param) for param in _params(owner)]


def _read_and_store(owner: Any, targets: Targets, checkpoint: List[Dict[str, torch.Tensor]]) -> None:
    """Read the checkpoint into the targets as torch_dist does, then MCore's store."""
    for tensors, values in zip(targets, checkpoint):
        for key, value in values.items():
            tensors[key].copy_(value)
    for param, tensors in zip(_params(owner), targets):
        owner._set_main_param_and_optimizer_states(param, tensors)


def _held(owner: Any) -> List[torch.Tensor]:
    return [owner.optimizer.state[p][k] for p in _params(owner) for k in sorted(owner.optimizer.state[p])]


def _upstream_state(checkpoint: List[Dict[str, torch.Tensor]]) -> List[torch.Tensor]:
    """The state upstream's targets (FP32 copies) and TE's set_scaled_state give."""
    owner = _owner()
    _read_and_store(owner, _build_targets(owner, StateAdopterRegistry(entry_point_group=None)), checkpoint)
    return _held(owner)


@pytest.fixture
def provider() -> HeldMomentReadTargets:
    return HeldMomentReadTargets()


@pytest.fixture
def provider_registry(provider: HeldMomentReadTargets) -> StateAdopterRegistry:
    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(provider)
    return registry


@pytest.fixture
def recorded(provider_registry: StateAdopterRegistry) -> Iterator[List[StateAdoptionOutcome]]:
    outcomes: List[StateAdoptionOutcome] = []
    handle = provider_registry.register_outcome_hook(outcomes.append)
    yield outcomes
    handle.remove()


def _moment_bytes(owner: Any, per_element: int) -> int:
    return per_element * 2 * sum(p.numel() for p in _params(owner))


def _remainder_bytes(owner: Any) -> int:
    return 2 * sum(p.numel() for p in _params(owner))


# --- the provider's targets are the held tensors, and the result is upstream's -----------------


def test_upstream_reads_into_fp32_copies_that_set_scaled_state_converts() -> None:
    """The baseline the hook point improves on, measured on the installed code."""
    owner = _owner()
    registry = StateAdopterRegistry(entry_point_group=None)
    outcomes: List[StateAdoptionOutcome] = []
    registry.register_outcome_hook(outcomes.append)
    targets = _build_targets(owner, registry)
    assert all(t[k].dtype == torch.float32 for t in targets for k in MOMENTS)
    (outcome,) = outcomes
    assert (outcome.hook_point, outcome.adopter, outcome.method) == ("read", None, "FusedAdamStandIn.get_unscaled_state")
    assert outcome.fallback_reason == "no registered adopter is a read-target provider"
    assert outcome.allocated_bytes == _moment_bytes(owner, 4)  # the FP32 copies of the BF16 moments
    assert outcome.reused_bytes == _remainder_bytes(owner)  # the remainders are read in place


def test_the_provider_s_targets_are_the_held_tensors_and_the_state_is_upstream_s(
    provider_registry: StateAdopterRegistry, recorded: List[StateAdoptionOutcome]
) -> None:
    owner = _owner()
    held_before = _held(owner)
    checkpoint = _checkpoint(owner)
    targets = _build_targets(owner, provider_registry)
    for param, tensors in zip(_params(owner), targets):
        for key in MOMENTS:
            assert tensors[key] is owner.optimizer.state[param][key]
        assert tensors["param"] is owner.optimizer.state[param]["master_param"]
    (outcome,) = recorded
    assert (outcome.hook_point, outcome.adopter, outcome.method) == ("read", "held_moments", None)
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (_moment_bytes(owner, 2) + _remainder_bytes(owner), 0)
    allocations = owner.optimizer.allocations
    _read_and_store(owner, targets, checkpoint)
    assert owner.optimizer.allocations == allocations
    assert all(a is b for a, b in zip(_held(owner), held_before))  # nothing was replaced
    assert_bitwise_equal(_held(owner), _upstream_state(checkpoint))


def test_a_save_keeps_writing_fp32_copies(provider_registry: StateAdopterRegistry, provider: HeldMomentReadTargets) -> None:
    owner = _owner()
    targets = _build_targets(owner, provider_registry, is_loading=False)
    assert all(t[k].dtype == torch.float32 for t in targets for k in MOMENTS)
    assert provider.checked == 0


def test_outside_the_scope_the_call_is_get_unscaled_state(provider_registry: StateAdopterRegistry) -> None:
    owner = _owner()
    with reading_optimizer_state(owner, True, registry=provider_registry):
        pass
    param = _params(owner)[0]
    assert unscaled_state_or_read_target(owner, param, "exp_avg").dtype == torch.float32


def test_another_owner_in_the_scope_gets_upstream_s_targets(provider_registry: StateAdopterRegistry) -> None:
    owner, other = _owner(), _owner()
    with reading_optimizer_state(owner, True, registry=provider_registry):
        targets = [other._get_main_param_and_optimizer_states(p) for p in _params(other)]
    assert all(t[k].dtype == torch.float32 for t in targets for k in MOMENTS)


# --- the switches and the central rules ---------------------------------------------------------


@pytest.mark.parametrize(
    "switch",
    ["config", "environment", "disabled by name", "instance get_unscaled_state"],
)
def test_every_switch_keeps_upstream_s_targets(
    switch: str,
    provider_registry: StateAdopterRegistry,
    provider: HeldMomentReadTargets,
    recorded: List[StateAdoptionOutcome],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    owner = _owner(optimizer_state_adoption=False) if switch == "config" else _owner()
    if switch == "environment":
        monkeypatch.setenv("MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION", "1")
    if switch == "disabled by name":
        monkeypatch.setenv("MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS", provider.name)
    if switch == "instance get_unscaled_state":
        own = owner.optimizer.get_unscaled_state
        owner.optimizer.__dict__["get_unscaled_state"] = own  # a wrapper set on the instance
    checkpoint = _checkpoint(owner)
    targets = _build_targets(owner, provider_registry)
    assert all(t[k].dtype == torch.float32 for t in targets for k in MOMENTS)
    (outcome,) = recorded
    assert outcome.adopter is None and outcome.fallback_reason
    _read_and_store(owner, targets, checkpoint)
    assert_bitwise_equal(_held(owner), _upstream_state(checkpoint))


def test_a_raising_check_is_a_decline() -> None:
    class RaisingReadCheck(HeldMomentReadTargets):
        def read_target_decline_reason(self, context: Any) -> Any:
            raise RuntimeError("read check exploded")

    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(RaisingCheckAdopter("plain"))  # no provider: skipped without a decline
    registry.register(RaisingReadCheck("raising"))
    outcomes: List[StateAdoptionOutcome] = []
    registry.register_outcome_hook(outcomes.append)
    owner = _owner()
    targets = _build_targets(owner, registry)
    assert all(t[k].dtype == torch.float32 for t in targets for k in MOMENTS)
    (outcome,) = outcomes
    assert outcome.declines == (("raising", "check raised RuntimeError: read check exploded"),)
    assert outcome.fallback_reason == "every read-target provider declined"


# --- a provider that breaks the contract: upstream's targets from then on -----------------------


def _bf16_copy(optimizer: Any, param: torch.Tensor) -> torch.Tensor:
    return optimizer.state[param]["exp_avg_sq"].clone()


def _wrong_shape(optimizer: Any, param: torch.Tensor) -> torch.Tensor:
    return torch.zeros(param.numel() + 1)


def _raises(optimizer: Any, param: torch.Tensor) -> torch.Tensor:
    raise KeyError("no such state")


def _a_parameter(optimizer: Any, param: torch.Tensor) -> torch.Tensor:
    return torch.nn.Parameter(torch.zeros(param.shape))


BROKEN_TARGETS = {
    "a BF16 copy": (_bf16_copy, "neither the held tensor nor FP32 of its shape"),
    "the wrong shape": (_wrong_shape, "neither the held tensor nor FP32 of its shape"),
    "a raise": (_raises, "KeyError"),
    "a Parameter": (_a_parameter, "it returned a Parameter, not a plain tensor"),
    "another device": (lambda o, p: torch.zeros(p.shape, device="meta"), "the target is on meta, the held 'exp_avg_sq' on cpu"),

}


@pytest.mark.parametrize("broken", sorted(BROKEN_TARGETS))
def test_a_broken_target_falls_back_for_it_and_the_rest(
    broken: str,
    provider: HeldMomentReadTargets,
    provider_registry: StateAdopterRegistry,
    recorded: List[StateAdoptionOutcome],
    caplog: pytest.LogCaptureFixture,
) -> None:
    make, message = BROKEN_TARGETS[broken]
    owner = _owner()
    first_param = _params(owner)[0]
    provider.target_of["exp_avg_sq"] = make
    checkpoint = _checkpoint(owner)
    with caplog.at_level(logging.WARNING):
        targets = _build_targets(owner, provider_registry)
    first = targets[0]
    assert first["exp_avg"] is owner.optimizer.state[first_param]["exp_avg"]  # before the failure
    assert first["exp_avg_sq"].dtype == torch.float32
    assert all(t[k].dtype == torch.float32 for t in targets[1:] for k in MOMENTS)
    (outcome,) = recorded
    assert outcome.adopter == provider.name and message in (outcome.fallback_reason or "")
    shape = tuple(_params(owner)[0].shape)
    assert f"failed to supply the read target of 'exp_avg_sq' of a parameter of shape {shape}" in caplog.text
    _read_and_store(owner, targets, checkpoint)
    assert_bitwise_equal(_held(owner), _upstream_state(checkpoint))


def test_a_scaled_fp16_state_cannot_be_read_in_place(
    provider: HeldMomentReadTargets, provider_registry: StateAdopterRegistry, recorded: List[StateAdoptionOutcome]
) -> None:
    owner = _owner()
    param = _params(owner)[0]
    held_fp16 = owner.optimizer.state[param]["exp_avg"].to(torch.float16)
    owner.optimizer.state[param]["exp_avg"] = held_fp16  # as TE holds FP16 moments (scaled)
    _build_targets(owner, provider_registry)
    (outcome,) = recorded
    assert "torch.float16, which TE scales: it needs an FP32 target" in (outcome.fallback_reason or "")


@pytest.mark.parametrize("with_provider", [True, False])
def test_an_error_while_building_ends_in_an_outcome(with_provider: bool, provider_registry: StateAdopterRegistry) -> None:
    registry = provider_registry if with_provider else StateAdopterRegistry(entry_point_group=None)
    recorded: List[StateAdoptionOutcome] = []
    registry.register_outcome_hook(recorded.append)
    owner = _owner()
    with pytest.raises(ZeroDivisionError):
        with reading_optimizer_state(owner, True, registry=registry):
            owner._get_main_param_and_optimizer_states(_params(owner)[0])  # targets were handed out
            raise ZeroDivisionError("while building")
    (outcome,) = recorded
    assert outcome.error == "ZeroDivisionError: while building"
    assert outcome.adopter == ("held_moments" if with_provider else None)
    assert outcome.method == "building the sharded state dict"
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (0, 0)  # a failed build measures nothing
    param = _params(owner)[0]
    assert unscaled_state_or_read_target(owner, param, "exp_avg").dtype == torch.float32  # scope gone


# --- the store --------------------------------------------------------------------------------


def _one_param_owner() -> Tuple[Any, torch.Tensor]:
    owner = _owner()
    return owner, _params(owner)[0]


def test_the_store_leaves_a_tensor_read_in_place_alone() -> None:
    owner, param = _one_param_owner()
    held = owner.optimizer.state[param]["exp_avg"]
    held.fill_(0.25)
    store_read_optimizer_state(owner, param, "exp_avg", held)  # TE would assert: not FP32
    assert owner.optimizer.state[param]["exp_avg"] is held and bool((held == 0.25).all())


def test_the_store_copies_a_bf16_target_into_a_held_tensor_that_replaced_it() -> None:
    owner, param = _one_param_owner()
    target = owner.optimizer.state[param]["exp_avg"]
    target.copy_(torch.linspace(-1, 1, param.numel()).reshape(param.shape))
    replacement = torch.zeros_like(target)
    owner.optimizer.state[param]["exp_avg"] = replacement  # e.g. TE's loader ran after the read
    store_read_optimizer_state(owner, param, "exp_avg", target)
    assert owner.optimizer.state[param]["exp_avg"] is replacement
    assert torch.equal(replacement, target)


def test_the_store_hands_fp32_values_to_set_scaled_state() -> None:
    owner, param = _one_param_owner()
    values = torch.randn(param.shape)
    store_read_optimizer_state(owner, param, "exp_avg", values)
    assert torch.equal(owner.optimizer.state[param]["exp_avg"], values.bfloat16())


def test_the_store_of_a_bf16_tensor_of_another_shape_is_te_s_to_refuse() -> None:
    owner, param = _one_param_owner()
    with pytest.raises(AssertionError):  # TE's set_scaled_state asserts FP32 input
        store_read_optimizer_state(owner, param, "exp_avg", torch.zeros(param.numel() + 1, dtype=torch.bfloat16))


def test_a_registered_provider_reaches_the_default_registry(outcomes: List[StateAdoptionOutcome]) -> None:
    handle = register_state_adopter(HeldMomentReadTargets("held_moments_default"))
    try:
        owner = _owner()
        with reading_optimizer_state(owner, True):
            targets = [owner._get_main_param_and_optimizer_states(p) for p in _params(owner)]
    finally:
        handle.remove()
    assert all(t[k].dtype == torch.bfloat16 for t in targets for k in MOMENTS)
    assert [o.adopter for o in outcomes if o.hook_point == "read"] == ["held_moments_default"]


def test_the_stand_in_asserts_fp32_like_te() -> None:
    """Why the store must not hand a held BF16 target to set_scaled_state."""
    optimizer = FusedAdamStandIn([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], exp_avg_dtype=torch.bfloat16)
    param = optimizer.param_groups[0]["params"][0]
    optimizer.initialize_state(param)
    with pytest.raises(AssertionError):
        optimizer.set_scaled_state(param, "exp_avg", optimizer.state[param]["exp_avg"])


def test_a_sharded_state_dict_that_asks_for_no_target_consults_nobody(
    provider: HeldMomentReadTargets, provider_registry: StateAdopterRegistry, recorded: List[StateAdoptionOutcome]
) -> None:
    """An FP32 owner's dp_reshardable sharded state dict reads into its state directly: the scope
    around it asks no provider and records no outcome."""
    owner = _owner(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False, use_precision_aware_optimizer=False)
    with reading_optimizer_state(owner, True, registry=provider_registry):
        targets = [owner._get_main_param_and_optimizer_states(p) for p in _params(owner)]
    assert all(t["exp_avg"] is owner.optimizer.state[p]["exp_avg"] for t, p in zip(targets, _params(owner)))
    assert (provider.checked, recorded) == (0, [])


def test_a_target_overlapping_the_held_tensor_is_refused(
    provider: HeldMomentReadTargets, recorded: List[StateAdoptionOutcome], provider_registry: StateAdopterRegistry
) -> None:
    """With FP32 master weights (no remainders) a target of the held dtype and shape that shares
    the held storage but is not the held tensor (another stride) must not pass as new memory."""
    optimizer = make_standin(
        make_params(0, dtype=torch.bfloat16),
        master_weights=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    )
    owner = precision_aware_owner(optimizer)
    provider.target_of["master_param"] = lambda o, p: o.state[p]["master_param"].as_strided(p.shape, [0] * p.dim())
    _build_targets(owner, provider_registry)
    (outcome,) = recorded
    assert "(ValueError: the target overlaps the held tensor without being it)" in (outcome.fallback_reason or "")


def test_an_owner_without_a_config_is_served(provider_registry: StateAdopterRegistry) -> None:
    owner = _owner()
    bare = types.SimpleNamespace(optimizer=owner.optimizer)  # what a third-party owner may be
    param = _params(owner)[0]
    with reading_optimizer_state(bare, True, registry=provider_registry):
        target = unscaled_state_or_read_target(bare, param, "exp_avg")
    assert target is owner.optimizer.state[param]["exp_avg"]


def test_an_interrupted_consult_ends_in_an_outcome_and_propagates() -> None:
    class Interrupting(HeldMomentReadTargets):
        def read_target_decline_reason(self, context: Any) -> Any:
            raise KeyboardInterrupt

    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(Interrupting("interrupting"))
    registry.register(HeldMomentReadTargets("never_asked"))
    outcomes: List[StateAdoptionOutcome] = []
    registry.register_outcome_hook(outcomes.append)
    owner = _owner()
    with pytest.raises(KeyboardInterrupt):
        with reading_optimizer_state(owner, True, registry=registry):
            owner._get_main_param_and_optimizer_states(_params(owner)[0])
    (outcome,) = outcomes
    assert (outcome.hook_point, outcome.fallback_reason) == ("read", "interrupted while consulting the adopters")
    assert outcome.optimizer.startswith(f"FusedAdamStandIn {id(owner.optimizer):#x}")
    assert outcome.error == "KeyboardInterrupt: "


def test_the_store_for_a_state_not_held_is_set_scaled_state() -> None:
    owner, param = _one_param_owner()
    del owner.optimizer.state[param]["exp_avg"]
    values = torch.randn(param.shape)
    store_read_optimizer_state(owner, param, "exp_avg", values)  # TE creates the state
    assert torch.equal(owner.optimizer.state[param]["exp_avg"], values.bfloat16())


@pytest.mark.parametrize("held", ["missing", "not a tensor", "no state for the parameter", "no entry at all"])
def test_a_target_for_a_state_not_held_is_refused(
    held: str, provider: HeldMomentReadTargets, provider_registry: StateAdopterRegistry, recorded: List[StateAdoptionOutcome]
) -> None:
    """MCore asks only for held tensors; a caller asking for another is told, not crashed."""
    owner, param = _one_param_owner()
    provider.target_of["extra"] = lambda o, p: torch.zeros(p.shape)
    if held == "not a tensor":
        owner.optimizer.state[param]["extra"] = 0.0
    if held == "no state for the parameter":
        del owner.optimizer.state[param]
        owner.optimizer.state[param]["exp_avg"] = torch.zeros(param.shape, dtype=torch.bfloat16)  # for get_unscaled_state
    if held == "no entry at all":
        del owner.optimizer.state[param]
        assert owner.optimizer.state.get(param) is None
    with reading_optimizer_state(owner, True, registry=provider_registry):
        with pytest.raises((KeyError, AttributeError)):  # the stand-in's own get_unscaled_state, as upstream's call
            unscaled_state_or_read_target(owner, param, "extra")
    (outcome,) = recorded
    assert "(ValueError: the optimizer holds no 'extra' for this parameter)" in (outcome.fallback_reason or "")


def test_a_new_fp32_target_is_read_into_and_converted_by_set_scaled_state(
    provider: HeldMomentReadTargets, provider_registry: StateAdopterRegistry, recorded: List[StateAdoptionOutcome]
) -> None:
    """The contract's other kind of target: a new FP32 tensor of the held shape (a scratch),
    which TE's set_scaled_state converts after the read; measured as allocated."""
    provider.target_of["exp_avg"] = lambda o, p: torch.empty(p.shape, dtype=torch.float32)
    owner = _owner()
    checkpoint = _checkpoint(owner)
    targets = _build_targets(owner, provider_registry)
    assert all(t["exp_avg"].dtype == torch.float32 and t["exp_avg_sq"].dtype == torch.bfloat16 for t in targets)
    (outcome,) = recorded
    assert (outcome.adopter, outcome.fallback_reason) == ("held_moments", None)
    assert outcome.allocated_bytes == sum(4 * p.numel() for p in _params(owner))  # the scratches
    _read_and_store(owner, targets, checkpoint)
    assert_bitwise_equal(_held(owner), _upstream_state(checkpoint))
