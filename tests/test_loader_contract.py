"""The loader's contract in detail: outcomes, log messages, the export hook point's fail-safety.

Written to kill the mutants that survived the first mutation run (docs/mutation-report.md):
every outcome is compared whole, every message the loader logs for people is compared
exactly, and every way an exporter can misbehave is shown to leave the optimizer as it was
and to return the optimizer's own ``state_dict()``. Real ``torch.optim`` optimizers
throughout.
"""

import logging
import types
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from adopters_for_tests import GarbageCheckAdopter, PyTorchLoaderAdopter, RaisingCheckAdopter
from builders import Owner

from megatron.core.optimizer.state_adoption import (
    StateAdoptionContext,
    StateAdoptionOutcome,
    StateExportContext,
    register_outcome_hook,
)
from megatron.core.optimizer.state_adoption.loader import _export_inner_state, _load_inner_state
from megatron.core.optimizer.state_adoption.registry import _StateAdopterRegistry

PACKAGE_LOGGER = "megatron.core.optimizer.state_adoption"
DISABLE_ENV_VAR = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
INSTANCE_REASON = (
    "the Adam instance has its own {method} (set on the instance, e.g. by a wrapper), which "
    "upstream calls"
)


def _trained_adam() -> torch.optim.Adam:
    """An Adam with two param groups and populated state."""
    generator = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(6,), (2, 3), (5,)]]
    optimizer = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=1e-3)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return optimizer


def _registry(*adopters: Any) -> _StateAdopterRegistry:
    registry = _StateAdopterRegistry(entry_point_group=None)
    for adopter in adopters:
        registry.register(adopter)
    return registry


def _messages(caplog: pytest.LogCaptureFixture) -> List[Tuple[int, str]]:
    """(level, message) of every record the subsystem logged."""
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith(PACKAGE_LOGGER)]


@pytest.fixture
def outcomes() -> Iterator[List[StateAdoptionOutcome]]:
    """Every outcome reported while the test runs."""
    seen: List[StateAdoptionOutcome] = []
    handle = register_outcome_hook(seen.append)
    yield seen
    handle.remove()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger=PACKAGE_LOGGER)
    return caplog


class FixedBytesAdopter:
    """Installs with PyTorch's loader and reports ``result`` as the bytes avoided."""

    def __init__(self, name: str, result: Any) -> None:
        self.name = name
        self.result = result
        self.adopted = 0

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: StateAdoptionContext) -> Any:
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
        self.adopted += 1
        return self.result


class Exporter:
    """Declines every load; exports whatever ``export`` returns for the optimizer."""

    def __init__(
        self,
        name: str,
        export: Callable[[torch.optim.Optimizer], Any],
        decline: Optional[str] = None,
    ) -> None:
        self.name = name
        self.export = export
        self.decline = decline
        self.exports = 0
        self.checks = 0

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return "exports only"

    def adopt(self, context: StateAdoptionContext) -> int:
        raise AssertionError("never accepts a load")

    def export_decline_reason(self, context: StateExportContext) -> Optional[str]:
        self.checks += 1
        return self.decline

    def export_state_dict(self, context: StateExportContext) -> Any:
        self.exports += 1
        return self.export(context.optimizer)


