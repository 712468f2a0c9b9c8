"""The log messages, word for word: their wording is a contract, documented in one place.

Every message the subsystem logs is listed, as a template, in the "Log messages" section at the
end of docs/user-guide.md: people grep logs for these lines and monitoring matches them. This
module is the only one that compares log text exactly. Each scenario below is a real load or
export (the FusedAdam stand-in, real ``torch.optim`` optimizers, the adopters of
tests/adopters_for_tests.py, a plugin distribution on disk) and states the complete log it
must produce: every record of the package's loggers, in order, as (level, template, values).
The placeholders (``<name>``) are filled with values the scenario computes from the objects it
made (the optimizer label from the optimizer's id, a hook's ``repr``), so nothing is matched
loosely. The templates used here and the section of the guide must list the same messages.
"""

import logging
import os
import re
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple, Union

import pytest
import torch
from adopters_for_tests import (
    CopyingAdopter,
    HeldMomentReadTargets,
    DecliningAdopter,
    Exporter,
    GarbageCheckAdopter,
    HalfInstallingAdopter,
    PyTorchLoaderAdopter,
    RaisingCheckAdopter,
    pytorch_state_dict,
)
from builders import (
    Owner,
    cloned_state_dict,
    config_with,
    export_through,
    fresh_standin,
    load_through,
    registry_of,
    standin_adopter,
    trained_standin,
)
from mcore_owners import precision_aware_owner
from real_optimizers import cloned, fresh_adam, params_of, trained_adam

from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    initialize_inner_optimizer_state,
    reading_optimizer_state,
    StateAdoptionContext,
    StateAdoptionOutcome,
)

LOGGER = "megatron.core.optimizer.state_adoption"
GUIDE = Path(__file__).resolve().parent.parent / "docs" / "user-guide.md"
SECTION = "## Log messages"
DEBUG, INFO, WARNING = logging.DEBUG, logging.INFO, logging.WARNING
LEVELS = {"DEBUG": DEBUG, "INFO": INFO, "WARNING": WARNING}

# --- the messages (level, template) --------------------------------------------------------

DECLINED = "Optimizer state adopter '<name>' declined: <reason>"
ADOPTER_INSTALLED = (
    "Optimizer state adopter '<name>' installed the state of <optimizer>: <reused> by reference, "
    "<allocated> newly allocated"
)
ADOPTER_EXPORTED = (
    "Optimizer state adopter '<name>' exported the state of <optimizer>: <reused> by reference, "
    "<allocated> newly allocated"
)
OWN_INSTALLED = (
    "<method> installed the state of <optimizer> (<reason>): <reused> by reference, <allocated> "
    "newly allocated"
)
OWN_EXPORTED = (
    "<method> exported the state of <optimizer> (<reason>): <reused> by reference, <allocated> "
    "newly allocated"
)
ALLOCATED_ON_INSTALL = (
    "Optimizer state adopter '<name>' installed <allocated> of newly allocated state for "
    "<optimizer> instead of the tensors it was given (did PyTorch's loader copy them?)"
)
ALLOCATED_ON_EXPORT = (
    "Optimizer state adopter '<name>' exported <allocated> of newly allocated state for "
    "<optimizer> instead of the tensors it was given (did PyTorch's loader copy them?)"
)
CHECK_RAISED = "Optimizer state adopter '<name>' raised in its check and is skipped: <error>"
CHECK_GARBAGE = (
    "Optimizer state adopter '<name>' returned <value> from its check instead of None or a "
    "reason; treating it as a decline"
)
INSTALL_FAILED = (
    "Optimizer state adopter '<name>' failed while installing the state (<error>); the optimizer "
    "was restored and <class>.load_state_dict loads the state instead"
)
EXPORT_FAILED = (
    "Optimizer state adopter '<name>' failed to export the state (<error>); <class>.state_dict is "
    "used instead"
)
OWN_METHOD_RAISED = "<method> raised for <optimizer>: <error>"
INTERRUPTED = "An optimizer state adopter raised for <optimizer>: <error>"
KILL_SWITCH_UNRECOGNISED = (
    "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION='<value>' is none of 1, true, yes, on (switch off) or "
    "0, false, no, off; optimizer state adoption is switched off to be safe"
)
CONFIG_NOT_A_BOOL = (
    "OptimizerConfig.optimizer_state_adoption=<value> is not a bool; optimizer state adoption is "
    "switched off to be safe"
)
UNKNOWN_ADOPTER_NAMES = (
    "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS names <names>, which no registered optimizer state "
    "adopter has (registered: <registered>)"
)
UNKNOWN_VARIABLE = (
    "The environment variable <variable> is not a setting of optimizer state adoption and is "
    "ignored; the settings are MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION and "
    "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS"
)
ADOPTER_INITIALIZED = (
    "Optimizer state adopter '<name>' initialized the state of <optimizer>: <reused> by "
    "reference, <allocated> newly allocated"
)
OWN_INITIALIZED = (
    "<method> initialized the state of <optimizer> (<reason>): <reused> by reference, "
    "<allocated> newly allocated"
)
INITIALIZE_FAILED = (
    "Optimizer state adopter '<name>' failed to initialize the state (<error>); the optimizer was "
    "restored and the own initialisation runs instead"
)
ADOPTER_READ = (
    "Optimizer state adopter '<name>' supplied the read targets for the state of <optimizer>: "
    "<reused> by reference, <allocated> newly allocated"
)
OWN_READ = (
    "<method> supplied the read targets for the state of <optimizer> (<reason>): <reused> by "
    "reference, <allocated> newly allocated"
)
READ_TARGET_FAILED = (
    "Optimizer state adopter '<name>' failed to supply the read target of '<state>' of a "
    "parameter of shape <shape> (<error>); it and the rest are get_unscaled_state's"
)
PLUGIN_SKIPPED = "Skipping optimizer state adopter plugin from <origin>: <error>"
OUTCOME_HOOK_RAISED = "Optimizer state adoption outcome hook <hook> raised <error>"

