"""The registry: registration order, prepend, handles, names, plugins, outcome hooks, strictness,
warnings, and the built-in registrations of the process-wide registry.

Plugins are real installed distributions (``install_plugin`` in conftest.py) in a group of the
test's own, so that the plugins installed in the environment stay out of the way.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch
from adopters_for_tests import DecliningAdopter, PyTorchLoaderAdopter, RaisingAfterLoaderAdopter
from builders import Owner, config_with, make_context, registry_of

from megatron.core.optimizer.state_adoption import (
    AdoptionOutcome,
    StateAdopter,
    StateAdopterRegistry,
    TEFusedAdamPrecisionAwareStateAdopter,
    default_registry,
    load_inner_optimizer_state_dict,
)
from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter

LOGGER = "megatron.core.optimizer.state_adoption"
GROUP = "test.adopters"
SOURCE = Path(__file__).resolve().parents[2] / "megatron/core/optimizer/state_adoption"
BUILT_IN = ["te_fused_adam_fp32", "te_fused_adam_bf16"]
OPT_IN_REASON = "OptimizerConfig.precision_aware_optimizer_state_adoption is not set"

#: The module of the test plugins: ``made`` lists the adopters its factories made, in order.
PLUGIN_SOURCE = textwrap.dedent(
    """
    import torch
    from megatron.core.optimizer.state_adoption import StateAdopter

    made = []

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
        def factory():
            made.append(name)
            return Plugin(name)
        return factory

    alpha, beta, gamma = make("alpha"), make("beta"), make("gamma")
    badly_named = make("1st")
    def raises():
        raise RuntimeError("factory exploded")
    def not_an_adopter():
        return object()
    """
)


def _names(registry: StateAdopterRegistry) -> List[str]:
    return [adopter.name for adopter in registry.adopters()]


def _plugin_registry(strict: bool = True) -> StateAdopterRegistry:
    return StateAdopterRegistry(strict=strict, plugin_group=GROUP)


def _sgd() -> torch.optim.SGD:
    """An SGD with momentum that took a step, so that it holds state."""
    param = torch.nn.Parameter(torch.ones(4))
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(4)
    sgd.step()
    return sgd


def _python(code: str, **environment: str) -> Any:
    """Runs ``code`` in a fresh interpreter; returns the JSON its last output line holds."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# The process-wide registry's built-in registrations


def test_tests_consult_a_strict_process_wide_registry() -> None:
    """conftest.py makes every fallback of the process-wide registry fail its test."""
    assert default_registry().strict
    with pytest.raises(RuntimeError, match=r"\[strict registry\]"):
        default_registry().fall_back("a fallback under test")


def test_the_built_in_registrations_are_the_fp32_adopter_then_the_config_gated_bf16_one() -> None:
    """In a process without any installed plugin, the process-wide registry holds exactly the
    built-in adopters, in this order."""
    registered = _python(
        """
        import importlib.metadata, json
        importlib.metadata.entry_points = lambda **selection: importlib.metadata.EntryPoints(())
        from megatron.core.optimizer.state_adoption import default_registry
        print(json.dumps([[type(a).__name__, a.name] for a in default_registry().adopters()]))
        """
    )
    assert registered == [
        ["TEFusedAdamFP32StateAdopter", "te_fused_adam_fp32"],
        ["TEFusedAdamPrecisionAwareStateAdopter", "te_fused_adam_bf16"],
    ]


