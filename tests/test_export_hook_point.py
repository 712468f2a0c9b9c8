"""The export hook point: which exporter supplies the inner state dict, and the check of its export.

``export_inner_optimizer_state_dict`` offers the export to the registered adopters that are
state exporters; the first that accepts supplies the state dict, which is checked against the
state the optimizer holds. A mismatch or an exception restores the optimizer and returns its
own ``state_dict()`` instead. Real ``torch.optim.Adam`` (per parameter a 0-d ``step``,
``exp_avg`` and ``exp_avg_sq``); TE's FusedAdam is reproduced by ``FusedAdamStandIn``.
"""

import copy
import logging
from collections import defaultdict
from typing import Any, Callable, Dict

import pytest
import torch
from adopters_for_tests import DecliningAdopter, Exporter, PyTorchLoaderAdopter, pytorch_state_dict
from builders import trained_standin, registry_of, export_through
from outcome_recording import recorded_outcomes
from real_optimizers import assert_unchanged, groups_without_params, held_state, params_of, state_bytes, trained_adam

from megatron.core.optimizer.state_adoption import (
    StateAdoptionOutcome,
)

LOGGER = "megatron.core.optimizer.state_adoption"
FAILED = "adopter 'bad' failed to export the state"


def _assert_is_own_state_dict(exported: Dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """``exported`` is Adam's own state_dict(): its groups and, per parameter, the held tensors."""
    own = optimizer.state_dict()
    assert exported["param_groups"] == own["param_groups"]
    assert exported["state"].keys() == own["state"].keys()
    for state_id, entry in own["state"].items():
        assert exported["state"][state_id].keys() == entry.keys()
        assert all(exported["state"][state_id][key] is value for key, value in entry.items())


# --- routing ------------------------------------------------------------------------------


def test_the_first_accepting_exporter_supplies_the_state_dict() -> None:
    """Hole 1: a correct exporter is used: the outcome names it and measures the held bytes."""
    plain = PyTorchLoaderAdopter("plain_adopter")  # not an exporter: neither asked nor recorded
    declining = Exporter("declining", pytorch_state_dict, decline="not now")
    good, later = Exporter("good", pytorch_state_dict), Exporter("later", pytorch_state_dict)
    registry = registry_of(plain, declining, good, later)
    optimizer = trained_adam()
    with recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    assert exported is good.exports[0] and later.checks == 0 and declining.exports == []
    (outcome,) = outcomes
    assert outcome.hook_point == "export" and outcome.adopter == "good" and outcome.method is None
    assert outcome.declines == (("declining", "not now"),) and outcome.fallback_reason is None
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (state_bytes(optimizer), 0) == (200, 0)
    assert plain.checked == []


@pytest.mark.parametrize(
    "adopters, reason, declines",
    [
        ((), "no registered adopter is a state exporter", ()),
        ((DecliningAdopter("loads_only"),), "no registered adopter is a state exporter", ()),
        (
            (Exporter("a", pytorch_state_dict, decline="not a"), Exporter("b", pytorch_state_dict, decline="not b")),
            "every state exporter declined",
            (("a", "not a"), ("b", "not b")),
        ),
    ],
    ids=["no adopter", "only non-exporters", "every exporter declines"],
)
def test_the_own_state_dict_runs_when_no_exporter_accepts(adopters: tuple, reason: str, declines: tuple) -> None:
    """Hole 6: an export outcome with only non-exporting adopters says so, not "no adopter is
    registered"."""
    registry = registry_of(*adopters)
    optimizer = trained_adam()
    with recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    _assert_is_own_state_dict(exported, optimizer)
    assert outcomes == [
        StateAdoptionOutcome(
            "export",
            outcomes[0].optimizer,
            None,
            method="Adam.state_dict",
            reused_bytes=200,
            declines=declines,
            fallback_reason=reason,
        )
    ]


def test_tes_own_state_dict_is_measured_as_allocating_its_fp32_copies() -> None:
    """Hole 6: TE's state_dict() (stand-in) returns FP32 copies of BF16 moments, which the
    export outcome counts as allocated; FP32 moments it returns as they are, reused."""
    bf16 = trained_standin(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    fp32 = trained_standin()
    registry = registry_of()
    with recorded_outcomes(registry) as outcomes:
        export_through(bf16, registry)
        export_through(fp32, registry)
    assert [(o.reused_bytes, o.allocated_bytes) for o in outcomes] == [(0, 8 * 232), (8 * 232, 0)]
    assert outcomes[0].method == "FusedAdamStandIn.state_dict"


def test_exports_are_logged_for_people(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    optimizer = trained_adam()
    export_through(optimizer, registry_of(Exporter("good", pytorch_state_dict)))
    export_through(optimizer, registry_of())
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith(LOGGER)]
    assert [level for level, _ in messages] == [logging.INFO, logging.DEBUG]
    label = f"Adam {id(optimizer):#x}"
    assert "'good'" in messages[0][1] and label in messages[0][1] and "200 B by reference" in messages[0][1]
    assert "Adam.state_dict" in messages[1][1] and label in messages[1][1]
    assert "no registered adopter is a state exporter" in messages[1][1]


# --- the check of an export ---------------------------------------------------------------


def _held(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """PyTorch's state dict with fresh containers, so a test can change it without touching the
    optimizer's own per-parameter dicts."""
    state_dict = pytorch_state_dict(optimizer)
    return {
        "state": {key: dict(entry) for key, entry in state_dict["state"].items()},
        "param_groups": [dict(group) for group in state_dict["param_groups"]],
    }


def _changed(change: Callable[[Dict[str, Any]], Any]) -> Callable[[torch.optim.Optimizer], Any]:
    def export(optimizer: torch.optim.Optimizer) -> Any:
        state_dict = _held(optimizer)
        change(state_dict)
        return state_dict

    return export


def _permute(state_dict: Dict[str, Any]) -> None:
    state = state_dict["state"]
    state[0], state[2] = state[2], state[0]  # both parameters have shape (6,)


def _with_group(index: int, **changes: Any) -> Callable[[Dict[str, Any]], None]:
    def change(state_dict: Dict[str, Any]) -> None:
        state_dict["param_groups"][index] = {**state_dict["param_groups"][index], **changes}

    return change


def _with_entry(state_id: int, change: Callable[[Dict[str, Any]], Any]) -> Callable[[Dict[str, Any]], None]:
    def apply(state_dict: Dict[str, Any]) -> None:
        change(state_dict["state"][state_id])

    return apply


MALFORMED: Dict[str, tuple] = {
    # case: (export, a fragment of the check's finding)
    "empty state": (_changed(lambda sd: sd.__setitem__("state", {})), "it has state for 0 ids"),
    "state permuted across two same-shape parameters": (_changed(_permute), "is not the held tensor"),
    "a copy instead of the held tensor": (
        _changed(_with_entry(1, lambda e: e.__setitem__("exp_avg", e["exp_avg"].clone()))),
        "exp_avg of parameter 1 is not the held tensor",
    ),
    "a copy of the 0-d step": (
        _changed(_with_entry(3, lambda e: e.__setitem__("step", e["step"].clone()))),
        "step of parameter 3 is not the held tensor",
    ),
    "a missing key": (_changed(_with_entry(3, lambda e: e.pop("exp_avg_sq"))), "the state of parameter 3 has keys"),
    "an extra key": (
        _changed(_with_entry(0, lambda e: e.__setitem__("master_param", torch.zeros(6)))),
        "the state of parameter 0 has keys",
    ),
    "a parameter's state missing": (_changed(lambda sd: sd["state"].pop(2)), "it has state for 3 ids"),
    "state for an unknown id": (
        _changed(lambda sd: sd["state"].__setitem__(9, dict(sd["state"][0]))),
        "it has state for 5 ids",
    ),
    "wrong learning rate": (_changed(_with_group(1, lr=0.25)), "param group 1 has lr=0.25"),
    "a hyper-parameter of another type": (_changed(_with_group(0, betas=[0.9, 0.999])), "param group 0 has betas"),
    "a missing hyper-parameter": (
        _changed(lambda sd: sd["param_groups"][0].pop("amsgrad")),
        "param group 0 has keys",
    ),
    "parameter ids reordered": (_changed(_with_group(0, params=[1, 0])), "param group 0 does not list"),
    "a group missing": (_changed(lambda sd: sd["param_groups"].pop()), "it has 1 param groups"),
    "an extra top-level key": (_changed(lambda sd: sd.__setitem__("version", 1)), "not a dict with exactly"),
    "old API: (state dict, byte count)": (lambda o: (_held(o), 0), "not a dict with exactly"),
    "not a dict": (lambda o: list(_held(o).items()), "not a dict with exactly"),
    "raises": (lambda o: (_ for _ in ()).throw(RuntimeError("exporter broke")), "RuntimeError: exporter broke"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_export_is_refused_and_the_own_state_dict_returned(case: str, caplog: pytest.LogCaptureFixture) -> None:
    """Hole 1: a malformed export is trusted: an export that is not the held state (wiped,
    permuted, copied, keys or groups changed) must fall back to the own state_dict, never be
    returned, and leave the optimizer unchanged."""
    export, finding = MALFORMED[case]
    bad, later = Exporter("bad", export), Exporter("later", pytorch_state_dict)
    registry = registry_of(bad, later)
    optimizer = trained_adam()
    state_before, groups_before = held_state(optimizer), groups_without_params(optimizer)
    with caplog.at_level(logging.WARNING, logger=LOGGER), recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    assert len(bad.exports) <= 1 and all(exported is not e for e in bad.exports)
    _assert_is_own_state_dict(exported, optimizer)
    assert_unchanged(optimizer, state_before, groups_before)
    assert later.checks == 0  # the own state_dict, not the next exporter
    (outcome,) = outcomes
    assert outcome.adopter is None and outcome.method == "Adam.state_dict"
    assert outcome.fallback_reason == FAILED
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "'bad' failed to export the state" in warning and finding in warning, warning


def test_an_exporter_that_replaced_the_state_before_failing_is_undone() -> None:
    optimizer = trained_adam()
    state = optimizer.state
    state_before, groups_before = held_state(optimizer), groups_without_params(optimizer)

    def vandalise(opt: torch.optim.Optimizer) -> Any:
        opt.state = defaultdict(dict)
        opt.param_groups[1]["lr"] = 99.0
        opt.param_groups[0]["params"].pop()
        raise RuntimeError("half-way")

    exported = export_through(optimizer, registry_of(Exporter("vandal", vandalise)))
    assert optimizer.state is state and [len(g["params"]) for g in optimizer.param_groups] == [2, 2]
    assert_unchanged(optimizer, state_before, groups_before)
    _assert_is_own_state_dict(exported, optimizer)


def _mutating(change: Callable[[torch.optim.Optimizer], None]) -> Callable[[torch.optim.Optimizer], Any]:
    """Changes the optimizer, then exports what it now holds (which matches the held state)."""

    def export(optimizer: torch.optim.Optimizer) -> Any:
        change(optimizer)
        return pytorch_state_dict(optimizer)

    return export


def _replace_moments_with_copies(optimizer: torch.optim.Optimizer) -> None:
    for entry in optimizer.state.values():
        entry["exp_avg"] = entry["exp_avg"].clone()


def _drop_a_parameters_state(optimizer: torch.optim.Optimizer) -> None:
    del optimizer.state[params_of(optimizer)[2]]


def _change_the_learning_rate(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[1]["lr"] = 0.25


@pytest.mark.parametrize(
    "change",
    [_replace_moments_with_copies, _drop_a_parameters_state, _change_the_learning_rate],
    ids=["moments replaced by copies", "a parameter's state dropped", "learning rate changed"],
)
def test_an_exporter_that_changes_the_optimizer_is_undone_even_if_its_export_matches(change) -> None:
    """An exporter must change nothing; one that does and then exports the changed state (which
    the check against the held state cannot tell apart) is undone and the own state_dict used."""
    optimizer = trained_adam()
    state_before, groups_before = held_state(optimizer), groups_without_params(optimizer)
    registry = registry_of(Exporter("bad", _mutating(change)))
    with recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    assert_unchanged(optimizer, state_before, groups_before)
    _assert_is_own_state_dict(exported, optimizer)
    assert [(o.adopter, o.fallback_reason) for o in outcomes] == [(None, FAILED)]


def test_an_export_of_another_optimizers_identical_state_is_refused() -> None:
    """E.g. an exporter that reads a cached or twin optimizer: equal values, other tensors."""
    optimizer, twin = trained_adam(), trained_adam()
    registry = registry_of(Exporter("bad", lambda o: pytorch_state_dict(twin)))
    with recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    _assert_is_own_state_dict(exported, optimizer)
    assert outcomes[0].fallback_reason == FAILED


def test_an_exporter_returning_a_deepcopy_is_refused() -> None:
    optimizer = trained_adam()
    registry = registry_of(Exporter("bad", lambda o: copy.deepcopy(pytorch_state_dict(o))))
    with recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    _assert_is_own_state_dict(exported, optimizer)
    assert outcomes[0].fallback_reason == FAILED


def test_an_export_with_aliasing_views_of_the_held_tensors_is_accepted() -> None:
    """The held tensor "itself" includes an exact alias (same storage, offset and stride), e.g.
    ``tensor.detach()``, which an exporter may return."""
    optimizer = trained_adam()

    def detached(o: torch.optim.Optimizer) -> Dict[str, Any]:
        state_dict = _held(o)
        state_dict["state"] = {
            key: {name: value.detach() for name, value in entry.items()} for key, entry in state_dict["state"].items()
        }
        return state_dict

    registry = registry_of(Exporter("good", detached))
    with recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    assert outcomes[0].adopter == "good" and outcomes[0].reused_bytes == 200
    assert exported["state"][0]["exp_avg"] is not optimizer.state[params_of(optimizer)[0]]["exp_avg"]


def test_an_exporter_must_return_the_held_state_of_a_fused_adam_too() -> None:
    """TE's FusedAdam (stand-in) holds FP32 moments; PyTorch's state dict of it is accepted."""
    optimizer = trained_standin()
    registry = registry_of(Exporter("good", pytorch_state_dict))
    with recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    assert outcomes[0].adopter == "good" and outcomes[0].reused_bytes == 8 * 232
    assert exported["param_groups"] == optimizer.state_dict()["param_groups"]



# --- exporters that change one thing only ---------------------------------------------------


def _state_replaced_by_an_equal_mapping(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state = defaultdict(dict, optimizer.state)  # same entries, another container


def _state_given_to_a_stateless_parameter(optimizer: torch.optim.Optimizer) -> None:
    param = params_of(optimizer)[3]  # the state mapping itself stays, one entry more
    optimizer.state[param] = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5)}


def _entry_replaced_by_an_equal_copy(optimizer: torch.optim.Optimizer) -> None:
    param = params_of(optimizer)[1]
    optimizer.state[param] = dict(optimizer.state[param])


def _key_added_to_an_entry(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state[params_of(optimizer)[1]]["max_exp_avg_sq"] = torch.zeros(2, 3)


def _group_replaced_by_an_equal_copy(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[0] = dict(optimizer.param_groups[0])


def _hyper_parameter_added(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[1]["warmup"] = 10


def _parameters_reordered(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[1]["params"].reverse()


def _parameter_appended(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[1]["params"].append(torch.nn.Parameter(torch.zeros(4)))


ONE_CHANGE = {
    "the state mapping replaced by an equal one": _state_replaced_by_an_equal_mapping,
    "state given to a parameter that had none": _state_given_to_a_stateless_parameter,
    "a state entry replaced by an equal copy": _entry_replaced_by_an_equal_copy,
    "a key added to a state entry in place": _key_added_to_an_entry,
    "a param group replaced by an equal copy": _group_replaced_by_an_equal_copy,
    "a hyper-parameter added to a group in place": _hyper_parameter_added,
    "a group's parameters reordered in place": _parameters_reordered,
    "a parameter appended to a group in place": _parameter_appended,
}


@pytest.mark.parametrize("case", list(ONE_CHANGE))
def test_an_exporter_that_changes_one_thing_only_is_undone(case: str) -> None:
    """Each change alone, with an export of what the optimizer then holds (so the check of the
    export cannot see it), is caught: the optimizer gets back its very containers and the own
    state_dict is returned."""
    optimizer = trained_adam()
    del optimizer.state[params_of(optimizer)[3]]  # one parameter without state
    state, entries, groups = optimizer.state, list(optimizer.state.values()), list(optimizer.param_groups)
    params = [[id(p) for p in group["params"]] for group in groups]
    state_before, groups_before = held_state(optimizer), groups_without_params(optimizer)
    registry = registry_of(Exporter("bad", _mutating(ONE_CHANGE[case])))
    with recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    assert [(o.adopter, o.fallback_reason) for o in outcomes] == [(None, FAILED)]
    assert optimizer.state is state and [id(e) for e in optimizer.state.values()] == [id(e) for e in entries]
    assert len(optimizer.param_groups) == 2 and all(a is b for a, b in zip(optimizer.param_groups, groups))
    assert [[id(p) for p in group["params"]] for group in optimizer.param_groups] == params
    assert_unchanged(optimizer, state_before, groups_before)
    _assert_is_own_state_dict(exported, optimizer)
    assert sorted(exported["state"]) == [0, 1, 2]


def test_a_params_list_rebuilt_with_the_same_parameters_is_no_change() -> None:
    """A group's parameters are compared one by one, not the list object: an exporter that
    rebuilds the list with the same parameters in the same order changed nothing, and its
    export is used."""

    def rebuild(optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group["params"] = list(group["params"])

    optimizer = trained_adam()
    params = params_of(optimizer)
    registry = registry_of(Exporter("rebuilding", _mutating(rebuild)))
    with recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    (outcome,) = outcomes
    assert outcome.adopter == "rebuilding" and outcome.fallback_reason is None
    assert exported is registry.registrations()[0].adopter.exports[0]  # type: ignore[attr-defined]
    assert all(a is b for a, b in zip(params_of(optimizer), params))


def test_an_exporter_that_moves_a_held_tensor_to_new_memory_is_measured_as_allocating() -> None:
    """The export figure is measured too: a held tensor whose data the exporter moved to a new
    buffer (``tensor.data = copy``) is still the held tensor, but its bytes are new."""

    def move_one(optimizer: torch.optim.Optimizer) -> None:
        held = optimizer.state[params_of(optimizer)[0]]["exp_avg"]
        held.data = held.data.clone()

    optimizer = trained_adam()
    registry = registry_of(Exporter("moving", _mutating(move_one)))
    with recorded_outcomes(registry) as outcomes:
        export_through(optimizer, registry)
    (outcome,) = outcomes
    assert outcome.adopter == "moving"
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (state_bytes(optimizer) - 24, 24)
