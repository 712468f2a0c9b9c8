"""The safeguards around what adopters hand out or leave behind: read targets that overlap,
have the wrong dtype or stride; initializers, whose state their own load must accept; a
state dict the caller keeps; a negated view; an exporter that wrote into the held state.

Every test uses the CPU stand-in for TE's FusedAdam (tests/fused_adam_standin.py reproduces
TE's loading behaviour) and compares with the path upstream Megatron-Core takes.
"""

import re
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from adopters_for_tests import Exporter, ReadTargets, pytorch_state_dict
from builders import Owner, registry_of, standin_adopter
from fused_adam_standin import FusedAdamStandIn
from mcore_owners import CpuFP32Optimizer

from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import (
    AdoptionContext,
    StateAdopterRegistry,
    TEFusedAdamFP32StateAdopter,
    export_inner_optimizer_state_dict,
    initialize_inner_optimizer_state,
    load_inner_optimizer_state_dict,
    reading_optimizer_state,
    store_read_optimizer_state,
    unscaled_state_or_read_target,
)

SHAPES = [(6,), (2, 3), (6,), (5,)]  # parameters 0 and 2 share a shape
KEYS = ("exp_avg", "exp_avg_sq", "master_param")


def _precision_aware(dtype: torch.dtype = torch.float32, remainders: bool = False) -> Owner:
    """A stand-in with BF16 moments and master weights, its state created as pass 1 leaves it."""
    params = [torch.nn.Parameter(torch.full(s, float(i + 1)).to(dtype)) for i, s in enumerate(SHAPES)]
    optimizer = FusedAdamStandIn(
        [{"params": params}],
        master_weights=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        store_param_remainders=remainders,
    )
    for param in params:
        optimizer.initialize_state(param, store_param_remainders=remainders and dtype == torch.bfloat16)
    return Owner(optimizer)


def _checkpoint(owner: Owner) -> Dict[Tuple[int, str], torch.Tensor]:
    """Distinct values per parameter and key, of the dtypes a checkpoint holds."""
    values = {}
    for index, param in enumerate(owner.optimizer.param_groups[0]["params"]):
        for number, key in enumerate(KEYS):
            held = owner.optimizer.state[param][key]
            dtype = torch.int16 if held.dtype == torch.int16 else torch.float32
            values[index, key] = torch.full(param.shape, 0.25 * (3 * index + number + 1)).to(dtype)
    return values


def _resume_read(owner: Owner, registry: StateAdopterRegistry) -> None:
    """Build the read targets, read the checkpoint into them as ``torch_dist`` does (a cast into
    each target), and store them as MCore's pass 2 does."""
    params = owner.optimizer.param_groups[0]["params"]
    with reading_optimizer_state(owner, True, registry):
        targets = {(i, k): unscaled_state_or_read_target(owner, p, k) for i, p in enumerate(params) for k in KEYS}
    for place, value in _checkpoint(owner).items():
        targets[place].copy_(value)
    for (index, key), target in targets.items():
        store_read_optimizer_state(owner, params[index], key, target)


def _state(owner: Owner) -> List[torch.Tensor]:
    return [owner.optimizer.state[p][k].clone() for p in owner.optimizer.param_groups[0]["params"] for k in KEYS]


def _upstream_read_state(**kwargs: Any) -> List[torch.Tensor]:
    owner = _precision_aware(**kwargs)
    _resume_read(owner, registry_of())
    return _state(owner)


def _provider(target_of: Dict[str, Callable[[Any, torch.Tensor], Any]]) -> ReadTargets:
    provider = ReadTargets("bad_targets")
    provider.target_of.update(target_of)
    return provider


_SCRATCH: Dict[Any, torch.Tensor] = {}


def _cached_scratch(optimizer: Any, param: torch.Tensor) -> torch.Tensor:
    return _SCRATCH.setdefault(tuple(param.shape), torch.empty(param.shape))


def _master_of_parameter_0_for_2(optimizer: Any, param: torch.Tensor) -> torch.Tensor:
    params = optimizer.param_groups[0]["params"]
    return optimizer.state[params[0] if param is params[2] else param]["master_param"]


OVERLAPPING_TARGETS = {
    "one FP32 scratch for both moments": lambda: (
        lambda scratch: {"exp_avg": lambda o, p: scratch, "exp_avg_sq": lambda o, p: scratch}
    )(torch.empty(64)[:6]),
    "a scratch cached per shape": lambda: {"exp_avg": _cached_scratch},
    "exp_avg read into the held FP32 master weights": lambda: {
        "exp_avg": lambda optimizer, param: optimizer.state[param]["master_param"]
    },
    "parameter 0's master target for parameter 2": lambda: {"master_param": _master_of_parameter_0_for_2},
}


