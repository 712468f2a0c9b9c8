"""The adopter registry: order, prepend, handles, unique and usable names, origins, outcome
hooks, threads, and plugins discovered from entry points.

Plugins are real installed distributions: a ``*.dist-info`` folder with ``entry_points.txt``
in a folder on ``sys.path``, which ``importlib.metadata`` finds like any installed package.
Most tests give them a group of their own (``TEST_GROUP``) so that the plugins installed in
the environment (e.g. the example package) stay out of the way; the process-wide registry's
group is used where that is the point. Switches (kill switch, disabling by name, the config
field) are in tests/test_switches.py.
"""

import dataclasses
import logging
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from adopters_for_tests import DecliningAdopter, PyTorchLoaderAdopter
from builders import Owner, cloned_state_dict, fresh_standin, standin_adopter, trained_standin

from megatron.core.optimizer.state_adoption import (
    StateAdopter,
    StateAdopterRegistration,
    StateAdopterRegistry,
    StateAdoptionContext,
    StateAdoptionOutcome,
    load_inner_optimizer_state_dict,
    register_outcome_hook,
    register_state_adopter,
    registered_state_adopters,
)
from megatron.core.optimizer.state_adoption.registry import default_registry
from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter

PACKAGE_LOGGER = "megatron.core.optimizer.state_adoption"
ENTRY_POINT_GROUP = "megatron_core.optimizer_state_adopters"
TEST_GROUP = "megatron_core_tests.optimizer_state_adopters"
NAME_RULE = "a name starts with a letter and has only letters, digits, '_', '.' and '-'"


def _names(registry: StateAdopterRegistry) -> List[str]:
    return [registration.name for registration in registry.registrations()]


def _warnings(caplog: pytest.LogCaptureFixture) -> List[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(PACKAGE_LOGGER) and r.levelno == logging.WARNING
    ]


def _trained_sgd() -> torch.optim.SGD:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.arange(4.0))]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


# --- Plugins: real installed distributions -----------------------------------------------

ADOPTER_CLASS = """
    class {cls}:
        name = {name!r}

        def decline_reason(self, context):
            import torch
            return None if isinstance(context.optimizer, torch.optim.SGD) else "not SGD"

        def adopt(self, context):
            import torch
            torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
            ADOPTED.append(({name!r}, context.optimizer))
"""


def adopter_module(*classes: "tuple[str, str]", extra: str = "") -> str:
    """Module source defining adopter classes ``(class name, adopter name)`` and ``ADOPTED``."""
    body = "".join(textwrap.dedent(ADOPTER_CLASS).format(cls=c, name=n) for c, n in classes)
    return "ADOPTED = []\nFACTORY_CALLS = []\n" + body + textwrap.dedent(extra)


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """``install_plugin(distribution, {entry point: value}, module source)`` installs a plugin
    distribution 1.0 (module of the same name, dist-info with ``entry_points.txt``) in a new
    folder at the front of ``sys.path``; the module is forgotten after the test."""
    count = [0]

    def install(
        distribution: str,
        entry_points: Dict[str, str],
        source: str = "",
        group: str = TEST_GROUP,
    ) -> Path:
        count[0] += 1
        root = tmp_path / f"site{count[0]}"
        root.mkdir()
        (root / f"{distribution}.py").write_text(source)
        dist_info = root / f"{distribution}-1.0.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n"
        )
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (dist_info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.delitem(sys.modules, distribution, raising=False)
        return root

    return install


def _plugin_registry(*built_in: StateAdopter) -> StateAdopterRegistry:
    return StateAdopterRegistry(built_in=built_in, entry_point_group=TEST_GROUP)


# --- The process-wide registry ----------------------------------------------------------------


def test_the_process_wide_registry_starts_with_the_te_fp32_adopter_built_in() -> None:
    first = registered_state_adopters()[0]
    assert first.name == "te_fused_adam_fp32" and first.origin == "built-in"
    assert isinstance(first.adopter, TEFusedAdamFP32StateAdopter)
    assert default_registry() is default_registry()
    assert default_registry().registrations() == registered_state_adopters()


def test_a_process_wide_registration_is_consulted_by_the_loader_and_removable() -> None:
    adopter = PyTorchLoaderAdopter("process_wide", torch.optim.SGD)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    handle = register_state_adopter(adopter)
    try:
        (mine,) = [r for r in registered_state_adopters() if r.adopter is adopter]
        assert mine.origin == "register_state_adopter" and mine.handle is handle
        assert registered_state_adopters()[-1] is mine  # appended after the plugins
        outcome = load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict())
        assert outcome.adopter == "process_wide" and len(adopter.adopted) == 1
    finally:
        handle.remove()
    assert adopter not in [r.adopter for r in registered_state_adopters()]
    outcome = load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict())
    assert outcome.adopter is None and len(adopter.adopted) == 1


