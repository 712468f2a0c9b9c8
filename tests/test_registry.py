"""Registry semantics: order, prepend, handles, listing, kill switch, threads, entry points."""

import logging
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from adopters_for_tests import DecliningAdopter, PyTorchLoaderAdopter
from builders import Owner, cloned_state_dict, fresh_standin, standin_adopter, state_tensors, trained_standin

from megatron.core.optimizer.state_adoption import (
    DISABLE_ENV_VAR,
    ENTRY_POINT_GROUP,
    StateAdopterRegistry,
    TEFusedAdamFP32StateAdopter,
    load_inner_optimizer_state_dict,
    register_state_adopter,
    registered_state_adopters,
    state_adoption_disabled,
)


def test_default_registry_lists_the_te_fp32_adopter() -> None:
    adopters = registered_state_adopters()
    assert any(isinstance(a, TEFusedAdamFP32StateAdopter) for a in adopters)
    assert "te_fused_adam_fp32" in [a.name for a in adopters]


def test_order_prepend_and_handle_removal(empty_registry: StateAdopterRegistry) -> None:
    a, b, c = DecliningAdopter("a"), DecliningAdopter("b"), DecliningAdopter("c")
    handle_a = empty_registry.register(a)
    empty_registry.register(b)
    handle_c = empty_registry.register(c, prepend=True)
    assert [x.name for x in empty_registry.adopters()] == ["c", "a", "b"]
    handle_a.remove()
    handle_a.remove()  # removing twice is harmless, as for PyTorch hooks
    assert [x.name for x in empty_registry.adopters()] == ["c", "b"]
    with handle_c:
        pass
    assert [x.name for x in empty_registry.adopters()] == ["b"]


def test_listing_is_a_snapshot(empty_registry: StateAdopterRegistry) -> None:
    empty_registry.register(DecliningAdopter("a"))
    listed = empty_registry.adopters()
    empty_registry.register(DecliningAdopter("b"))
    assert [x.name for x in listed] == ["a"]


def test_process_wide_registration_is_consulted_and_removable() -> None:
    adopter = PyTorchLoaderAdopter("process_wide", torch.optim.SGD)
    params = [torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    handle = register_state_adopter(adopter, prepend=True)
    try:
        assert registered_state_adopters()[0] is adopter
        load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict())
        assert len(adopter.adopted) == 1
    finally:
        handle.remove()
    assert adopter not in registered_state_adopters()


@pytest.mark.parametrize(
    "bad", [object(), PyTorchLoaderAdopter, DecliningAdopter(""), type("NoAdopt", (), {"name": "x", "decline_reason": lambda s, c: None})()]
)
def test_register_rejects_non_adopters(empty_registry: StateAdopterRegistry, bad: object) -> None:
    with pytest.raises(TypeError, match="state adopter"):
        empty_registry.register(bad)  # type: ignore[arg-type]
    assert empty_registry.adopters() == ()


def test_first_accepting_adopter_wins(empty_registry: StateAdopterRegistry) -> None:
    declining = DecliningAdopter("declining")
    first, second = PyTorchLoaderAdopter("first"), PyTorchLoaderAdopter("second")
    for adopter in (declining, first, second):
        empty_registry.register(adopter)
    optimizer = fresh_standin()
    load_inner_optimizer_state_dict(Owner(optimizer), cloned_state_dict(trained_standin()), empty_registry)
    assert declining.checks == 1 and len(first.adopted) == 1
    assert second.checked == [] and second.adopted == []
    assert optimizer.allocations == 0


def test_no_adopter_accepting_runs_the_optimizers_own_loader(empty_registry: StateAdopterRegistry, caplog) -> None:
    empty_registry.register(DecliningAdopter("declining", reason="not my optimizer"))
    optimizer = fresh_standin()
    with caplog.at_level(logging.DEBUG, logger="megatron.core.optimizer.state_adoption"):
        load_inner_optimizer_state_dict(Owner(optimizer), cloned_state_dict(trained_standin()), empty_registry)
    assert optimizer.allocations == len(state_tensors(optimizer))
    assert "'declining' declined: not my optimizer" in caplog.text
    assert "FusedAdamStandIn.load_state_dict loads it" in caplog.text