@pytest.mark.parametrize("targets", OVERLAPPING_TARGETS)
def test_overlapping_read_targets_are_refused_and_the_state_is_upstreams(targets: str) -> None:
    """Each target overlapping another target or a held tensor it does not replace is refused:
    a strict registry raises; otherwise it and the rest are upstream's, and the state after the
    read and store equals upstream's."""
    _SCRATCH.clear()
    with pytest.raises(RuntimeError, match="the target overlaps"):
        _resume_read(_precision_aware(), registry_of(_provider(OVERLAPPING_TARGETS[targets]())))
    _SCRATCH.clear()
    owner = _precision_aware()
    _resume_read(owner, registry_of(_provider(OVERLAPPING_TARGETS[targets]()), strict=False))
    for mine, upstream in zip(_state(owner), _upstream_read_state()):
        assert torch.equal(mine, upstream)


class _CreatingInitializer(TEFusedAdamFP32StateAdopter):
    """The built-in FP32 adopter (for the stand-in) creating other state than its own."""

    name = "creating"

    def __init__(self, state: Callable[[List[torch.Tensor]], List[Dict[str, Any]]]) -> None:
        super().__init__(FusedAdamStandIn, "cpu", "2.20.2")
        self.state = state

    def initialize(self, context: AdoptionContext) -> None:
        params = context.optimizer.param_groups[0]["params"]
        for param, entry in zip(params, self.state(params)):
            context.optimizer.state[param] = entry


def _moments(make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[List[torch.Tensor]], List[Dict[str, Any]]]:
    return lambda params: [{k: make(p) for k in ("exp_avg", "exp_avg_sq")} for p in params]


_SHARED = torch.zeros(4)
CREATED = {
    "BF16 moments": (_moments(lambda p: torch.zeros_like(p, dtype=torch.bfloat16)), "incoming exp_avg is torch.bfloat16"),
    "exp_avg only": (lambda ps: [{"exp_avg": torch.zeros_like(p)} for p in ps], "has keys ['exp_avg']"),
    "the parameter itself": (_moments(lambda p: p.data), "exp_avg overlaps parameter 0"),
    "one tensor for both moments": (lambda ps: [dict.fromkeys(("exp_avg", "exp_avg_sq"), torch.zeros_like(p)) for p in ps],
                                    "exp_avg_sq overlaps incoming exp_avg"),
    "moments shared by two parameters": (_moments(lambda p: _SHARED), "overlaps incoming exp_avg"),
    "another shape": (_moments(lambda p: torch.zeros(2, 2)), "has shape (2, 2), the parameter (4,)"),
}  # fmt: skip


@pytest.mark.parametrize("created", CREATED)
def test_an_initialization_its_own_load_would_not_accept_is_undone(created: str) -> None:
    """The created state must be what the adopter's load accepts as a state dict the call site
    owns: TE's keys and dtypes, the parameter's shape, memory of its own. Anything else is undone
    and the own initialization (the dummy step) runs; a strict registry raises."""
    make, reason = CREATED[created]
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(2)]
    owner, ran = Owner(FusedAdamStandIn([{"params": params}])), []
    own = lambda: ran.append(1)  # noqa: E731
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        initialize_inner_optimizer_state(owner, own, registry=registry_of(_CreatingInitializer(make)), steps=True)
    assert len(owner.optimizer.state) == 0 and "step" not in owner.optimizer.param_groups[0] and ran == []
    initialize_inner_optimizer_state(owner, own, registry=registry_of(_CreatingInitializer(make), strict=False), steps=True)
    assert len(owner.optimizer.state) == 0 and "step" not in owner.optimizer.param_groups[0] and ran == [1]


def test_the_created_state_takes_a_checkpoint_as_the_dummy_steps_does() -> None:
    """Megatron-FSDP's resume: create the state, read the checkpoint into it (only keys the
    state and groups have are read), load. TE's step gives the groups their ``step``, so after
    the resume the step is the checkpoint's 2 and the next one 3, the moments the checkpoint's."""
    checkpoint = FusedAdamStandIn([{"params": [torch.nn.Parameter(torch.ones(4))]}])
    for _ in range(2):
        checkpoint.param_groups[0]["params"][0].grad = torch.full((4,), 1 / 3)
        checkpoint.step()
    param = torch.nn.Parameter(torch.ones(4))
    owner = Owner(FusedAdamStandIn([{"params": [param]}]))
    initialize_inner_optimizer_state(owner, registry=registry_of(standin_adopter()), steps=True)
    held, saved = owner.optimizer.state[param], checkpoint.state[checkpoint.param_groups[0]["params"][0]]
    for key, value in held.items():  # the read: in place, only the keys the state has
        value.copy_(saved[key])
    group, saved_group = owner.optimizer.param_groups[0], checkpoint.param_groups[0]
    group.update({key: saved_group[key] for key in group if key != "params"})
    state_dict = {"state": {0: held}, "param_groups": [dict(group, params=[0])]}
    load_inner_optimizer_state_dict(owner, state_dict, registry=registry_of(standin_adopter()))
    assert owner.optimizer.param_groups[0]["step"] == 2
    assert all(held[k].dtype == torch.float32 and torch.equal(held[k], saved[k]) for k in ("exp_avg", "exp_avg_sq"))
    param.grad = torch.ones(4)
    owner.optimizer.step()
    assert owner.optimizer.param_groups[0]["step"] == 3