def test_the_built_in_bf16_adopter_acts_only_where_the_config_opts_in() -> None:
    names = _names(default_registry())
    assert names[:2] == BUILT_IN
    fp32, bf16 = default_registry().adopters()[:2]
    assert type(fp32) is TEFusedAdamFP32StateAdopter
    assert type(bf16) is TEFusedAdamPrecisionAwareStateAdopter
    optimizer = _sgd()
    declined = make_context(optimizer, optimizer.state_dict(), config=config_with())
    assert bf16.decline_reason(declined) == OPT_IN_REASON
    opted_in = make_context(
        optimizer, optimizer.state_dict(), config=config_with(precision_aware_optimizer_state_adoption=True)
    )
    reason = bf16.decline_reason(opted_in)
    assert isinstance(reason, str) and reason != OPT_IN_REASON  # the next check: not FusedAdam
    # an instance made without the opt-in (as a plugin's entry point makes it) needs no field
    assert TEFusedAdamPrecisionAwareStateAdopter().decline_reason(declined) != OPT_IN_REASON


# Order, prepend and handles


def test_adopters_are_tried_in_registration_order_and_prepend_puts_one_first(
    install_plugin: Callable[..., Path]
) -> None:
    """The plugins are registered when the registry is first consulted: after what code
    registered before, before what it registers later."""
    install_plugin("ordered", {"beta": "ordered:beta", "alpha": "ordered:alpha"}, PLUGIN_SOURCE, GROUP)
    registry = _plugin_registry()
    registry.register(DecliningAdopter("code_1"))
    assert _names(registry) == ["code_1", "alpha", "beta"]  # consulted: the plugins load
    registry.register(DecliningAdopter("code_2"))
    registry.register(DecliningAdopter("first"), prepend=True)
    registry.register(DecliningAdopter("very_first"), prepend=True)
    assert _names(registry) == ["very_first", "first", "code_1", "alpha", "beta", "code_2"]


def test_the_first_accepting_adopter_in_order_acts() -> None:
    optimizer = _sgd()
    later, first = PyTorchLoaderAdopter("later", torch.optim.SGD), PyTorchLoaderAdopter("first", torch.optim.SGD)
    registry = registry_of(DecliningAdopter("declines"), later)
    registry.register(first, prepend=True)
    load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=registry)
    assert (len(first.adopted), len(later.adopted), len(later.checked)) == (1, 0, 0)


def test_a_handle_removes_its_adopter_once_and_a_stale_handle_removes_nothing() -> None:
    registry = registry_of(DecliningAdopter("kept"))
    handle = registry.register(DecliningAdopter("removed"))
    prepended = registry.register(DecliningAdopter("prepended"), prepend=True)
    assert _names(registry) == ["prepended", "kept", "removed"]
    handle.remove()
    prepended.remove()
    assert _names(registry) == ["kept"]
    handle.remove()  # a second removal is harmless
    registry.register(DecliningAdopter("removed"))  # the name is free again
    handle.remove()  # stale: the new registration stays
    assert _names(registry) == ["kept", "removed"]


def test_a_plugins_name_is_taken_for_later_registrations(install_plugin: Callable[..., Path]) -> None:
    install_plugin("plugins", {"alpha": "plugins:alpha"}, PLUGIN_SOURCE, GROUP)
    registry = _plugin_registry()
    assert _names(registry) == ["alpha"]
    with pytest.raises(ValueError, match="a state adopter named 'alpha' is registered"):
        registry.register(DecliningAdopter("alpha"))
    assert _names(registry) == ["alpha"]


# Names and types


@pytest.mark.parametrize("name", ["a", "te_fused_adam_fp32", "my.plugin-2", "A9_x"])
def test_names_of_letters_digits_underscores_dots_and_dashes_are_accepted(name: str) -> None:
    assert _names(registry_of(DecliningAdopter(name))) == [name]


@pytest.mark.parametrize("name", ["", " padded ", "my adopter", "1st", "a\tb", "-x", "a\n", None, 3])
def test_other_names_are_refused(name: object) -> None:
    registry = registry_of()
    with pytest.raises(TypeError, match="a name starts with a letter"):
        registry.register(DecliningAdopter(name))  # type: ignore[arg-type]
    assert registry.adopters() == ()


