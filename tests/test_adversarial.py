"""Adversarial inputs: every case ends adopted, loaded by the fallback, or in upstream's error.

Each case states its expected outcome and, afterwards, checks that the optimizer is
consistent: every parameter's state is either entirely the incoming tensors (adopted) or
entirely fresh tensors (the optimizer's own loader ran), with no state tensor aliasing another
or a parameter. Error cases must raise exactly what the optimizer's own loader raises for the
same input (upstream behaviour). CPU part; TE's loader is reproduced by ``FusedAdamStandIn``.
"""

import gc
import threading
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from builders import (
    Owner,
    cloned_state_dict,
    fresh_standin,
    make_context,
    standin_adopter,
    trained_standin,
)
from fused_adam_standin import FusedAdamStandIn

from megatron.core.optimizer.state_adoption import StateAdoptionContext
from megatron.core.optimizer.state_adoption.loader import _load_inner_state
from megatron.core.optimizer.state_adoption.registry import _StateAdopterRegistry

ADOPTED, FALLBACK = "adopted", "fallback"


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def assert_consistent(optimizer: torch.optim.Optimizer, incoming: Dict[str, Any], outcome: str) -> None:
    """All-or-nothing per parameter and no aliasing, for ``outcome`` adopted or fallback."""
    ids = [i for g in incoming["param_groups"] for i in g["params"]]
    storages: Dict[int, str] = {p.untyped_storage().data_ptr(): f"param {n}" for n, p in enumerate(_params(optimizer))}
    for index, (state_id, param) in enumerate(zip(ids, _params(optimizer))):
        installed = optimizer.state[param]
        offered = incoming["state"].get(state_id, {})
        assert set(installed) == set(k for k, v in offered.items() if v is not None), index
        same = [installed[k] is offered[k] for k in installed]
        assert all(same) if outcome == ADOPTED else not any(same), (index, outcome, same)
        for key, tensor in installed.items():
            if tensor.numel() == 0:
                continue
            ptr = tensor.untyped_storage().data_ptr()
            assert ptr not in storages, f"parameter {index} {key} aliases {storages.get(ptr)}"
            storages[ptr] = f"parameter {index} {key}"


def _own_loader_outcome(build: Callable[[], tuple]) -> Optional[BaseException]:
    """What the optimizer's own loader (upstream behaviour) does with the same input."""
    optimizer, state_dict = build()
    try:
        optimizer.load_state_dict(state_dict)
    except Exception as error:  # the upstream error to compare against
        return error
    return None


