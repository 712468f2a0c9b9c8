"""The ``initialize`` hook point: Megatron-FSDP's creation of the state a checkpoint is read into.

``DistributedOptimizer.sharded_param_state_fsdp_dtensor(is_loading=True)`` (Megatron-FSDP,
``fsdp_dtensor``) creates the inner optimizer's state with a dummy ``step()`` on zero gradients,
which holds a gradient per parameter on top of the new state.
``initialize_inner_optimizer_state`` offers that to the registered state initializers; the
default adopter runs TE FusedAdam's own ``step()`` without gradients (the CPU stand-in
reproduces TE's step: state and group ``step`` are created before gradients are looked at).
The tests run on real DTensors of a one-rank gloo group, through the installed
DistributedOptimizer's own methods (:mod:`mcore_owners`).
"""

import functools
import logging
import types
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from adopters_for_tests import PyTorchLoaderAdopter
from builders import config_with, ddp_config_with, registry_of, standin_adopter
from fused_adam_standin import FusedAdamStandIn
from mcore_owners import MCORE_PARAM_GROUP_KEYS, CpuDistributedOptimizer
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import register_optimizer_step_post_hook

from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import (
    StateAdoptionOutcome,
    StateExportContext,
    initialize_inner_optimizer_state,
    register_state_adopter,
)
from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter

SHAPES = [(12,), (4, 3), (0,), (6,)]
ELEMENTS = 12 + 12 + 0 + 6
DISABLE_ENV_VAR = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
DISABLED_ADOPTERS_ENV_VAR = "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS"
STANDIN = "te_fused_adam_fp32_standin"