def test_the_process_wide_registry_refuses_the_built_in_name() -> None:
    with pytest.raises(ValueError, match=r"'te_fused_adam_fp32' is already registered \(built-in\)"):
        register_state_adopter(standin_adopter())


# --- Order, prepend, handles ---------------------------------------------------------------------


def test_order_prepend_and_handle_removal(empty_registry: StateAdopterRegistry) -> None:
    a, b, c, d = (DecliningAdopter(name) for name in "abcd")
    handle_a = empty_registry.register(a)
    empty_registry.register(b)
    handle_c = empty_registry.register(c, prepend=True)
    empty_registry.register(d, prepend=True)  # the latest prepend goes first, as in PyTorch
    assert _names(empty_registry) == ["d", "c", "a", "b"]
    handle_a.remove()
    assert _names(empty_registry) == ["d", "c", "b"]
    with handle_c:  # a handle is a context manager, as PyTorch's are
        pass
    assert _names(empty_registry) == ["d", "b"]


def test_built_in_adopters_come_first_and_report_their_origin() -> None:
    registry = StateAdopterRegistry(
        built_in=(DecliningAdopter("one"), DecliningAdopter("two")), entry_point_group=None
    )
    registry.register(DecliningAdopter("three"))
    assert [(r.name, r.origin) for r in registry.registrations()] == [
        ("one", "built-in"),
        ("two", "built-in"),
        ("three", "register_state_adopter"),
    ]


def test_a_listing_is_an_immutable_snapshot(empty_registry: StateAdopterRegistry) -> None:
    handle = empty_registry.register(DecliningAdopter("a"))
    listed = empty_registry.registrations()
    empty_registry.register(DecliningAdopter("b"))
    handle.remove()
    assert isinstance(listed, tuple) and [r.name for r in listed] == ["a"]
    assert isinstance(listed[0], StateAdopterRegistration) and listed[0].handle is handle
    with pytest.raises(dataclasses.FrozenInstanceError):
        listed[0].name = "renamed"  # type: ignore[misc]
    assert _names(empty_registry) == ["b"]


# --- Unique, usable names ---------------------------------------------------------------------


def test_a_taken_name_is_refused_and_the_registry_is_unchanged(
    empty_registry: StateAdopterRegistry,
) -> None:
    first = DecliningAdopter("same")
    empty_registry.register(first)
    with pytest.raises(ValueError, match=r"'same' is already registered \(register_state_adopter\)"):
        empty_registry.register(PyTorchLoaderAdopter("same"), prepend=True)
    assert [r.adopter for r in empty_registry.registrations()] == [first]


def test_registering_the_same_adopter_twice_is_refused(empty_registry: StateAdopterRegistry) -> None:
    adopter = PyTorchLoaderAdopter("twice")
    empty_registry.register(adopter)
    with pytest.raises(ValueError, match="already registered"):
        empty_registry.register(adopter)
    assert len(empty_registry.registrations()) == 1


def test_a_removed_name_can_be_registered_again_and_a_stale_handle_leaves_it_alone(
    empty_registry: StateAdopterRegistry,
) -> None:
    old = empty_registry.register(DecliningAdopter("again"))
    old.remove()
    old.remove()  # removing twice is harmless, as for PyTorch hooks
    new_adopter = DecliningAdopter("again")
    empty_registry.register(new_adopter)
    old.remove()  # the old handle does not remove the new registration
    assert [r.adopter for r in empty_registry.registrations()] == [new_adopter]


@pytest.mark.parametrize(
    "name",
    ["", " ", "my adopter", "a\tb", " padded ", "padded ", "a,b", "1st", "_private", "-x", "x\n", "adopté", "a/b"],
)
def test_hole_4_a_name_that_cannot_be_listed_in_the_disable_variable_is_refused(
    empty_registry: StateAdopterRegistry, name: str
) -> None:
    """Hole 4: names with spaces or tabs were accepted but could never be disabled by name."""
    with pytest.raises(TypeError) as refused:
        empty_registry.register(DecliningAdopter(name))
    assert str(refused.value).endswith(NAME_RULE) and repr(name) in str(refused.value)
    assert empty_registry.registrations() == ()


