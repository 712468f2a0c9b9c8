"""The switches: ``OptimizerConfig.optimizer_state_adoption`` and, for the drop-in build, the
environment variables ``MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION`` (kill switch) and
``MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS`` (skip adopters by name).

A switch that is off, on, mistyped or unmatched must never be silent: adoption off (or an
unrecognised value, which switches it off to be safe) shows in the outcome's fallback reason
and the load's INFO line; a value or name that does nothing is a WARNING, once per process.
Both hook points (load and export) obey every switch. Settings are read at every call.
"""

import logging
import sys
import types
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch
from adopters_for_tests import PyTorchLoaderAdopter
from builders import (
    Owner,
    cloned_state_dict,
    config_with,
    fresh_standin,
    standin_adopter,
    state_tensors,
    trained_standin,
)

from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    StateAdoptionContext,
    StateAdoptionOutcome,
    StateExportContext,
    export_inner_optimizer_state_dict,
    load_inner_optimizer_state_dict,
)

PACKAGE_LOGGER = "megatron.core.optimizer.state_adoption"
DISABLE = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
DISABLED_ADOPTERS = "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS"
CONFIG_SWITCH = "OptimizerConfig.optimizer_state_adoption"
TEST_GROUP = "megatron_core_tests.switch_adopters"


@pytest.fixture(autouse=True)
def _no_adoption_settings_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without state-adoption variables (the developer's shell may set some)."""
    import os

    for name in list(os.environ):
        if "STATE_ADOPT" in name.upper():
            monkeypatch.delenv(name)


class StandInExporter:
    """The stand-in adopter, also exporting PyTorch's state dict (the held tensors)."""

    def __init__(self, name: str = "te_fused_adam_fp32") -> None:
        self._adopter = standin_adopter()
        self.name = name
        self.exports = 0

    def decline_reason(self, context: StateAdoptionContext) -> Any:
        return self._adopter.decline_reason(context)

    def adopt(self, context: StateAdoptionContext) -> None:
        self._adopter.adopt(context)

    def export_decline_reason(self, context: StateExportContext) -> Any:
        return None

    def export_state_dict(self, context: StateExportContext) -> Dict[str, Any]:
        self.exports += 1
        state_dict: Dict[str, Any] = torch.optim.Optimizer.state_dict(context.optimizer)
        state_dict["state"] = {key: dict(entry) for key, entry in state_dict["state"].items()}
        return state_dict


@pytest.fixture
def exporting_registry() -> StateAdopterRegistry:
    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(StandInExporter())
    return registry


def _load(registry: StateAdopterRegistry, **owner_fields: Any) -> StateAdoptionOutcome:
    """Load a trained stand-in's cloned state into a fresh one, through ``registry``."""
    optimizer = fresh_standin()
    outcome = load_inner_optimizer_state_dict(
        Owner(optimizer, **owner_fields), cloned_state_dict(trained_standin()), registry=registry
    )
    if outcome.adopter is None:  # the stand-in's own loader: allocates every state tensor
        assert optimizer.allocations == len(state_tensors(optimizer)) > 0
    else:
        assert optimizer.allocations == 0
    return outcome


def _export(registry: StateAdopterRegistry, **owner_fields: Any) -> StateAdoptionOutcome:
    outcomes: List[StateAdoptionOutcome] = []
    handle = registry.register_outcome_hook(outcomes.append)
    try:
        export_inner_optimizer_state_dict(Owner(trained_standin(), **owner_fields), registry=registry)
    finally:
        handle.remove()
    (outcome,) = outcomes
    return outcome


def _records(caplog: pytest.LogCaptureFixture, level: int) -> List[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(PACKAGE_LOGGER) and r.levelno == level
    ]


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger=PACKAGE_LOGGER)
    return caplog


# --- OptimizerConfig.optimizer_state_adoption ----------------------------------------------------


def test_the_config_field_exists_and_defaults_to_on() -> None:
    assert OptimizerConfig().optimizer_state_adoption is True


