"""The one dispatcher, tried at every hook point through its call-site function: the first
accepting adopter wins; the gate (methods set on the instance, hooks); adoption switched off
(upstream's path and nothing else); fail-safety (raising, nonsense, changing and writing checks,
failed attempts, interrupts, the own code's errors) with every attribute and container undone;
the load rule (an install keeps the incoming tensors themselves); outcomes, which exist only
while an outcome hook is registered; and the log messages.

Most cases build an owner whose inner optimizer is the CPU stand-in for TE's FusedAdam
(tests/fused_adam_standin.py reproduces TE's loading behaviour) and a runner for its hook point;
the rest use real ``torch.optim`` optimizers.
"""

import collections
import copy
import dataclasses
import logging
import re
import threading
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from adopters_for_tests import (
    DecliningAdopter,
    Exporter,
    GarbageCheckAdopter,
    PyTorchLoaderAdopter,
    RaisingCheckAdopter,
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
from real_optimizers import (
    assert_same_state,
    cloned,
    fresh_adam,
    fresh_sgd,
    make_params,
    trained_adam,
    trained_sgd,
)
from torch.optim import optimizer as torch_optimizer

from megatron.core.optimizer.state_adoption import (
    AdoptionOutcome,
    StateAdopter,
    StateAdopterRegistry,
    export_inner_optimizer_state_dict,
    initialize_inner_optimizer_state,
    load_inner_optimizer_state_dict,
    reading_optimizer_state,
    store_read_optimizer_state,
    unscaled_state_or_read_target,
)
from megatron.core.optimizer.state_adoption.dispatch import describe

LOGGER = "megatron.core.optimizer.state_adoption"
BF16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, master_weights=True)
OFF = config_with(optimizer_state_adoption=False)
CANNOT_UNDO = (
    "Optimizer state adoption cannot undo this: it wrote into 1 tensor(s) of the optimizer, "
    "its parameters or the state dict"
)


@dataclasses.dataclass
class Case:
    """One hook point: ``setup()`` gives an owner and a runner ``run(registry) -> result``."""

    point: str
    setup: Callable[[], Tuple[Owner, Callable[[StateAdopterRegistry], Any]]]
    method: str  # upstream's call, which runs when set on the instance
    hook: Optional[Tuple[str, str]]  # a torch.optim.Optimizer hook registration and its kind
    own: str  # the own code's label in the outcome
    verb: str  # what an adopter did, in the log


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
        owner, lambda: _dummy_step(owner.optimizer), registry=registry, steps=True
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
    Case("load", _load, "load_state_dict", ("register_load_state_dict_pre_hook", "pre"),
         "FusedAdamStandIn.load_state_dict", "installed"),
    Case("export", _export, "state_dict", ("register_state_dict_post_hook", "post"),
         "FusedAdamStandIn.state_dict", "exported"),
    Case("initialize", _initialize, "step", ("register_step_pre_hook", "pre"),
         "_initialize.<locals>.<lambda>.<locals>.<lambda>", "initialized"),
    Case("read", _read, "get_unscaled_state", None,
         "FusedAdamStandIn.get_unscaled_state", "supplied read targets for"),
]  # fmt: skip
IDS = [case.point for case in CASES]
HOOKED = [case for case in CASES if case.hook]
LOAD, EXPORT, INITIALIZE, READ = CASES


def _accepting(name: str = "accepting") -> PyTorchLoaderAdopter:
    return PyTorchLoaderAdopter(name, FusedAdamStandIn)


def _run(case: Case, registry: StateAdopterRegistry) -> Tuple[Owner, Any, AdoptionOutcome]:
    owner, run = case.setup()
    result: List[Any] = []
    outcome = outcome_of(registry, lambda: result.append(run(registry)), case.point)
    return owner, result[0], outcome


def _held(optimizer: torch.optim.Optimizer) -> List[Tuple[int, str, Any]]:
    """(parameter position, key, value) of every held state value, to compare by identity."""
    positions = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return sorted(
        ((positions.get(id(param), -1), key, value) for param, entry in optimizer.state.items() for key, value in entry.items()),
        key=lambda item: item[:2],
    )


def _same_objects(left: List[Tuple[int, str, Any]], right: List[Tuple[int, str, Any]]) -> bool:
    return [item[:2] for item in left] == [item[:2] for item in right] and all(
        a[2] is b[2] for a, b in zip(left, right)
    )


def _raised(call: Callable[[], Any]) -> Optional[Tuple[type, str]]:
    """(type, message) of what ``call()`` raises, or None."""
    try:
        call()
    except Exception as error:  # compared with what upstream's call raises
        return type(error), str(error)
    return None


def _unaddressed(message: str) -> str:
    return re.sub(r"0x[0-9a-f]+", "0x…", message)


# --- routing ----------------------------------------------------------------------------------


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


def test_an_owner_without_a_config_is_served_by_the_adopters() -> None:
    """Only a config's ``optimizer_state_adoption`` switches off: any object with an ``optimizer``
    and no ``config`` is served by the adopters."""
    owner, registry = types.SimpleNamespace(optimizer=fresh_standin()), registry_of(_accepting())
    state_dict = cloned_state_dict(trained_standin())
    outcome = outcome_of(
        registry,
        lambda: load_inner_optimizer_state_dict(owner, state_dict, owns_state_dict=True, registry=registry),
    )
    assert outcome.adopter == "accepting" and outcome.declines == ()


