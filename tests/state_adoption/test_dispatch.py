"""The one dispatcher, tried at every hook point through its call-site function: first accepting
adopter wins, the gate (switches, instance methods, hooks), fail-safety (raising, nonsense and
writing checks, failed attempts, interrupts, the own code's errors), and one outcome per call.

Each case builds an owner whose inner optimizer is the CPU stand-in for TE's FusedAdam
(tests/fused_adam_standin.py reproduces TE's loading behaviour) and a runner for its hook point.
"""

import collections
import copy
import dataclasses
import logging
import re
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torch.optim import optimizer as torch_optimizer
from adopters_for_tests import (
    DecliningAdopter,
    Exporter,
    GarbageCheckAdopter,
    PyTorchLoaderAdopter,
    RaisingCheckAdopter,
    ReplacingCheckAdopter,
    WritingCheckAdopter,
    pytorch_state_dict,
)
from builders import (
    Owner,
    cloned_state_dict,
    config_with,
    fresh_standin,
    outcome_of,
    registry_of,
    state_tensors,
    trained_standin,
)
from fused_adam_standin import FusedAdamStandIn
from real_optimizers import cloned, fresh_adam, fresh_sgd, trained_adam, trained_sgd

from megatron.core.optimizer.state_adoption import (
    AdoptionOutcome,
    StateAdopter,
    StateAdopterRegistry,
    export_inner_optimizer_state_dict,
    initialize_inner_optimizer_state,
    load_inner_optimizer_state_dict,
    reading_optimizer_state,
    unscaled_state_or_read_target,
)
from megatron.core.optimizer.state_adoption.dispatch import describe, log

LOGGER = "megatron.core.optimizer.state_adoption"
BF16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, master_weights=True)


@dataclasses.dataclass
class Case:
    """One hook point: ``setup()`` gives an owner and a runner ``run(registry) -> result``."""

    point: str
    setup: Callable[[], Tuple[Owner, Callable[[StateAdopterRegistry], Any]]]
    method: str  # upstream's call, which runs when set on the instance
    hook: Optional[str]  # a torch.optim.Optimizer hook registration upstream's call runs
    own: str  # the own code's label in the outcome


def _load() -> Tuple[Owner, Callable[[StateAdopterRegistry], Any]]:
    owner, state_dict = Owner(fresh_standin()), cloned_state_dict(trained_standin())
    return owner, lambda registry: load_inner_optimizer_state_dict(
        owner, state_dict, owns_state_dict=True, registry=registry
    )


def _export() -> Tuple[Owner, Callable[[StateAdopterRegistry], Any]]:
    owner = Owner(trained_standin())
    return owner, lambda registry: export_inner_optimizer_state_dict(owner, registry=registry)