def test_config_switch_off_runs_the_own_loader_and_names_the_field(
    registry: StateAdopterRegistry, logs: pytest.LogCaptureFixture
) -> None:
    outcome = _load(registry, config=OptimizerConfig(optimizer_state_adoption=False))
    assert outcome.adopter is None and outcome.declines == ()
    assert outcome.method == "FusedAdamStandIn.load_state_dict"
    assert outcome.fallback_reason == f"{CONFIG_SWITCH} is False"
    assert _records(logs, logging.WARNING) == []  # a deliberate switch is not a problem
    assert any(f"{CONFIG_SWITCH} is False" in m for m in _records(logs, logging.INFO))
    assert _load(registry).adopter == "te_fused_adam_fp32"  # the default config: on


def test_config_switch_off_applies_to_the_export_too(exporting_registry: StateAdopterRegistry) -> None:
    outcome = _export(exporting_registry, config=config_with(optimizer_state_adoption=False))
    assert outcome.adopter is None and outcome.method == "FusedAdamStandIn.state_dict"
    assert outcome.fallback_reason == f"{CONFIG_SWITCH} is False"
    assert _export(exporting_registry).adopter == "te_fused_adam_fp32"


@pytest.mark.parametrize("value", [0, 1, "False", "true", None], ids=repr)
def test_a_config_value_that_is_not_a_bool_switches_adoption_off_with_one_warning(
    registry: StateAdopterRegistry, logs: pytest.LogCaptureFixture, value: Any
) -> None:
    config = config_with(optimizer_state_adoption=value)
    for _ in range(2):
        outcome = _load(registry, config=config)
        assert outcome.adopter is None and outcome.fallback_reason == f"{CONFIG_SWITCH} is {value!r}"
    (warning,) = _records(logs, logging.WARNING)  # once per process, not once per load
    assert f"{CONFIG_SWITCH}={value!r} is not a bool" in warning and "switched off" in warning


@pytest.mark.parametrize(
    "config",
    [None, types.SimpleNamespace(use_precision_aware_optimizer=False)],
    ids=["no config", "a config without the field"],
)
def test_an_owner_without_the_field_keeps_adoption_on(config: Any) -> None:
    """An owner without a config, or a config from before the field, is not switched off."""
    adopter = PyTorchLoaderAdopter("any_sgd", torch.optim.SGD)
    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(adopter)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    outcome = load_inner_optimizer_state_dict(Owner(optimizer, config=config), optimizer.state_dict(), registry=registry)
    assert outcome.adopter == "any_sgd"


def test_an_owner_without_a_config_attribute_keeps_adoption_on() -> None:
    """The owner is anything with an ``optimizer``; one that has no ``config`` at all (not even
    None) is not switched off either, and its load is adopted with a context of defaults."""
    adopter = PyTorchLoaderAdopter("any_sgd", torch.optim.SGD)
    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(adopter)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    owner = types.SimpleNamespace(optimizer=optimizer)
    outcome = load_inner_optimizer_state_dict(owner, optimizer.state_dict(), registry=registry)
    assert outcome.adopter == "any_sgd"
    (context,) = adopter.adopted  # what the adopter was told of the bare owner
    assert context.config is None and context.ddp_config is None and context.is_stub_optimizer is False


# --- MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION ----------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "YES", "on", " On "])
def test_the_kill_switch_runs_the_own_loader_and_says_so_at_info(
    registry: StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture, value: str
) -> None:
    """Hole 4: an active kill switch was logged only at DEBUG; the load's outcome line is INFO."""
    monkeypatch.setenv(DISABLE, value)
    outcome = _load(registry)
    assert outcome.adopter is None and outcome.declines == ()  # no adopter asked
    assert outcome.fallback_reason == f"{DISABLE}={value} is set"
    (line,) = [m for m in _records(logs, logging.INFO) if f"{DISABLE}={value} is set" in m]
    assert line.startswith("FusedAdamStandIn.load_state_dict installed the state of FusedAdamStandIn ")
    assert _records(logs, logging.WARNING) == []


def test_the_kill_switch_applies_to_the_export_and_is_read_at_every_call(
    exporting_registry: StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DISABLE, "1")
    outcome = _export(exporting_registry)
    assert outcome.adopter is None and outcome.fallback_reason == f"{DISABLE}=1 is set"
    assert _load(exporting_registry).adopter is None
    monkeypatch.setenv(DISABLE, "0")  # no restart needed
    assert _export(exporting_registry).adopter == "te_fused_adam_fp32"
    assert _load(exporting_registry).adopter == "te_fused_adam_fp32"


