"""The registry: order, prepend, handles, names, threads, plugins, outcome hooks, strictness and
the environment switch.

Plugins are real installed distributions (``install_plugin`` in conftest.py) in a group of the
test's own, so that the plugins installed in the environment stay out of the way.
"""

import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Callable, List

import pytest
import torch
from adopters_for_tests import DecliningAdopter, PyTorchLoaderAdopter
from builders import Owner, registry_of

from megatron.core.optimizer.state_adoption import (
    AdoptionOutcome,
    StateAdopter,
    StateAdopterRegistry,
    default_registry,
    load_inner_optimizer_state_dict,
)

LOGGER = "megatron.core.optimizer.state_adoption"
GROUP = "test.adopters"

PLUGIN_SOURCE = textwrap.dedent(
    """
    import torch
    from megatron.core.optimizer.state_adoption import StateAdopter

    class Plugin(StateAdopter):
        def __init__(self, name):
            self._name = name
        @property
        def name(self):
            return self._name
        def decline_reason(self, context):
            return None if isinstance(context.optimizer, torch.optim.SGD) else "not SGD"
        def adopt(self, context):
            torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))

    def make(name):
        return lambda: Plugin(name)

    alpha, beta, gamma = make("alpha"), make("beta"), make("gamma")
    mismatched = make("another_name")
    def raises():
        raise RuntimeError("factory exploded")
    def not_an_adopter():
        return object()
    """
)


def _names(registry: StateAdopterRegistry) -> List[str]:
    return [adopter.name for adopter, _ in registry.registrations()]


def _plugin_registry(strict: bool = True) -> StateAdopterRegistry:
    return StateAdopterRegistry(strict=strict, plugin_group=GROUP)


def test_the_process_wide_registry_holds_the_fp32_adopter_built_in_and_nothing_opt_in() -> None:
    assert _names(default_registry()) == ["te_fused_adam_fp32"]


def test_order_is_prepended_built_in_plugins_then_code_whenever_registered(
    install_plugin: Callable[..., Path]
) -> None:
    """The documented rule holds whether code registers before or after the plugins load."""
    install_plugin("ordered", {"beta": "ordered:beta", "alpha": "ordered:alpha"}, PLUGIN_SOURCE, GROUP)
    registry = _plugin_registry()
    registry.register(DecliningAdopter("code_1"))
    registry.register(DecliningAdopter("built"), built_in=True)
    registry.load_plugins()
    registry.register(DecliningAdopter("code_2"))
    registry.register(DecliningAdopter("first"), prepend=True)
    registry.register(DecliningAdopter("very_first"), prepend=True)
    assert _names(registry) == ["very_first", "first", "built", "alpha", "beta", "code_1", "code_2"]


