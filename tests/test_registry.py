"""Registry semantics: order, prepend, handles, unique names, origins, disabling by name,
kill switch, outcome hooks, threads, entry points."""

import logging
import sys
import textwrap
import threading
from pathlib import Path
from typing import List

import pytest
import torch
from adopters_for_tests import DecliningAdopter, PyTorchLoaderAdopter
from builders import Owner, cloned_state_dict, fresh_standin, standin_adopter, state_tensors, trained_standin

from megatron.core.optimizer.state_adoption import (
    StateAdopter,
    StateAdoptionOutcome,
    load_inner_optimizer_state_dict,
    register_outcome_hook,
    register_state_adopter,
    registered_state_adopters,
)
from megatron.core.optimizer.state_adoption.loader import _load_inner_state
from megatron.core.optimizer.state_adoption.registry import _StateAdopterRegistry
from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter

DISABLE_ENV_VAR = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
DISABLED_ADOPTERS_ENV_VAR = "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS"
ENTRY_POINT_GROUP = "megatron_core.optimizer_state_adopters"


def test_default_registry_lists_the_te_fp32_adopter_as_built_in() -> None:
    (built_in,) = [r for r in registered_state_adopters() if r.name == "te_fused_adam_fp32"]
    assert isinstance(built_in.adopter, TEFusedAdamFP32StateAdopter)
    assert built_in.origin == "built-in"


def test_order_prepend_and_handle_removal(empty_registry: _StateAdopterRegistry) -> None:
    a, b, c = DecliningAdopter("a"), DecliningAdopter("b"), DecliningAdopter("c")
    handle_a = empty_registry.register(a)
    empty_registry.register(b)
    handle_c = empty_registry.register(c, prepend=True)
    assert [x.name for x in empty_registry.registrations()] == ["c", "a", "b"]
    handle_a.remove()
    handle_a.remove()  # removing twice is harmless, as for PyTorch hooks
    assert [x.name for x in empty_registry.registrations()] == ["c", "b"]
    with handle_c:
        pass
    assert [x.name for x in empty_registry.registrations()] == ["b"]


def test_listing_is_a_snapshot(empty_registry: _StateAdopterRegistry) -> None:
    empty_registry.register(DecliningAdopter("a"))
    listed = empty_registry.registrations()
    empty_registry.register(DecliningAdopter("b"))
    assert [x.name for x in listed] == ["a"]


def test_process_wide_registration_is_consulted_and_removable() -> None:
    adopter = PyTorchLoaderAdopter("process_wide", torch.optim.SGD)
    params = [torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    handle = register_state_adopter(adopter, prepend=True)
    try:
        first = registered_state_adopters()[0]
        assert first.adopter is adopter and first.origin == "register_state_adopter"
        outcome = load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict())
        assert len(adopter.adopted) == 1 and outcome.adopter == "process_wide"
    finally:
        handle.remove()
    assert adopter not in [r.adopter for r in registered_state_adopters()]


@pytest.mark.parametrize(
    "bad", [object(), PyTorchLoaderAdopter, DecliningAdopter(""), type("NoAdopt", (), {"name": "x", "decline_reason": lambda s, c: None})()]
)
def test_register_rejects_non_adopters(empty_registry: _StateAdopterRegistry, bad: object) -> None:
    with pytest.raises(TypeError, match="state adopter"):
        empty_registry.register(bad)  # type: ignore[arg-type]
    assert empty_registry.registrations() == ()


def test_first_accepting_adopter_wins(empty_registry: _StateAdopterRegistry) -> None:
    declining = DecliningAdopter("declining")
    first, second = PyTorchLoaderAdopter("first"), PyTorchLoaderAdopter("second")
    for adopter in (declining, first, second):
        empty_registry.register(adopter)
    optimizer = fresh_standin()
    _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), empty_registry)
    assert declining.checks == 1 and len(first.adopted) == 1
    assert second.checked == [] and second.adopted == []
    assert optimizer.allocations == 0