MESSAGES = {
    (DEBUG, DECLINED),
    (DEBUG, OWN_EXPORTED),
    (INFO, ADOPTER_INSTALLED),
    (INFO, ADOPTER_EXPORTED),
    (INFO, OWN_INSTALLED),
    (WARNING, ALLOCATED_ON_INSTALL),
    (WARNING, ALLOCATED_ON_EXPORT),
    (WARNING, CHECK_RAISED),
    (WARNING, CHECK_GARBAGE),
    (WARNING, INSTALL_FAILED),
    (WARNING, EXPORT_FAILED),
    (WARNING, OWN_METHOD_RAISED),
    (WARNING, INTERRUPTED),
    (WARNING, KILL_SWITCH_UNRECOGNISED),
    (WARNING, CONFIG_NOT_A_BOOL),
    (WARNING, UNKNOWN_ADOPTER_NAMES),
    (WARNING, UNKNOWN_VARIABLE),
    (WARNING, PLUGIN_SKIPPED),
    (WARNING, OUTCOME_HOOK_RAISED),
    (INFO, ADOPTER_INITIALIZED),
    (DEBUG, OWN_INITIALIZED),
    (WARNING, INITIALIZE_FAILED),
    (INFO, ADOPTER_READ),
    (DEBUG, OWN_READ),
    (WARNING, READ_TARGET_FAILED),
}

# --- the reasons the messages carry (<reason>) ----------------------------------------------

NO_ADOPTER = "no adopter is registered"
EVERY_ADOPTER_DECLINED = "every adopter declined"
FAILED_TO_INSTALL = "adopter '<name>' failed while installing the state"
NO_EXPORTER = "no registered adopter is a state exporter"
EVERY_EXPORTER_DECLINED = "every state exporter declined"
FAILED_TO_EXPORT = "adopter '<name>' failed to export the state"
KILL_SWITCH_SET = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=<value> is set"
KILL_SWITCH_NOT_RECOGNISED = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION='<value>' is not recognised, so adoption is off"
CONFIG_SWITCHED_OFF = "OptimizerConfig.optimizer_state_adoption is <value>"
INSTANCE_METHOD = (
    "the <class> instance has its own <method name> (set on the instance, e.g. by a wrapper), "
    "which upstream calls"
)
HOOK_REGISTERED = "a <method name> <kind>-hook is registered, which the own <method name> runs"
HOOKS_NOT_INSPECTABLE = "the optimizer's <method name> <kind>-hooks cannot be inspected"
DISABLED_BY_NAME = "disabled by MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS"
CHECK_RAISED_REASON = "check raised <error>"
CHECK_GARBAGE_REASON = "check returned <type> instead of None or a reason"
NOT_COPYABLE = "the state dict cannot be copied for a rollback: <error repr>"
NO_INITIALIZER = "no registered adopter is a state initializer"
EVERY_INITIALIZER_DECLINED = "every state initializer declined"
FAILED_TO_INITIALIZE = "adopter '<name>' failed to initialize the state"
HOLDS_STATE = "the inner optimizer already holds state, which the own initialisation steps"
INSTANCE_STEP = (
    "the <class> instance has its own step (set on the instance, e.g. by a wrapper), which the "
    "own initialisation calls"
)
STEP_HOOK = "a step <kind>-hook is registered, which the own initialisation runs"
STEP_HOOKS_NOT_INSPECTABLE = "the optimizer's step <kind>-hooks cannot be inspected"
GLOBAL_STEP_HOOKS = (
    "global optimizer step hooks are registered (or cannot be inspected), which the own "
    "initialisation runs"
)

NO_READ_TARGET_PROVIDER = "no registered adopter is a read-target provider"
EVERY_READ_TARGET_PROVIDER_DECLINED = "every read-target provider declined"

REASONS = {
    NO_READ_TARGET_PROVIDER,
    EVERY_READ_TARGET_PROVIDER_DECLINED,
    NO_ADOPTER,
    EVERY_ADOPTER_DECLINED,
    FAILED_TO_INSTALL,
    NO_EXPORTER,
    EVERY_EXPORTER_DECLINED,
    FAILED_TO_EXPORT,
    KILL_SWITCH_SET,
    KILL_SWITCH_NOT_RECOGNISED,
    CONFIG_SWITCHED_OFF,
    INSTANCE_METHOD,
    HOOK_REGISTERED,
    HOOKS_NOT_INSPECTABLE,
    DISABLED_BY_NAME,
    CHECK_RAISED_REASON,
    CHECK_GARBAGE_REASON,
    NOT_COPYABLE,
    NO_INITIALIZER,
    EVERY_INITIALIZER_DECLINED,
    FAILED_TO_INITIALIZE,
    HOLDS_STATE,
    INSTANCE_STEP,
    STEP_HOOK,
    STEP_HOOKS_NOT_INSPECTABLE,
    GLOBAL_STEP_HOOKS,
}

# --- filling templates ----------------------------------------------------------------------

Value = Union[str, Tuple[str, Mapping[str, Any]]]  # a text, or a reason template with its values
Line = Tuple[int, str, Mapping[str, Value]]
PLACEHOLDER = re.compile(r"<([a-z][a-z ]*)>")


