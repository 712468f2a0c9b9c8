"""Fail-safety: whatever an adopter or the input does, the optimizer ends as its own loader
leaves it, or the call raises what upstream raises.

Three parts: adopters whose check misbehaves or whose install fails (rolled back, then the own
loader runs), plugin-author mistakes that do not raise (caught after the install), and
malformed or unusual input (adopted, loaded by the own loader, or upstream's error). Real
``torch.optim`` optimizers; TE's loader is reproduced by ``FusedAdamStandIn``, which counts
every state tensor it allocates.
"""

import logging
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from adopters_for_tests import (
    GarbageCheckAdopter,
    HalfInstallingAdopter,
    PyTorchLoaderAdopter,
    RaisingCheckAdopter,
)
from builders import (
    registry_of,
    load_through,
    Owner,
    assert_bitwise_equal,
    cloned_state_dict,
    fresh_standin,
    standin_registry,
    state_tensors,
    trained_standin,
)
from fused_adam_standin import FusedAdamStandIn
from outcome_recording import recorded_outcomes
from real_optimizers import assert_same_state, cloned, fresh_adam, params_of, trained_adam

from megatron.core.optimizer.state_adoption import (
    StateAdoptionContext,
    export_inner_optimizer_state_dict,
)

LOGGER = "megatron.core.optimizer.state_adoption"


def _tes_loader_result() -> List[torch.Tensor]:
    """The state TE's own loader produces for the standard payload."""
    reference = fresh_standin()
    reference.load_state_dict(cloned_state_dict(trained_standin()))
    return state_tensors(reference)


def _adam_payload() -> Dict[str, Any]:
    """A trained Adam's state dict whose learning rates then changed (a scheduler's)."""
    state_dict = cloned(trained_adam().state_dict())
    state_dict["param_groups"][0]["lr"] = 2e-3
    return state_dict


def _adam_loaded_by_its_own_loader() -> torch.optim.Adam:
    reference = fresh_adam()
    reference.load_state_dict(_adam_payload())
    return reference


# --- checks that misbehave ----------------------------------------------------------------


@pytest.mark.parametrize(
    "adopter, reason",
    [
        (RaisingCheckAdopter("raising"), "check raised RuntimeError: check exploded"),
        (GarbageCheckAdopter("garbage"), "check returned int instead of None or a reason"),
    ],
    ids=["raises", "returns garbage"],
)
def test_a_check_that_raises_or_answers_garbage_is_a_logged_decline(adopter: Any, reason: str, caplog) -> None:
    later = PyTorchLoaderAdopter("later")
    optimizer = fresh_standin()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outcome = load_through(optimizer, cloned_state_dict(trained_standin()), registry_of(adopter, later))
    assert outcome.declines == ((adopter.name, reason),) and outcome.adopter == "later"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert repr(adopter.name) in warning
    assert_bitwise_equal(state_tensors(optimizer), _tes_loader_result())


# --- installs that fail -------------------------------------------------------------------


@pytest.mark.parametrize("mutate_incoming", [False, True], ids=["raises", "mutates the incoming dict, then raises"])
def test_an_adopter_failing_half_way_is_rolled_back_then_the_own_loader_runs(mutate_incoming: bool, caplog) -> None:
    later = PyTorchLoaderAdopter("later")
    registry = registry_of(HalfInstallingAdopter(mutate_incoming=mutate_incoming), later)
    optimizer = fresh_standin()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outcome = load_through(optimizer, cloned_state_dict(trained_standin()), registry)
    assert outcome.adopter is None and outcome.method == "FusedAdamStandIn.load_state_dict"
    assert outcome.fallback_reason == "adopter 'half_installing' failed while installing the state"
    assert "(RuntimeError: failed half-way)" in caplog.text
    assert later.checked == []  # the optimizer's own loader, not the next adopter
    assert optimizer.allocations == len(state_tensors(optimizer)) == 8
    assert all("bogus" not in entry for entry in optimizer.state.values())
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]
    assert optimizer.param_groups[0]["lr"] == 1e-3
    assert_bitwise_equal(state_tensors(optimizer), _tes_loader_result())