def test_adoption_logs_adopter_and_bytes_avoided(registry: StateAdopterRegistry, caplog) -> None:
    optimizer = fresh_standin()
    with caplog.at_level(logging.INFO, logger="megatron.core.optimizer.state_adoption"):
        load_inner_optimizer_state_dict(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    expected = 8 * sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    records = [r for r in caplog.records if "installed" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert f"'te_fused_adam_fp32' installed the FusedAdamStandIn state, avoiding {expected} bytes" in records[0].getMessage()


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_kill_switch_skips_every_adopter(registry: StateAdopterRegistry, monkeypatch, value: str) -> None:
    monkeypatch.setenv(DISABLE_ENV_VAR, value)
    assert state_adoption_disabled()
    optimizer = fresh_standin()
    load_inner_optimizer_state_dict(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    assert optimizer.allocations == len(state_tensors(optimizer)) > 0


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_kill_switch_off_values_keep_adoption(registry: StateAdopterRegistry, monkeypatch, value: str) -> None:
    monkeypatch.setenv(DISABLE_ENV_VAR, value)
    optimizer = fresh_standin()
    load_inner_optimizer_state_dict(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
    assert optimizer.allocations == 0


def test_concurrent_registration_and_removal_while_listing(empty_registry: StateAdopterRegistry) -> None:
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
                names = [a.name for a in empty_registry.adopters()]
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
    names = [a.name for a in empty_registry.adopters()]
    assert sorted(names) == sorted(f"w{w}-{i}" for w in range(8) for i in range(300) if i % 3 == 0)


def _install_plugin_distribution(root: Path, name: str, entry_points: str, module_source: str) -> None:
    """Write a real installed distribution (dist-info with entry_points.txt) under ``root``."""
    (root / f"{name}.py").write_text(textwrap.dedent(module_source))
    dist_info = root / f"{name}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{textwrap.dedent(entry_points)}")


PLUGIN_SOURCE = """
    class SgdAdopter:
        name = "plugin_sgd"

        def decline_reason(self, context):
            import torch
            return None if isinstance(context.optimizer, torch.optim.SGD) else "not SGD"

        def adopt(self, context):
            import torch
            torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
            return 0

    def not_an_adopter():
        return object()
"""


def test_entry_point_plugins_are_discovered_and_broken_ones_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    _install_plugin_distribution(
        tmp_path,
        "sgd_adoption_plugin",
        """\
        a_good = sgd_adoption_plugin:SgdAdopter
        b_missing_module = no_such_module_for_adoption:Adopter
        c_not_an_adopter = sgd_adoption_plugin:not_an_adopter
        """,
        PLUGIN_SOURCE,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = StateAdopterRegistry()
    registry.register(DecliningAdopter("built_in"))
    with caplog.at_level(logging.WARNING, logger="megatron.core.optimizer.state_adoption"):
        names = [a.name for a in registry.adopters()]
    # Plugins installed in the environment (e.g. the example package) may follow.
    assert names[:2] == ["built_in", "plugin_sgd"]
    assert "b_missing_module" in caplog.text and "ModuleNotFoundError" in caplog.text
    assert "c_not_an_adopter" in caplog.text and "TypeError" in caplog.text
    assert [a.name for a in registry.adopters()] == names  # discovered once
    assert "plugin_sgd" not in [a.name for a in StateAdopterRegistry(entry_point_group=None).adopters()]

    params = [torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    params[0].grad = torch.ones(2)
    optimizer.step()
    momentum = optimizer.state[params[0]]["momentum_buffer"]
    load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry)
    assert optimizer.state[params[0]]["momentum_buffer"] is momentum
    sys.modules.pop("sgd_adoption_plugin", None)


def test_registry_without_entry_point_group_discovers_nothing(tmp_path: Path, monkeypatch) -> None:
    _install_plugin_distribution(tmp_path, "ignored_plugin", "x = ignored_plugin:SgdAdopter\n", PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert StateAdopterRegistry(entry_point_group=None).adopters() == ()


def test_standin_adopter_is_a_state_adopter() -> None:
    from megatron.core.optimizer.state_adoption import StateAdopter

    assert isinstance(standin_adopter(), StateAdopter)
    assert repr(standin_adopter()) == "TEFusedAdamFP32StateAdopter(name='te_fused_adam_fp32')"