def _payload_case(mutate: Callable[[Dict[str, Any]], None], **optimizer_kwargs: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        state_dict = cloned_state_dict(trained_standin())
        mutate(state_dict)
        return fresh_standin(**optimizer_kwargs), state_dict

    return build


def _set_moment(index: int, key: str, make: Callable[[torch.Tensor], Any]) -> Callable[[Dict[str, Any]], None]:
    def mutate(state_dict: Dict[str, Any]) -> None:
        state_dict["state"][index][key] = make(state_dict["state"][index][key])

    return mutate


def _untouched(state_dict: Dict[str, Any]) -> None:
    return None


def _from_bf16_run(state_dict: Dict[str, Any]) -> None:
    """A checkpoint whose moments were saved by a BF16-moment (precision-aware) run."""
    for entry in state_dict["state"].values():
        for key in entry:
            entry[key] = entry[key].bfloat16()


def _other_model_size(state_dict: Dict[str, Any]) -> None:
    """Same parameter count, different shapes: a checkpoint of another model."""
    state_dict["state"][1] = {k: torch.zeros(8, 16) for k in ("exp_avg", "exp_avg_sq")}


def _missing_param(state_dict: Dict[str, Any]) -> None:
    state_dict["param_groups"][1]["params"].pop()
    state_dict["state"].pop(3)


def _extra_param(state_dict: Dict[str, Any]) -> None:
    state_dict["param_groups"][1]["params"].append(4)
    state_dict["state"][4] = {k: torch.zeros(5) for k in ("exp_avg", "exp_avg_sq")}


def _extra_group(state_dict: Dict[str, Any]) -> None:
    state_dict["param_groups"].append({**state_dict["param_groups"][1], "params": []})


CASES: Dict[str, tuple] = {
    "standard FP32 payload": (_payload_case(_untouched), ADOPTED),
    "wrong shape": (_payload_case(_set_moment(0, "exp_avg", lambda t: t[:10])), RuntimeError),
    "other model size (same count)": (_payload_case(_other_model_size), RuntimeError),
    "BF16 moments into FP32 run": (_payload_case(_from_bf16_run), FALLBACK),
    "FP32 moments into BF16-moment run": (
        _payload_case(_untouched, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
        FALLBACK,
    ),
    "FP16 moment": (_payload_case(_set_moment(2, "exp_avg_sq", lambda t: t.half())), FALLBACK),
    "FP64 moment": (_payload_case(_set_moment(2, "exp_avg", lambda t: t.double())), FALLBACK),
    "non-contiguous moment": (_payload_case(_set_moment(1, "exp_avg", lambda t: t.t().contiguous().t())), FALLBACK),
    "moment requiring grad": (_payload_case(_set_moment(0, "exp_avg", lambda t: t.requires_grad_())), FALLBACK),
    "moment aliasing the other": (
        _payload_case(lambda sd: sd["state"][0].__setitem__("exp_avg_sq", sd["state"][0]["exp_avg"])),
        FALLBACK,
    ),
    "per-parameter step (non-TE format)": (
        _payload_case(lambda sd: [e.__setitem__("step", torch.tensor(2.0)) for e in sd["state"].values()]),
        KeyError,
    ),
    "extra master_param key": (
        _payload_case(lambda sd: sd["state"][0].__setitem__("master_param", sd["state"][0]["exp_avg"].clone())),
        FALLBACK,
    ),
    "missing exp_avg_sq": (_payload_case(lambda sd: sd["state"][2].pop("exp_avg_sq")), FALLBACK),
    "missing parameter": (_payload_case(_missing_param), ValueError),
    "extra parameter": (_payload_case(_extra_param), ValueError),
    "extra group": (_payload_case(_extra_group), ValueError),
    "no state for one parameter": (_payload_case(lambda sd: sd["state"].pop(2)), FALLBACK),
}


@pytest.mark.parametrize("case", list(CASES))
def test_adversarial_input(case: str, registry: _StateAdopterRegistry) -> None:
    build, expected = CASES[case]
    optimizer, state_dict = build()
    if isinstance(expected, type):
        upstream = _own_loader_outcome(build)
        assert isinstance(upstream, expected), upstream
        with pytest.raises(expected) as ours:
            _load_inner_state(Owner(optimizer), state_dict, registry)
        assert str(ours.value) == str(upstream)
        return
    _load_inner_state(Owner(optimizer), state_dict, registry)
    assert_consistent(optimizer, state_dict, expected)
    assert (optimizer.allocations == 0) == (expected == ADOPTED)
    reference, reference_payload = build()
    reference.load_state_dict(reference_payload)
    for mine, theirs in zip(_params(optimizer), _params(reference)):
        assert optimizer.state[mine].keys() == reference.state[theirs].keys()
        for key in optimizer.state[mine]:
            assert torch.equal(optimizer.state[mine][key], reference.state[theirs][key])


class _BlockingAdopter:
    """Declines, but only after the test thread said so; lets a load be caught mid-way."""

    name = "blocking"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        self.entered.set()
        assert self.release.wait(timeout=30)
        return "blocked, then declined"

    def adopt(self, context: StateAdoptionContext) -> int:
        raise AssertionError("never accepts")


def test_registration_and_removal_during_a_load_do_not_disturb_it() -> None:
    registry = _StateAdopterRegistry(entry_point_group=None)
    blocking = _BlockingAdopter()
    registry.register(blocking)
    handle = registry.register(standin_adopter())
    optimizer = fresh_standin()
    errors: List[BaseException] = []

    def load() -> None:
        try:
            _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    loader = threading.Thread(target=load)
    loader.start()
    assert blocking.entered.wait(timeout=30)
    handle.remove()  # removed while the load is in progress: the load keeps its snapshot
    late = _BlockingAdopter()
    late.name = "late_blocking"
    registry.register(late, prepend=True)
    blocking.release.set()
    loader.join(timeout=30)
    assert errors == [] and not loader.is_alive()
    assert optimizer.allocations == 0  # adopted by the snapshot's stand-in adopter
    assert [a.name for a in registry.registrations()] == ["late_blocking", "blocking"]


def test_te_api_drift_declines(registry: _StateAdopterRegistry) -> None:
    """A FusedAdam without the attributes the adopter reads is declined, not crashed on."""
    for attribute in ("master_weights", "store_param_remainders", "name_to_dtype_map"):
        optimizer = fresh_standin()
        delattr(optimizer, attribute)
        reason = standin_adopter().decline_reason(make_context(optimizer, cloned_state_dict(trained_standin())))
        assert reason is not None and attribute in reason


def test_twenty_load_cycles_do_not_grow_python_objects(registry: _StateAdopterRegistry) -> None:
    optimizer = trained_standin()

    def cycle() -> None:
        _load_inner_state(Owner(optimizer), cloned_state_dict(optimizer), registry)
        _load_inner_state(Owner(optimizer), optimizer.state_dict(), registry)

    for _ in range(3):
        cycle()
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(20):
        cycle()
    gc.collect()
    assert len(gc.get_objects()) <= before
    assert len(optimizer.state) == len(_params(optimizer))


def test_optimizer_subclass_of_standin_is_accepted_when_nothing_is_overridden(registry) -> None:
    subclass = type("PlainSubclass", (FusedAdamStandIn,), {})
    optimizer = subclass([p for g in fresh_standin().param_groups for p in g["params"]])
    state_dict = cloned_state_dict(trained_standin())
    state_dict["param_groups"] = state_dict["param_groups"][:1]
    state_dict["param_groups"][0]["params"] = [0, 1, 2, 3]
    _load_inner_state(Owner(optimizer), state_dict, registry)
    assert_consistent(optimizer, state_dict, ADOPTED)