# --- the gate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_method_set_on_the_instance_runs_instead_of_any_adopter(case: Case) -> None:
    """Upstream's ``self.optimizer.<method>(...)`` resolves an instance attribute first (e.g.
    Megatron-Bridge's loader): it runs and no adopter is asked."""
    adopter = _accepting()
    owner, run = case.setup()
    calls: List[Any] = []
    own = getattr(owner.optimizer, case.method)
    owner.optimizer.__dict__[case.method] = lambda *args: calls.append(args) or own(*args)
    registry = registry_of(adopter)
    outcome = outcome_of(registry, lambda: run(registry), case.point)
    assert len(calls) >= 1 and adopter.checked == [] and outcome.adopter is None
    # the outcome names what ran: the instance's own method (Megatron-FSDP's own initialization)
    instance = f"{case.method} set on the FusedAdamStandIn instance"
    assert outcome.method == (case.own if case.point == "initialize" else instance)
    assert outcome.declines == ()
    assert outcome.fallback_reason == f"the FusedAdamStandIn instance has its own {case.method}"


def test_a_set_scaled_state_on_the_instance_sends_every_read_target_to_get_unscaled_state() -> None:
    """The read's store calls ``set_scaled_state``: one set on the instance keeps the adopters
    out of the read too."""
    adopter = _accepting()
    owner, run = _read()
    owner.optimizer.__dict__["set_scaled_state"] = owner.optimizer.set_scaled_state
    registry = registry_of(adopter)
    outcome = outcome_of(registry, lambda: run(registry), "read")
    assert adopter.checked == [] and (outcome.adopter, outcome.method) == (None, READ.own)
    assert outcome.fallback_reason == "the FusedAdamStandIn instance has its own set_scaled_state"


@pytest.mark.parametrize("readable", [True, False], ids=["registered", "unreadable"])
@pytest.mark.parametrize("case", HOOKED, ids=[case.point for case in HOOKED])
def test_registered_or_unreadable_hooks_run_through_the_own_code(case: Case, readable: bool) -> None:
    """A registered hook runs only in upstream's method, so that runs and no adopter is asked;
    a hook table that is no mapping counts as registered (upstream's method then fails on it,
    exactly as it does without adoption)."""
    assert case.hook is not None
    registration, kind = case.hook
    adopter, calls = _accepting(), []
    owners = [case.setup() for _ in range(2)]
    for owner, _ in owners:
        getattr(owner.optimizer, registration)(lambda *args: calls.append(args))
        if not readable:
            owner.optimizer.__dict__[f"_optimizer_{case.method}_{kind}_hooks"] = None
    (owner, run), (twin, _) = owners
    registry, outcomes = registry_of(adopter), []
    registry.register_outcome_hook(outcomes.append)
    raised = _raised(lambda: run(registry))
    direct = {
        "load": lambda: twin.optimizer.load_state_dict(cloned_state_dict(trained_standin())),
        "export": twin.optimizer.state_dict,
        "initialize": lambda: _dummy_step(twin.optimizer),
    }[case.point]
    assert raised == _raised(direct) and (raised is None) is readable
    (outcome,) = outcomes
    assert adopter.checked == [] and outcome.adopter is None and outcome.method == case.own
    assert outcome.fallback_reason == f"{kind}-hooks of {case.method} are registered, which upstream runs"
    assert len(calls) == (2 if readable else 0)  # the own call and the direct one


@pytest.mark.parametrize("register", [torch_optimizer.register_optimizer_step_pre_hook,
                                      torch_optimizer.register_optimizer_step_post_hook], ids=["pre", "post"])  # fmt: skip
def test_global_step_hooks_send_the_initialization_to_the_own_code(register: Callable[..., Any]) -> None:
    """PyTorch's global step hooks run around every ``step()``, the own dummy step's too: with
    one registered no adopter is asked and the own code runs (its step runs the hook once)."""
    kind = "pre" if register is torch_optimizer.register_optimizer_step_pre_hook else "post"
    adopter, calls, outcomes = _accepting(), [], []
    owner, run = _initialize()
    registry = registry_of(adopter)
    registry.register_outcome_hook(outcomes.append)
    handle = register(lambda *a: calls.append(a))
    try:
        run(registry)
    finally:
        handle.remove()
    assert len(calls) == 1 and len(owner.optimizer.state) > 0
    (outcome,) = outcomes
    assert adopter.checked == [] and outcome.adopter is None and outcome.method == INITIALIZE.own
    assert outcome.fallback_reason == f"global {kind}-hooks of step are registered, which upstream runs"


def _held_state(optimizer: Any) -> None:
    optimizer.initialize_state(optimizer.param_groups[0]["params"][0])


INITIALIZE_GATES = {
    "state held already": (_held_state, "the optimizer holds state already, which the own initialization keeps"),
    "a gradient": (lambda o: setattr(o.param_groups[1]["params"][0], "grad", torch.ones(7)),
                   "a parameter has a gradient, which a step would apply"),
    "a decoupled gradient": (lambda o: setattr(o.param_groups[1]["params"][0], "decoupled_grad", torch.ones(7)),
                             "a parameter has a gradient, which a step would apply"),
}  # fmt: skip


@pytest.mark.parametrize("prepare, reason", INITIALIZE_GATES.values(), ids=INITIALIZE_GATES)
def test_an_initialization_a_step_would_change_runs_the_own_code(prepare: Callable[[Any], None], reason: str) -> None:
    """A step without gradients only creates state where none is held and no gradient waits."""
    adopter = _accepting()
    owner, run = _initialize()
    prepare(owner.optimizer)
    registry = registry_of(adopter)
    outcome = outcome_of(registry, lambda: run(registry), "initialize")
    assert adopter.checked == [] and (outcome.adopter, outcome.method, outcome.fallback_reason) == (
        None, INITIALIZE.own, reason)  # fmt: skip


# --- adoption switched off: upstream's path exactly -------------------------------------------