def _dummy_step(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()


def _initialize() -> Tuple[Owner, Callable[[StateAdopterRegistry], Any]]:
    owner = Owner(fresh_standin())
    return owner, lambda registry: initialize_inner_optimizer_state(
        owner, lambda: _dummy_step(owner.optimizer), registry=registry
    )


def _read() -> Tuple[Owner, Callable[[StateAdopterRegistry], Any]]:
    optimizer = fresh_standin(**BF16)
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.initialize_state(param)
    owner = Owner(optimizer)

    def run(registry: StateAdopterRegistry) -> List[torch.Tensor]:
        with reading_optimizer_state(owner, True, registry):
            return [
                unscaled_state_or_read_target(owner, param, key)
                for group in optimizer.param_groups
                for param in group["params"]
                for key in ("exp_avg", "exp_avg_sq", "master_param")
            ]

    return owner, run


CASES = [
    Case("load", _load, "load_state_dict", "register_load_state_dict_pre_hook", "FusedAdamStandIn.load_state_dict"),
    Case("export", _export, "state_dict", "register_state_dict_post_hook", "FusedAdamStandIn.state_dict"),
    Case("initialize", _initialize, "step", "register_step_pre_hook", "_initialize.<locals>.<lambda>.<locals>.<lambda>"),
    Case("read", _read, "get_unscaled_state", None, "FusedAdamStandIn.get_unscaled_state"),
]  # fmt: skip
IDS = [case.point for case in CASES]


def _accepting(name: str = "accepting") -> PyTorchLoaderAdopter:
    return PyTorchLoaderAdopter(name, FusedAdamStandIn)


def _run(case: Case, registry: StateAdopterRegistry) -> Tuple[Owner, Any, AdoptionOutcome]:
    owner, run = case.setup()
    result: List[Any] = []
    outcome = outcome_of(registry, lambda: result.append(run(registry)), case.point)
    return owner, result[0], outcome


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_first_accepting_adopter_handles_the_call_and_later_ones_are_not_asked(case: Case) -> None:
    declining, later = DecliningAdopter("declining", "not mine"), _accepting("later")
    _, _, outcome = _run(case, registry_of(declining, _accepting(), later))
    assert outcome.adopter == "accepting" and outcome.method is None
    assert outcome.declines == (("declining", "not mine"),) and later.checked == []
    assert outcome.hook_point == case.point and outcome.error is None


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_without_an_accepting_adopter_the_own_code_runs(case: Case) -> None:
    _, _, outcome = _run(case, registry_of())
    assert (outcome.adopter, outcome.method, outcome.fallback_reason) == (None, case.own, "no adopter is registered")
    _, _, outcome = _run(case, registry_of(DecliningAdopter("declining", "not mine")))
    assert outcome.fallback_reason == "every adopter declined"
    assert outcome.declines == (("declining", "not mine"),)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_switches_send_every_call_to_the_own_code_without_asking(case: Case) -> None:
    adopter = _accepting()
    owner, run = case.setup()
    owner.config = config_with(optimizer_state_adoption=False)
    registry = registry_of(adopter)
    outcome = outcome_of(registry, lambda: run(registry), case.point)
    assert outcome.fallback_reason == "OptimizerConfig.optimizer_state_adoption is False"
    off = StateAdopterRegistry(strict=True, switched_off="MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=1 is set")
    off.register(adopter)
    _, _, outcome = _run(case, off)
    assert outcome.fallback_reason == "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=1 is set"
    assert adopter.checked == [] and outcome.method == case.own


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_method_set_on_the_instance_runs_instead_of_any_adopter(case: Case) -> None:
    """Upstream's ``self.optimizer.<method>(...)`` resolves an instance attribute first (e.g.
    Megatron-Bridge's loader): it runs, exactly once, and no adopter is asked."""
    adopter = _accepting()
    owner, run = case.setup()
    calls: List[Any] = []
    own = getattr(owner.optimizer, case.method)
    owner.optimizer.__dict__[case.method] = lambda *args: calls.append(args) or own(*args)
    registry = registry_of(adopter)
    outcome = outcome_of(registry, lambda: run(registry), case.point)
    assert len(calls) >= 1 and adopter.checked == [] and outcome.adopter is None
    assert outcome.fallback_reason == f"the FusedAdamStandIn instance has its own {case.method}, which upstream calls"


@pytest.mark.parametrize("case", [c for c in CASES if c.hook], ids=[c.point for c in CASES if c.hook])
def test_registered_or_uninspectable_hooks_run_through_the_own_code(case: Case) -> None:
    for broken in (None, "unreadable", "missing"):
        adopter = _accepting()
        owner, run = case.setup()
        calls: List[Any] = []
        getattr(owner.optimizer, case.hook)(lambda *args: calls.append(args))  # type: ignore[misc]
        for name, value in list(vars(owner.optimizer).items()) if broken else ():
            if name.startswith("_optimizer_") and name.endswith("_hooks") and len(value):
                owner.optimizer.__dict__[name] = None  # a registry that cannot be read
                if broken == "missing":
                    del owner.optimizer.__dict__[name]  # or none at all
        registry, outcomes = registry_of(adopter), []
        registry.register_outcome_hook(outcomes.append)
        try:
            run(registry)
        except AttributeError:  # upstream's own method fails on such a registry, and so does this
            assert broken
        (outcome,) = outcomes
        assert adopter.checked == [] and outcome.adopter is None and outcome.method == case.own
        assert outcome.fallback_reason == "hooks are registered (or cannot be inspected) that upstream runs"
        assert broken or len(calls) == 1


@pytest.mark.parametrize("table", ["registered", "absent"])
def test_global_step_hooks_send_the_initialization_to_the_own_code(
    table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PyTorch's global step hooks run around every ``step()``, the own dummy step's too: with one
    registered, or on a torch without the (private) tables, no adopter is asked and the own code
    runs (which, without the tables, fails as PyTorch's own step does)."""
    adopter, calls, outcomes = _accepting(), [], []
    owner, run = _initialize()
    registry = registry_of(adopter)
    registry.register_outcome_hook(outcomes.append)
    if table == "absent":
        monkeypatch.delattr(torch_optimizer, "_global_optimizer_pre_hooks")
        with pytest.raises(NameError):
            run(registry)
    else:
        handle = torch_optimizer.register_optimizer_step_pre_hook(lambda *a: calls.append(a))
        try:
            run(registry)
        finally:
            handle.remove()
        assert len(calls) == 1 and len(owner.optimizer.state) > 0
    (outcome,) = outcomes
    assert adopter.checked == [] and outcome.adopter is None and outcome.method == CASES[2].own
    assert outcome.fallback_reason == "hooks are registered (or cannot be inspected) that upstream runs"


BROKEN_CHECKS = {
    RaisingCheckAdopter: ("its check raised RuntimeError: check exploded",
                          "raised in its check; it counts as a decline (RuntimeError: check exploded)"),
    GarbageCheckAdopter: ("its check returned a int", "answered 42 in its check; it counts as a decline"),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("broken", BROKEN_CHECKS, ids=["raising", "nonsense"])
def test_a_raising_or_nonsense_check_is_a_logged_decline_or_with_a_strict_registry_an_error(
    case: Case, broken: type, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _, _, outcome = _run(case, registry_of(broken("broken"), _accepting(), strict=False))
    decline, warning = BROKEN_CHECKS[broken]
    assert outcome.adopter == "accepting" and outcome.declines == (("broken", decline),)
    assert caplog.messages == [f"Optimizer state adoption: adopter 'broken' {warning}"]
    with pytest.raises(RuntimeError, match=r"adopter 'broken' .* \[strict registry\]"):
        _run(case, registry_of(broken("broken"), _accepting()))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_check_that_changes_containers_is_undone_and_one_that_writes_into_tensors_is_an_error(
    case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    owner, run = case.setup()
    before = [(key, dict(entry)) for key, entry in owner.optimizer.state.items()]
    lrs = [group["lr"] for group in owner.optimizer.param_groups]
    registry = registry_of(ReplacingCheckAdopter("replacing"), strict=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outcome = outcome_of(registry, lambda: run(registry), case.point)
    assert outcome.declines == (("replacing", "its check changed the optimizer"),)
    assert caplog.messages == [
        "Optimizer state adoption: adopter 'replacing' changed the optimizer in its check; it counts as a decline"
    ]
    assert [(key, dict(entry)) for key, entry in owner.optimizer.state.items()] == before or case.point in ("load", "initialize")
    assert [group["lr"] for group in owner.optimizer.param_groups] == lrs
    owner, run = case.setup()
    if case.point in ("load", "export", "read"):
        with pytest.raises(RuntimeError, match="adopter 'writing' wrote into tensors in its check"):
            run(registry_of(WritingCheckAdopter("writing"), strict=False))


class _FailingAttempt(PyTorchLoaderAdopter):
    """Accepts every role, changes the optimizer's containers, then raises."""

    def _fail(self, context: Any) -> Any:
        context.optimizer.param_groups[0]["lr"] = 999.0
        context.optimizer.state.clear()
        raise RuntimeError("attempt exploded")

    def adopt(self, context: Any) -> None:
        self._fail(context)

    def export_state_dict(self, context: Any) -> Any:
        return self._fail(context)

    def read_target(self, context: Any, param: torch.Tensor, name: str) -> torch.Tensor:
        raise RuntimeError("attempt exploded")


@pytest.mark.parametrize("case", [c for c in CASES if c.point != "initialize"], ids=[c.point for c in CASES if c.point != "initialize"])
def test_a_failed_attempt_is_undone_and_the_own_code_runs_or_with_a_strict_registry_raises(
    case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        owner, result, outcome = _run(case, registry_of(_FailingAttempt("failing", FusedAdamStandIn), strict=False))
    assert "adopter 'failing' failed" in caplog.text and "attempt exploded" in caplog.text
    assert outcome.fallback_reason is not None and outcome.fallback_reason.startswith("adopter 'failing' failed")
    assert owner.optimizer.param_groups[0]["lr"] == 1e-3
    reference, expected, _ = _run(case, registry_of())
    assert_same = state_tensors(owner.optimizer) == [] or all(
        torch.equal(a.float(), b.float()) for a, b in zip(state_tensors(owner.optimizer), state_tensors(reference.optimizer))
    )
    assert assert_same
    owner, run = case.setup()
    with pytest.raises(RuntimeError, match="attempt exploded"):
        run(registry_of(_FailingAttempt("failing", FusedAdamStandIn)))
    assert owner.optimizer.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_interrupt_while_consulting_propagates_with_one_outcome(case: Case) -> None:
    class Interrupting(DecliningAdopter):
        def decline_reason(self, context: Any) -> Optional[str]:
            raise KeyboardInterrupt

    registry, outcomes = registry_of(Interrupting("interrupting")), []
    registry.register_outcome_hook(outcomes.append)
    owner, run = case.setup()
    with pytest.raises(KeyboardInterrupt):
        run(registry)
    (outcome,) = outcomes
    assert outcome.error == "KeyboardInterrupt: " and outcome.adopter is None
    assert outcome.method is None  # nothing of upstream's ran
    assert outcome.fallback_reason == "interrupted while consulting the adopters"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_own_codes_error_propagates_unchanged_after_its_outcome(case: Case) -> None:
    owner, run = case.setup()
    error = ValueError("upstream's own error")

    def raising(*args: Any) -> Any:
        raise error

    owner.optimizer.__dict__[case.method] = raising
    if case.point == "initialize":
        owner.optimizer.__dict__.pop("step")
        owner, run = owner, lambda registry: initialize_inner_optimizer_state(owner, raising, registry=registry)
    registry, outcomes = registry_of(), []
    registry.register_outcome_hook(outcomes.append)
    with pytest.raises(ValueError) as raised:
        run(registry)
    assert raised.value is error
    (outcome,) = outcomes
    assert outcome.error == "ValueError: upstream's own error" and (outcome.reused_bytes, outcome.allocated_bytes) == (0, 0)


def test_an_adopter_returning_a_value_from_adopt_is_measured_not_believed() -> None:
    class Boasting(PyTorchLoaderAdopter):
        def adopt(self, context: Any) -> Any:  # type: ignore[override]
            super().adopt(context)
            return 10**12

    optimizer, registry = fresh_standin(), registry_of(Boasting("boasting", FusedAdamStandIn))
    state_dict = cloned_state_dict(trained_standin())
    outcome = outcome_of(
        registry,
        lambda: load_inner_optimizer_state_dict(Owner(optimizer), state_dict, owns_state_dict=True, registry=registry),
    )
    assert outcome.reused_bytes == sum(t.nbytes for t in state_tensors(optimizer))


def test_a_load_logs_golden_messages(caplog: pytest.LogCaptureFixture) -> None:
    """Three messages users read, word for word: an adoption, the own loader, a fallback."""
    registry = registry_of(_accepting(), strict=False)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        owner, _, _ = _run(CASES[0], registry)
        _run(CASES[0], registry_of(DecliningAdopter("declining", "not mine")))
        _run(CASES[0], registry_of(_FailingAttempt("failing", FusedAdamStandIn), strict=False))
    label = lambda message: message.split(" 0x")[0] + " 0x…" + message.split(")", 1)[1] if " 0x" in message else message  # noqa: E731
    messages = [label(r.getMessage()) for r in caplog.records if r.name.startswith(LOGGER)]
    assert messages[0] == "Optimizer state adopter 'accepting' installed the state of FusedAdamStandIn 0x…: 1,856 B by reference, 0 B newly allocated"
    assert "Optimizer state adopter 'declining' declined: not mine" in messages
    assert "FusedAdamStandIn.load_state_dict installed the state of FusedAdamStandIn 0x… (every adopter declined): 0 B by reference, 1,856 B newly allocated" in messages
    assert any(m.startswith("Optimizer state adoption: adopter 'failing' failed and was undone; the own code runs for FusedAdamStandIn 0x") for m in messages)


def test_an_owner_without_a_config_is_not_switched_off() -> None:
    """Only a config's ``optimizer_state_adoption`` switches off: any object with an ``optimizer``
    and no ``config`` is served by the adopters."""
    owner, registry = types.SimpleNamespace(optimizer=fresh_standin()), registry_of(_accepting())
    state_dict = cloned_state_dict(trained_standin())
    outcome = outcome_of(
        registry,
        lambda: load_inner_optimizer_state_dict(owner, state_dict, owns_state_dict=True, registry=registry),
    )
    assert outcome.adopter == "accepting" and outcome.declines == ()


class _ChangingCheck(DecliningAdopter):
    """Its check makes ``change(optimizer, state_dict)``, then declines."""

    def __init__(self, change: Callable[[Any, Any], Any]) -> None:
        super().__init__("changing", "declines anyway")
        self.change = change

    def decline_reason(self, context: Any) -> Optional[str]:
        self.change(context.optimizer, context.state_dict)
        return self.reason


CHECK_CHANGES = {
    "a key of None renamed": lambda o, sd: o.param_groups[0].__setitem__("renamed", o.param_groups[0].pop("foreach")),
    "the state dict's params list": lambda o, sd: sd["param_groups"][1]["params"].append(99),
    "the state replaced": lambda o, sd: setattr(o, "state", collections.defaultdict(dict)),
}  # fmt: skip


@pytest.mark.parametrize("change", CHECK_CHANGES.values(), ids=CHECK_CHANGES)
def test_any_container_a_check_changes_is_found_and_restored(change: Callable[[Any, Any], Any]) -> None:
    """A real Adam's load: a group key whose value is None renamed (Adam's ``foreach``), a list
    five levels into the incoming state dict, the ``state`` attribute replaced."""
    optimizer, state_dict = fresh_adam(), cloned(trained_adam().state_dict())
    given_groups = copy.deepcopy(state_dict["param_groups"])
    registry = registry_of(_ChangingCheck(change), strict=False)
    outcome = outcome_of(
        registry, lambda: load_inner_optimizer_state_dict(Owner(optimizer), state_dict, registry=registry)
    )
    assert outcome.declines == (("changing", "its check changed the optimizer"),)
    assert outcome.method == "Adam.load_state_dict" and outcome.error is None
    assert state_dict["param_groups"] == given_groups


def test_the_snapshot_before_a_check_walks_a_bounded_depth() -> None:
    """Any object may be a hyper-parameter, a list holding itself too: the walk over the
    containers stops below the depth of PyTorch's state dicts, and the load goes on."""
    optimizer, state_dict = fresh_adam(), cloned(trained_adam().state_dict())
    cycle: List[Any] = []
    cycle.append(cycle)
    optimizer.param_groups[0]["cycle"] = cycle
    registry = registry_of(DecliningAdopter("declining"))
    outcome = outcome_of(
        registry, lambda: load_inner_optimizer_state_dict(Owner(optimizer), state_dict, registry=registry)
    )
    assert outcome.method == "Adam.load_state_dict" and outcome.error is None


class _InstallingAnotherLr(PyTorchLoaderAdopter):
    """Installs with PyTorch's loader, then changes a hyper-parameter."""

    def adopt(self, context: Any) -> None:
        super().adopt(context)
        context.optimizer.param_groups[0]["lr"] = 0.5


def _replacing_state(optimizer: Any) -> Any:
    optimizer.state = collections.defaultdict(dict, optimizer.state)
    return pytorch_state_dict(optimizer)


def _changing_lr(optimizer: Any) -> Any:
    optimizer.param_groups[0]["lr"] = 0.5
    return pytorch_state_dict(optimizer)


WRONG_RESULTS = {
    "an install with another lr": (CASES[0], lambda: _InstallingAnotherLr("wrong", FusedAdamStandIn),
                                   "param group 0 does not have the state dict's lr"),
    "an export of copies": (CASES[1], lambda: Exporter("wrong", lambda o: copy.deepcopy(pytorch_state_dict(o))),
                            "the export['state'][0]['exp_avg'] is not the held tensor"),
    "an export after replacing the state": (CASES[1], lambda: Exporter("wrong", _replacing_state),
                                            "it replaced the optimizer's state or param groups"),
    "an export after changing a group": (CASES[1], lambda: Exporter("wrong", _changing_lr),
                                         "it changed the optimizer's containers or the state dict's"),
}  # fmt: skip


@pytest.mark.parametrize("case, adopter, reason", WRONG_RESULTS.values(), ids=WRONG_RESULTS)
def test_a_result_that_does_not_match_is_undone_and_the_own_code_runs(
    case: Case, adopter: Callable[[], StateAdopter], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    owner, run = case.setup()
    state, registry = owner.optimizer.state, registry_of(adopter(), strict=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outcome = outcome_of(registry, lambda: run(registry), case.point)
    assert (outcome.adopter, outcome.method) == (None, case.own)
    assert outcome.fallback_reason == "adopter 'wrong' failed and was undone"
    assert caplog.messages == [
        f"Optimizer state adoption: adopter 'wrong' failed and was undone; the own code runs for "
        f"{describe(owner.optimizer)} (ValueError: its result does not match: {reason})"
    ]
    assert owner.optimizer.param_groups[0]["lr"] == 1e-3
    assert case.point == "load" or owner.optimizer.state is state
    owner, run = case.setup()
    with pytest.raises(RuntimeError, match=re.escape(f"its result does not match: {reason}")):
        run(registry_of(adopter()))


def test_the_own_codes_export_is_passed_on_whatever_it_is() -> None:
    """A ``state_dict`` set on the instance is upstream's call: its result is returned as it is,
    a mapping or not, and measured as no state."""
    owner, run = _export()
    exported = ["not", "a", "state", "dict"]
    owner.optimizer.__dict__["state_dict"] = lambda: exported
    registry, results = registry_of(), []
    outcome = outcome_of(registry, lambda: results.append(run(registry)))
    assert results[0] is exported and (outcome.reused_bytes, outcome.allocated_bytes) == (0, 0)


def test_a_read_that_fails_after_its_targets_were_built_reports_no_bytes() -> None:
    """Its outcome has the error and no bytes; the same read finishing reports its targets'."""
    for error in (None, ValueError("the read failed")):
        owner, _ = _read()
        params = [p for g in owner.optimizer.param_groups for p in g["params"]]
        registry, outcomes = registry_of(_accepting()), []
        registry.register_outcome_hook(outcomes.append)
        try:
            with reading_optimizer_state(owner, True, registry):
                targets = [unscaled_state_or_read_target(owner, p, "exp_avg") for p in params]
                if error is not None:
                    raise error
        except ValueError as raised:
            assert raised is error
        (outcome,) = outcomes
        measured = (outcome.reused_bytes, outcome.allocated_bytes)
        assert outcome.adopter == "accepting" and outcome.error == (error and f"ValueError: {error}")
        assert measured == ((0, 0) if error else (sum(t.nbytes for t in targets), 0))


def test_a_storage_is_measured_once_however_many_state_tensors_cover_it() -> None:
    """PyTorch's own loader keeps incoming tensors: two parameters' entries sharing one tensor
    count its bytes once (parameters 0 and 2 have one shape)."""
    optimizer, state_dict = fresh_sgd(), cloned(trained_sgd().state_dict())
    state_dict["state"][2]["momentum_buffer"] = state_dict["state"][0]["momentum_buffer"]
    registry = registry_of()
    outcome = outcome_of(
        registry, lambda: load_inner_optimizer_state_dict(Owner(optimizer), state_dict, registry=registry)
    )
    buffers = {id(e["momentum_buffer"]): e["momentum_buffer"] for e in optimizer.state.values()}
    assert len(buffers) == 3 and outcome.method == "SGD.load_state_dict"
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (sum(t.nbytes for t in buffers.values()), 0)


X = "SGD 0x7f00 (4 params, 23 elements)"
INSTALLED = f"Optimizer state adopter 'a' installed the state of {X}"
NEW_MEMORY = ": new memory instead of the tensors it was given"
D, I, W = logging.DEBUG, logging.INFO, logging.WARNING
LOGS: Dict[str, Tuple[AdoptionOutcome, str, List[Tuple[int, str]]]] = {
    "an adoption by reference": (AdoptionOutcome("load", X, "a", reused_bytes=2**20), "installed",
                                 [(I, f"{INSTALLED}: 1.0 MiB by reference, 0 B newly allocated")]),
    "one new byte": (AdoptionOutcome("load", X, "a", allocated_bytes=1), "installed",
                     [(I, f"{INSTALLED}: 0 B by reference, 1 B newly allocated"),
                      (W, f"{INSTALLED}: 0 B by reference, 1 B newly allocated{NEW_MEMORY}")]),
    "an export into new memory": (AdoptionOutcome("export", X, "a", reused_bytes=1023, allocated_bytes=3 * 2**19), "exported",
                                  [(I, f"Optimizer state adopter 'a' exported the state of {X}: 1,023 B by reference, 1.5 MiB newly allocated"),
                                   (W, f"Optimizer state adopter 'a' exported the state of {X}: 1,023 B by reference, 1.5 MiB newly allocated{NEW_MEMORY}")]),
    "an initialization": (AdoptionOutcome("initialize", X, "a", allocated_bytes=2**20 - 1), "initialized",
                          [(I, f"Optimizer state adopter 'a' initialized the state of {X}: 0 B by reference, 1,048,575 B newly allocated")]),
    "read targets": (AdoptionOutcome("read", X, "a", allocated_bytes=8), "supplied read targets for",
                     [(I, f"Optimizer state adopter 'a' supplied read targets for the state of {X}: 0 B by reference, 8 B newly allocated")]),
    "the own load after a decline": (
        AdoptionOutcome("load", X, None, "SGD.load_state_dict", 0, 1024, (("d", "not mine"),), "every adopter declined"),
        "installed", [(D, "Optimizer state adopter 'd' declined: not mine"),
                      (I, f"SGD.load_state_dict installed the state of {X} (every adopter declined): 0 B by reference, 1,024 B newly allocated")]),
    "the own export": (AdoptionOutcome("export", X, None, "SGD.state_dict", fallback_reason="no adopter is registered"),
                       "exported", [(D, f"SGD.state_dict exported the state of {X} (no adopter is registered): 0 B by reference, 0 B newly allocated")]),
    "an error": (AdoptionOutcome("load", X, None, "SGD.load_state_dict", error="ValueError: boom"), "installed",
                 [(W, f"Optimizer state load of {X} raised: ValueError: boom")]),
}  # fmt: skip


@pytest.mark.parametrize("outcome, verb, records", LOGS.values(), ids=LOGS)
def test_each_outcome_is_logged_word_for_word_at_its_level(
    outcome: AdoptionOutcome, verb: str, records: List[Tuple[int, str]], caplog: pytest.LogCaptureFixture
) -> None:
    """Declines at debug; an adoption at info, warning if it allocated at a load or an export;
    the own code at info for a load, else debug; an error as a warning. Sizes from 1 MiB in MiB."""
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        log(outcome, verb)
    assert [(record.levelno, record.getMessage()) for record in caplog.records] == records