def test_no_adopter_accepting_runs_the_optimizers_own_loader(empty_registry: _StateAdopterRegistry, caplog) -> None:
    empty_registry.register(DecliningAdopter("declining", reason="not my optimizer"))
    optimizer = fresh_standin()
    with caplog.at_level(logging.DEBUG, logger="megatron.core.optimizer.state_adoption"):
        _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), empty_registry)
    assert optimizer.allocations == len(state_tensors(optimizer))
    assert "'declining' declined: not my optimizer" in caplog.text
    assert "(every adopter declined): FusedAdamStandIn.load_state_dict runs" in caplog.text


def test_adoption_logs_adopter_and_bytes_avoided(registry: _StateAdopterRegistry, caplog) -> None:
    optimizer = fresh_standin()
    with caplog.at_level(logging.INFO, logger="megatron.core.optimizer.state_adoption"):
        _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    expected = 8 * sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    records = [r for r in caplog.records if "installed" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert f"'te_fused_adam_fp32' installed the FusedAdamStandIn state, avoiding {expected} bytes" in records[0].getMessage()


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_kill_switch_skips_every_adopter(registry: _StateAdopterRegistry, monkeypatch, value: str) -> None:
    monkeypatch.setenv(DISABLE_ENV_VAR, value)
    optimizer = fresh_standin()
    outcome = _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    assert optimizer.allocations == len(state_tensors(optimizer)) > 0
    assert outcome.adopter is None and outcome.fallback_reason == f"{DISABLE_ENV_VAR} is set"


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_kill_switch_off_values_keep_adoption(registry: _StateAdopterRegistry, monkeypatch, value: str) -> None:
    monkeypatch.setenv(DISABLE_ENV_VAR, value)
    optimizer = fresh_standin()
    _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    assert optimizer.allocations == 0


def test_concurrent_registration_and_removal_while_listing(empty_registry: _StateAdopterRegistry) -> None:
    errors: list = []
    stop = threading.Event()

    def churn(worker: int) -> None:
        try:
            for i in range(300):
                handle = empty_registry.register(DecliningAdopter(f"w{worker}-{i}"), prepend=i % 2 == 0)
                if i % 3:
                    handle.remove()
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    def list_continuously() -> None:
        try:
            while not stop.is_set():
                names = [a.name for a in empty_registry.registrations()]
                assert len(names) == len(set(names))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    reader = threading.Thread(target=list_continuously)
    reader.start()
    workers = [threading.Thread(target=churn, args=(w,)) for w in range(8)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    stop.set()
    reader.join()
    assert errors == []
    names = [a.name for a in empty_registry.registrations()]
    assert sorted(names) == sorted(f"w{w}-{i}" for w in range(8) for i in range(300) if i % 3 == 0)


def _install_plugin_distribution(root: Path, name: str, entry_points: str, module_source: str) -> None:
    """Write a real installed distribution (dist-info with entry_points.txt) under ``root``."""
    (root / f"{name}.py").write_text(textwrap.dedent(module_source))
    dist_info = root / f"{name}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{textwrap.dedent(entry_points)}")


PLUGIN_SOURCE = """
    ADOPTED = []

    class SgdAdopter:
        name = "plugin_sgd"

        def decline_reason(self, context):
            import torch
            return None if isinstance(context.optimizer, torch.optim.SGD) else "not SGD"

        def adopt(self, context):
            import torch
            torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
            ADOPTED.append(context.optimizer)
            return 0

    class CollidingAdopter(SgdAdopter):
        name = "built_in"

    def not_an_adopter():
        return object()
"""


def test_entry_point_plugins_are_discovered_and_broken_or_colliding_ones_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    _install_plugin_distribution(
        tmp_path,
        "sgd_adoption_plugin",
        """\
        a_good = sgd_adoption_plugin:SgdAdopter
        b_missing_module = no_such_module_for_adoption:Adopter
        c_not_an_adopter = sgd_adoption_plugin:not_an_adopter
        d_colliding = sgd_adoption_plugin:CollidingAdopter
        """,
        PLUGIN_SOURCE,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = _StateAdopterRegistry()
    built_in = DecliningAdopter("built_in")
    registry.register(built_in, origin="built-in")
    with caplog.at_level(logging.WARNING, logger="megatron.core.optimizer.state_adoption"):
        registrations = registry.registrations()
    # Plugins installed in the environment (e.g. the example package) may follow.
    assert [r.name for r in registrations[:2]] == ["built_in", "plugin_sgd"]
    assert registrations[0].adopter is built_in
    assert registrations[1].origin == (
        "entry point a_good = sgd_adoption_plugin:SgdAdopter (sgd_adoption_plugin 1.0)"
    )
    assert "b_missing_module" in caplog.text and "ModuleNotFoundError" in caplog.text
    assert "c_not_an_adopter" in caplog.text and "TypeError" in caplog.text
    assert "d_colliding" in caplog.text and "'built_in' is already registered" in caplog.text
    assert registry.registrations() == registrations  # discovered once
    assert _StateAdopterRegistry(entry_point_group=None).registrations() == ()

    plugin = sys.modules["sgd_adoption_plugin"]
    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    params[0].grad = torch.ones(2)
    optimizer.step()
    outcome = _load_inner_state(Owner(optimizer), optimizer.state_dict(), registry)
    assert outcome.adopter == "plugin_sgd" and plugin.ADOPTED == [optimizer]

    registrations[1].handle.remove()  # an entry-point adopter is removable like any other
    assert "plugin_sgd" not in [r.name for r in registry.registrations()]
    outcome = _load_inner_state(Owner(optimizer), optimizer.state_dict(), registry)
    assert outcome.adopter is None and plugin.ADOPTED == [optimizer]
    sys.modules.pop("sgd_adoption_plugin", None)


def test_registry_without_entry_point_group_discovers_nothing(tmp_path: Path, monkeypatch) -> None:
    _install_plugin_distribution(tmp_path, "ignored_plugin", "x = ignored_plugin:SgdAdopter\n", PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _StateAdopterRegistry(entry_point_group=None).registrations() == ()


def test_standin_adopter_is_a_state_adopter() -> None:
    assert isinstance(standin_adopter(), StateAdopter)
    assert repr(standin_adopter()) == "TEFusedAdamFP32StateAdopter(name='te_fused_adam_fp32')"


def test_a_taken_name_is_refused(empty_registry: _StateAdopterRegistry) -> None:
    first = DecliningAdopter("same")
    empty_registry.register(first)
    with pytest.raises(ValueError, match="'same' is already registered .register_state_adopter."):
        empty_registry.register(PyTorchLoaderAdopter("same"), prepend=True)
    assert [r.adopter for r in empty_registry.registrations()] == [first]


def test_the_process_wide_registry_refuses_the_default_adopters_name() -> None:
    with pytest.raises(ValueError, match="'te_fused_adam_fp32' is already registered .built-in."):
        register_state_adopter(standin_adopter())


@pytest.mark.parametrize("name", ["", "  ", "a,b"])
def test_names_must_be_usable_in_the_disable_list(empty_registry: _StateAdopterRegistry, name: str) -> None:
    with pytest.raises(TypeError, match="without commas"):
        empty_registry.register(DecliningAdopter(name))


def test_a_removed_name_can_be_registered_again(empty_registry: _StateAdopterRegistry) -> None:
    empty_registry.register(DecliningAdopter("again")).remove()
    empty_registry.register(DecliningAdopter("again"))
    assert [r.name for r in empty_registry.registrations()] == ["again"]


@pytest.mark.parametrize("listed", ["first", " first , unknown", "unknown,first,"])
def test_adopters_disabled_by_name_are_skipped_and_recorded(
    empty_registry: _StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch, listed: str
) -> None:
    first, second = PyTorchLoaderAdopter("first"), PyTorchLoaderAdopter("second")
    empty_registry.register(first)
    empty_registry.register(second)
    monkeypatch.setenv(DISABLED_ADOPTERS_ENV_VAR, listed)
    outcome = _load_inner_state(Owner(fresh_standin()), cloned_state_dict(trained_standin()), empty_registry)
    assert first.checked == [] and len(second.adopted) == 1
    assert outcome.adopter == "second"
    assert outcome.declines == (("first", f"disabled by {DISABLED_ADOPTERS_ENV_VAR}"),)


def test_disabling_the_default_adopter_by_name_restores_the_own_loader(
    registry: _StateAdopterRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DISABLED_ADOPTERS_ENV_VAR, "te_fused_adam_fp32")
    optimizer = fresh_standin()
    outcome = _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    assert optimizer.allocations == len(state_tensors(optimizer)) > 0
    assert outcome.adopter is None and outcome.fallback_reason == "every adopter declined"
    monkeypatch.delenv(DISABLED_ADOPTERS_ENV_VAR)
    assert _load_inner_state(Owner(fresh_standin()), cloned_state_dict(trained_standin()), registry).adopter == (
        "te_fused_adam_fp32"
    )


def test_outcome_hooks_see_every_load_in_order_and_can_be_removed(registry: _StateAdopterRegistry) -> None:
    seen: List[str] = []
    outcomes: List[StateAdoptionOutcome] = []
    second = register_outcome_hook(lambda outcome: seen.append("second"))
    first = register_outcome_hook(outcomes.append, prepend=True)
    try:
        optimizer = fresh_standin()
        adopted = _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    finally:
        second.remove()
    assert outcomes == [adopted] and seen == ["second"]
    assert adopted == StateAdoptionOutcome(
        "load", "FusedAdamStandIn", "te_fused_adam_fp32", 8 * sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    )
    try:
        fallback = _load_inner_state(Owner(fresh_standin()), cloned_state_dict(trained_standin()), _StateAdopterRegistry(None))
    finally:
        first.remove()
    assert outcomes == [adopted, fallback] and seen == ["second"]
    assert fallback.adopter is None and fallback.avoided_bytes == 0
    assert fallback.fallback_reason == "no adopter is registered"
    _load_inner_state(Owner(fresh_standin()), cloned_state_dict(trained_standin()), registry)
    assert len(outcomes) == 2


def test_a_raising_outcome_hook_is_logged_and_the_load_completes(registry: _StateAdopterRegistry, caplog) -> None:
    def broken(outcome: StateAdoptionOutcome) -> None:
        raise RuntimeError("observer broke")

    handle = register_outcome_hook(broken)
    try:
        optimizer = fresh_standin()
        with caplog.at_level(logging.WARNING, logger="megatron.core.optimizer.state_adoption"):
            outcome = _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    finally:
        handle.remove()
    assert outcome.adopter == "te_fused_adam_fp32" and optimizer.allocations == 0
    assert "outcome hook" in caplog.text and "RuntimeError: observer broke" in caplog.text


def test_outcome_hooks_must_be_callable() -> None:
    with pytest.raises(TypeError, match="not callable"):
        register_outcome_hook("print")  # type: ignore[arg-type]


def test_outcome_json_lists_declines_as_pairs(empty_registry: _StateAdopterRegistry) -> None:
    empty_registry.register(DecliningAdopter("no", reason="not mine"))
    outcome = _load_inner_state(Owner(fresh_standin()), cloned_state_dict(trained_standin()), empty_registry)
    assert outcome.to_json() == {
        "hook_point": "load",
        "optimizer": "FusedAdamStandIn",
        "adopter": None,
        "avoided_bytes": 0,
        "declines": [["no", "not mine"]],
        "fallback_reason": "every adopter declined",
    }