class _RecordingStandIn(FusedAdamStandIn):
    """Records the containers its own loader finds, and every ``__setstate__``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: List[Dict[str, Any]] = []
        self.setstate_calls = 0

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.setstate_calls = getattr(self, "setstate_calls", 0) + 1
        super().__setstate__(state)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.seen.append(
            {
                "state": self.state,
                "entries": {p: dict(e) for p, e in self.state.items()},
                "groups": list(self.param_groups),
                "group_entries": [dict(g) for g in self.param_groups],
                "params": [list(g["params"]) for g in self.param_groups],
            }
        )
        super().load_state_dict(state_dict)


def test_the_rollback_restores_the_containers_exactly_without_setstate() -> None:
    """The own loader then finds the very state, entries, groups and parameters of before the
    call; the rollback assigns ``state`` and ``param_groups`` instead of calling __setstate__
    (which an optimizer may override, e.g. Adam's converts ``step`` values)."""
    optimizer = trained_standin()
    recording = _RecordingStandIn(optimizer.param_groups, lr=1e-3)
    recording.load_state_dict(optimizer.state_dict())  # holds state, like a resumed optimizer
    state, groups = recording.state, list(recording.param_groups)
    entries = {p: dict(e) for p, e in recording.state.items()}
    group_entries = [dict(g) for g in recording.param_groups]
    recording.seen.clear()
    recording.setstate_calls = 0
    load_through(recording, cloned_state_dict(trained_standin()), registry_of(HalfInstallingAdopter()))
    (seen,) = recording.seen
    assert seen["state"] is state and seen["entries"].keys() == entries.keys()
    assert all(seen["entries"][p][k] is v for p, e in entries.items() for k, v in e.items())
    assert all(a is b for a, b in zip(seen["groups"], groups)) and seen["group_entries"] == group_entries
    assert [len(p) for p in seen["params"]] == [2, 2]
    assert recording.setstate_calls == 1  # PyTorch's loader's own, as upstream


# --- plugin-author mistakes that do not raise ---------------------------------------------


class _Mistaken:
    """Accepts everything; ``adopt`` runs ``install(context)``."""

    def __init__(self, name: str, install: Callable[[StateAdoptionContext], Any]) -> None:
        self.name = name
        self.install = install

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: StateAdoptionContext) -> Any:
        return self.install(context)


def _pytorch_loader(context: StateAdoptionContext) -> None:
    torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))


def _only_some_params(context: StateAdoptionContext) -> None:
    _pytorch_loader(context)
    del context.optimizer.state[params_of(context.optimizer)[3]]


def _a_key_missing(context: StateAdoptionContext) -> None:
    _pytorch_loader(context)
    del context.optimizer.state[params_of(context.optimizer)[1]]["exp_avg_sq"]


def _a_key_added(context: StateAdoptionContext) -> None:
    _pytorch_loader(context)
    context.optimizer.state[params_of(context.optimizer)[1]]["master_param"] = torch.zeros(2, 3)


def _state_for_a_stranger(context: StateAdoptionContext) -> None:
    _pytorch_loader(context)
    context.optimizer.state[torch.zeros(1)] = {"exp_avg": torch.zeros(1)}


def _groups_copied_from_the_state_dict(context: StateAdoptionContext) -> None:
    """Forgets that PyTorch's loader puts the optimizer's parameters into the incoming groups."""
    _pytorch_loader(context)
    context.optimizer.param_groups = [dict(group) for group in context.state_dict["param_groups"]]


def _only_the_groups(context: StateAdoptionContext) -> None:
    torch.optim.Optimizer.load_state_dict(
        context.optimizer, {"state": {}, "param_groups": context.state_dict["param_groups"]}
    )


def _state_keyed_by_ids(context: StateAdoptionContext) -> None:
    _pytorch_loader(context)
    context.optimizer.state = context.state_dict["state"]  # type: ignore[assignment]


def _only_the_state(context: StateAdoptionContext) -> None:
    """Forgets the groups' hyper-parameters (TE keeps its per-group ``step`` there)."""
    for state_id, param in zip(
        (i for g in context.state_dict["param_groups"] for i in g["params"]), params_of(context.optimizer)
    ):
        context.optimizer.state[param] = dict(context.state_dict["state"][state_id])