class RecordingAdam(torch.optim.Adam):
    """A real Adam that records each call of the methods upstream calls at the hook points, with
    TE's ``get_unscaled_state`` (the held tensor) and ``set_scaled_state`` (a copy into it)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.calls: List[str] = []
        self.stored: List[Tuple[torch.Tensor, str, torch.Tensor]] = []

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.calls.append("load_state_dict")
        super().load_state_dict(state_dict)

    def state_dict(self) -> Dict[str, Any]:
        self.calls.append("state_dict")
        return super().state_dict()

    def step(self, closure: Any = None) -> Any:
        self.calls.append("step")
        return super().step(closure)

    def get_unscaled_state(self, param: torch.Tensor, name: str) -> torch.Tensor:
        self.calls.append("get_unscaled_state")
        held: torch.Tensor = self.state[param][name]
        return held

    def set_scaled_state(self, param: torch.Tensor, name: str, unscaled: torch.Tensor) -> None:
        self.calls.append("set_scaled_state")
        self.stored.append((param, name, unscaled))
        self.state[param][name].copy_(unscaled)


def _recording_adam(steps: int = 0) -> RecordingAdam:
    """``fresh_adam()``'s groups and parameters (so ``trained_adam()``'s state dict fits)."""
    params = make_params()
    optimizer = RecordingAdam([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=1e-3)
    generator = torch.Generator().manual_seed(11)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    optimizer.zero_grad()
    optimizer.calls.clear()
    return optimizer


def _off_load(owner: Owner, registry: StateAdopterRegistry) -> List[str]:
    state_dict = cloned(trained_adam().state_dict())
    load_inner_optimizer_state_dict(owner, state_dict, owns_state_dict=True, registry=registry)
    reference = fresh_adam()
    reference.load_state_dict(cloned(trained_adam().state_dict()))
    assert_same_state(owner.optimizer, reference)
    return ["load_state_dict"]


def _off_export(owner: Owner, registry: StateAdopterRegistry) -> List[str]:
    exported = export_inner_optimizer_state_dict(owner, registry=registry)
    held = [e["exp_avg"] for e in exported["state"].values()]
    assert all(any(t is h for h in state_tensors(owner.optimizer)) for t in held) and len(held) == 4
    return ["state_dict"]


def _off_initialize(owner: Owner, registry: StateAdopterRegistry) -> List[str]:
    ran: List[int] = []
    initialize_inner_optimizer_state(owner, lambda: ran.append(1) or _dummy_step(owner.optimizer), registry=registry, steps=True)
    assert ran == [1] and len(owner.optimizer.state) == 4
    return ["step"]


def _off_read(owner: Owner, registry: StateAdopterRegistry) -> List[str]:
    params = [p for g in owner.optimizer.param_groups for p in g["params"]]
    with reading_optimizer_state(owner, True, registry):
        targets = [unscaled_state_or_read_target(owner, param, "exp_avg") for param in params]
    for param, target in zip(params, targets):
        store_read_optimizer_state(owner, param, "exp_avg", target)
    return ["get_unscaled_state"] * 4 + ["set_scaled_state"] * 4


OFF_POINTS = {
    "load": (0, _off_load),
    "export": (2, _off_export),
    "initialize": (0, _off_initialize),
    "read": (2, _off_read),
}


@pytest.mark.parametrize("point", OFF_POINTS)
def test_adoption_off_calls_upstreams_method_once_and_nothing_else(
    point: str, install_plugin: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """With ``optimizer_state_adoption=False`` each call-site function is upstream's call: the
    inner optimizer's own method runs exactly once, and nothing else happens: no adopter is
    asked (not even a pending plugin loaded: this one is broken, which a strict registry raises
    for), no outcome is reported to the registered hook, nothing is logged at any level."""
    install_plugin("broken_off_plugin", {"broken": "broken_off_plugin:Missing"}, "", "test.off_plugins")
    registry = StateAdopterRegistry(strict=True, plugin_group="test.off_plugins")
    adopter, outcomes = PyTorchLoaderAdopter("accepting", torch.optim.Optimizer), []
    registry.register(adopter)
    registry.register_outcome_hook(outcomes.append)
    steps, call = OFF_POINTS[point]
    owner = Owner(_recording_adam(steps), config=OFF)
    with caplog.at_level(logging.DEBUG):
        expected = call(owner, registry)
    assert owner.optimizer.calls == expected
    assert adopter.checked == [] and adopter.adopted == [] and outcomes == []
    assert caplog.records == []
    with pytest.raises(RuntimeError, match="the plugin broken = broken_off_plugin:Missing"):
        registry.adopters()  # the trap was armed: any consultation would have raised


def _sparse_first_moment(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    state_dict["state"][0]["exp_avg"] = state_dict["state"][0]["exp_avg"].to_sparse()
    return state_dict


SPARSE = {  # (trained, fresh, what upstream's own loader does with a sparse moment)
    "Adam": (trained_adam, fresh_adam, None),
    "FusedAdam stand-in": (trained_standin, fresh_standin, RuntimeError),  # TE copies into dense
}


@pytest.mark.parametrize("trained, fresh, upstream", SPARSE.values(), ids=SPARSE)
def test_adoption_off_hands_a_sparse_state_to_the_own_loader_untouched(
    trained: Callable[[], Any], fresh: Callable[[], Any], upstream: Optional[type]
) -> None:
    """With adoption off no tensor is walked, measured or snapshot: a sparse moment (whose
    storage cannot be accessed) reaches the inner optimizer's own loader, which loads it or
    raises its own error exactly as when called directly."""
    registry = registry_of(PyTorchLoaderAdopter("accepting", torch.optim.Optimizer))
    mine, theirs = fresh(), fresh()
    raised = _raised(lambda: load_inner_optimizer_state_dict(
        Owner(mine, config=OFF), _sparse_first_moment(cloned_state_dict(trained())), owns_state_dict=True,
        registry=registry))  # fmt: skip
    assert raised == _raised(lambda: theirs.load_state_dict(_sparse_first_moment(cloned_state_dict(trained()))))
    assert (raised and raised[0]) is upstream
    if raised is None:
        assert len(state_tensors(mine)) == len(state_tensors(theirs)) == 12
        for a, b in zip(state_tensors(mine), state_tensors(theirs)):
            assert a.layout == b.layout and torch.equal(a.to_dense(), b.to_dense())


def test_adoption_off_exports_a_sparse_held_state_as_the_own_state_dict() -> None:
    optimizer = trained_adam()
    first = optimizer.param_groups[0]["params"][0]
    optimizer.state[first]["exp_avg"] = sparse = optimizer.state[first]["exp_avg"].to_sparse()
    registry = registry_of(PyTorchLoaderAdopter("accepting", torch.optim.Optimizer))
    exported = export_inner_optimizer_state_dict(Owner(optimizer, config=OFF), registry=registry)
    assert exported["state"][0]["exp_avg"] is sparse and exported == optimizer.state_dict()


def test_adoption_off_stores_every_read_tensor_through_set_scaled_state() -> None:
    """Adoption on keeps a held tensor that was read in place and copies a BF16 read into a held
    BF16 state; off, both go to the inner optimizer's ``set_scaled_state``, as upstream's do."""
    optimizer = _recording_adam(steps=1)
    first, second = optimizer.param_groups[0]["params"]
    optimizer.state[second]["exp_avg"] = optimizer.state[second]["exp_avg"].bfloat16()
    in_place, bf16 = optimizer.state[first]["exp_avg"], torch.zeros_like(optimizer.state[second]["exp_avg"])
    for config in (config_with(), OFF):
        store_read_optimizer_state(Owner(optimizer, config=config), first, "exp_avg", in_place)
        store_read_optimizer_state(Owner(optimizer, config=config), second, "exp_avg", bf16)
        if config is not OFF:
            assert optimizer.calls == [] and torch.equal(optimizer.state[second]["exp_avg"], bf16)
    assert optimizer.calls == ["set_scaled_state"] * 2
    assert [(p is q, n, t is u) for (p, n, t), q, u in zip(optimizer.stored, (first, second), (in_place, bf16))] == [
        (True, "exp_avg", True)] * 2  # fmt: skip


# --- checks -----------------------------------------------------------------------------------

BROKEN_CHECKS = {
    RaisingCheckAdopter: ("its check raised RuntimeError: check exploded", " (RuntimeError: check exploded)"),
    GarbageCheckAdopter: ("its check returned 42, not a reason", ""),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("broken", BROKEN_CHECKS, ids=["raising", "nonsense"])
def test_a_raising_or_nonsense_check_declines_with_a_warning_or_with_a_strict_registry_an_error(
    case: Case, broken: type, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _, _, outcome = _run(case, registry_of(broken("broken"), _accepting(), strict=False))
    decline, cause = BROKEN_CHECKS[broken]
    assert outcome.adopter == "accepting" and outcome.declines == (("broken", decline),)
    assert caplog.messages == [f"Optimizer state adoption: adopter 'broken': {decline}; it declines{cause}"]
    with pytest.raises(RuntimeError, match=rf"adopter 'broken': {decline}.*\[strict registry\]"):
        _run(case, registry_of(broken("broken"), _accepting()))


class _ChangingCheck(DecliningAdopter):
    """Its checks (every role) make ``change(optimizer, state_dict)``, then decline."""

    def __init__(self, change: Callable[[Any, Any], Any], name: str = "changing") -> None:
        super().__init__(name, "declines anyway")
        self.change = change

    def decline_reason(self, context: Any) -> Optional[str]:
        self.change(context.optimizer, context.state_dict)
        return self.reason

    export_decline_reason = initialize_decline_reason = read_target_decline_reason = decline_reason


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_check_that_changes_the_optimizer_is_undone_and_declines_with_a_warning(
    case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    owner, run = case.setup()
    before, lrs = _held(owner.optimizer), [group["lr"] for group in owner.optimizer.param_groups]
    registry = registry_of(_ChangingCheck(lambda o, sd: o.param_groups[0].__setitem__("lr", 123.0)), strict=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outcome = outcome_of(registry, lambda: run(registry), case.point)
    reason = "its check changed the optimizer: it changed the optimizer's 'param_groups'"
    assert outcome.declines == (("changing", reason),) and outcome.method == case.own
    assert caplog.messages == [f"Optimizer state adoption: adopter 'changing': {reason}; it declines"]
    assert [group["lr"] for group in owner.optimizer.param_groups] == lrs
    assert case.point in ("load", "initialize") or _same_objects(_held(owner.optimizer), before)


@pytest.mark.parametrize("case", [LOAD, EXPORT, READ], ids=["load", "export", "read"])
def test_a_check_that_writes_into_a_tensor_is_an_error_even_for_a_lenient_registry(case: Case) -> None:
    """Containers can be refilled, tensor contents not: the call raises instead of going on."""
    owner, run = case.setup()
    with pytest.raises(RuntimeError) as raised:
        run(registry_of(WritingCheckAdopter("writing"), strict=False))
    assert str(raised.value) == CANNOT_UNDO


CHECK_CHANGES = {
    "a key of None renamed": (lambda o, sd: o.param_groups[0].__setitem__("renamed", o.param_groups[0].pop("foreach")),
                              "it changed the optimizer's 'param_groups'"),
    "the state dict's params list": (lambda o, sd: sd["param_groups"][1]["params"].append(99),
                                     "it changed the incoming state dict"),
    "the state replaced": (lambda o, sd: setattr(o, "state", collections.defaultdict(dict)),
                           "it replaced the optimizer's attribute 'state'"),
    "a default changed": (lambda o, sd: o.defaults.__setitem__("lr", 0.5), "it changed the optimizer's 'defaults'"),
    "an attribute added": (lambda o, sd: setattr(o, "adopted", True), "it replaced the optimizer's attribute 'adopted'"),
}  # fmt: skip


@pytest.mark.parametrize("change, found", CHECK_CHANGES.values(), ids=CHECK_CHANGES)
def test_any_attribute_or_container_a_check_changes_is_found_and_restored(change: Callable[[Any, Any], Any], found: str) -> None:
    """A real Adam's load: a group key whose value is None renamed (Adam's ``foreach``), a list
    four levels into the incoming state dict, the ``state`` attribute replaced, a default
    changed, an attribute added. Each is named in the decline and undone before the own loader
    runs, which then loads what it loads without any adopter."""
    optimizer, state_dict = fresh_adam(), cloned(trained_adam().state_dict())
    given_groups = copy.deepcopy(state_dict["param_groups"])
    registry = registry_of(_ChangingCheck(change), strict=False)
    outcome = outcome_of(
        registry, lambda: load_inner_optimizer_state_dict(Owner(optimizer), state_dict, registry=registry)
    )
    assert outcome.declines == (("changing", f"its check changed the optimizer: {found}"),)
    assert outcome.method == "Adam.load_state_dict" and outcome.error is None
    assert state_dict["param_groups"] == given_groups
    reference = fresh_adam()
    reference.load_state_dict(cloned(trained_adam().state_dict()))
    assert_same_state(optimizer, reference)
    assert sorted(vars(optimizer)) == sorted(vars(reference)) and optimizer.defaults == reference.defaults


def test_the_snapshot_walks_a_bounded_depth() -> None:
    """Any object may be a hyper-parameter, a list holding itself too: the walk over the
    containers stops, and the load goes on."""
    optimizer, state_dict = fresh_adam(), cloned(trained_adam().state_dict())
    cycle: List[Any] = []
    cycle.append(cycle)
    optimizer.param_groups[0]["cycle"] = cycle
    registry = registry_of(DecliningAdopter("declining"))
    outcome = outcome_of(
        registry, lambda: load_inner_optimizer_state_dict(Owner(optimizer), state_dict, registry=registry)
    )
    assert outcome.method == "Adam.load_state_dict" and outcome.error is None


class _MutatingThenRaisingCheck(DecliningAdopter):
    """Its load and export checks pop a state entry (the incoming one for a load) and append
    to a param group's params, then raise."""

    def decline_reason(self, context: Any) -> Optional[str]:
        state = context.optimizer.state if context.state_dict is None else context.state_dict["state"]
        state.pop(next(iter(state)))
        context.optimizer.param_groups[0]["params"].append(torch.zeros(1))
        raise ValueError("check failed after changing the optimizer")

    export_decline_reason = decline_reason