def test_a_taken_name_and_a_non_adopter_are_refused_and_the_registry_is_unchanged() -> None:
    registry = registry_of(DecliningAdopter("taken"))
    with pytest.raises(ValueError, match="a state adopter named 'taken' is registered"):
        registry.register(DecliningAdopter("taken"))
    with pytest.raises(ValueError, match="a state adopter named 'taken' is registered"):
        registry.register(DecliningAdopter("taken"), prepend=True)
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


# Plugins


def test_plugins_load_lazily_once_and_in_entry_point_name_order(install_plugin: Callable[..., Path]) -> None:
    install_plugin("plugins", {"gamma": "plugins:gamma", "alpha": "plugins:alpha"}, PLUGIN_SOURCE, GROUP)
    registry = _plugin_registry()
    assert "plugins" not in sys.modules  # constructing the registry imports no plugin
    assert _names(registry) == ["alpha", "gamma"]
    registry.load_plugins()
    assert _names(registry) == ["alpha", "gamma"]
    assert sys.modules["plugins"].made == ["alpha", "gamma"]  # each factory called once


def test_the_plugins_load_at_the_first_consultation_and_not_with_adoption_off(
    install_plugin: Callable[..., Path]
) -> None:
    install_plugin("plugins", {"alpha": "plugins:alpha"}, PLUGIN_SOURCE, GROUP)
    registry = _plugin_registry()
    registry.register(DecliningAdopter("in_code"))
    optimizer, recorded = _sgd(), []
    registry.register_outcome_hook(recorded.append)
    off = config_with(optimizer_state_adoption=False)
    load_inner_optimizer_state_dict(Owner(optimizer, config=off), optimizer.state_dict(), registry=registry)
    assert "plugins" not in sys.modules and recorded == []  # off: nothing is asked or loaded
    load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=registry)
    (outcome,) = recorded
    assert outcome.adopter == "alpha" and outcome.declines == (("in_code", "never adopts"),)
    assert sys.modules["plugins"].made == ["alpha"]


def test_an_entry_point_may_name_an_adopter_of_another_name(install_plugin: Callable[..., Path]) -> None:
    install_plugin("plugins", {"my_plugin": "plugins:beta", "z spaced": "plugins:alpha"}, PLUGIN_SOURCE, GROUP)
    assert _names(_plugin_registry()) == ["beta", "alpha"]  # by entry-point name: 'my_plugin' first


BROKEN = {
    "a_missing_module": ("plugins_missing_xyz:Adopter", "ModuleNotFoundError"),
    "a_raising_factory": ("plugins:raises", "RuntimeError: factory exploded"),
    "a_non_adopter": ("plugins:not_an_adopter", "is not a StateAdopter"),
    "a_badly_named": ("plugins:badly_named", "has the name '1st'"),
    "beta": ("plugins:beta", "a state adopter named 'beta' is registered"),
}