def fill(template: str, values: Mapping[str, Value]) -> str:
    """``template`` with every placeholder replaced by its value (a reason: filled first)."""
    assert set(PLACEHOLDER.findall(template)) == set(values), (template, sorted(values))

    def text(value: Value) -> str:
        if isinstance(value, tuple):
            reason, reason_values = value
            assert reason in REASONS, reason
            return fill(reason, reason_values)
        return value

    return PLACEHOLDER.sub(lambda match: text(values[match.group(1)]), template)


def reason(template: str, **values: str) -> Tuple[str, Mapping[str, str]]:
    """A reason template and its values, e.g. ``reason(FAILED_TO_INSTALL, name="x")``."""
    return template, {key.replace("_", " "): value for key, value in values.items()}


def label(optimizer: torch.optim.Optimizer) -> str:
    """How outcomes and log lines name an inner optimizer: class, id, size."""
    params = params_of(optimizer)
    elements = sum(p.numel() for p in params)
    return f"{type(optimizer).__name__} {id(optimizer):#x} ({len(params)} params, {elements:,} elements)"


def own_load(optimizer: torch.optim.Optimizer, why: Value, reused: str, allocated: str) -> Line:
    return INFO, OWN_INSTALLED, {
        "method": f"{type(optimizer).__name__}.load_state_dict",
        "optimizer": label(optimizer),
        "reason": why,
        "reused": reused,
        "allocated": allocated,
    }


def own_export(optimizer: torch.optim.Optimizer, why: Value, reused: str, allocated: str = "0 B") -> Line:
    return DEBUG, OWN_EXPORTED, {
        "method": f"{type(optimizer).__name__}.state_dict",
        "optimizer": label(optimizer),
        "reason": why,
        "reused": reused,
        "allocated": allocated,
    }


def adopted(name: str, optimizer: torch.optim.Optimizer, reused: str, allocated: str = "0 B") -> Line:
    values = {"name": name, "optimizer": label(optimizer), "reused": reused, "allocated": allocated}
    return INFO, ADOPTER_INSTALLED, values


def declined(name: str, why: Value) -> Line:
    return DEBUG, DECLINED, {"name": name, "reason": why}


STANDIN_BYTES = "1,856 B"  # FP32 exp_avg and exp_avg_sq of the stand-in's 232 elements
ADAM_BYTES = "200 B"  # trained_adam(): 0-d step, exp_avg, exp_avg_sq of 23 elements


def _standin_load(registry: StateAdopterRegistry, **owner_fields: Any) -> torch.optim.Optimizer:
    optimizer = fresh_standin()
    load_through(optimizer, cloned_state_dict(trained_standin()), registry, **owner_fields)
    return optimizer


# --- scenarios: each runs a real load or export and returns the log it must produce ----------

Scenario = Callable[[pytest.MonkeyPatch, Path], List[Line]]


def adopter_installs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _standin_load(registry_of(DecliningAdopter("declining", "not mine"), standin_adopter()))
    return [declined("declining", "not mine"), adopted("te_fused_adam_fp32", optimizer, STANDIN_BYTES)]