@pytest.mark.parametrize("point", ["load", "export"])
def test_a_strict_registry_raises_for_a_check_that_changed_containers_only_after_undoing_them(point: str) -> None:
    """The strict error is raised after the restore: the optimizer (and a load's incoming
    state dict) are as they were before the call."""
    registry = registry_of(_MutatingThenRaisingCheck("mutating"))
    optimizer = fresh_standin() if point == "load" else trained_standin()
    state_dict = cloned_state_dict(trained_standin())
    held, params = _held(optimizer), [list(group["params"]) for group in optimizer.param_groups]
    incoming = dict(state_dict["state"])
    with pytest.raises(RuntimeError, match="adopter 'mutating'") as raised:
        if point == "load":
            load_inner_optimizer_state_dict(Owner(optimizer), state_dict, owns_state_dict=True, registry=registry)
        else:
            export_inner_optimizer_state_dict(Owner(optimizer), registry=registry)
    assert _same_objects(_held(optimizer), held) and (point == "load" or len(held) == 8)
    assert [len(group["params"]) for group in optimizer.param_groups] == [len(p) for p in params]
    assert all(a is b for g, p in zip(optimizer.param_groups, params) for a, b in zip(g["params"], p))
    assert state_dict["state"] == incoming and all(state_dict["state"][k] is v for k, v in incoming.items())
    changed = "'param_groups'" if point == "load" else "'(state|param_groups)'"  # either is changed first
    assert re.fullmatch(
        rf"Optimizer state adoption: adopter 'mutating': its check changed the optimizer: it changed the "
        rf"optimizer's {changed} \(ValueError: check failed after changing the optimizer\) \[strict registry\]",
        str(raised.value),
    )