def test_a_handle_removes_its_adopter_once_even_from_many_threads() -> None:
    """A handle removed from 8 threads at once raises nowhere (PyTorch's handle checks, then
    deletes: threads switching between the two raised KeyError before), 200 times, with threads
    switching as often as possible; a stale handle leaves a new registration alone."""
    errors: List[BaseException] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(200):
            registry = registry_of(DecliningAdopter("kept"))
            handle = registry.register(DecliningAdopter("removed"))
            barrier = threading.Barrier(8)

            def remove() -> None:
                barrier.wait()
                try:
                    handle.remove()
                except BaseException as error:  # collected for the assertion
                    errors.append(error)

            threads = [threading.Thread(target=remove) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and _names(registry) == ["kept"]
    registry.register(DecliningAdopter("removed"))
    handle.remove()  # stale: the new registration stays
    assert _names(registry) == ["kept", "removed"]


def test_concurrent_registrations_of_one_name_let_exactly_one_win() -> None:
    registry = registry_of()
    results: List[str] = []
    barrier = threading.Barrier(8)

    def register() -> None:
        barrier.wait()
        try:
            registry.register(DecliningAdopter("contested"))
            results.append("won")
        except ValueError:
            results.append("refused")

    threads = [threading.Thread(target=register) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == ["refused"] * 7 + ["won"] and _names(registry) == ["contested"]


@pytest.mark.parametrize("name", ["a", "te_fused_adam_fp32", "my.plugin-2", "A9_x"])
def test_names_of_letters_digits_underscores_dots_and_dashes_are_accepted(name: str) -> None:
    assert _names(registry_of(DecliningAdopter(name))) == [name]


@pytest.mark.parametrize("name", ["", " padded ", "my adopter", "1st", "a\tb", "-x", None, 3])
def test_other_names_are_refused(name: object) -> None:
    registry = registry_of()
    with pytest.raises(TypeError, match="a name starts with a letter"):
        registry.register(DecliningAdopter(name))  # type: ignore[arg-type]
    assert registry.registrations() == ()


def test_a_taken_name_and_a_non_adopter_are_refused_and_the_registry_is_unchanged() -> None:
    registry = registry_of(DecliningAdopter("taken"))
    with pytest.raises(ValueError, match="a state adopter named 'taken' is registered"):
        registry.register(DecliningAdopter("taken"))
    for thing in (object(), DecliningAdopter, lambda context: None):
        with pytest.raises(TypeError, match="is not a StateAdopter"):
            registry.register(thing)  # type: ignore[arg-type]
    assert _names(registry) == ["taken"]


def test_the_abc_requires_a_name_and_the_load_role() -> None:
    class NoAdopt(StateAdopter):
        name = "incomplete"

        def decline_reason(self, context):  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(TypeError, match="abstract"):
        NoAdopt()  # type: ignore[abstract]


def test_plugins_load_once_in_entry_point_name_order_and_only_when_asked(
    install_plugin: Callable[..., Path]
) -> None:
    install_plugin("plugins", {"gamma": "plugins:gamma", "alpha": "plugins:alpha"}, PLUGIN_SOURCE, GROUP)
    registry = _plugin_registry()
    assert _names(registry) == []  # installing a package changes nothing by itself
    registry.load_plugins()
    registry.load_plugins()
    assert _names(registry) == ["alpha", "gamma"]
    _, handle = registry.registrations()[0]
    handle.remove()
    assert _names(registry) == ["gamma"]


def test_concurrent_plugin_loads_register_each_plugin_once(install_plugin: Callable[..., Path]) -> None:
    install_plugin("plugins", {"alpha": "plugins:alpha", "beta": "plugins:beta"}, PLUGIN_SOURCE, GROUP)
    registry = _plugin_registry()
    threads = [threading.Thread(target=registry.load_plugins) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _names(registry) == ["alpha", "beta"]


BROKEN = {
    "a_missing_module": ("plugins_missing_xyz:Adopter", "ModuleNotFoundError"),
    "a_raising_factory": ("plugins:raises", "RuntimeError: factory exploded"),
    "a_non_adopter": ("plugins:not_an_adopter", "is not a StateAdopter"),
    "a_mismatched": ("plugins:mismatched", "name 'another_name' is not the entry point's"),
    "b spaced": ("plugins:alpha", "name 'alpha' is not the entry point's"),
    "beta": ("plugins:beta", "a state adopter named 'beta' is registered"),
}


def test_broken_plugins_are_skipped_with_a_warning_naming_them_and_the_rest_load(
    install_plugin: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    install_plugin(
        "plugins", {**{k: v for k, (v, _) in BROKEN.items()}, "gamma": "plugins:gamma"}, PLUGIN_SOURCE, GROUP
    )
    registry = _plugin_registry(strict=False)
    registry.register(DecliningAdopter("beta"), built_in=True)  # a plugin's name, taken
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        registry.load_plugins()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(BROKEN)
    for entry_point, (value, error) in BROKEN.items():
        (warning,) = [w for w in warnings if f"entry point {entry_point} = {value} (plugins 1.0)" in w]
        assert warning.startswith("Optimizer state adoption: the plugin from") and error in warning
    assert _names(registry) == ["beta", "gamma"]


def test_a_strict_registry_raises_for_a_broken_plugin(install_plugin: Callable[..., Path]) -> None:
    install_plugin("plugins", {"a_raising_factory": "plugins:raises"}, PLUGIN_SOURCE, GROUP)
    with pytest.raises(RuntimeError, match=r"factory exploded\) \[strict registry\]"):
        _plugin_registry(strict=True).load_plugins()


def test_outcome_hooks_run_in_order_prepended_first_and_can_be_removed() -> None:
    registry, calls = registry_of(), []
    registry.register_outcome_hook(lambda outcome: calls.append("second"))
    handle = registry.register_outcome_hook(lambda outcome: calls.append("removed"))
    registry.register_outcome_hook(lambda outcome: calls.append("first"), prepend=True)
    handle.remove()
    registry.report(AdoptionOutcome("load", "opt", None))
    assert calls == ["first", "second"]
    with pytest.raises(TypeError, match="is not callable"):
        registry.register_outcome_hook(42)  # type: ignore[arg-type]


def test_a_raising_outcome_hook_is_a_fallback_and_later_hooks_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lenient, calls = registry_of(strict=False), []

    def broken(outcome: AdoptionOutcome) -> None:
        raise ValueError("hook exploded")

    for registry in (lenient, registry_of(strict=True)):
        registry.register_outcome_hook(broken)
        registry.register_outcome_hook(calls.append)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        lenient.report(AdoptionOutcome("load", "opt", None))
    assert len(calls) == 1 and "outcome hook" in caplog.text and "hook exploded" in caplog.text
    with pytest.raises(RuntimeError, match="strict registry"):
        registry.report(AdoptionOutcome("load", "opt", None))


def test_an_interrupt_in_an_outcome_hook_propagates_after_exactly_one_outcome() -> None:
    """Medium hole: a Ctrl-C in an outcome hook gave two outcomes for one call."""
    registry, seen = registry_of(PyTorchLoaderAdopter("sgd", torch.optim.SGD)), []

    def interrupted(outcome: AdoptionOutcome) -> None:
        seen.append(outcome)
        raise KeyboardInterrupt

    registry.register_outcome_hook(interrupted)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    with pytest.raises(KeyboardInterrupt):
        load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=registry)
    assert len(seen) == 1 and seen[0].adopter == "sgd"


def test_a_fallback_is_logged_on_every_rank(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Outcomes are logged by rank 0 only; a fallback by every rank that falls back."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args: 3)
    registry = registry_of(strict=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        registry.fall_back("an adopter failed")
    assert [r.getMessage() for r in caplog.records] == ["Optimizer state adoption: an adopter failed"]


@pytest.mark.parametrize(
    "value, off, warned", [(" Yes ", True, False), ("0", False, False), ("ture", True, True)]
)
def test_the_environment_switch_is_read_once_at_import(value: str, off: bool, warned: bool) -> None:
    """``MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION`` (for Megatron-LM releases without the series'
    argument) is read when the package is imported, in a fresh interpreter here, never per call:
    setting it later changes nothing; a value it does not know switches off, with a warning."""
    script = textwrap.dedent(
        """
        import logging, os, sys, warnings
        warnings.simplefilter("ignore")
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
        from megatron.core.optimizer.state_adoption import default_registry
        before = default_registry().switched_off
        os.environ["MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"] = "1"
        print("REASON", before, default_registry().switched_off == before)
        """
    )
    env = {"MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION": value, "PATH": "/usr/bin:/bin"}
    output = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    (reason_line,) = [line for line in output.splitlines() if line.startswith("REASON")]
    assert reason_line.endswith("True")
    assert ("MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=" in reason_line) is off
    assert ("is none of 1, true, yes, on, 0, false, no, off" in output) is warned