MISTAKES = {
    "state for only some parameters": _only_some_params,
    "a key missing": _a_key_missing,
    "a key added": _a_key_added,
    "state for a tensor that is no parameter": _state_for_a_stranger,
    "param groups holding ids instead of parameters": _groups_copied_from_the_state_dict,
    "only the groups installed": _only_the_groups,
    "the state keyed by ids": _state_keyed_by_ids,
    "only the state installed, not the groups": _only_the_state,
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_an_install_that_does_not_match_the_incoming_state_is_undone(case: str, caplog) -> None:
    """A plugin's ``adopt`` that returns normally but installed something other than the
    incoming state is caught after the install: rolled back, and the own loader runs."""
    optimizer = fresh_adam()
    registry = registry_of(_Mistaken("mistaken", MISTAKES[case]))
    with caplog.at_level(logging.WARNING, logger=LOGGER), recorded_outcomes(registry) as outcomes:
        outcome = load_through(optimizer, _adam_payload(), registry)
    assert outcomes == [outcome]
    assert outcome.adopter is None and outcome.method == "Adam.load_state_dict"
    assert outcome.fallback_reason == "adopter 'mistaken' failed while installing the state"
    assert "'mistaken' failed while installing the state" in caplog.text
    assert_same_state(optimizer, _adam_loaded_by_its_own_loader())
    assert all(isinstance(p, torch.nn.Parameter) for p in params_of(optimizer))


class _Opaque:
    """A hyper-parameter value without its own ``==`` (PyTorch's loader deep-copies groups)."""


def test_a_correct_install_with_unusual_hyper_parameters_is_kept() -> None:
    """The check after the install compares hyper-parameters by value: deep copies of objects
    without ``==``, NaN and tensors are the state dict's."""
    state_dict = _adam_payload()
    for group in state_dict["param_groups"]:
        group.update(config=_Opaque(), max_lr=float("nan"), lr_tensor=torch.tensor([0.1, 0.2]))
    optimizer = fresh_adam()
    outcome = load_through(optimizer, state_dict, registry_of(PyTorchLoaderAdopter("pytorch")))
    assert outcome.adopter == "pytorch" and outcome.reused_bytes == 200
    assert isinstance(optimizer.param_groups[0]["config"], _Opaque)


@pytest.mark.parametrize("returned", [10**12, "many", -1, object()], ids=["a huge claim", "text", "negative", "an object"])
def test_a_value_returned_from_adopt_is_ignored_and_the_install_measured(returned: Any) -> None:
    """``adopt`` returns None; what it returns anyway is no claim: the outcome is measured."""

    def install(context: StateAdoptionContext) -> Any:
        _pytorch_loader(context)
        return returned

    optimizer = fresh_adam()
    outcome = load_through(optimizer, _adam_payload(), registry_of(_Mistaken("claims", install)))
    assert outcome.adopter == "claims" and outcome.reused_bytes == 200 and outcome.allocated_bytes == 0
    assert_same_state(optimizer, _adam_loaded_by_its_own_loader())


class _Interrupt(BaseException):
    """A BaseException that is no Exception, like KeyboardInterrupt or SystemExit."""


class _Interrupted(PyTorchLoaderAdopter):
    """An adopter and exporter that raises ``error`` from the method named ``where``."""

    def __init__(self, where: str, error: BaseException) -> None:
        super().__init__("interrupted")
        self.where, self.error = where, error

    def _maybe_raise(self, method: str) -> None:
        if method == self.where:
            raise self.error

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        self._maybe_raise("decline_reason")
        return None

    def adopt(self, context: StateAdoptionContext) -> None:
        self._maybe_raise("adopt")

    def export_decline_reason(self, context: Any) -> Optional[str]:
        self._maybe_raise("export_decline_reason")
        return None

    def export_state_dict(self, context: Any) -> Dict[str, Any]:
        self._maybe_raise("export_state_dict")
        raise AssertionError("unreachable")


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3), _Interrupt("plugin")], ids=type)
@pytest.mark.parametrize("where", ["decline_reason", "adopt", "export_decline_reason", "export_state_dict"])
def test_a_base_exception_from_an_adopter_propagates_unchanged(where: str, error: BaseException) -> None:
    """Hole 3: the loader falls back from an adopter's ``Exception`` only: an interrupt or exit
    is not an adopter's bug to fall back from, so it propagates as it would from upstream's
    loader, and neither a later adopter nor the own method runs (the process is being stopped).
    The optimizer is restored first, and the call still ends in an outcome with the error."""
    later = PyTorchLoaderAdopter("later")
    registry = registry_of(_Interrupted(where, error), later)
    optimizer = fresh_standin() if where in ("decline_reason", "adopt") else trained_standin()
    allocations = optimizer.allocations
    state_before = {param: dict(entry) for param, entry in optimizer.state.items()}
    with recorded_outcomes(registry) as outcomes, pytest.raises(type(error)) as raised:
        if where in ("decline_reason", "adopt"):
            load_through(optimizer, cloned_state_dict(trained_standin()), registry)
        else:
            export_inner_optimizer_state_dict(Owner(optimizer), registry=registry)
    assert raised.value is error
    assert later.checked == [] and optimizer.allocations == allocations
    assert {param: dict(entry) for param, entry in optimizer.state.items()} == state_before
    assert [(o.adopter, o.error) for o in outcomes] == [(None, f"{type(error).__name__}: {error}")]
    assert outcomes[0].fallback_reason == "interrupted while consulting the adopters"
    assert outcomes[0].hook_point == ("load" if where in ("decline_reason", "adopt") else "export")
    assert outcomes[0].optimizer == f"FusedAdamStandIn {id(optimizer):#x} (4 params, 232 elements)"