class _InterruptedInitializer(DecliningAdopter):
    """Its initialization check creates the first parameter's moment, then is interrupted."""

    def initialize_decline_reason(self, context: Any) -> Optional[str]:
        first = context.optimizer.param_groups[0]["params"][0]
        context.optimizer.state[first]["exp_avg"] = torch.zeros_like(first)
        raise KeyboardInterrupt


def test_an_interrupt_in_an_initializers_check_leaves_no_state_behind() -> None:
    owner, ran = Owner(fresh_standin()), []
    with pytest.raises(KeyboardInterrupt):
        initialize_inner_optimizer_state(owner, lambda: ran.append(1), registry=registry_of(_InterruptedInitializer("x")))
    assert len(owner.optimizer.state) == 0 and ran == []


class _Interrupting(DecliningAdopter):
    def decline_reason(self, context: Any) -> Optional[str]:
        raise KeyboardInterrupt

    export_decline_reason = initialize_decline_reason = read_target_decline_reason = decline_reason


INTERRUPTED = [pytest.param(case, id=case.point) for case in CASES[:3] + [READ]]


@pytest.mark.parametrize("case", INTERRUPTED)
def test_an_interrupt_while_consulting_propagates_with_one_outcome_and_nothing_run(case: Case) -> None:
    registry, outcomes = registry_of(_Interrupting("interrupting")), []
    registry.register_outcome_hook(outcomes.append)
    owner, run = case.setup()
    before = _held(owner.optimizer)
    with pytest.raises(KeyboardInterrupt):
        run(registry)
    (outcome,) = outcomes
    assert outcome.error == "KeyboardInterrupt: " and outcome.adopter is None
    assert _same_objects(_held(owner.optimizer), before)
    assert outcome.method is None  # nothing of upstream's ran


# --- attempts ---------------------------------------------------------------------------------


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


ATTEMPTED = [LOAD, EXPORT, READ]
FAILURE = {
    "load": ("adopter 'failing' failed and was undone", "the own code runs for {}"),
    "export": ("adopter 'failing' failed and was undone", "the own code runs for {}"),
    "read": ("adopter 'failing' failed for exp_avg", "get_unscaled_state serves the rest"),
}