def _pytorch_state_dict(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    return torch.optim.Optimizer.state_dict(optimizer)


def _assert_same_state_dict(left: Dict[str, Any], right: Dict[str, Any]) -> None:
    """Same groups and the very same state tensors (Adam's state_dict holds references)."""
    assert left["param_groups"] == right["param_groups"]
    assert left["state"].keys() == right["state"].keys()
    for key, entry in left["state"].items():
        assert entry.keys() == right["state"][key].keys()
        assert all(entry[name] is right["state"][key][name] for name in entry)


# --- load hook point ----------------------------------------------------------------------


def test_an_adoption_is_logged_with_its_savings_in_mib(outcomes, logs) -> None:
    optimizer = _trained_adam()
    adopter = FixedBytesAdopter("fixed", 5 * 2**19)
    outcome = _load_inner_state(Owner(optimizer), _trained_adam().state_dict(), _registry(adopter))
    assert outcome == StateAdoptionOutcome("load", "Adam", "fixed", 5 * 2**19) and outcomes == [outcome]
    assert _messages(logs) == [
        (
            logging.INFO,
            "Optimizer state adopter 'fixed' installed the Adam state, avoiding 2621440 bytes "
            "(2.5 MiB) of allocation",
        )
    ]


def test_a_fallback_after_declines_is_logged_with_every_decline(outcomes, logs) -> None:
    registry = _registry(RaisingCheckAdopter("raising"), GarbageCheckAdopter("garbage"))
    outcome = _load_inner_state(Owner(_trained_adam()), _trained_adam().state_dict(), registry)
    declines = (
        ("raising", "check raised RuntimeError: check exploded"),
        ("garbage", "check returned int instead of None or a reason"),
    )
    assert outcome == StateAdoptionOutcome(
        "load", "Adam", None, declines=declines, fallback_reason="every adopter declined"
    )
    assert outcomes == [outcome]
    assert _messages(logs) == [
        (
            logging.WARNING,
            "Optimizer state adopter 'raising' raised in its check and is skipped: "
            "RuntimeError: check exploded",
        ),
        (
            logging.WARNING,
            "Optimizer state adopter 'garbage' returned 42 from its check instead of None or "
            "a reason; treating it as a decline",
        ),
        (logging.DEBUG, "Optimizer state adopter 'raising' declined: check raised RuntimeError: check exploded"),
        (
            logging.DEBUG,
            "Optimizer state adopter 'garbage' declined: check returned int instead of None or a reason",
        ),
        (
            logging.INFO,
            "No optimizer state adopter installed the state (every adopter declined): "
            "Adam.load_state_dict runs",
        ),
    ]


@pytest.mark.parametrize(
    "result, problem",
    [
        ("many", "adopt() returned 'many' instead of a byte count"),
        (-3, "adopt() returned a negative byte count -3"),
    ],
)
def test_an_adopter_returning_no_byte_count_is_undone_and_named(result, problem, outcomes, logs) -> None:
    adopter = FixedBytesAdopter("bad_bytes", result)
    later = FixedBytesAdopter("later", 0)
    optimizer = _trained_adam()
    payload = _trained_adam().state_dict()
    outcome = _load_inner_state(Owner(optimizer), payload, _registry(adopter, later))
    assert adopter.adopted == 1 and later.adopted == 0
    assert outcome == StateAdoptionOutcome(
        "load", "Adam", None, fallback_reason="adopter 'bad_bytes' failed while installing the state"
    )
    assert outcomes == [outcome]
    assert _messages(logs) == [
        (
            logging.WARNING,
            f"Optimizer state adopter 'bad_bytes' failed while installing the state (TypeError: "
            f"{problem}); the optimizer was restored and Adam.load_state_dict loads the state instead",
        ),
        (
            logging.INFO,
            "No optimizer state adopter installed the state (adopter 'bad_bytes' failed while "
            "installing the state): Adam.load_state_dict runs",
        ),
    ]


def test_an_adopter_accepting_despite_an_instance_loader_is_named_in_a_warning(outcomes, logs) -> None:
    optimizer = _trained_adam()
    calls: List[Dict[str, Any]] = []

    def load_state_dict(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        calls.append(state_dict)
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]
    permissive = PyTorchLoaderAdopter("permissive")
    payload = _trained_adam().state_dict()
    outcome = _load_inner_state(Owner(optimizer), payload, _registry(permissive))
    reason = INSTANCE_REASON.format(method="load_state_dict")
    assert calls == [payload] and permissive.adopted == []
    assert outcome == StateAdoptionOutcome(
        "load", "Adam", None, declines=(("permissive", f"accepted, but not used: {reason}"),), fallback_reason=reason
    )
    assert _messages(logs)[0] == (
        logging.WARNING,
        f"Optimizer state adopter 'permissive' accepted although {reason}; the instance's method runs",
    )


def test_the_kill_switch_outcome_and_message(monkeypatch, outcomes, logs) -> None:
    monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    adopter = FixedBytesAdopter("fixed", 0)
    outcome = _load_inner_state(Owner(_trained_adam()), _trained_adam().state_dict(), _registry(adopter))
    assert adopter.adopted == 0
    assert outcome == StateAdoptionOutcome("load", "Adam", None, fallback_reason=f"{DISABLE_ENV_VAR} is set")
    assert outcomes == [outcome]
    assert _messages(logs) == [
        (
            logging.DEBUG,
            f"No optimizer state adopter installed the state ({DISABLE_ENV_VAR} is set): "
            "Adam.load_state_dict runs",
        )
    ]


def test_a_state_dict_that_cannot_be_copied_is_not_offered_to_adopters(outcomes) -> None:
    """Without a copy there is no rollback, so no adopter may touch it; SGD's own loader runs."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    adopter = PyTorchLoaderAdopter("would_adopt")
    payload = {"state": {0: [1, 2]}, "param_groups": [{**optimizer.state_dict()["param_groups"][0]}]}
    outcome = _load_inner_state(Owner(optimizer), payload, _registry(adopter))
    assert adopter.adopted == []
    ((name, reason),) = outcome.declines
    assert name == "would_adopt"
    assert reason.startswith("the state dict cannot be copied for a rollback: TypeError(")
    assert outcome.adopter is None and outcome.fallback_reason == "every adopter declined"
    assert optimizer.state[param] == [1, 2]  # what SGD's own loader makes of it


# --- export hook point --------------------------------------------------------------------


def test_an_export_returns_the_exporters_dict_and_skips_non_exporters_and_declines(outcomes, logs) -> None:
    optimizer = _trained_adam()
    exported: List[Dict[str, Any]] = []

    def export(opt: torch.optim.Optimizer) -> Tuple[Dict[str, Any], int]:
        exported.append(_pytorch_state_dict(opt))
        return exported[-1], 3 * 2**20 + 2**19

    plain = PyTorchLoaderAdopter("plain_adopter")  # not an exporter: not consulted, no decline
    declining = Exporter("declining", export, decline="not now")
    good = Exporter("good", export)
    state_dict = _export_inner_state(Owner(optimizer), _registry(plain, declining, good))
    assert state_dict is exported[0] and good.exports == 1
    assert declining.checks == 1 and declining.exports == 0
    outcome = StateAdoptionOutcome("export", "Adam", "good", 3670016, (("declining", "not now"),))
    assert outcomes == [outcome]
    assert _messages(logs) == [
        (logging.DEBUG, "Optimizer state adopter 'declining' declined: not now"),
        (
            logging.INFO,
            "Optimizer state adopter 'good' exported the Adam state, avoiding 3670016 bytes "
            "(3.5 MiB) of allocation",
        ),
    ]


def _raise(error: Exception) -> Callable[[torch.optim.Optimizer], Any]:
    def export(optimizer: torch.optim.Optimizer) -> Any:
        raise error

    return export


def _without_last_group(optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, Any], int]:
    state_dict = _pytorch_state_dict(optimizer)
    return {**state_dict, "param_groups": state_dict["param_groups"][:1]}, 0


BAD_EXPORTS = {
    "raises": (_raise(RuntimeError("exporter broke")), "RuntimeError: exporter broke"),
    "dict only": (_pytorch_state_dict, "TypeError: export_state_dict() did not return (state dict, byte count)"),
    "list of two": (
        lambda o: [_pytorch_state_dict(o), 0],
        "TypeError: export_state_dict() did not return (state dict, byte count)",
    ),
    "three-tuple": (
        lambda o: (_pytorch_state_dict(o), 0, 0),
        "TypeError: export_state_dict() did not return (state dict, byte count)",
    ),
    "negative bytes": (
        lambda o: (_pytorch_state_dict(o), -1),
        "TypeError: export_state_dict() returned a negative byte count -1",
    ),
    "bool bytes": (
        lambda o: (_pytorch_state_dict(o), True),
        "TypeError: export_state_dict() returned True instead of a byte count",
    ),
    "not a dict": (
        lambda o: (list(_pytorch_state_dict(o).items()), 0),
        "TypeError: export_state_dict() returned a list, not a dict",
    ),
    "not a dict and negative bytes": (
        lambda o: (list(_pytorch_state_dict(o).items()), -2),
        "TypeError: export_state_dict() returned a negative byte count -2",
    ),
    "groups do not match": (_without_last_group, "TypeError: the state dict has 1 param groups, the optimizer 2"),
}


@pytest.mark.parametrize("case", list(BAD_EXPORTS))
def test_a_bad_export_falls_back_to_the_own_state_dict(case: str, outcomes, logs) -> None:
    export, problem = BAD_EXPORTS[case]
    optimizer = _trained_adam()
    expected = optimizer.state_dict()
    bad, later = Exporter("bad", export), Exporter("later", _pytorch_state_dict)
    state_dict = _export_inner_state(Owner(optimizer), _registry(bad, later))
    _assert_same_state_dict(state_dict, expected)
    assert bad.exports == 1 and later.checks == 0  # the own state_dict, not the next exporter
    failure = "adopter 'bad' failed to export the state"
    assert outcomes == [StateAdoptionOutcome("export", "Adam", None, fallback_reason=failure)]
    assert _messages(logs) == [
        (
            logging.WARNING,
            f"Optimizer state adopter 'bad' failed to export the state ({problem}); Adam.state_dict "
            "is used instead",
        ),
        (logging.DEBUG, f"No optimizer state adopter exported the state ({failure}): Adam.state_dict runs"),
    ]


def test_an_exporter_that_replaced_the_state_before_failing_is_undone(outcomes) -> None:
    optimizer = _trained_adam()
    state, expected = optimizer.state, optimizer.state_dict()

    def vandalise(opt: torch.optim.Optimizer) -> Any:
        opt.state = defaultdict(dict)
        opt.param_groups[1]["lr"] = 99.0
        raise RuntimeError("half-way")

    state_dict = _export_inner_state(Owner(optimizer), _registry(Exporter("vandal", vandalise)))
    assert optimizer.state is state and optimizer.param_groups[1]["lr"] == 0.5
    _assert_same_state_dict(state_dict, expected)
    assert outcomes[0].fallback_reason == "adopter 'vandal' failed to export the state"


def test_an_export_where_every_exporter_declines(outcomes, logs) -> None:
    optimizer = _trained_adam()
    expected = optimizer.state_dict()
    state_dict = _export_inner_state(Owner(optimizer), _registry(Exporter("no", _pytorch_state_dict, "not mine")))
    _assert_same_state_dict(state_dict, expected)
    assert outcomes == [
        StateAdoptionOutcome(
            "export", "Adam", None, declines=(("no", "not mine"),), fallback_reason="every adopter declined"
        )
    ]
    assert _messages(logs)[-1] == (
        logging.DEBUG,
        "No optimizer state adopter exported the state (every adopter declined): Adam.state_dict runs",
    )


def test_an_export_with_an_instance_state_dict_names_it(outcomes) -> None:
    optimizer = _trained_adam()
    sentinel: Dict[str, Any] = {"state": {}, "param_groups": []}
    optimizer.state_dict = types.MethodType(lambda self: sentinel, optimizer)  # type: ignore[method-assign]
    good = Exporter("good", lambda o: (_pytorch_state_dict(o), 0))
    assert _export_inner_state(Owner(optimizer), _registry(good)) is sentinel
    reason = INSTANCE_REASON.format(method="state_dict")
    assert good.exports == 0
    assert outcomes == [
        StateAdoptionOutcome(
            "export", "Adam", None, declines=(("good", f"accepted, but not used: {reason}"),), fallback_reason=reason
        )
    ]


def test_an_export_without_exporters(outcomes, logs) -> None:
    optimizer = _trained_adam()
    expected = optimizer.state_dict()
    _assert_same_state_dict(_export_inner_state(Owner(optimizer), _registry()), expected)
    assert outcomes == [StateAdoptionOutcome("export", "Adam", None, fallback_reason="no adopter is registered")]
    assert _messages(logs) == [
        (
            logging.DEBUG,
            "No optimizer state adopter exported the state (no adopter is registered): Adam.state_dict runs",
        )
    ]


def test_the_kill_switch_at_the_export_hook_point(monkeypatch, outcomes, logs) -> None:
    monkeypatch.setenv(DISABLE_ENV_VAR, "yes")
    optimizer = _trained_adam()
    expected = optimizer.state_dict()
    good = Exporter("good", lambda o: (_pytorch_state_dict(o), 0))
    _assert_same_state_dict(_export_inner_state(Owner(optimizer), _registry(good)), expected)
    assert good.checks == 0
    assert outcomes == [StateAdoptionOutcome("export", "Adam", None, fallback_reason=f"{DISABLE_ENV_VAR} is set")]
    assert _messages(logs) == [
        (
            logging.DEBUG,
            f"No optimizer state adopter exported the state ({DISABLE_ENV_VAR} is set): Adam.state_dict runs",
        )
    ]


# --- outcome hooks ------------------------------------------------------------------------


def test_outcome_hooks_run_in_registration_order_and_prepend_goes_first() -> None:
    order: List[str] = []
    handles = [
        register_outcome_hook(lambda outcome: order.append("a")),
        register_outcome_hook(lambda outcome: order.append("b")),
        register_outcome_hook(lambda outcome: order.append("c"), prepend=True),
    ]
    try:
        _load_inner_state(Owner(_trained_adam()), _trained_adam().state_dict(), _registry())
    finally:
        for handle in handles:
            handle.remove()
    assert order == ["c", "a", "b"]


def test_a_raising_outcome_hook_is_named_in_the_warning(logs) -> None:
    def broken_hook(outcome: StateAdoptionOutcome) -> None:
        raise RuntimeError("observer broke")

    handle = register_outcome_hook(broken_hook)
    try:
        _load_inner_state(Owner(_trained_adam()), _trained_adam().state_dict(), _registry())
    finally:
        handle.remove()
    assert (
        logging.WARNING,
        f"Optimizer state adoption outcome hook {broken_hook!r} raised RuntimeError: observer broke",
    ) in _messages(logs)