def test_broken_plugins_are_skipped_with_a_warning_naming_each_and_the_rest_load(
    install_plugin: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    install_plugin(
        "plugins", {**{k: v for k, (v, _) in BROKEN.items()}, "gamma": "plugins:gamma"}, PLUGIN_SOURCE, GROUP
    )
    registry = _plugin_registry(strict=False)
    registry.register(DecliningAdopter("beta"))  # a plugin's name, taken
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _names(registry) == ["beta", "gamma"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(BROKEN), warnings
    for entry_point, (value, error) in BROKEN.items():
        (warning,) = [w for w in warnings if f"the plugin {entry_point} = {value} (plugins 1.0) failed" in w]
        assert warning.startswith("Optimizer state adoption: ") and error in warning
        assert "it is skipped" in warning


def test_a_strict_registry_registers_every_good_plugin_then_raises_naming_the_broken_one(
    install_plugin: Callable[..., Path]
) -> None:
    """The broken plugin sorts first; the good ones after it are still registered."""
    install_plugin(
        "plugins", {"a_broken": "plugins:raises", "beta": "plugins:beta", "gamma": "plugins:gamma"},
        PLUGIN_SOURCE, GROUP,
    )  # fmt: skip
    registry = _plugin_registry(strict=True)
    with pytest.raises(RuntimeError, match=r"a_broken = plugins:raises .*factory exploded\) \[strict registry\]"):
        registry.load_plugins()
    assert sys.modules["plugins"].made == ["beta", "gamma"]
    assert _names(registry) == ["beta", "gamma"]  # loaded once: nothing is retried or raised again


REENTRANT_SOURCE = textwrap.dedent(
    """
    import types
    import torch
    from registry_under_load import registry, seen
    from megatron.core.optimizer.state_adoption import StateAdopter, load_inner_optimizer_state_dict

    class Reentrant(StateAdopter):
        name = "reentrant"
        def decline_reason(self, context):
            return "declines"
        def adopt(self, context):
            raise AssertionError("never accepted")

    class Later(Reentrant):
        name = "later"

    # What importing a package that builds and loads an optimizer does to the registry:
    registry.load_plugins()
    seen.append([adopter.name for adopter in registry.adopters()])
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    load_inner_optimizer_state_dict(types.SimpleNamespace(optimizer=sgd), sgd.state_dict(), registry=registry)
    """
)


def test_a_plugin_whose_import_consults_the_loading_registry_loads_once_without_deadlock(
    install_plugin: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    install_plugin(
        "reentrant_plugin",
        {"a_reentrant": "reentrant_plugin:Reentrant", "b_later": "reentrant_plugin:Later"},
        REENTRANT_SOURCE,
        GROUP,
    )
    registry, seen = _plugin_registry(strict=True), []
    monkeypatch.setitem(sys.modules, "registry_under_load", types.SimpleNamespace(registry=registry, seen=seen))
    result: Dict[str, Any] = {}

    def load() -> None:
        try:
            registry.load_plugins()
            result["names"] = _names(registry)
        except BaseException as error:  # reported by the assertion below
            result["error"] = error

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "loading a plugin whose import consults the registry deadlocked"
    assert result == {"names": ["reentrant", "later"]}
    assert seen == [[]]  # during its import: what was registered so far


# No environment variable


def test_no_environment_variable_switches_adoption_off() -> None:
    """Adoption is switched off by ``OptimizerConfig.optimizer_state_adoption`` only: a fresh
    process with ``MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=1`` set still adopts."""
    adopted_by = _python(
        """
        import json, types, torch
        from megatron.core.optimizer.state_adoption import (
            StateAdopter, default_registry, load_inner_optimizer_state_dict,
        )

        class SGDLoader(StateAdopter):
            name = "sgd_loader"
            def decline_reason(self, context):
                return None if isinstance(context.optimizer, torch.optim.SGD) else "not SGD"
            def adopt(self, context):
                torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))

        default_registry().register(SGDLoader(), prepend=True)
        outcomes = []
        default_registry().register_outcome_hook(outcomes.append)
        param = torch.nn.Parameter(torch.ones(4))
        sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)
        param.grad = torch.ones(4)
        sgd.step()
        load_inner_optimizer_state_dict(types.SimpleNamespace(optimizer=sgd), sgd.state_dict())
        print(json.dumps([[o.adopter, o.fallback_reason] for o in outcomes]))
        """,
        MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION="1",
    )
    assert adopted_by == [["sgd_loader", None]]


def test_the_subsystem_reads_no_environment_variable() -> None:
    sources = sorted(SOURCE.glob("*.py"))
    assert sources
    for path in sources:
        text = path.read_text()
        assert "environ" not in text and "getenv" not in text, path.name


# Fallbacks: strict raises, lenient warns once on rank 0


def test_the_same_lenient_fallback_twice_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    registry = registry_of(RaisingAfterLoaderAdopter("raising", torch.optim.SGD), strict=False)
    optimizer = _sgd()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=registry)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("Optimizer state adoption: adopter 'raising' failed and was undone")
    assert "failed after PyTorch's loader" in warnings[0]
    registry.fall_back("another thing failed")  # another fallback still warns
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings[1:] == ["Optimizer state adoption: another thing failed"]


def test_a_strict_registry_raises_for_every_fallback() -> None:
    registry = registry_of(strict=True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"^Optimizer state adoption: it failed \(ValueError: why\) \[strict"):
            registry.fall_back("it failed", ValueError("why"), "the own code runs")


@pytest.mark.parametrize("rank, logged", [(0, True), (3, False)])
def test_a_lenient_fallback_warns_on_rank_0_only(
    rank: int, logged: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args: rank)
    registry = registry_of(strict=False)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        registry.fall_back("an adopter failed", instead="the own code runs")
    expected = ["Optimizer state adoption: an adopter failed; the own code runs"]
    assert [r.getMessage() for r in caplog.records] == (expected if logged else [])


# Outcome hooks


def test_outcome_hooks_run_in_order_prepended_first_and_can_be_removed() -> None:
    registry, calls = registry_of(), []
    assert not registry.observed
    registry.register_outcome_hook(lambda outcome: calls.append("second"))
    handle = registry.register_outcome_hook(lambda outcome: calls.append("removed"))
    registry.register_outcome_hook(lambda outcome: calls.append("first"), prepend=True)
    handle.remove()
    registry.report(AdoptionOutcome("load", "opt", None))
    assert calls == ["first", "second"] and registry.observed
    with pytest.raises(TypeError, match="is not callable"):
        registry.register_outcome_hook(42)  # type: ignore[arg-type]


def test_the_registry_is_observed_exactly_while_an_outcome_hook_is_registered() -> None:
    registry = registry_of()
    first, second = registry.register_outcome_hook(print), registry.register_outcome_hook(print)
    first.remove()
    assert registry.observed
    second.remove()
    assert not registry.observed


def test_a_raising_outcome_hook_is_a_fallback_and_later_hooks_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lenient, strict, calls = registry_of(strict=False), registry_of(strict=True), []

    def broken(outcome: AdoptionOutcome) -> None:
        raise ValueError("hook exploded")

    for registry in (lenient, strict):
        registry.register_outcome_hook(broken)
        registry.register_outcome_hook(calls.append)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        lenient.report(AdoptionOutcome("load", "opt", None))
    assert len(calls) == 1 and "outcome hook" in caplog.text and "hook exploded" in caplog.text
    with pytest.raises(RuntimeError, match="hook exploded.*strict registry"):
        strict.report(AdoptionOutcome("load", "opt", None))
    assert len(calls) == 1  # strict: the raise ends the report


def test_a_strict_raising_outcome_hook_raises_but_the_adoption_stays() -> None:
    optimizer, incoming = _sgd(), _sgd()
    state_dict = incoming.state_dict()
    registry = registry_of(PyTorchLoaderAdopter("sgd", torch.optim.SGD))

    def broken(outcome: AdoptionOutcome) -> None:
        raise ValueError("hook exploded")

    registry.register_outcome_hook(broken)
    with pytest.raises(RuntimeError, match="hook exploded"):
        load_inner_optimizer_state_dict(Owner(optimizer), state_dict, registry=registry)
    (param,) = optimizer.param_groups[0]["params"]
    assert optimizer.state[param]["momentum_buffer"] is state_dict["state"][0]["momentum_buffer"]


def test_an_interrupt_in_an_outcome_hook_propagates_after_exactly_one_outcome() -> None:
    registry, seen = registry_of(PyTorchLoaderAdopter("sgd", torch.optim.SGD)), []

    def interrupted(outcome: AdoptionOutcome) -> None:
        seen.append(outcome)
        raise KeyboardInterrupt

    registry.register_outcome_hook(interrupted)
    optimizer = _sgd()
    with pytest.raises(KeyboardInterrupt):
        load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=registry)
    assert len(seen) == 1 and seen[0].adopter == "sgd"