def _dtensor(local: torch.Tensor, cpu_mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(local, cpu_mesh, [Shard(0)], run_check=False)


def _owner(cpu_mesh: DeviceMesh, seed: int = 0, config: Any = None) -> CpuDistributedOptimizer:
    """A Megatron-FSDP DistributedOptimizer over fresh DTensor parameters (no state yet)."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(_dtensor(torch.randn(s, generator=generator), cpu_mesh)) for s in SHAPES]
    inner = FusedAdamStandIn(
        [{"params": params[:2], **MCORE_PARAM_GROUP_KEYS}, {"params": params[2:], **MCORE_PARAM_GROUP_KEYS, "wd_mult": 0.0}],
        lr=1e-2,
        weight_decay=0.1,
    )
    owner = CpuDistributedOptimizer(inner, config or OptimizerConfig(), ddp_config_with(use_megatron_fsdp=True))
    owner.param_to_name = {p: f"layer.param{i}" for i, p in enumerate(params)}  # what _param_name caches
    return owner


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _state_locals(optimizer: torch.optim.Optimizer) -> List[Tuple[str, torch.Tensor]]:
    return [(k, optimizer.state[p][k].to_local()) for p in _params(optimizer) for k in sorted(optimizer.state[p])]


def _same_bits(left: List[torch.Tensor], right: List[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        for a, b in zip(left, right)
    )


def _own_path_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLED_ADOPTERS_ENV_VAR, STANDIN)


def _with_standin() -> Iterator[Any]:
    adopter = standin_adopter()
    adopter.name = STANDIN  # our own adopter object, under a name beside the built-in one
    handle = register_state_adopter(adopter, prepend=True)
    yield adopter
    handle.remove()


@pytest.fixture
def standin() -> Iterator[Any]:
    """The default adopter recognising the stand-in, ahead of the built-in one (which declines
    the stand-in: TE is not loaded)."""
    yield from _with_standin()


def test_the_default_adopter_creates_the_dummy_steps_state_without_its_gradients(
    cpu_mesh: DeviceMesh, standin: Any, outcomes: List[StateAdoptionOutcome], monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, own = _owner(cpu_mesh), _owner(cpu_mesh)
    ours.sharded_param_state_fsdp_dtensor(is_loading=True)
    grads_seen = [p.grad for p in _params(ours.optimizer)]
    (created,) = outcomes
    assert (created.hook_point, created.adopter) == ("initialize", STANDIN)
    assert created.allocated_bytes == 8 * ELEMENTS and created.reused_bytes == 0
    assert grads_seen == [None] * len(SHAPES)
    _own_path_disabled(monkeypatch)
    own.sharded_param_state_fsdp_dtensor(is_loading=True)
    assert outcomes[-1].adopter is None and outcomes[-1].method.endswith("_init_optimizer_states_with_dummy_values")
    assert [k for k, _ in _state_locals(ours.optimizer)] == [k for k, _ in _state_locals(own.optimizer)]
    assert _same_bits([t for _, t in _state_locals(ours.optimizer)], [t for _, t in _state_locals(own.optimizer)])
    for param in _params(ours.optimizer):
        assert [type(v) for v in ours.optimizer.state[param].values()] == [DTensor, DTensor]
        assert all(v.placements == param.placements for v in ours.optimizer.state[param].values())
    assert [g["step"] for g in ours.optimizer.param_groups] == [g["step"] for g in own.optimizer.param_groups] == [1, 1]
    # the one difference: the dummy step's zero gradients applied weight decay to the parameters
    assert not _same_bits([p.to_local() for p in _params(ours.optimizer)], [p.to_local() for p in _params(own.optimizer)])


def _checkpoint(cpu_mesh: DeviceMesh) -> Dict[str, Any]:
    """What a Megatron-FSDP run saved: its parameters, state and group metadata after 2 steps."""
    trained = _owner(cpu_mesh, seed=0)
    for _ in range(2):
        for param in _params(trained.optimizer):
            param.grad = _dtensor(torch.full(param.to_local().shape, 0.5), cpu_mesh)
        trained.optimizer.step()
    saved = trained.sharded_param_state_fsdp_dtensor(is_loading=False)
    return {
        "params": [p.to_local().clone() for p in _params(trained.optimizer)],
        "state": {name: {k: v.to_local().clone() for k, v in entry.items()} for name, entry in saved["state"].items()},
        "param_to_group_meta": {name: dict(meta) for name, meta in saved["param_to_group_meta"].items()},
    }


def _resume(owner: CpuDistributedOptimizer, checkpoint: Dict[str, Any]) -> None:
    """Megatron-LM's fsdp_dtensor load: build the sharded state dict (initialisation), read the
    checkpoint in place (torch.distributed.checkpoint writes into every tensor and replaces every
    leaf value the state dict has a key for), then load_state_dict."""
    state_dict = owner.sharded_param_state_fsdp_dtensor(is_loading=True)
    with torch.no_grad():
        for param, saved in zip(_params(owner.optimizer), checkpoint["params"]):
            param.to_local().copy_(saved)
        for name, entry in state_dict["state"].items():
            for key, value in entry.items():
                value.to_local().copy_(checkpoint["state"][name][key])
    for name, meta in state_dict["param_to_group_meta"].items():
        for key in meta:  # only the keys the state dict has are read
            meta[key] = checkpoint["param_to_group_meta"][name][key]
    owner.load_state_dict(state_dict)


def test_a_resume_through_the_initializer_equals_the_own_path_bit_for_bit_and_so_does_the_next_step(
    cpu_mesh: DeviceMesh, standin: Any, outcomes: List[StateAdoptionOutcome], monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = _checkpoint(cpu_mesh)
    ours = _owner(cpu_mesh, seed=1)
    _resume(ours, checkpoint)
    assert [(o.hook_point, o.adopter) for o in outcomes] == [("initialize", STANDIN), ("load", STANDIN)]
    _own_path_disabled(monkeypatch)
    own = _owner(cpu_mesh, seed=1)
    _resume(own, checkpoint)
    assert [(o.hook_point, o.adopter) for o in outcomes[2:]] == [("initialize", None), ("load", None)]
    for optimizer in (ours.optimizer, own.optimizer):
        assert [g["step"] for g in optimizer.param_groups] == [2, 2]  # the checkpoint's, read into the key
    assert _same_bits([t for _, t in _state_locals(ours.optimizer)], [t for _, t in _state_locals(own.optimizer)])
    assert _same_bits([p.to_local() for p in _params(ours.optimizer)], [p.to_local() for p in _params(own.optimizer)])
    for owner in (ours, own):
        for param in _params(owner.optimizer):
            param.grad = _dtensor(torch.full(param.to_local().shape, -0.25), cpu_mesh)
        owner.optimizer.step()
    assert _same_bits([t for _, t in _state_locals(ours.optimizer)], [t for _, t in _state_locals(own.optimizer)])
    assert _same_bits([p.to_local() for p in _params(ours.optimizer)], [p.to_local() for p in _params(own.optimizer)])


def _own_runs(owner: CpuDistributedOptimizer, outcomes: List[StateAdoptionOutcome]) -> StateAdoptionOutcome:
    owner.sharded_param_state_fsdp_dtensor(is_loading=True)
    (created,) = [o for o in outcomes if o.hook_point == "initialize"]
    assert created.adopter is None and created.method.endswith("_init_optimizer_states_with_dummy_values")
    assert [g["step"] for g in owner.optimizer.param_groups] == [1, 1]  # the dummy step ran once
    return created


def _with_held_state(owner: CpuDistributedOptimizer) -> None:
    owner.optimizer.initialize_state(_params(owner.optimizer)[0])


def _with_instance_step(owner: CpuDistributedOptimizer) -> None:
    inner = owner.optimizer
    inner.step = types.MethodType(FusedAdamStandIn.step, inner)  # a user's wrapper on the instance


def _with_step_hook(owner: CpuDistributedOptimizer) -> None:
    owner.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: None)


def _with_gradient(owner: CpuDistributedOptimizer) -> None:
    param = _params(owner.optimizer)[1]
    param.grad = torch.zeros_like(param)


CENTRAL_RULES = {
    "the optimizer holds state": (_with_held_state, "the inner optimizer already holds state, which the own initialisation steps"),
    "step set on the instance": (
        _with_instance_step,
        "the FusedAdamStandIn instance has its own step (set on the instance, e.g. by a wrapper), which the own initialisation calls",
    ),
    "a step pre-hook": (_with_step_hook, "a step pre-hook is registered, which the own initialisation runs"),
}


@pytest.mark.parametrize("change, reason", CENTRAL_RULES.values(), ids=CENTRAL_RULES.keys())
def test_the_central_rules_send_the_initialisation_to_the_own_path(
    cpu_mesh: DeviceMesh, standin: Any, outcomes: List[StateAdoptionOutcome], change: Any, reason: str
) -> None:
    owner = _owner(cpu_mesh)
    change(owner)
    created = _own_runs(owner, outcomes)
    assert created.fallback_reason == reason and created.declines == ()


def test_a_global_step_hook_sends_the_initialisation_to_the_own_path(
    cpu_mesh: DeviceMesh, standin: Any, outcomes: List[StateAdoptionOutcome]
) -> None:
    ran: List[int] = []
    handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: ran.append(1))
    try:
        created = _own_runs(_owner(cpu_mesh), outcomes)
    finally:
        handle.remove()
    assert created.fallback_reason == (
        "global optimizer step hooks are registered (or cannot be inspected), which the own initialisation runs"
    )
    assert ran == [1]


def test_switches_and_disabling_by_name_reach_the_initialisation(
    cpu_mesh: DeviceMesh, standin: Any, outcomes: List[StateAdoptionOutcome], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _own_runs(_owner(cpu_mesh, config=config_with(optimizer_state_adoption=False)), outcomes).fallback_reason == (
        "OptimizerConfig.optimizer_state_adoption is False"
    )
    outcomes.clear()
    monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    assert _own_runs(_owner(cpu_mesh), outcomes).fallback_reason == f"{DISABLE_ENV_VAR}=1 is set"
    outcomes.clear()
    monkeypatch.delenv(DISABLE_ENV_VAR)
    _own_path_disabled(monkeypatch)
    created = _own_runs(_owner(cpu_mesh), outcomes)
    assert (STANDIN, f"disabled by {DISABLED_ADOPTERS_ENV_VAR}") in created.declines


DECLINES = {
    "a parameter has a gradient": (_with_gradient, "parameter 1 has a grad, which a step would apply"),
    "precision-aware owner": (
        lambda owner: setattr(owner, "config", types.SimpleNamespace(optimizer_cpu_offload=False, use_precision_aware_optimizer=True)),
        "use_precision_aware_optimizer is set: the optimizer is precision-aware",
    ),
    "TE master weights": (
        lambda owner: setattr(owner.optimizer, "master_weights", True),
        "FusedAdam.master_weights is set",
    ),
}


@pytest.mark.parametrize("change, reason", DECLINES.values(), ids=DECLINES.keys())
def test_each_decline_rule_of_the_default_adopter_names_itself(
    cpu_mesh: DeviceMesh, standin: Any, outcomes: List[StateAdoptionOutcome], change: Any, reason: str
) -> None:
    """(The owner and the optimizer here are our test objects: changing them is the test's input.)"""
    owner = _owner(cpu_mesh)
    change(owner)
    if reason == "FusedAdam.master_weights is set":  # the stand-in cannot step with master weights
        outcome = initialize_inner_optimizer_state(owner, lambda: None, registry=registry_of(standin_adopter()))
    else:
        outcome = _own_runs(owner, outcomes)
    assert outcome.declines[0][1] == reason
    assert outcome.fallback_reason == "every state initializer declined"


class _Initializer:
    """An initializer test double that accepts and then misbehaves in one given way."""

    def __init__(self, behaviour: str) -> None:
        self.name = f"test_{behaviour}"
        self.behaviour = behaviour

    def decline_reason(self, context: Any) -> Any:
        return "not an adopter"

    def adopt(self, context: Any) -> None:
        raise AssertionError("never adopts")

    def initialize_decline_reason(self, context: Any) -> Any:
        return None

    def initialize_state(self, context: Any) -> None:
        optimizer = context.optimizer
        params = _params(optimizer)
        optimizer.initialize_state(params[0])
        if self.behaviour == "raises":
            raise RuntimeError("initializer exploded")
        if self.behaviour == "changes_a_group":
            optimizer.param_groups[0]["lr"] = 99.0
        if self.behaviour in ("skips_the_last_param", "replaces_a_group", "appends_to_a_group", "adds_foreign_state"):
            optimizer.initialize_state(params[1])  # params[2] is empty, params[3] stays without state
        if self.behaviour in ("replaces_a_group", "appends_to_a_group", "adds_foreign_state"):
            optimizer.initialize_state(params[2])
            optimizer.initialize_state(params[3])
        if self.behaviour == "replaces_a_group":
            optimizer.param_groups[0] = dict(optimizer.param_groups[0])  # equal, but not the group
        if self.behaviour == "appends_to_a_group":
            optimizer.param_groups[0]["params"].append(torch.zeros(1))
        if self.behaviour == "adds_foreign_state":
            optimizer.state[torch.zeros(1)] = {"exp_avg": torch.zeros(1)}


@pytest.mark.parametrize(
    "behaviour, problem",
    [
        ("raises", "RuntimeError: initializer exploded"),
        ("leaves_params_without_state", "parameter 1 has no state"),
        ("changes_a_group", "the param groups changed"),
        ("skips_the_last_param", "parameter 3 has no state"),  # after the empty shard, parameter 2
        ("replaces_a_group", "the param groups changed"),
        ("appends_to_a_group", "the param groups changed"),
        ("adds_foreign_state", "there is state for something that is no parameter of the optimizer"),
    ],
)
def test_a_failing_initializer_is_rolled_back_and_the_own_path_runs(
    cpu_mesh: DeviceMesh, outcomes: List[StateAdoptionOutcome], caplog: pytest.LogCaptureFixture, behaviour: str, problem: str
) -> None:
    owner = _owner(cpu_mesh)
    initializer = _Initializer(behaviour)
    handle = register_state_adopter(initializer, prepend=True)
    try:
        with caplog.at_level(logging.WARNING, logger="megatron.core.optimizer.state_adoption"):
            created = _own_runs(owner, outcomes)
    finally:
        handle.remove()
    assert created.fallback_reason == f"adopter '{initializer.name}' failed to initialize the state"
    error = problem if behaviour == "raises" else f"RuntimeError: the initialized state is incomplete: {problem}"
    assert caplog.messages == [
        f"Optimizer state adopter '{initializer.name}' failed to initialize the state ({error}); the optimizer "
        "was restored and the own initialisation runs instead"
    ]
    assert [g["lr"] for g in owner.optimizer.param_groups] == [1e-2, 1e-2]
    assert len(owner.optimizer.state) == len(SHAPES)  # the dummy step's state, nothing of the initializer's


def test_an_own_initialisation_that_raises_is_recorded_and_re_raised(cpu_mesh: DeviceMesh) -> None:
    def own() -> None:
        raise ValueError("dummy step failed")

    registry = registry_of()
    recorded: List[StateAdoptionOutcome] = []
    registry.register_outcome_hook(recorded.append)
    with pytest.raises(ValueError, match="dummy step failed"):
        initialize_inner_optimizer_state(_owner(cpu_mesh), own, registry=registry)
    (created,) = recorded
    assert created.error == "ValueError: dummy step failed" and created.fallback_reason == "no registered adopter is a state initializer"


class _CreatingInitializer(_Initializer):
    """Creates the state of every parameter whose local shard is not empty, and nothing else."""

    def initialize_state(self, context: Any) -> None:
        for param in _params(context.optimizer):
            if param.to_local().numel() > 0:
                context.optimizer.initialize_state(param)


def _initialize_with(owner: CpuDistributedOptimizer, *adopters: Any, own: Any = None) -> StateAdoptionOutcome:
    return initialize_inner_optimizer_state(owner, own or (lambda: None), registry=registry_of(*adopters))


def test_an_empty_shard_may_stay_without_state_and_groups_may_carry_a_step_already(cpu_mesh: DeviceMesh) -> None:
    """Completeness means state for every parameter with a non-empty local shard; a group's
    ``step`` (there before, advanced or created by the initializer) is not a change."""
    owner = _owner(cpu_mesh)
    owner.optimizer.param_groups[0]["step"] = 7
    outcome = _initialize_with(owner, _CreatingInitializer("creating"))
    assert outcome.adopter == "test_creating" and _params(owner.optimizer)[2] not in owner.optimizer.state
    owner = _owner(cpu_mesh)
    owner.optimizer.param_groups[0]["step"] = 7
    assert _initialize_with(owner, standin_adopter()).adopter == "te_fused_adam_fp32"
    assert [g["step"] for g in owner.optimizer.param_groups] == [8, 1]  # TE's step advanced or created it


def test_an_initializer_may_replace_a_params_list_by_an_equal_one(cpu_mesh: DeviceMesh) -> None:
    class _Relisting(_CreatingInitializer):
        def initialize_state(self, context: Any) -> None:
            super().initialize_state(context)
            context.optimizer.param_groups[1]["params"] = list(context.optimizer.param_groups[1]["params"])

    assert _initialize_with(_owner(cpu_mesh), _Relisting("relisting")).adopter == "test_relisting"


def test_initializers_are_asked_in_order_past_adopters_and_declining_initializers(cpu_mesh: DeviceMesh) -> None:
    class _Declining(_CreatingInitializer):
        def initialize_decline_reason(self, context: Any) -> Any:
            return "not today"

    adopter_only = PyTorchLoaderAdopter("adopter_only")
    outcome = _initialize_with(_owner(cpu_mesh), adopter_only, _Declining("declining"), _CreatingInitializer("creating"))
    assert outcome.adopter == "test_creating" and outcome.declines == (("test_declining", "not today"),)
    assert adopter_only.checked == []  # an adopter that is no initializer is not asked


def test_an_owner_without_configs_reaches_the_initializers_which_decline_it(cpu_mesh: DeviceMesh) -> None:
    bare = types.SimpleNamespace(optimizer=_owner(cpu_mesh).optimizer)  # no config, ddp_config, stub flag
    outcome = _initialize_with(bare, standin_adopter())
    assert outcome.declines == (("te_fused_adam_fp32", "the owner's OptimizerConfig is unknown"),)


def test_missing_step_hook_registries_count_as_hooks(cpu_mesh: DeviceMesh) -> None:
    owner = _owner(cpu_mesh)
    del owner.optimizer._optimizer_step_post_hooks  # our test optimizer, without its registry
    created: List[Any] = []
    outcome = _initialize_with(owner, standin_adopter(), own=lambda: created.append(1))
    assert outcome.fallback_reason == "the optimizer's step post-hooks cannot be inspected" and created == [1]


def test_an_interrupted_check_ends_in_an_outcome_and_propagates(cpu_mesh: DeviceMesh) -> None:
    class _Interrupting(_CreatingInitializer):
        def initialize_decline_reason(self, context: Any) -> Any:
            raise KeyboardInterrupt("stop")

    class _Declining(_CreatingInitializer):
        def initialize_decline_reason(self, context: Any) -> Any:
            return "no"

    owner = _owner(cpu_mesh)
    registry = registry_of(_Declining("first"), _Interrupting("interrupting"))
    recorded: List[StateAdoptionOutcome] = []
    registry.register_outcome_hook(recorded.append)
    with pytest.raises(KeyboardInterrupt):
        initialize_inner_optimizer_state(owner, lambda: None, registry=registry)
    (outcome,) = recorded
    assert (outcome.hook_point, outcome.adopter, outcome.declines) == ("initialize", None, (("test_first", "no"),))
    assert outcome.fallback_reason == "interrupted while consulting the adopters"
    assert outcome.error == "KeyboardInterrupt: stop" and outcome.optimizer.startswith("FusedAdamStandIn 0x")


def test_an_own_initialisation_without_a_qualified_name_is_named_by_its_repr(cpu_mesh: DeviceMesh) -> None:
    own = functools.partial(lambda owner: None, None)
    outcome = _initialize_with(_owner(cpu_mesh), own=own)
    assert outcome.method == repr(own)


def test_the_default_adopter_checks_every_parameter_the_te_release_and_decoupled_gradients(cpu_mesh: DeviceMesh) -> None:
    owner = _owner(cpu_mesh)
    param = _params(owner.optimizer)[3]
    param.decoupled_grad = torch.zeros_like(param)  # what MCore sets in precision-aware runs
    assert standin_adopter().initialize_decline_reason(StateExportContext.for_owner(owner)) == (
        "parameter 3 has a decoupled_grad, which a step would apply"
    )
    bf16 = _owner(cpu_mesh)
    bf16.optimizer.param_groups[1]["params"][1] = torch.nn.Parameter(_dtensor(torch.zeros(3, dtype=torch.bfloat16), cpu_mesh))
    assert standin_adopter().initialize_decline_reason(StateExportContext.for_owner(bf16)) == (
        "parameter 3: is torch.bfloat16, not torch.float32"
    )
    te_2_0 = _owner(cpu_mesh)
    te_2_0.optimizer = FusedAdamStandIn(te_2_0.optimizer.param_groups, lr=1e-2, te_release=(2, 0))
    adopter = TEFusedAdamFP32StateAdopter(fused_adam_class=FusedAdamStandIn, param_device_type="cpu", te_version="2.0.0")
    assert adopter.initialize_decline_reason(StateExportContext.for_owner(te_2_0)) is None