# --- malformed or unusual input -----------------------------------------------------------

ADOPTED, FALLBACK = "adopted", "fallback"


def _assert_consistent(optimizer: torch.optim.Optimizer, incoming: Dict[str, Any], result: str) -> None:
    """Per parameter all incoming tensors (adopted) or all fresh ones (own loader); no state
    tensor aliases another or a parameter."""
    ids = [i for g in incoming["param_groups"] for i in g["params"]]
    storages = {p.untyped_storage().data_ptr(): f"param {n}" for n, p in enumerate(params_of(optimizer))}
    for index, (state_id, param) in enumerate(zip(ids, params_of(optimizer))):
        installed = optimizer.state.get(param, {})
        offered = incoming["state"].get(state_id, {})
        assert set(installed) == {k for k, v in offered.items() if v is not None}, index
        same = [installed[k] is offered[k] for k in installed]
        assert all(same) if result == ADOPTED else not any(same), (index, result, same)
        for key, tensor in installed.items():
            ptr = tensor.untyped_storage().data_ptr()
            assert ptr not in storages, f"parameter {index} {key} aliases {storages.get(ptr)}"
            storages[ptr] = f"parameter {index} {key}"


def _payload(mutate: Callable[[Dict[str, Any]], Any], **optimizer_kwargs: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        state_dict = cloned_state_dict(trained_standin())
        mutate(state_dict)
        return fresh_standin(**optimizer_kwargs), state_dict

    return build


def _moment(index: int, key: str, make: Callable[[torch.Tensor], Any]) -> Callable[[Dict[str, Any]], None]:
    def mutate(state_dict: Dict[str, Any]) -> None:
        state_dict["state"][index][key] = make(state_dict["state"][index][key])

    return mutate


def _from_bf16_run(state_dict: Dict[str, Any]) -> None:
    for entry in state_dict["state"].values():
        for key in entry:
            entry[key] = entry[key].bfloat16()


def _missing_param(state_dict: Dict[str, Any]) -> None:
    state_dict["param_groups"][1]["params"].pop()
    state_dict["state"].pop(3)


def _extra_param(state_dict: Dict[str, Any]) -> None:
    state_dict["param_groups"][1]["params"].append(4)
    state_dict["state"][4] = {k: torch.zeros(5) for k in ("exp_avg", "exp_avg_sq")}


INPUTS: Dict[str, tuple] = {
    "standard FP32 payload": (_payload(lambda sd: None), ADOPTED),
    "wrong shape": (_payload(_moment(0, "exp_avg", lambda t: t[:10])), RuntimeError),
    "other model, same parameter count": (
        _payload(lambda sd: sd["state"].__setitem__(1, {k: torch.zeros(8, 16) for k in ("exp_avg", "exp_avg_sq")})),
        RuntimeError,
    ),
    "BF16 moments into an FP32 run": (_payload(_from_bf16_run), FALLBACK),
    "FP32 moments into a BF16-moment run": (
        _payload(lambda sd: None, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
        FALLBACK,
    ),
    "moments aliasing each other": (
        _payload(lambda sd: sd["state"][0].__setitem__("exp_avg_sq", sd["state"][0]["exp_avg"])),
        FALLBACK,
    ),
    "an extra master_param key": (
        _payload(lambda sd: sd["state"][0].__setitem__("master_param", sd["state"][0]["exp_avg"].clone())),
        FALLBACK,
    ),
    "exp_avg_sq missing": (_payload(lambda sd: sd["state"][2].pop("exp_avg_sq")), FALLBACK),
    "no state for one parameter": (_payload(lambda sd: sd["state"].pop(2)), FALLBACK),
    "a parameter missing": (_payload(_missing_param), ValueError),
    "an extra parameter": (_payload(_extra_param), ValueError),
    "an extra group": (
        _payload(lambda sd: sd["param_groups"].append({**sd["param_groups"][1], "params": []})),
        ValueError,
    ),
    "no param_groups": (_payload(lambda sd: sd.pop("param_groups")), KeyError),
}


@pytest.mark.parametrize("case", list(INPUTS))
def test_unusual_input_is_adopted_loaded_by_the_own_loader_or_raises_as_upstream(case: str) -> None:
    build, expected = INPUTS[case]
    optimizer, state_dict = build()
    if isinstance(expected, type):
        upstream_optimizer, upstream_state_dict = build()
        with pytest.raises(expected) as upstream:
            upstream_optimizer.load_state_dict(upstream_state_dict)
        with pytest.raises(expected) as ours:
            load_through(optimizer, state_dict, standin_registry())
        assert str(ours.value) == str(upstream.value)
        return
    outcome = load_through(optimizer, state_dict, standin_registry())
    assert (outcome.adopter is not None) == (expected == ADOPTED)
    _assert_consistent(optimizer, state_dict, expected)
    assert (optimizer.allocations == 0) == (expected == ADOPTED)
    reference, reference_payload = build()
    reference.load_state_dict(reference_payload)
    for mine, theirs in zip(params_of(optimizer), params_of(reference)):
        assert optimizer.state[mine].keys() == reference.state[theirs].keys()
        for key in optimizer.state[mine]:
            assert torch.equal(optimizer.state[mine][key], reference.state[theirs][key])


def test_a_state_dict_that_cannot_be_copied_for_a_rollback_is_not_offered_to_adopters() -> None:
    """Without a copy there is no rollback, so no adopter may touch it; SGD's own loader runs."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    adopter = PyTorchLoaderAdopter("would_adopt")
    payload = {"state": {0: [1, 2]}, "param_groups": optimizer.state_dict()["param_groups"]}
    outcome = load_through(optimizer, payload, registry_of(adopter))
    assert adopter.adopted == []
    ((name, reason),) = outcome.declines
    assert name == "would_adopt" and reason.startswith("the state dict cannot be copied for a rollback: TypeError(")
    assert outcome.adopter is None and outcome.fallback_reason == "every adopter declined"
    assert optimizer.state[param] == [1, 2]  # what SGD's own loader makes of it


@pytest.mark.parametrize("state_dict", [None, [("state", {})], {"state": [], "param_groups": []}], ids=repr)
def test_a_state_dict_of_the_wrong_type_reaches_the_own_loader(state_dict: Any) -> None:
    with pytest.raises(Exception) as upstream:
        fresh_adam().load_state_dict(state_dict)
    registry = registry_of(PyTorchLoaderAdopter("pytorch"))
    with recorded_outcomes(registry) as outcomes, pytest.raises(type(upstream.value)) as ours:
        load_through(fresh_adam(), state_dict, registry)
    assert str(ours.value) == str(upstream.value)
    assert [o.error for o in outcomes] == [f"{type(upstream.value).__name__}: {upstream.value}"]


def test_a_plain_subclass_of_fused_adam_is_adopted() -> None:
    subclass = type("PlainSubclass", (FusedAdamStandIn,), {})
    optimizer = subclass([p for g in fresh_standin().param_groups for p in g["params"]])
    state_dict = cloned_state_dict(trained_standin())
    state_dict["param_groups"] = state_dict["param_groups"][:1]
    state_dict["param_groups"][0]["params"] = [0, 1, 2, 3]
    outcome = load_through(optimizer, state_dict, standin_registry())
    assert outcome.adopter == "te_fused_adam_fp32"
    _assert_consistent(optimizer, state_dict, ADOPTED)