@pytest.mark.parametrize("name", ["a", "Z9", "te_fused_adam_fp32", "my.org-adopter_2"])
def test_names_of_letters_digits_underscores_dots_and_dashes_are_accepted(
    empty_registry: StateAdopterRegistry, name: str
) -> None:
    empty_registry.register(DecliningAdopter(name))
    assert _names(empty_registry) == [name]


class _NoAdopt:
    name = "no_adopt"

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None


class _ExporterOnly:
    name = "exporter_only"

    def export_decline_reason(self, context: Any) -> Optional[str]:
        return None

    def export_state_dict(self, context: Any) -> Dict[str, Any]:
        return {}


class _NoName:
    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: StateAdoptionContext) -> None:
        pass


@pytest.mark.parametrize(
    "bad",
    [object(), None, "te_fused_adam_fp32", PyTorchLoaderAdopter, _NoAdopt(), _ExporterOnly(), _NoName()],
    ids=["object", "None", "a name", "a class", "no adopt", "an exporter only", "no name"],
)
def test_something_that_is_not_an_adopter_instance_is_refused(
    empty_registry: StateAdopterRegistry, bad: object
) -> None:
    """A plugin author's mistakes: the class instead of an instance, a missing method. The
    error names what an adopter needs."""
    with pytest.raises(TypeError) as refused:
        empty_registry.register(bad)  # type: ignore[arg-type]
    assert str(refused.value) == (
        f"{bad!r} is not a state adopter: it needs a 'name' and the methods "
        "'decline_reason(context)' and 'adopt(context)'"
    )
    assert empty_registry.registrations() == ()


@pytest.mark.parametrize("name", [5, None, b"bytes", ["a"]], ids=["int", "None", "bytes", "list"])
def test_a_name_that_is_not_a_str_is_refused(empty_registry: StateAdopterRegistry, name: Any) -> None:
    adopter = DecliningAdopter("placeholder")
    adopter.name = name
    with pytest.raises(TypeError, match="has the name"):
        empty_registry.register(adopter)
    assert empty_registry.registrations() == ()


# --- Outcome hooks ---------------------------------------------------------------------------


def test_outcome_hooks_see_every_load_in_order_and_can_be_removed(registry: StateAdopterRegistry) -> None:
    seen: List[str] = []
    second = registry.register_outcome_hook(lambda outcome: seen.append("second"))
    first = registry.register_outcome_hook(lambda outcome: seen.append("first"), prepend=True)
    outcomes: List[StateAdoptionOutcome] = []
    registry.register_outcome_hook(outcomes.append)
    adopted = load_inner_optimizer_state_dict(
        Owner(fresh_standin()), cloned_state_dict(trained_standin()), registry=registry
    )
    assert seen == ["first", "second"] and outcomes == [adopted]
    second.remove()
    first.remove()
    first.remove()
    fallback = load_inner_optimizer_state_dict(Owner(_trained_sgd()), _trained_sgd().state_dict(), registry=registry)
    assert seen == ["first", "second"] and outcomes == [adopted, fallback]
    assert adopted.adopter == "te_fused_adam_fp32" and fallback.adopter is None


def test_outcome_hooks_are_per_registry(registry: StateAdopterRegistry) -> None:
    """A load through an isolated registry reaches its hooks, not the process-wide ones."""
    isolated: List[StateAdoptionOutcome] = []
    process_wide: List[StateAdoptionOutcome] = []
    registry.register_outcome_hook(isolated.append)
    handle = register_outcome_hook(process_wide.append)
    try:
        outcome = load_inner_optimizer_state_dict(
            Owner(fresh_standin()), cloned_state_dict(trained_standin()), registry=registry
        )
    finally:
        handle.remove()
    assert isolated == [outcome] and process_wide == []


def test_report_outcome_hands_an_outcome_to_every_hook(empty_registry: StateAdopterRegistry) -> None:
    outcome = StateAdoptionOutcome("load", "SGD 0x1 (1 params, 3 elements)", "mine")
    received: List[StateAdoptionOutcome] = []
    empty_registry.register_outcome_hook(received.append)
    empty_registry.register_outcome_hook(received.append)
    empty_registry.report_outcome(outcome)
    assert received == [outcome, outcome]