def adopter_installs_copies(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _standin_load(registry_of(CopyingAdopter()))
    values = {"name": "copying", "optimizer": label(optimizer), "allocated": STANDIN_BYTES}
    return [adopted("copying", optimizer, "0 B", STANDIN_BYTES), (WARNING, ALLOCATED_ON_INSTALL, values)]


def exporter_exports(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = trained_adam()
    export_through(optimizer, registry_of(Exporter("good", pytorch_state_dict)))
    values = {"name": "good", "optimizer": label(optimizer), "reused": ADAM_BYTES, "allocated": "0 B"}
    return [(INFO, ADOPTER_EXPORTED, values)]


def _reallocating_export(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    held = optimizer.state[params_of(optimizer)[0]]["exp_avg"]
    held.data = held.data.clone()  # the held tensor itself, moved to new memory
    return pytorch_state_dict(optimizer)


def exporter_reallocates(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = trained_adam()
    export_through(optimizer, registry_of(Exporter("reallocating", _reallocating_export)))
    values = {"name": "reallocating", "optimizer": label(optimizer), "reused": "176 B", "allocated": "24 B"}
    allocated = {"name": "reallocating", "optimizer": label(optimizer), "allocated": "24 B"}
    return [(INFO, ADOPTER_EXPORTED, values), (WARNING, ALLOCATED_ON_EXPORT, allocated)]


def no_adopter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _standin_load(registry_of())
    return [own_load(optimizer, reason(NO_ADOPTER), "0 B", STANDIN_BYTES)]


def every_adopter_declines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _standin_load(registry_of(DecliningAdopter("a", "reason a"), DecliningAdopter("b", "reason b")))
    return [
        declined("a", "reason a"),
        declined("b", "reason b"),
        own_load(optimizer, reason(EVERY_ADOPTER_DECLINED), "0 B", STANDIN_BYTES),
    ]


def no_exporter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = trained_adam()
    export_through(optimizer, registry_of(DecliningAdopter("loads_only")))
    return [own_export(optimizer, reason(NO_EXPORTER), ADAM_BYTES)]


def every_exporter_declines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = trained_adam()
    export_through(optimizer, registry_of(Exporter("busy", pytorch_state_dict, decline="not now")))
    return [declined("busy", "not now"), own_export(optimizer, reason(EVERY_EXPORTER_DECLINED), ADAM_BYTES)]


def kill_switch_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    monkeypatch.setenv("MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION", "1")
    optimizer = _standin_load(registry_of(standin_adopter()))
    return [own_load(optimizer, reason(KILL_SWITCH_SET, value="1"), "0 B", STANDIN_BYTES)]


def kill_switch_unrecognised(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    monkeypatch.setenv("MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION", "ture")
    optimizer = _standin_load(registry_of(standin_adopter()))
    return [
        (WARNING, KILL_SWITCH_UNRECOGNISED, {"value": "ture"}),
        own_load(optimizer, reason(KILL_SWITCH_NOT_RECOGNISED, value="ture"), "0 B", STANDIN_BYTES),
    ]


def config_switched_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _standin_load(registry_of(standin_adopter()), config=config_with(optimizer_state_adoption=False))
    return [own_load(optimizer, reason(CONFIG_SWITCHED_OFF, value="False"), "0 B", STANDIN_BYTES)]


def config_not_a_bool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _standin_load(registry_of(standin_adopter()), config=config_with(optimizer_state_adoption="yes"))
    return [
        (WARNING, CONFIG_NOT_A_BOOL, {"value": "'yes'"}),
        own_load(optimizer, reason(CONFIG_SWITCHED_OFF, value="'yes'"), "0 B", STANDIN_BYTES),
    ]


def disabled_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    monkeypatch.setenv("MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS", "te_fused_adam_fp32")
    optimizer = _standin_load(registry_of(standin_adopter()))
    return [
        declined("te_fused_adam_fp32", reason(DISABLED_BY_NAME)),
        own_load(optimizer, reason(EVERY_ADOPTER_DECLINED), "0 B", STANDIN_BYTES),
    ]


def unknown_adopter_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    monkeypatch.setenv("MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS", "zz_typo,te_fused_adam_fp23")
    optimizer = _standin_load(registry_of(DecliningAdopter("declining", "not mine"), standin_adopter()))
    names = {"names": "te_fused_adam_fp23, zz_typo", "registered": "declining, te_fused_adam_fp32"}
    return [
        (WARNING, UNKNOWN_ADOPTER_NAMES, names),
        declined("declining", "not mine"),
        adopted("te_fused_adam_fp32", optimizer, STANDIN_BYTES),
    ]


def unknown_adopter_name_without_adopters(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    monkeypatch.setenv("MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS", "te_fused_adam_fp32")
    optimizer = _standin_load(registry_of())
    return [
        (WARNING, UNKNOWN_ADOPTER_NAMES, {"names": "te_fused_adam_fp32", "registered": "none"}),
        own_load(optimizer, reason(NO_ADOPTER), "0 B", STANDIN_BYTES),
    ]


def unknown_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    monkeypatch.setenv("MCORE_DISABLE_OPTIMIZER_STATE_ADOPTIONS", "1")
    optimizer = _standin_load(registry_of(standin_adopter()))
    return [
        (WARNING, UNKNOWN_VARIABLE, {"variable": "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTIONS"}),
        adopted("te_fused_adam_fp32", optimizer, STANDIN_BYTES),
    ]


def instance_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = fresh_standin()

    def load_state_dict(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]
    load_through(optimizer, cloned_state_dict(trained_standin()), registry_of(standin_adopter()))
    why = reason(INSTANCE_METHOD, **{"class": "FusedAdamStandIn", "method_name": "load_state_dict"})
    line = own_load(optimizer, why, STANDIN_BYTES, "0 B")
    return [(line[0], line[1], {**line[2], "method": "load_state_dict set on the FusedAdamStandIn instance"})]


def instance_state_dict(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = trained_adam()

    def state_dict(self: torch.optim.Optimizer) -> Dict[str, Any]:
        return torch.optim.Optimizer.state_dict(self)

    optimizer.state_dict = types.MethodType(state_dict, optimizer)  # type: ignore[method-assign]
    export_through(optimizer, registry_of(Exporter("good", pytorch_state_dict)))
    why = reason(INSTANCE_METHOD, **{"class": "Adam", "method_name": "state_dict"})
    line = own_export(optimizer, why, ADAM_BYTES)
    return [(line[0], line[1], {**line[2], "method": "state_dict set on the Adam instance"})]


def load_hook_registered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = fresh_adam()
    optimizer.register_load_state_dict_post_hook(lambda optimizer: None)
    load_through(optimizer, cloned(trained_adam().state_dict()), registry_of(PyTorchLoaderAdopter("pytorch")))
    why = reason(HOOK_REGISTERED, method_name="load_state_dict", kind="post")
    return [own_load(optimizer, why, ADAM_BYTES, "0 B")]


class _HookList:
    """A hook registry that is no mapping but has the ``values()`` PyTorch iterates."""

    def values(self) -> List[Callable[..., None]]:
        return []


def hooks_not_inspectable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = trained_adam()
    optimizer._optimizer_state_dict_pre_hooks = _HookList()  # type: ignore[assignment]
    export_through(optimizer, registry_of(Exporter("good", pytorch_state_dict)))
    return [own_export(optimizer, reason(HOOKS_NOT_INSPECTABLE, method_name="state_dict", kind="pre"), ADAM_BYTES)]


def check_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _standin_load(registry_of(RaisingCheckAdopter("raising"), PyTorchLoaderAdopter("later")))
    error = "RuntimeError: check exploded"
    return [
        (WARNING, CHECK_RAISED, {"name": "raising", "error": error}),
        declined("raising", reason(CHECK_RAISED_REASON, error=error)),
        adopted("later", optimizer, STANDIN_BYTES),
    ]


def check_answers_garbage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _standin_load(registry_of(GarbageCheckAdopter("garbage"), PyTorchLoaderAdopter("later")))
    return [
        (WARNING, CHECK_GARBAGE, {"name": "garbage", "value": "42"}),
        declined("garbage", reason(CHECK_GARBAGE_REASON, type="int")),
        adopted("later", optimizer, STANDIN_BYTES),
    ]


def state_dict_not_copyable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    payload = {"state": {0: [1, 2]}, "param_groups": optimizer.state_dict()["param_groups"]}
    load_through(optimizer, payload, registry_of(PyTorchLoaderAdopter("would_adopt")))
    try:
        dict([1, 2])  # type: ignore[call-overload]  # Python's own words for why
    except TypeError as error:
        why = reason(NOT_COPYABLE, error_repr=repr(error))
    return [declined("would_adopt", why), own_load(optimizer, reason(EVERY_ADOPTER_DECLINED), "0 B", "0 B")]


def install_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _standin_load(registry_of(HalfInstallingAdopter()))
    values = {"name": "half_installing", "error": "RuntimeError: failed half-way", "class": "FusedAdamStandIn"}
    return [
        (WARNING, INSTALL_FAILED, values),
        own_load(optimizer, reason(FAILED_TO_INSTALL, name="half_installing"), "0 B", STANDIN_BYTES),
    ]


class _GroupsOnly:
    """Accepts, then installs only the param groups (a plugin author's mistake)."""

    name = "groups_only"

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: StateAdoptionContext) -> None:
        groups = context.state_dict["param_groups"]
        torch.optim.Optimizer.load_state_dict(context.optimizer, {"state": {}, "param_groups": groups})


def install_does_not_match(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _standin_load(registry_of(_GroupsOnly()))
    error = "RuntimeError: the installed state does not match the state dict: parameter 0 has no state"
    return [
        (WARNING, INSTALL_FAILED, {"name": "groups_only", "error": error, "class": "FusedAdamStandIn"}),
        own_load(optimizer, reason(FAILED_TO_INSTALL, name="groups_only"), "0 B", STANDIN_BYTES),
    ]


def _export_failure(export: Callable[[torch.optim.Optimizer], Any], error: str) -> List[Line]:
    optimizer = trained_adam()
    export_through(optimizer, registry_of(Exporter("bad", export)))
    return [
        (WARNING, EXPORT_FAILED, {"name": "bad", "error": error, "class": "Adam"}),
        own_export(optimizer, reason(FAILED_TO_EXPORT, name="bad"), ADAM_BYTES),
    ]


def export_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    def export(optimizer: torch.optim.Optimizer) -> Any:
        raise RuntimeError("exporter broke")

    return _export_failure(export, "RuntimeError: exporter broke")


def export_does_not_match(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    def export(optimizer: torch.optim.Optimizer) -> Any:
        state_dict = pytorch_state_dict(optimizer)
        state_dict["state"] = {}
        return state_dict

    mismatch = "it has state for 0 ids ([]), the optimizer holds state for ids [0, 1, 2, 3] (4)"
    return _export_failure(export, f"ValueError: the exported state dict does not match the optimizer: {mismatch}")


def _changing(change: Callable[[torch.optim.Optimizer], None]) -> Callable[[torch.optim.Optimizer], Any]:
    def export(optimizer: torch.optim.Optimizer) -> Any:
        change(optimizer)
        return pytorch_state_dict(optimizer)

    return export


def _state_replaced(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state = defaultdict(dict, optimizer.state)


def _entry_replaced(optimizer: torch.optim.Optimizer) -> None:
    param = params_of(optimizer)[1]
    optimizer.state[param] = dict(optimizer.state[param])


def _value_replaced(optimizer: torch.optim.Optimizer) -> None:
    entry = optimizer.state[params_of(optimizer)[1]]
    entry["exp_avg"] = entry["exp_avg"].clone()


def _group_added(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups.append({**optimizer.param_groups[1], "params": []})


def _group_replaced(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[0] = dict(optimizer.param_groups[0])


def _hyper_parameter_replaced(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[1]["lr"] = 0.25


def _params_reordered(optimizer: torch.optim.Optimizer) -> None:
    optimizer.param_groups[0]["params"].reverse()


CHANGES = {
    "its state replaced": (_state_replaced, "its state changed"),
    "a state entry replaced": (_entry_replaced, "its state changed"),
    "a state value replaced": (_value_replaced, "its state changed"),
    "a param group added": (_group_added, "its param groups changed"),
    "a param group replaced": (_group_replaced, "its param groups changed"),
    "a hyper-parameter changed": (_hyper_parameter_replaced, "its param groups changed"),
    "a group's parameters reordered": (_params_reordered, "its param groups changed"),
}


def _export_changes(case: str) -> Scenario:
    change, what = CHANGES[case]

    def scenario(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
        return _export_failure(_changing(change), f"RuntimeError: exporting changed the optimizer: {what}")

    return scenario


class _FailingAdam(torch.optim.Adam):
    """An Adam whose own ``load_state_dict`` raises."""

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        raise RuntimeError("disk gone")


def own_loader_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = _FailingAdam(fresh_adam().param_groups)
    with pytest.raises(RuntimeError):
        load_through(optimizer, cloned(trained_adam().state_dict()), registry_of(DecliningAdopter("declining", "no")))
    values = {"method": "_FailingAdam.load_state_dict", "optimizer": label(optimizer), "error": "RuntimeError: disk gone"}
    return [declined("declining", "no"), (WARNING, OWN_METHOD_RAISED, values)]


class _Interrupting(DecliningAdopter):
    """Its check is interrupted (Ctrl-C while it runs)."""

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        raise KeyboardInterrupt("stop")


def interrupted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = fresh_standin()
    registry = registry_of(DecliningAdopter("declining", "no"), _Interrupting("interrupting"))
    with pytest.raises(KeyboardInterrupt):
        load_through(optimizer, cloned_state_dict(trained_standin()), registry)
    return [declined("declining", "no"), (WARNING, INTERRUPTED, {"optimizer": label(optimizer), "error": "KeyboardInterrupt: stop"})]


class _InterruptingExporter(Exporter):
    """Its export check is interrupted."""

    def export_decline_reason(self, context: Any) -> Optional[str]:
        raise SystemExit(3)


def export_interrupted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = trained_adam()
    with pytest.raises(SystemExit):
        export_through(optimizer, registry_of(_InterruptingExporter("interrupting", pytorch_state_dict)))
    return [(WARNING, INTERRUPTED, {"optimizer": label(optimizer), "error": "SystemExit: 3"})]


def outcome_hook_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    def hook(outcome: StateAdoptionOutcome) -> None:
        raise RuntimeError("observer broke")

    registry = registry_of(standin_adopter())
    registry.register_outcome_hook(hook)
    optimizer = _standin_load(registry)
    return [
        adopted("te_fused_adam_fp32", optimizer, STANDIN_BYTES),
        (WARNING, OUTCOME_HOOK_RAISED, {"hook": repr(hook), "error": "RuntimeError: observer broke"}),
    ]


PLUGIN_GROUP = "megatron_core_tests.log_message_plugins"
PLUGIN_SOURCE = """
class Adopter:
    name = "actual_name"

    def decline_reason(self, context):
        return "declines everything"

    def adopt(self, context):
        raise AssertionError("never accepts")
"""


def plugin_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    (tmp_path / "log_message_plugin.py").write_text(PLUGIN_SOURCE)
    dist_info = tmp_path / "log_message_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: log_message_plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\nlisted_name = log_message_plugin:Adopter\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "log_message_plugin", raising=False)
    optimizer = _standin_load(StateAdopterRegistry(entry_point_group=PLUGIN_GROUP))
    origin = "entry point listed_name = log_message_plugin:Adopter (log_message_plugin 1.0)"
    error = (
        "ValueError: the adopter's name 'actual_name' differs from the entry point's name "
        "'listed_name'; they must be equal (the name disables it)"
    )
    return [(WARNING, PLUGIN_SKIPPED, {"origin": origin, "error": error}), own_load(optimizer, reason(NO_ADOPTER), "0 B", STANDIN_BYTES)]


class _DummyStepOwner(Owner):
    """An owner whose own initialisation is MCore's dummy step on zero gradients."""

    def _init_optimizer_states_with_dummy_values(self) -> None:
        for param in params_of(self.optimizer):
            param.grad = torch.zeros_like(param)
        self.optimizer.step()
        self.optimizer.zero_grad()


DUMMY_STEP = "_DummyStepOwner._init_optimizer_states_with_dummy_values"


def _initialize(optimizer: torch.optim.Optimizer, registry: StateAdopterRegistry) -> None:
    owner = _DummyStepOwner(optimizer)
    initialize_inner_optimizer_state(owner, owner._init_optimizer_states_with_dummy_values, registry)


def own_initialized(optimizer: torch.optim.Optimizer, why: Value, method: str = DUMMY_STEP) -> Line:
    values = {"method": method, "optimizer": label(optimizer), "reason": why, "reused": "0 B", "allocated": STANDIN_BYTES}
    return DEBUG, OWN_INITIALIZED, values


def initializer_initializes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = fresh_standin()
    _initialize(optimizer, registry_of(standin_adopter()))
    values = {"name": "te_fused_adam_fp32", "optimizer": label(optimizer), "reused": "0 B", "allocated": STANDIN_BYTES}
    return [(INFO, ADOPTER_INITIALIZED, values)]


def no_initializer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = fresh_standin()
    _initialize(optimizer, registry_of(DecliningAdopter("not_an_initializer")))
    return [own_initialized(optimizer, reason(NO_INITIALIZER))]


def every_initializer_declines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = fresh_standin()
    params_of(optimizer)[0].grad = torch.zeros_like(params_of(optimizer)[0])
    _initialize(optimizer, registry_of(standin_adopter()))
    why = "parameter 0 has a grad, which a step would apply"
    return [declined("te_fused_adam_fp32", why), own_initialized(optimizer, reason(EVERY_INITIALIZER_DECLINED))]


class _FailingInitializer(DecliningAdopter):
    """An initializer that accepts and raises."""

    def initialize_decline_reason(self, context: Any) -> Optional[str]:
        return None

    def initialize_state(self, context: Any) -> None:
        raise RuntimeError("no memory")


def initializer_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    optimizer = fresh_standin()
    _initialize(optimizer, registry_of(_FailingInitializer("failing")))
    failed = {"name": "failing", "error": "RuntimeError: no memory"}
    return [(WARNING, INITIALIZE_FAILED, failed), own_initialized(optimizer, reason(FAILED_TO_INITIALIZE, name="failing"))]


def _own_initialization_because(change: Callable[[torch.optim.Optimizer], Any], why: Value, method: str = DUMMY_STEP) -> List[Line]:
    optimizer = fresh_standin()
    change(optimizer)
    owner = _DummyStepOwner(optimizer)

    def create_state_directly() -> None:  # for an optimizer whose step() cannot run
        for param in params_of(optimizer):
            optimizer.initialize_state(param)

    own = owner._init_optimizer_states_with_dummy_values if method == DUMMY_STEP else create_state_directly
    initialize_inner_optimizer_state(owner, own, registry_of(standin_adopter()))
    return [own_initialized(optimizer, why, own.__qualname__ if method != DUMMY_STEP else DUMMY_STEP)]


def initialize_holding_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    def held(optimizer: torch.optim.Optimizer) -> None:
        for param in params_of(optimizer):
            optimizer.initialize_state(param)

    optimizer = fresh_standin()
    held(optimizer)
    owner = _DummyStepOwner(optimizer)
    initialize_inner_optimizer_state(owner, lambda: None, registry_of(standin_adopter()))
    values = {"method": "initialize_holding_state.<locals>.<lambda>", "optimizer": label(optimizer), "reason": reason(HOLDS_STATE), "reused": STANDIN_BYTES, "allocated": "0 B"}
    return [(DEBUG, OWN_INITIALIZED, values)]


def initialize_with_instance_step(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    return _own_initialization_because(
        lambda optimizer: setattr(optimizer, "step", types.MethodType(type(optimizer).step, optimizer)),
        reason(INSTANCE_STEP, **{"class": "FusedAdamStandIn"}),
    )


def initialize_with_step_hook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    return _own_initialization_because(
        lambda optimizer: optimizer.register_step_post_hook(lambda *args: None), reason(STEP_HOOK, kind="post")
    )


def initialize_with_uninspectable_step_hooks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    return _own_initialization_because(
        lambda optimizer: setattr(optimizer, "_optimizer_step_pre_hooks", _HookList()),
        reason(STEP_HOOKS_NOT_INSPECTABLE, kind="pre"),
        method="direct",
    )


def initialize_with_global_step_hook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    handle = register_optimizer_step_pre_hook(lambda *args: None)
    try:
        return _own_initialization_because(lambda optimizer: None, reason(GLOBAL_STEP_HOOKS))
    finally:
        handle.remove()


def _read(registry: StateAdopterRegistry, change: Callable[[Any], Any] = lambda owner: None) -> Any:
    """Build a precision-aware owner's read targets as sharded_param_state_dp_reshardable does."""
    optimizer = fresh_standin(
        exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, master_weights=True
    )
    owner = precision_aware_owner(optimizer)
    change(owner)
    with reading_optimizer_state(owner, True, registry=registry):
        for param in params_of(optimizer):
            owner._get_main_param_and_optimizer_states(param)
    return owner


READ_BF16_BYTES = "928 B"  # BF16 exp_avg and exp_avg_sq of the stand-in's 232 elements
MASTER_BYTES = "928 B"  # its FP32 master weights


def own_read(optimizer: torch.optim.Optimizer, why: Value, reused: str = MASTER_BYTES, allocated: str = STANDIN_BYTES) -> Line:
    values = {"method": "FusedAdamStandIn.get_unscaled_state", "optimizer": label(optimizer), "reason": why, "reused": reused, "allocated": allocated}
    return DEBUG, OWN_READ, values


def provider_supplies(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    owner = _read(registry_of(HeldMomentReadTargets()))
    values = {"name": "held_moments", "optimizer": label(owner.optimizer), "reused": "1,856 B", "allocated": "0 B"}
    return [(INFO, ADOPTER_READ, values)]


def no_read_target_provider(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    owner = _read(registry_of(DecliningAdopter("not_a_provider")))
    return [own_read(owner.optimizer, reason(NO_READ_TARGET_PROVIDER))]


def every_read_target_provider_declines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    monkeypatch.setenv("MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS", "held_moments")
    owner = _read(registry_of(HeldMomentReadTargets()))
    return [declined("held_moments", reason(DISABLED_BY_NAME)), own_read(owner.optimizer, reason(EVERY_READ_TARGET_PROVIDER_DECLINED))]


def read_with_instance_get_unscaled_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    def wrap(owner: Any) -> None:
        owner.optimizer.__dict__["get_unscaled_state"] = owner.optimizer.get_unscaled_state

    owner = _read(registry_of(HeldMomentReadTargets()), wrap)
    why = reason(INSTANCE_METHOD, **{"class": "FusedAdamStandIn", "method name": "get_unscaled_state"})
    return [own_read(owner.optimizer, why)]


def read_target_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[Line]:
    provider = HeldMomentReadTargets()

    def no_such_state(optimizer: Any, param: torch.Tensor) -> Any:
        raise KeyError("exp_avg_sq")

    provider.target_of["exp_avg_sq"] = no_such_state
    owner = _read(registry_of(provider))
    shape = str(tuple(params_of(owner.optimizer)[0].shape))
    failed = {"name": "held_moments", "state": "exp_avg_sq", "shape": shape, "error": "KeyError: 'exp_avg_sq'"}
    first = params_of(owner.optimizer)[0].numel() * 2  # the first exp_avg, read in place
    values = {"name": "held_moments", "optimizer": label(owner.optimizer), "reused": f"{928 + first:,} B", "allocated": f"{1856 - 2 * first:,} B"}
    return [(WARNING, READ_TARGET_FAILED, failed), (INFO, ADOPTER_READ, values)]


SCENARIOS: Dict[str, Scenario] = {
    "an adopter installs the state": adopter_installs,
    "an adopter installs copies": adopter_installs_copies,
    "an exporter exports the held state": exporter_exports,
    "an exporter moves a held tensor to new memory": exporter_reallocates,
    "no adopter is registered": no_adopter,
    "every adopter declines": every_adopter_declines,
    "no exporter is registered": no_exporter,
    "every exporter declines": every_exporter_declines,
    "the kill switch is set": kill_switch_set,
    "the kill switch has an unrecognised value": kill_switch_unrecognised,
    "the config switches adoption off": config_switched_off,
    "the config value is not a bool": config_not_a_bool,
    "an adopter is disabled by name": disabled_by_name,
    "unknown names are disabled": unknown_adopter_names,
    "a name is disabled in an empty registry": unknown_adopter_name_without_adopters,
    "a variable that is no setting": unknown_variable,
    "a load_state_dict set on the instance": instance_loader,
    "a state_dict set on the instance": instance_state_dict,
    "a load_state_dict hook is registered": load_hook_registered,
    "state_dict hooks cannot be inspected": hooks_not_inspectable,
    "a check raises": check_raises,
    "a check answers garbage": check_answers_garbage,
    "the state dict cannot be copied": state_dict_not_copyable,
    "an install raises": install_raises,
    "an install does not match the state dict": install_does_not_match,
    "an export raises": export_raises,
    "an export does not match the optimizer": export_does_not_match,
    **{f"an exporter changes the optimizer: {case}": _export_changes(case) for case in CHANGES},
    "the own loader raises": own_loader_raises,
    "consulting the adopters is interrupted": interrupted,
    "consulting the exporters is interrupted": export_interrupted,
    "an outcome hook raises": outcome_hook_raises,
    "a plugin is skipped": plugin_skipped,
    "an initializer creates the state": initializer_initializes,
    "no initializer is registered": no_initializer,
    "every initializer declines": every_initializer_declines,
    "an initializer fails": initializer_fails,
    "the optimizer holds state already": initialize_holding_state,
    "a step set on the instance": initialize_with_instance_step,
    "a step hook is registered": initialize_with_step_hook,
    "step hooks cannot be inspected": initialize_with_uninspectable_step_hooks,
    "a global step hook is registered": initialize_with_global_step_hook,
    "a provider supplies the read targets": provider_supplies,
    "no read-target provider is registered": no_read_target_provider,
    "every read-target provider declines": every_read_target_provider_declines,
    "a get_unscaled_state set on the instance": read_with_instance_get_unscaled_state,
    "a read target fails": read_target_fails,
}


def _without_adoption_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove the state-adoption variables the developer's shell may set."""
    for name in list(os.environ):
        if "STATE_ADOPT" in name.upper():
            monkeypatch.delenv(name)


def _guide_section() -> str:
    text = GUIDE.read_text()
    assert text.count(SECTION) == 1, f"{GUIDE} needs exactly one '{SECTION}' section"
    section = text.split(SECTION, 1)[1]
    assert "\n## " not in section, f"'{SECTION}' must be the guide's last section"
    return section


def _documented() -> Tuple[Set[Tuple[int, str]], Set[str]]:
    """The (level, message) rows and the reason rows of the guide's tables."""
    section = _guide_section()
    messages = {
        (LEVELS[match.group(1)], match.group(2))
        for match in re.finditer(r"^\| (DEBUG|INFO|WARNING) \| `([^`]+)` \|", section, re.MULTILINE)
    }
    reasons = {match.group(1) for match in re.finditer(r"^\| `([^`]+)` \|", section, re.MULTILINE)}
    return messages, reasons


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_each_message_is_logged_word_for_word(
    scenario: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The scenario's complete log, every record of the package's loggers in order, is the
    expected lines exactly: level and full message; and the guide lists each template."""
    _without_adoption_settings(monkeypatch)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    expected = SCENARIOS[scenario](monkeypatch, tmp_path)
    logged = [(record.levelno, record.getMessage()) for record in caplog.records if record.name.startswith(LOGGER)]
    assert logged == [(level, fill(template, values)) for level, template, values in expected]
    messages, reasons = _documented()
    for level, template, values in expected:
        assert (level, template) in messages, f"docs/user-guide.md does not list {logging.getLevelName(level)} `{template}`"
        for value in values.values():
            assert not isinstance(value, tuple) or value[0] in reasons, f"docs/user-guide.md does not list `{value[0]}`"


def test_every_message_and_reason_is_produced_by_a_scenario(tmp_path_factory: pytest.TempPathFactory) -> None:
    """No listed message or reason goes unchecked, and the scenarios use no other."""
    messages, reasons = set(), set()
    for scenario in SCENARIOS.values():
        with pytest.MonkeyPatch.context() as monkeypatch:
            _without_adoption_settings(monkeypatch)
            lines = scenario(monkeypatch, tmp_path_factory.mktemp("scenario"))
        for level, template, values in lines:
            messages.add((level, template))
            reasons.update(value[0] for value in values.values() if isinstance(value, tuple))
    assert messages == MESSAGES, (sorted(messages - MESSAGES), sorted(MESSAGES - messages))
    assert reasons == REASONS, (sorted(reasons - REASONS), sorted(REASONS - reasons))


def test_the_user_guide_lists_exactly_these_messages_and_reasons() -> None:
    """docs/user-guide.md's last section lists each message (level and template) and each
    reason, as this module does: the documentation and the code cannot drift apart."""
    documented, reasons = _documented()
    assert documented == MESSAGES, (sorted(documented - MESSAGES), sorted(MESSAGES - documented))
    assert reasons == REASONS, (sorted(reasons - REASONS), sorted(REASONS - reasons))