@pytest.mark.usefixtures("standin_in_default_registry")
def test_a_state_dict_the_caller_keeps_is_never_shared_by_two_optimizers() -> None:
    """One state dict loaded into two non-distributed FP32Optimizers: upstream's TE loader copies,
    so stepping one changes neither the other nor the caller's dict. The built-in adopter installs
    by reference only tensors the call site created or the optimizer holds already."""
    source = FusedAdamStandIn([{"params": [torch.nn.Parameter(torch.ones(3))]}])
    source.param_groups[0]["params"][0].grad = torch.ones(3)
    source.step()
    state_dict = source.state_dict()
    state_dict["state"] = {k: {n: v.clone() for n, v in e.items()} for k, e in state_dict["state"].items()}
    kept = {n: v.clone() for n, v in state_dict["state"][0].items()}
    owners = [CpuFP32Optimizer(FusedAdamStandIn([{"params": [torch.nn.Parameter(torch.ones(3))]}]), OptimizerConfig()) for _ in range(2)]
    for owner in owners:
        owner.load_state_dict(state_dict)
    first, second = (o.optimizer.state[o.optimizer.param_groups[0]["params"][0]] for o in owners)
    assert first["exp_avg"].data_ptr() != second["exp_avg"].data_ptr()
    owners[0].optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
    owners[0].optimizer.step()
    assert torch.equal(second["exp_avg"], kept["exp_avg"]) and torch.equal(state_dict["state"][0]["exp_avg"], kept["exp_avg"])


def test_a_negated_view_is_declined_and_loaded_as_its_values() -> None:
    source = FusedAdamStandIn([{"params": [torch.nn.Parameter(torch.ones(3))]}])
    source.param_groups[0]["params"][0].grad = torch.ones(3)
    source.step()
    state_dict = source.state_dict()
    moment = state_dict["state"][0]["exp_avg"].clone()
    state_dict["state"][0] = {"exp_avg": torch._neg_view(-moment), "exp_avg_sq": state_dict["state"][0]["exp_avg_sq"].clone()}
    param = torch.nn.Parameter(torch.ones(3))
    registry, outcomes = registry_of(standin_adopter()), []
    registry.register_outcome_hook(outcomes.append)
    load_inner_optimizer_state_dict(Owner(FusedAdamStandIn([{"params": [param]}])), state_dict, owns_state_dict=True, registry=registry)
    assert outcomes[0].adopter is None
    assert outcomes[0].declines == (("te_fused_adam_fp32", "parameter 0: incoming exp_avg is a negated or conjugated view"),)


@pytest.mark.parametrize(
    "target_of, reason",
    [
        ({"master_param": lambda o, p: torch.zeros(p.shape)}, "the target is torch.float32, not torch.int16"),
        ({"exp_avg": lambda o, p: torch.zeros(1).expand(p.shape)}, "the target is not contiguous"),
    ],
    ids=["int16 remainders read into FP32", "a stride-0 target"],
)
def test_read_targets_of_the_wrong_dtype_or_stride_are_refused_before_the_read(target_of: Dict[str, Any], reason: str) -> None:
    with pytest.raises(RuntimeError, match=reason):
        _resume_read(_precision_aware(torch.bfloat16, remainders=True), registry_of(_provider(target_of)))
    owner = _precision_aware(torch.bfloat16, remainders=True)
    _resume_read(owner, registry_of(_provider(target_of), strict=False))
    for mine, upstream in zip(_state(owner), _upstream_read_state(dtype=torch.bfloat16, remainders=True)):
        assert torch.equal(mine, upstream)


def test_an_exporter_that_wrote_into_the_held_state_is_an_error_not_a_fallback() -> None:
    """Its containers can be restored, their contents not: continuing with the own state_dict
    would export the zeroed moments, so even a lenient registry raises."""

    def zeroing(optimizer: Any) -> Any:
        for entry in optimizer.state.values():
            entry["exp_avg"].zero_()
        raise RuntimeError("exporter exploded")

    optimizer = FusedAdamStandIn([{"params": [torch.nn.Parameter(torch.ones(3))]}])
    optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
    optimizer.step()
    with pytest.raises(RuntimeError, match=re.escape(
            "Optimizer state adoption cannot undo this: it wrote into 1 tensor(s) of the optimizer")):  # fmt: skip
        export_inner_optimizer_state_dict(Owner(optimizer), registry=registry_of(Exporter("zeroing", zeroing), strict=False))
    ok = registry_of(Exporter("correct", pytorch_state_dict))
    assert export_inner_optimizer_state_dict(Owner(optimizer), registry=ok)["state"][0]["exp_avg"] is optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]