def test_a_raising_outcome_hook_is_logged_and_neither_the_load_nor_later_hooks_suffer(
    registry: StateAdopterRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(outcome: StateAdoptionOutcome) -> None:
        raise RuntimeError("observer broke")

    later: List[StateAdoptionOutcome] = []
    registry.register_outcome_hook(broken)
    registry.register_outcome_hook(later.append)
    optimizer = fresh_standin()
    with caplog.at_level(logging.WARNING, logger=PACKAGE_LOGGER):
        outcome = load_inner_optimizer_state_dict(
            Owner(optimizer), cloned_state_dict(trained_standin()), registry=registry
        )
    assert outcome.adopter == "te_fused_adam_fp32" and optimizer.allocations == 0
    assert later == [outcome]
    (warning,) = _warnings(caplog)
    assert "outcome hook" in warning and "RuntimeError: observer broke" in warning


def test_a_hook_may_add_and_remove_hooks_while_it_is_called(empty_registry: StateAdopterRegistry) -> None:
    calls: List[str] = []
    handles: Dict[str, Any] = {}

    def self_removing(outcome: StateAdoptionOutcome) -> None:
        calls.append("self_removing")
        handles["self_removing"].remove()
        empty_registry.register_outcome_hook(lambda o: calls.append("added"))

    handles["self_removing"] = empty_registry.register_outcome_hook(self_removing)
    empty_registry.register_outcome_hook(lambda o: calls.append("other"))
    outcome = StateAdoptionOutcome("load", "X", None)
    empty_registry.report_outcome(outcome)
    assert calls == ["self_removing", "other"]  # the hooks of the call's start, each once
    empty_registry.report_outcome(outcome)
    assert calls == ["self_removing", "other", "other", "added"]


@pytest.mark.parametrize("hook", ["print", None, 42])
def test_an_outcome_hook_must_be_callable(empty_registry: StateAdopterRegistry, hook: Any) -> None:
    with pytest.raises(TypeError, match="not callable"):
        empty_registry.register_outcome_hook(hook)
    with pytest.raises(TypeError, match="not callable"):
        register_outcome_hook(hook)


def test_process_wide_outcome_hooks_run_in_registration_order_unless_prepended() -> None:
    calls: List[str] = []
    handles = [
        register_outcome_hook(lambda outcome: calls.append("first")),
        register_outcome_hook(lambda outcome: calls.append("second")),
        register_outcome_hook(lambda outcome: calls.append("prepended"), prepend=True),
    ]
    try:
        default_registry().report_outcome(StateAdoptionOutcome("load", "SGD 0x1 (1 params, 3 elements)", None))
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["prepended", "first", "second"]


def test_an_outcome_is_json_ready_with_declines_as_pairs(empty_registry: StateAdopterRegistry) -> None:
    empty_registry.register(DecliningAdopter("no", reason="not mine"))
    optimizer = fresh_standin()
    outcome = load_inner_optimizer_state_dict(
        Owner(optimizer), cloned_state_dict(trained_standin()), registry=empty_registry
    )
    record = outcome.to_json()
    assert record["declines"] == [["no", "not mine"]]
    assert {k: record[k] for k in ("hook_point", "adopter", "method", "fallback_reason", "error")} == {
        "hook_point": "load",
        "adopter": None,
        "method": "FusedAdamStandIn.load_state_dict",
        "fallback_reason": "every adopter declined",
        "error": None,
    }
    assert record["optimizer"].startswith(f"FusedAdamStandIn {id(optimizer):#x} (4 params, ")
    assert record["reused_bytes"] == 0 and record["allocated_bytes"] > 0


# --- Threads --------------------------------------------------------------------------------------


def _run_threads(targets: List[Callable[[], None]]) -> List[BaseException]:
    errors: List[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as error:  # reported to the test
                errors.append(error)

        return run

    threads = [threading.Thread(target=guarded(target)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a thread hangs (deadlock?)"
    return errors


def test_concurrent_registration_and_removal_while_listing(empty_registry: StateAdopterRegistry) -> None:
    stop = threading.Event()

    def churn(worker: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(300):
                handle = empty_registry.register(DecliningAdopter(f"w{worker}-{i}"), prepend=i % 2 == 0)
                if i % 3:
                    handle.remove()

        return run

    def list_continuously() -> None:
        while not stop.is_set():
            names = _names(empty_registry)
            assert len(names) == len(set(names))

    reader = threading.Thread(target=list_continuously)
    reader.start()
    errors = _run_threads([churn(w) for w in range(8)])
    stop.set()
    reader.join()
    assert errors == []
    assert sorted(_names(empty_registry)) == sorted(
        f"w{w}-{i}" for w in range(8) for i in range(300) if i % 3 == 0
    )


def test_concurrent_registration_of_one_name_lets_exactly_one_win(empty_registry: StateAdopterRegistry) -> None:
    adopters = [DecliningAdopter("contested") for _ in range(16)]
    barrier = threading.Barrier(len(adopters))

    def register(adopter: DecliningAdopter) -> Callable[[], None]:
        def run() -> None:
            barrier.wait()
            empty_registry.register(adopter)

        return run

    errors = _run_threads([register(a) for a in adopters])
    assert len(errors) == len(adopters) - 1 and all(isinstance(e, ValueError) for e in errors)
    (winner,) = empty_registry.registrations()
    assert winner.adopter in adopters


def test_concurrent_first_uses_discover_each_plugin_exactly_once(
    install_plugin: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    install_plugin(
        "slow_adoption_plugin",
        {"slow_sgd": "slow_adoption_plugin:make"},
        adopter_module(
            ("Adopter", "slow_sgd"),
            extra="""
            import time

            def make():
                FACTORY_CALLS.append(1)
                time.sleep(0.05)  # widen the window for a second discovery
                return Adopter()
            """,
        ),
    )
    registry = _plugin_registry()
    listings: List[List[str]] = []
    barrier = threading.Barrier(8)

    def first_use(worker: int) -> Callable[[], None]:
        def run() -> None:
            barrier.wait()
            if worker % 2:
                registry.register(DecliningAdopter(f"code{worker}"))
            listings.append(_names(registry))

        return run

    with caplog.at_level(logging.WARNING, logger=PACKAGE_LOGGER):
        assert _run_threads([first_use(w) for w in range(8)]) == []
    assert sys.modules["slow_adoption_plugin"].FACTORY_CALLS == [1]
    assert _warnings(caplog) == []
    names = _names(registry)
    assert names[0] == "slow_sgd" and sorted(names[1:]) == [f"code{w}" for w in (1, 3, 5, 7)]
    assert all(listing[0] == "slow_sgd" for listing in listings)  # nobody saw it missing


# --- Plugins from entry points ---------------------------------------------------------------------


def test_a_plugin_is_discovered_with_its_origin_consulted_and_removable(
    install_plugin: Callable[..., Path],
) -> None:
    install_plugin("sgd_adoption_plugin", {"plugin_sgd": "sgd_adoption_plugin:Adopter"}, adopter_module(("Adopter", "plugin_sgd")))
    registry = _plugin_registry(DecliningAdopter("built_in"))
    registrations = registry.registrations()
    assert [r.name for r in registrations] == ["built_in", "plugin_sgd"]
    assert registrations[1].origin == (
        "entry point plugin_sgd = sgd_adoption_plugin:Adopter (sgd_adoption_plugin 1.0)"
    )
    assert registry.registrations() == registrations  # discovered once

    plugin = sys.modules["sgd_adoption_plugin"]
    optimizer = _trained_sgd()
    outcome = load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=registry)
    assert outcome.adopter == "plugin_sgd" and plugin.ADOPTED == [("plugin_sgd", optimizer)]
    assert outcome.declines == (("built_in", "never adopts"),)

    registrations[1].handle.remove()  # an entry-point adopter is removable like any other
    assert _names(registry) == ["built_in"]
    outcome = load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=registry)
    assert outcome.adopter is None and len(plugin.ADOPTED) == 1
    registry.register(plugin.Adopter())  # and it can come back, registered in code
    assert [r.origin for r in registry.registrations()] == ["built-in", "register_state_adopter"]


def test_a_registry_without_an_entry_point_group_discovers_nothing(
    install_plugin: Callable[..., Path],
) -> None:
    install_plugin("ignored_plugin", {"ignored": "ignored_plugin:Adopter"}, adopter_module(("Adopter", "ignored")))
    assert StateAdopterRegistry(entry_point_group=None).registrations() == ()
    assert "ignored_plugin" not in sys.modules
    assert _names(_plugin_registry()) == ["ignored"]  # the control: the plugin is findable


def test_the_process_wide_group_is_the_default_group(install_plugin: Callable[..., Path]) -> None:
    install_plugin(
        "default_group_plugin",
        {"default_group_sgd": "default_group_plugin:Adopter"},
        adopter_module(("Adopter", "default_group_sgd")),
        group=ENTRY_POINT_GROUP,
    )
    registrations = StateAdopterRegistry().registrations()  # the default group
    (ours,) = [r for r in registrations if r.name == "default_group_sgd"]
    assert ours.origin.startswith("entry point default_group_sgd = default_group_plugin:Adopter")
    assert all(r.origin.startswith("entry point ") for r in registrations)
    assert "default_group_sgd" not in _names(_plugin_registry())


BROKEN_PLUGINS = adopter_module(
    ("Good", "z_good"),
    ("Mismatched", "another_name"),
    ("Colliding", "built_in"),
    ("Spaced", "b spaced"),
    ("ClassReturned", "a_class_returned"),
    extra="""
    import types

    def raises():
        raise RuntimeError("factory exploded")

    def returns_a_non_adopter():
        return types.SimpleNamespace(name="a_non_adopter")

    def returns_nothing():
        return None

    def returns_the_class():
        return ClassReturned

    class NeedsArguments(Good):
        def __init__(self, required):
            pass
    """,
)


def test_broken_and_colliding_plugins_are_skipped_with_a_warning_and_the_rest_load(
    install_plugin: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A plugin author's mistakes, each skipped with a warning naming the entry point, its
    distribution and the error; the good plugin after them (by name) still loads."""
    install_plugin(
        "broken_plugins",
        {
            "a_missing_module": "no_such_adoption_module_xyz:Adopter",
            "a_missing_attribute": "broken_plugins:NoSuchClass",
            "a_raising_factory": "broken_plugins:raises",
            "a_non_adopter": "broken_plugins:returns_a_non_adopter",
            "a_none": "broken_plugins:returns_nothing",
            "a_class_returned": "broken_plugins:returns_the_class",
            "a_needs_arguments": "broken_plugins:NeedsArguments",
            "a_mismatched": "broken_plugins:Mismatched",
            "built_in": "broken_plugins:Colliding",
            "b spaced": "broken_plugins:Spaced",
            "z_good": "broken_plugins:Good",
        },
        BROKEN_PLUGINS,
    )
    registry = _plugin_registry(DecliningAdopter("built_in"))
    with caplog.at_level(logging.WARNING, logger=PACKAGE_LOGGER):
        assert _names(registry) == ["built_in", "z_good"]
    warnings = _warnings(caplog)
    prefix = "Skipping optimizer state adopter plugin from entry point "
    assert all(w.startswith(prefix) and "(broken_plugins 1.0)" in w for w in warnings), warnings
    by_entry_point = {w[len(prefix) :].split(" = ")[0]: w for w in warnings}
    expected = {
        "a_missing_module": "ModuleNotFoundError: No module named 'no_such_adoption_module_xyz'",
        "a_missing_attribute": "AttributeError",
        "a_raising_factory": "RuntimeError: factory exploded",
        "a_non_adopter": "TypeError: namespace(name='a_non_adopter') is not a state adopter",
        "a_none": "ValueError: the adopter's name None differs from the entry point's name 'a_none'",
        "a_class_returned": "TypeError: <class 'broken_plugins.ClassReturned'> is not a state adopter",
        "a_needs_arguments": "TypeError",
        "a_mismatched": "ValueError: the adopter's name 'another_name' differs from the entry point's name 'a_mismatched'",
        "built_in": "ValueError: a state adopter named 'built_in' is already registered (built-in)",
        "b spaced": "TypeError: state adopter",
    }
    assert sorted(by_entry_point) == sorted(expected)
    for entry_point, fragment in expected.items():
        assert fragment in by_entry_point[entry_point], by_entry_point[entry_point]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=PACKAGE_LOGGER):
        registry.registrations()
    assert _warnings(caplog) == []  # discovery, and its warnings, happen once


def test_hole_4_a_plugin_whose_entry_point_name_differs_from_its_name_is_skipped_loudly(
    install_plugin: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Hole 4: disabling a plugin by its entry-point name silently did nothing when the
    adopter's name differed; such a plugin is now not registered at all, with a warning."""
    install_plugin(
        "alias_plugin", {"alias_ep": "alias_plugin:Adopter"}, adopter_module(("Adopter", "real_name"))
    )
    registry = _plugin_registry()
    with caplog.at_level(logging.WARNING, logger=PACKAGE_LOGGER):
        assert registry.registrations() == ()
    (warning,) = _warnings(caplog)
    assert "entry point alias_ep = alias_plugin:Adopter (alias_plugin 1.0)" in warning
    assert "'real_name'" in warning and "'alias_ep'" in warning and "must be equal" in warning
    optimizer = _trained_sgd()
    outcome = load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=registry)
    assert outcome.adopter is None and sys.modules["alias_plugin"].ADOPTED == []


def test_plugins_are_ordered_by_entry_point_name_and_a_repeated_name_loads_once(
    install_plugin: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Sorting is by entry-point name; two distributions declaring the same name are found in
    ``sys.path`` order, so the first on the path wins and the other is skipped loudly."""
    install_plugin(
        "second_on_path",
        {"same_name": "second_on_path:Same", "an_earlier_name": "second_on_path:Earlier"},
        adopter_module(("Same", "same_name"), ("Earlier", "an_earlier_name")),
    )
    install_plugin(  # installed last, so first on sys.path
        "first_on_path",
        {"same_name": "first_on_path:Same", "b_middle": "first_on_path:Middle"},
        adopter_module(("Same", "same_name"), ("Middle", "b_middle")),
    )
    with caplog.at_level(logging.WARNING, logger=PACKAGE_LOGGER):
        registrations = _plugin_registry().registrations()
    assert [r.name for r in registrations] == ["an_earlier_name", "b_middle", "same_name"]
    assert registrations[2].origin == "entry point same_name = first_on_path:Same (first_on_path 1.0)"
    (warning,) = _warnings(caplog)
    assert "second_on_path:Same (second_on_path 1.0)" in warning and "already registered" in warning


def test_of_two_plugins_of_one_name_the_first_on_the_path_wins_whatever_its_value(
    install_plugin: Callable[..., Path],
) -> None:
    """Only the entry-point name orders plugins: a tie keeps ``sys.path`` order, also when the
    value of the one further back on the path sorts first."""
    install_plugin("a_further_back", {"tied": "a_further_back:Tied"}, adopter_module(("Tied", "tied")))
    install_plugin("z_in_front", {"tied": "z_in_front:Tied"}, adopter_module(("Tied", "tied")))  # first on the path
    (registration,) = _plugin_registry().registrations()  # the other is skipped with a warning
    assert registration.origin == "entry point tied = z_in_front:Tied (z_in_front 1.0)"
    assert isinstance(registration.adopter, sys.modules["z_in_front"].Tied)


def test_a_plugin_factory_that_registers_itself_in_code_ends_up_registered_once(
    install_plugin: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A plugin author who calls register() from the entry point's factory (as well as
    declaring the entry point): no deadlock, one registration, a warning for the duplicate."""
    root = install_plugin(
        "self_registering_plugin",
        {"self_registering": "self_registering_plugin:make"},
        adopter_module(
            ("Adopter", "self_registering"),
            extra="""
            import registry_under_test

            def make():
                adopter = Adopter()
                registry_under_test.REGISTRY.register(adopter)
                return adopter
            """,
        ),
    )
    (root / "registry_under_test.py").write_text("REGISTRY = None\n")
    import registry_under_test  # type: ignore[import-not-found]

    registry = _plugin_registry()
    registry_under_test.REGISTRY = registry
    try:
        with caplog.at_level(logging.WARNING, logger=PACKAGE_LOGGER):
            registrations = registry.registrations()
    finally:
        del sys.modules["registry_under_test"]
    assert [(r.name, r.origin) for r in registrations] == [("self_registering", "register_state_adopter")]
    (warning,) = _warnings(caplog)
    assert "'self_registering' is already registered (register_state_adopter)" in warning


def test_a_plugin_factory_that_registers_another_adopter_neither_deadlocks_nor_loses_one(
    install_plugin: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A factory that registers a helper adopter in code while the registry discovers plugins
    (the registry's lock is held then): both end up registered, each with its origin."""
    root = install_plugin(
        "helper_registering_plugin",
        {"with_helper": "helper_registering_plugin:make"},
        adopter_module(
            ("Adopter", "with_helper"),
            ("Helper", "the_helper"),
            extra="""
            import helper_registry_under_test

            def make():
                helper_registry_under_test.REGISTRY.register(Helper())
                return Adopter()
            """,
        ),
    )
    (root / "helper_registry_under_test.py").write_text("REGISTRY = None\n")
    import helper_registry_under_test  # type: ignore[import-not-found]

    registry = _plugin_registry(DecliningAdopter("built_in"))
    helper_registry_under_test.REGISTRY = registry
    try:
        with caplog.at_level(logging.WARNING, logger=PACKAGE_LOGGER):
            errors = _run_threads([registry.registrations])
    finally:
        del sys.modules["helper_registry_under_test"]
    assert errors == [] and _warnings(caplog) == []
    origins = dict((r.name, r.origin) for r in registry.registrations())
    assert origins.pop("built_in") == "built-in" and registry.registrations()[0].name == "built_in"
    assert origins == {
        "the_helper": "register_state_adopter",
        "with_helper": "entry point with_helper = helper_registering_plugin:make (helper_registering_plugin 1.0)",
    }


# --- Hole 5: the order does not depend on when code registers --------------------------------------


def test_hole_5_code_registrations_follow_the_plugins_whenever_they_are_made(
    install_plugin: Callable[..., Path],
) -> None:
    """Hole 5: an adopter registered in code before the first load ran ahead of the
    entry-point plugins, one registered after it behind them. Now both follow the plugins,
    and ``prepend=True`` goes before everything, whenever it is called."""
    install_plugin("ordered_plugin", {"plugin": "ordered_plugin:Adopter"}, adopter_module(("Adopter", "plugin")))
    built_in = DecliningAdopter("built_in")

    early = _plugin_registry(built_in)
    early.register(PyTorchLoaderAdopter("before_first_use"))  # nothing listed or loaded yet
    early.register(PyTorchLoaderAdopter("prepended_early"), prepend=True)
    optimizer = _trained_sgd()
    first_load = load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=early)
    early.register(PyTorchLoaderAdopter("after_first_load"))
    early.register(PyTorchLoaderAdopter("prepended_late"), prepend=True)
    assert _names(early) == [
        "prepended_late",
        "prepended_early",
        "built_in",
        "plugin",
        "before_first_use",
        "after_first_load",
    ]
    assert first_load.adopter == "prepended_early"

    late = _plugin_registry(built_in)
    late.registrations()  # the first listing
    late.register(PyTorchLoaderAdopter("before_first_use"))
    late.register(PyTorchLoaderAdopter("prepended_early"), prepend=True)
    late.register(PyTorchLoaderAdopter("after_first_load"))
    late.register(PyTorchLoaderAdopter("prepended_late"), prepend=True)
    assert _names(late) == _names(early)


def test_hole_5_without_prepend_the_plugin_wins_over_code_registered_before_the_first_load(
    install_plugin: Callable[..., Path],
) -> None:
    """Hole 5: which adopter installs the state does not depend on timing either."""
    install_plugin("winning_plugin", {"plugin": "winning_plugin:Adopter"}, adopter_module(("Adopter", "plugin")))
    registry = _plugin_registry()
    code = PyTorchLoaderAdopter("code", torch.optim.SGD)
    registry.register(code)  # before the first load
    optimizer = _trained_sgd()
    outcome = load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=registry)
    assert outcome.adopter == "plugin" and code.checked == []


def test_hole_5_process_wide_registrations_follow_the_installed_plugins() -> None:
    """Hole 5 for the process-wide registry: built-in, then every entry-point plugin, then
    code registrations (prepend=True first of all)."""
    appended = register_state_adopter(DecliningAdopter("appended_in_code"))
    prepended = register_state_adopter(DecliningAdopter("prepended_in_code"), prepend=True)
    try:
        origins = [(r.name, r.origin) for r in registered_state_adopters()]
    finally:
        appended.remove()
        prepended.remove()
    assert origins[0] == ("prepended_in_code", "register_state_adopter")
    assert origins[1] == ("te_fused_adam_fp32", "built-in")
    assert origins[-1] == ("appended_in_code", "register_state_adopter")
    plugins = [i for i, (_, origin) in enumerate(origins) if origin.startswith("entry point ")]
    assert all(1 < i < len(origins) - 1 for i in plugins)
