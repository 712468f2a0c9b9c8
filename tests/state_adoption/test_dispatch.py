"""The one dispatcher, tried at every hook point through its call-site function: first accepting
adopter wins, the gate (switches, instance methods, hooks), fail-safety (raising, nonsense and
writing checks, failed attempts, interrupts, the own code's errors), and one outcome per call.

Each case builds an owner whose inner optimizer is the CPU stand-in for TE's FusedAdam
(tests/fused_adam_standin.py reproduces TE's loading behaviour) and a runner for its hook point.
"""

import dataclasses
import logging
from typing import Any, Callable, List, Optional, Tuple

import pytest
import torch
from adopters_for_tests import (
    DecliningAdopter,
    GarbageCheckAdopter,
    PyTorchLoaderAdopter,
    RaisingCheckAdopter,
    ReplacingCheckAdopter,
    WritingCheckAdopter,
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
    for broken in (False, True):
        adopter = _accepting()
        owner, run = case.setup()
        calls: List[Any] = []
        getattr(owner.optimizer, case.hook)(lambda *args: calls.append(args))  # type: ignore[misc]
        if broken:
            for name, value in list(vars(owner.optimizer).items()):
                if name.startswith("_optimizer_") and name.endswith("_hooks") and len(value):
                    owner.optimizer.__dict__[name] = None  # a registry that cannot be read
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


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("broken", [RaisingCheckAdopter, GarbageCheckAdopter])
def test_a_raising_or_nonsense_check_is_a_logged_decline_or_with_a_strict_registry_an_error(
    case: Case, broken: type, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _, _, outcome = _run(case, registry_of(broken("broken"), _accepting(), strict=False))
    assert outcome.adopter == "accepting" and outcome.declines[0][0] == "broken"
    assert "adopter 'broken'" in caplog.text
    with pytest.raises(RuntimeError, match=r"adopter 'broken' .* \[strict registry\]"):
        _run(case, registry_of(broken("broken"), _accepting()))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_check_that_changes_containers_is_undone_and_one_that_writes_into_tensors_is_an_error(
    case: Case,
) -> None:
    owner, run = case.setup()
    before = [(key, dict(entry)) for key, entry in owner.optimizer.state.items()]
    lrs = [group["lr"] for group in owner.optimizer.param_groups]
    registry = registry_of(ReplacingCheckAdopter("replacing"), strict=False)
    outcome = outcome_of(registry, lambda: run(registry), case.point)
    assert outcome.declines == (("replacing", "its check changed the optimizer"),)
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