def test_the_kill_switch_wins_over_the_config_field(
    registry: StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DISABLE, "1")
    outcome = _load(registry, config=OptimizerConfig(optimizer_state_adoption=True))
    assert outcome.fallback_reason == f"{DISABLE}=1 is set"
    monkeypatch.setenv(DISABLE, "0")  # an environment "off" cannot switch the config back on
    outcome = _load(registry, config=OptimizerConfig(optimizer_state_adoption=False))
    assert outcome.fallback_reason == f"{CONFIG_SWITCH} is False"


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off", " OFF "])
def test_kill_switch_off_values_keep_adoption_without_a_warning(
    registry: StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv(DISABLE, value)
    assert _load(registry).adopter == "te_fused_adam_fp32"
    assert _records(logs, logging.WARNING) == []


@pytest.mark.parametrize("value", ["ture", "2", "y", "disable", "-1", "1 # off"])
def test_hole_4_an_unrecognised_kill_switch_value_switches_off_with_one_warning(
    registry: StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture, value: str
) -> None:
    """Hole 4: ``ture``, ``2``, ``y`` and ``disable`` left adoption on without a word."""
    monkeypatch.setenv(DISABLE, value)
    for _ in range(2):
        outcome = _load(registry)
        assert outcome.adopter is None and outcome.declines == ()
        assert outcome.fallback_reason == f"{DISABLE}={value!r} is not recognised, so adoption is off"
    assert _export(registry).adopter is None
    (warning,) = _records(logs, logging.WARNING)  # once per process
    assert warning.startswith(f"{DISABLE}={value!r} is none of 1, true, yes, on")
    assert "switched off to be safe" in warning


# --- MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS ---------------------------------------------------------


@pytest.mark.parametrize("listed", ["first", " first , second_unused ", "first,,", ",first"])
def test_adopters_disabled_by_name_are_skipped_and_recorded(
    monkeypatch: pytest.MonkeyPatch, listed: str
) -> None:
    first, second = PyTorchLoaderAdopter("first"), PyTorchLoaderAdopter("second")
    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(first)
    registry.register(second)
    registry.register(PyTorchLoaderAdopter("second_unused"))
    monkeypatch.setenv(DISABLED_ADOPTERS, listed)
    outcome = _load(registry)
    assert first.checked == [] and len(second.adopted) == 1  # a disabled adopter is not asked
    assert outcome.adopter == "second"
    assert outcome.declines == (("first", f"disabled by {DISABLED_ADOPTERS}"),)


def test_disabling_the_only_adopter_by_name_restores_the_own_loader(
    registry: StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch, exporting_registry: StateAdopterRegistry
) -> None:
    monkeypatch.setenv(DISABLED_ADOPTERS, "te_fused_adam_fp32")
    outcome = _load(registry)
    assert outcome.adopter is None and outcome.fallback_reason == "every adopter declined"
    export = _export(exporting_registry)
    assert export.adopter is None and export.fallback_reason == "every state exporter declined"
    assert export.declines == (("te_fused_adam_fp32", f"disabled by {DISABLED_ADOPTERS}"),)
    monkeypatch.delenv(DISABLED_ADOPTERS)
    assert _load(registry).adopter == "te_fused_adam_fp32"


def test_hole_4_an_unknown_name_to_disable_is_warned_with_the_registered_names(
    registry: StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    """Hole 4: ``MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS=te_fused_adam_fp23`` disabled nothing,
    silently. It still disables nothing, and says which names would."""
    monkeypatch.setenv(DISABLED_ADOPTERS, "te_fused_adam_fp23")
    for _ in range(2):
        assert _load(registry).adopter == "te_fused_adam_fp32"
    (warning,) = _records(logs, logging.WARNING)
    assert warning.startswith(f"{DISABLED_ADOPTERS} names te_fused_adam_fp23, which no registered")
    assert warning.endswith("(registered: te_fused_adam_fp32)")


def test_only_the_unknown_names_are_warned_about_and_an_empty_registry_says_none(
    registry: StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(DISABLED_ADOPTERS, "zz_typo,te_fused_adam_fp32,aa_typo")
    assert _load(registry).adopter is None
    (warning,) = _records(logs, logging.WARNING)
    assert f"{DISABLED_ADOPTERS} names aa_typo, zz_typo, which" in warning
    logs.clear()
    assert _load(StateAdopterRegistry(entry_point_group=None)).adopter is None
    (warning,) = _records(logs, logging.WARNING)
    assert warning.endswith("(registered: none)")


# --- Variables that are not settings ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTIONS",
        "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTER",
        "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTERS",
        "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTION",
        "mcore_disable_optimizer_state_adoption",
    ],
)
def test_hole_4_a_misspelt_variable_is_warned_about(
    registry: StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture, name: str
) -> None:
    """Hole 4: a plural-name (or singular, or lowercase) typo of a variable did nothing, silently.
    It is still ignored, and a WARNING names it and the real settings."""
    monkeypatch.setenv(name, "1")
    for _ in range(2):
        assert _load(registry).adopter == "te_fused_adam_fp32"
    (warning,) = _records(logs, logging.WARNING)
    assert warning == (
        f"The environment variable {name} is not a setting of optimizer state adoption and is "
        f"ignored; the settings are {DISABLE} and {DISABLED_ADOPTERS}"
    )


def test_each_configuration_warning_is_given_once_and_different_ones_each_once(
    registry: StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MCORE_DISABLE_OPTIMIZER_STATE_ADOPTIONS", "1")
    monkeypatch.setenv(DISABLED_ADOPTERS, "nobody")
    for _ in range(3):
        _load(registry)
    monkeypatch.setenv(DISABLED_ADOPTERS, "somebody")
    for _ in range(3):
        _load(registry)
    warnings = _records(logs, logging.WARNING)
    assert len(warnings) == 3, warnings
    assert sum("MCORE_DISABLE_OPTIMIZER_STATE_ADOPTIONS" in w for w in warnings) == 1
    assert sum("names nobody," in w for w in warnings) == 1
    assert sum("names somebody," in w for w in warnings) == 1


# --- Disabling a plugin by its entry-point name --------------------------------------------------------

PLUGIN_SOURCE = """
import torch


class Adopter:
    name = "switchable_plugin"

    def decline_reason(self, context):
        return None if isinstance(context.optimizer, torch.optim.SGD) else "not SGD"

    def adopt(self, context):
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
"""


@pytest.fixture
def plugin_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], StateAdopterRegistry]:
    """A plugin distribution whose entry point ``switchable_plugin`` names its adopter."""
    (tmp_path / "switchable_plugin_module.py").write_text(PLUGIN_SOURCE)
    dist_info = tmp_path / "switchable_plugin_module-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: switchable_plugin_module\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[{TEST_GROUP}]\nswitchable_plugin = switchable_plugin_module:Adopter\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "switchable_plugin_module", raising=False)
    return lambda: StateAdopterRegistry(entry_point_group=TEST_GROUP)


def test_hole_4_a_plugin_is_disabled_by_its_entry_point_name(
    plugin_registry: Callable[[], StateAdopterRegistry],
    monkeypatch: pytest.MonkeyPatch,
    logs: pytest.LogCaptureFixture,
) -> None:
    """Hole 4: disabling a plugin by the name in its ``pyproject.toml`` did nothing when the
    adopter's ``name`` differed. The names must now be equal (tests/test_registry.py shows a
    differing plugin skipped with a warning), so the entry-point name disables it."""
    registry = plugin_registry()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    owner = Owner(optimizer)
    assert load_inner_optimizer_state_dict(owner, optimizer.state_dict(), registry=registry).adopter == (
        "switchable_plugin"
    )
    monkeypatch.setenv(DISABLED_ADOPTERS, "switchable_plugin")
    outcome = load_inner_optimizer_state_dict(owner, optimizer.state_dict(), registry=registry)
    assert outcome.adopter is None
    assert outcome.declines == (("switchable_plugin", f"disabled by {DISABLED_ADOPTERS}"),)
    assert _records(logs, logging.WARNING) == []