@pytest.mark.parametrize("case", ATTEMPTED, ids=[case.point for case in ATTEMPTED])
def test_a_failed_attempt_is_undone_and_the_own_code_runs_or_with_a_strict_registry_raises(
    case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        owner, _, outcome = _run(case, registry_of(_FailingAttempt("failing", FusedAdamStandIn), strict=False))
    what, instead = FAILURE[case.point]
    assert caplog.messages == [
        f"Optimizer state adoption: {what}; {instead.format(describe(owner.optimizer))} (RuntimeError: attempt exploded)"
    ]
    assert (outcome.adopter, outcome.fallback_reason) == (None, what)
    assert owner.optimizer.param_groups[0]["lr"] == 1e-3
    reference, _, _ = _run(case, registry_of())
    assert len(state_tensors(owner.optimizer)) == len(state_tensors(reference.optimizer)) > 0
    for a, b in zip(state_tensors(owner.optimizer), state_tensors(reference.optimizer)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    owner, run = case.setup()
    with pytest.raises(RuntimeError, match="attempt exploded"):
        run(registry_of(_FailingAttempt("failing", FusedAdamStandIn)))
    assert owner.optimizer.param_groups[0]["lr"] == 1e-3


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
    "an install with another lr": (LOAD, lambda: _InstallingAnotherLr("wrong", FusedAdamStandIn),
                                   "param group 0 does not have the state dict's lr"),
    "an export of copies": (EXPORT, lambda: Exporter("wrong", lambda o: copy.deepcopy(pytorch_state_dict(o))),
                            "the export['state'][0]['exp_avg'] is not the held tensor"),
    "an export after replacing the state": (EXPORT, lambda: Exporter("wrong", _replacing_state),
                                            "it replaced the optimizer's attribute 'state'"),
    "an export after changing a group": (EXPORT, lambda: Exporter("wrong", _changing_lr),
                                         "it changed the optimizer's 'param_groups'"),
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


class _ChangingThenRaising(PyTorchLoaderAdopter):
    """Installs with PyTorch's loader, makes ``change(optimizer)``, then raises."""

    def __init__(self, change: Callable[[Any], Any]) -> None:
        super().__init__("changing_then_raising")
        self.change = change

    def adopt(self, context: Any) -> None:
        super().adopt(context)
        self.change(context.optimizer)
        raise RuntimeError("adopt failed after changing the optimizer")


def _rebind_dtypes(optimizer: Any) -> None:
    optimizer.name_to_dtype_map = dict(optimizer.name_to_dtype_map, exp_avg_sq=torch.bfloat16)


ATTRIBUTE_CHANGES = {  # (trained, fresh, change)
    "Adam defaults['lr']": (trained_adam, fresh_adam, lambda o: o.defaults.__setitem__("lr", 0.5)),
    "a name_to_dtype_map entry": (trained_standin, fresh_standin,
                                  lambda o: o.name_to_dtype_map.__setitem__("exp_avg", torch.bfloat16)),
    "name_to_dtype_map rebound": (trained_standin, fresh_standin, _rebind_dtypes),
    "master_weights rebound": (trained_standin, fresh_standin, lambda o: setattr(o, "master_weights", True)),
    "an attribute added": (trained_adam, fresh_adam, lambda o: setattr(o, "adopted_by", "someone")),
}  # fmt: skip
PLAIN = (str, int, float, bool, torch.dtype, type(None))


def _assert_loaded_alike(mine: Any, theirs: Any) -> None:
    """The same attributes; equal plain values, defaults, dtype maps, groups and state."""
    assert sorted(vars(mine)) == sorted(vars(theirs))
    for name, value in vars(theirs).items():
        if isinstance(value, PLAIN) or name in ("defaults", "name_to_dtype_map"):
            assert getattr(mine, name) == value, name
    assert_same_state(mine, theirs)


@pytest.mark.parametrize("trained, fresh, change", ATTRIBUTE_CHANGES.values(), ids=ATTRIBUTE_CHANGES)
def test_an_adopter_that_changed_any_attribute_then_raised_is_fully_undone(
    trained: Callable[[], Any], fresh: Callable[[], Any], change: Callable[[Any], Any]
) -> None:
    """Every attribute of the inner optimizer is put back and every container refilled, so the
    own loader that runs instead loads exactly what it loads into a fresh optimizer."""
    mine, theirs = fresh(), fresh()
    registry = registry_of(_ChangingThenRaising(change), strict=False)
    outcome = outcome_of(registry, lambda: load_inner_optimizer_state_dict(
        Owner(mine), cloned_state_dict(trained()), owns_state_dict=True, registry=registry))  # fmt: skip
    assert (outcome.adopter, outcome.fallback_reason) == (None, "adopter 'changing_then_raising' failed and was undone")
    theirs.load_state_dict(cloned_state_dict(trained()))
    _assert_loaded_alike(mine, theirs)


class _InstallingInstead(PyTorchLoaderAdopter):
    """Accepts, installs the groups with PyTorch's loader and, per parameter, ``make(tensor)``
    in place of each incoming tensor."""

    def __init__(self, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__("instead")
        self.make = make

    def decline_reason(self, context: Any) -> Optional[str]:
        return None

    def adopt(self, context: Any) -> None:
        optimizer, given = context.optimizer, context.state_dict
        torch.optim.Optimizer.load_state_dict(optimizer, {"state": {}, "param_groups": given["param_groups"]})
        ids = [i for group in given["param_groups"] for i in group["params"]]
        for state_id, param in zip(ids, (p for g in optimizer.param_groups for p in g["params"])):
            optimizer.state[param] = {k: self.make(v) for k, v in given["state"][state_id].items()}


INSTEAD = {
    "clones": lambda t: t.clone(),
    "BF16 copies of FP32 moments": lambda t: t.bfloat16(),
    "zeros of the dtype and shape": torch.zeros_like,
}


@pytest.mark.parametrize("make", INSTEAD.values(), ids=INSTEAD)
def test_an_install_of_other_tensors_than_the_incoming_ones_is_rejected(make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """An install must keep the incoming tensors themselves: adopting exists so that no second
    copy of the state is made, and only identity shows that the checkpoint's values (not new
    ones of the right layout) were installed. So clones of the right dtype, shape and values are
    rejected too, like BF16 casts and zeros; a strict registry raises, a lenient one falls back
    to the own loader, which then loads what it loads without any adopter."""
    with pytest.raises(RuntimeError, match="exp_avg of parameter 0 is not the incoming tensor itself"):
        load_inner_optimizer_state_dict(Owner(fresh_standin()), cloned_state_dict(trained_standin()),
                                        owns_state_dict=True, registry=registry_of(_InstallingInstead(make)))  # fmt: skip
    mine, theirs = fresh_standin(), fresh_standin()
    registry = registry_of(_InstallingInstead(make), strict=False)
    outcome = outcome_of(registry, lambda: load_inner_optimizer_state_dict(
        Owner(mine), cloned_state_dict(trained_standin()), owns_state_dict=True, registry=registry))  # fmt: skip
    assert (outcome.adopter, outcome.method) == (None, "FusedAdamStandIn.load_state_dict")
    theirs.load_state_dict(cloned_state_dict(trained_standin()))
    _assert_loaded_alike(mine, theirs)


class _WritingInstaller(PyTorchLoaderAdopter):
    """Installs by reference with PyTorch's loader, writing into one incoming tensor."""

    def adopt(self, context: Any) -> None:
        super().adopt(context)
        context.state_dict["state"][0]["exp_avg"].add_(1.0)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
def test_an_install_that_wrote_into_an_incoming_tensor_is_an_error_never_a_success(strict: bool) -> None:
    """The checkpoint's values are gone, so neither the install nor the own loader can be
    right: the call raises, whatever the registry's mode."""
    optimizer, state_dict = fresh_adam(), cloned(trained_adam().state_dict())
    with pytest.raises(RuntimeError) as raised:
        load_inner_optimizer_state_dict(Owner(optimizer), state_dict, owns_state_dict=True,
                                        registry=registry_of(_WritingInstaller("writing", torch.optim.Adam), strict=strict))  # fmt: skip
    assert str(raised.value) == CANNOT_UNDO


def test_a_strict_outcome_hook_that_raises_after_an_adoption_does_not_undo_it() -> None:
    """The outcome is reported once the adoption is final: a raising hook raises in strict mode
    but the optimizer keeps the installed tensors themselves."""
    optimizer, state_dict = fresh_standin(), cloned_state_dict(trained_standin())
    registry = registry_of(_accepting())

    def broken(outcome: AdoptionOutcome) -> None:
        raise ValueError("hook exploded")

    registry.register_outcome_hook(broken)
    with pytest.raises(RuntimeError, match=r"outcome hook .* raised \(ValueError: hook exploded\)"):
        load_inner_optimizer_state_dict(Owner(optimizer), state_dict, owns_state_dict=True, registry=registry)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(
        optimizer.state[param].get(key) is state_dict["state"][index][key]
        for index, param in enumerate(params)
        for key in ("exp_avg", "exp_avg_sq")
    )
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 5e-4]


@pytest.mark.parametrize("accepting", [False, True], ids=["own loader", "adopter"])
def test_a_state_entry_holding_an_object_deepcopy_cannot_copy_loads_as_upstream_does(accepting: bool) -> None:
    """The snapshot copies containers only: a lock in a state entry is kept, by the own loader
    or by an adopter, as Adam's own load keeps it."""
    lock = threading.Lock()
    registry = registry_of(PyTorchLoaderAdopter("adam", torch.optim.Adam) if accepting else DecliningAdopter("declining"))
    mine, theirs, state_dict = fresh_adam(), fresh_adam(), cloned(trained_adam().state_dict())
    state_dict["state"][0]["lock"] = lock
    outcome = outcome_of(registry, lambda: load_inner_optimizer_state_dict(
        Owner(mine), state_dict, owns_state_dict=True, registry=registry))  # fmt: skip
    assert outcome.adopter == ("adam" if accepting else None) and outcome.error is None
    theirs.load_state_dict(dict(state_dict, state={k: dict(e) for k, e in state_dict["state"].items()}))
    first = mine.param_groups[0]["params"][0]
    assert mine.state[first]["lock"] is lock
    assert_same_state(mine, theirs)


@pytest.mark.parametrize("accepting", [False, True], ids=["own loader", "adopter"])
def test_a_tensor_inside_a_tuple_in_a_state_entry_is_installed_as_the_same_object(accepting: bool) -> None:
    """The snapshot copies no tensor: tensors inside a tuple in a state entry (one of them a
    non-leaf tensor, which cannot be deep-copied) are installed as the same objects, by the own
    loader or by an adopter, as Adam's own load keeps them."""
    registry = registry_of(PyTorchLoaderAdopter("adam", torch.optim.Adam) if accepting else DecliningAdopter("declining"))
    optimizer, state_dict = fresh_adam(), cloned(trained_adam().state_dict())
    pair = (torch.ones(3), torch.ones(2, requires_grad=True) * 2)
    state_dict["state"][0]["pair"] = pair
    outcome = outcome_of(registry, lambda: load_inner_optimizer_state_dict(
        Owner(optimizer), state_dict, owns_state_dict=True, registry=registry))  # fmt: skip
    assert outcome.adopter == ("adam" if accepting else None) and outcome.error is None
    installed = optimizer.state[optimizer.param_groups[0]["params"][0]]["pair"]
    assert installed[0] is pair[0] and installed[1] is pair[1]


# --- the own code, measurement and outcomes ---------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_own_codes_error_propagates_unchanged_after_its_outcome(case: Case) -> None:
    owner, run = case.setup()
    error = ValueError("upstream's own error")

    def raising(*args: Any) -> Any:
        raise error

    owner.optimizer.__dict__[case.method] = raising
    if case.point == "initialize":
        owner.optimizer.__dict__.pop("step")
        owner, run = owner, lambda registry: initialize_inner_optimizer_state(owner, raising, registry=registry, steps=True)
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


# --- logs -------------------------------------------------------------------------------------

STANDIN = "FusedAdamStandIn 0x… (4 params, 232 elements)"


def _messages(caplog: pytest.LogCaptureFixture) -> List[Tuple[int, str]]:
    return [(r.levelno, _unaddressed(r.getMessage())) for r in caplog.records if r.name.startswith(LOGGER)]


def test_a_load_logs_golden_messages(caplog: pytest.LogCaptureFixture) -> None:
    """The messages users read, word for word, with an outcome hook registered: an adoption at
    info with its sizes; the own loader at debug with every decline in one message (declines are
    not logged one by one); a fallback's warning, then the own loader's debug message."""
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        _run(LOAD, registry_of(_accepting(), strict=False))
        _run(LOAD, registry_of(DecliningAdopter("declining", "not mine"), DecliningAdopter("other", "nor mine")))
        _run(LOAD, registry_of(_FailingAttempt("failing", FusedAdamStandIn), strict=False))
    assert _messages(caplog) == [
        (logging.INFO, f"Optimizer state adopter 'accepting' installed the state of {STANDIN}: 1,856 B by reference, 0 B newly allocated"),
        (logging.DEBUG, f"FusedAdamStandIn.load_state_dict ran for {STANDIN} (every adopter declined; 'declining': not mine; 'other': nor mine)"),
        (logging.WARNING, f"Optimizer state adoption: adopter 'failing' failed and was undone; the own code runs for {STANDIN} (RuntimeError: attempt exploded)"),
        (logging.DEBUG, f"FusedAdamStandIn.load_state_dict ran for {STANDIN} (adopter 'failing' failed and was undone)"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_hook_point_logs_its_adoption_and_its_own_code(case: Case, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        _, _, adopted = _run(case, registry_of(_accepting()))
        _run(case, registry_of())
    sizes = f"{adopted.reused_bytes:,} B by reference, {adopted.allocated_bytes:,} B newly allocated"
    assert _messages(caplog) == [
        (logging.INFO, f"Optimizer state adopter 'accepting' {case.verb} the state of {STANDIN}: {sizes}"),
        (logging.DEBUG, f"{case.own} ran for {STANDIN} (no adopter is registered)"),
    ]


def test_sizes_from_one_mib_are_logged_in_mib(caplog: pytest.LogCaptureFixture) -> None:
    params = [torch.nn.Parameter(torch.zeros(2**18)), torch.nn.Parameter(torch.zeros(3))]
    source = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for param in params:
        param.grad = torch.ones_like(param)
    source.step()
    target = torch.optim.SGD([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.1, momentum=0.9)
    registry = registry_of(PyTorchLoaderAdopter("sgd", torch.optim.SGD))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        outcome_of(registry, lambda: load_inner_optimizer_state_dict(
            Owner(target), cloned(source.state_dict()), owns_state_dict=True, registry=registry))  # fmt: skip
    assert _messages(caplog) == [(logging.INFO, "Optimizer state adopter 'sgd' installed the state of SGD 0x… "
                                                "(2 params, 262,147 elements): 1.0 MiB by reference, 0 B newly allocated")]  # fmt: skip


def test_outcomes_exist_only_while_an_outcome_hook_is_registered(caplog: pytest.LogCaptureFixture) -> None:
    """Without an outcome hook nothing is measured: an adoption's message has no sizes and an
    error of the own code is not logged (it propagates); with one, both are."""
    error = ValueError("upstream's own error")

    def raising(state_dict: Any) -> None:
        raise error

    def failing_load(registry: StateAdopterRegistry) -> None:
        owner, run = _load()
        owner.optimizer.__dict__["load_state_dict"] = raising
        with pytest.raises(ValueError):
            run(registry)

    registry = registry_of(_accepting())
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        _, run = _load()
        run(registry)
        failing_load(registry)
    assert not registry.observed and _messages(caplog) == [
        (logging.INFO, f"Optimizer state adopter 'accepting' installed the state of {STANDIN}"),
    ]
    caplog.clear()
    outcomes: List[AdoptionOutcome] = []
    handle = registry.register_outcome_hook(outcomes.append)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        _, run = _load()
        run(registry)
        failing_load(registry)
    handle.remove()
    assert [(o.adopter, o.error) for o in outcomes] == [("accepting", None), (None, "ValueError: upstream's own error")]
    assert _messages(caplog) == [
        (logging.INFO, f"Optimizer state adopter 'accepting' installed the state of {STANDIN}: 1,856 B by reference, 0 B newly allocated"),
        (logging.WARNING, f"Optimizer state load of {STANDIN} raised: ValueError: upstream's own error"),
    ]  # fmt: skip


@pytest.mark.parametrize("value", ["false", 0, None], ids=["a string", "an int", "None"])
def test_a_switch_that_is_no_bool_is_a_clear_error_before_anything_runs(value: Any) -> None:
    """``OptimizerConfig.optimizer_state_adoption="false"`` would read as on: it is refused,
    naming the value, before the inner optimizer or any adopter is touched."""
    from megatron.core.optimizer.state_adoption import load_inner_optimizer_state_dict

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    before = optimizer.state_dict()
    owner = types.SimpleNamespace(optimizer=optimizer, config=types.SimpleNamespace(optimizer_state_adoption=value))
    with pytest.raises(TypeError, match=f"OptimizerConfig.optimizer_state_adoption is {value!r}, not a bool"):
        load_inner_optimizer_state_dict(owner, before)  # type: ignore[arg-type]
    assert optimizer.state_dict() == before
