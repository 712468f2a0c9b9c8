"""The registry's contract in detail: defaults, exact messages, entry-point order and origins.

Written to kill the mutants that survived the first mutation run (docs/mutation-report.md).
Plugins are real installed distributions (a dist-info folder with ``entry_points.txt`` on
``sys.path``), as in tests/test_registry.py.
"""

import logging
import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from adopters_for_tests import DecliningAdopter

from megatron.core.optimizer.state_adoption import register_state_adopter, registered_state_adopters
from megatron.core.optimizer.state_adoption.registry import _entry_point_origin, _StateAdopterRegistry
from megatron.core.optimizer.state_adoption.settings import _disabled_adopter_names

ENTRY_POINT_GROUP = "megatron_core.optimizer_state_adopters"
DISABLED_ADOPTERS_ENV_VAR = "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS"


def _install_distribution(root: Path, name: str, entry_points: str, module_source: str = "") -> None:
    """Write an installed distribution ``name`` 1.0 (module ``name`` and its dist-info) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.py").write_text(textwrap.dedent(module_source))
    dist_info = root / f"{name}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{textwrap.dedent(entry_points)}")


def _adopter_module(adopter_name: str) -> str:
    return f"""
        class Adopter:
            name = {adopter_name!r}

            def decline_reason(self, context):
                return "only listed"

            def adopt(self, context):
                raise AssertionError("never accepts")
    """


def test_register_state_adopter_appends_unless_told_to_prepend() -> None:
    registered_state_adopters()  # entry-point adopters are loaded before the new ones
    appended = register_state_adopter(DecliningAdopter("appended_by_default"))
    prepended = register_state_adopter(DecliningAdopter("prepended"), prepend=True)
    try:
        names = [r.name for r in registered_state_adopters()]
        assert names[0] == "prepended" and names[-1] == "appended_by_default"
    finally:
        appended.remove()
        prepended.remove()


def test_a_non_adopter_is_refused_with_what_an_adopter_needs(empty_registry: _StateAdopterRegistry) -> None:
    not_an_adopter = object()
    with pytest.raises(TypeError) as refused:
        empty_registry.register(not_an_adopter)  # type: ignore[arg-type]
    assert str(refused.value) == (
        f"{not_an_adopter!r} is not a state adopter: it needs a 'name' and the methods "
        "'decline_reason(context)' and 'adopt(context)'"
    )


def test_the_origin_of_an_entry_point_without_a_distribution() -> None:
    entry_point = EntryPoint("plain", "some_package.adoption:Adopter", ENTRY_POINT_GROUP)
    assert _entry_point_origin(entry_point) == "entry point plain = some_package.adoption:Adopter"


def test_a_broken_plugin_is_skipped_with_its_origin_and_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _install_distribution(tmp_path, "broken_adoption_plugin", "broken = no_such_adoption_module_xyz:Adopter\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="megatron.core.optimizer.state_adoption"):
        _StateAdopterRegistry().registrations()
    warnings = [r.getMessage() for r in caplog.records if "broken_adoption_plugin" in r.getMessage()]
    assert warnings == [
        "Skipping optimizer state adopter plugin from entry point broken = "
        "no_such_adoption_module_xyz:Adopter (broken_adoption_plugin 1.0): ModuleNotFoundError: "
        "No module named 'no_such_adoption_module_xyz'"
    ]


def test_entry_points_are_ordered_by_name_and_equal_names_keep_the_search_path_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sorting is by entry-point name only: two plugins declaring the same name are tried in
    ``sys.path`` order (the order Python itself finds them in), not by their values."""
    _install_distribution(
        tmp_path / "first", "zz_first_on_path", "same_name = zz_first_on_path:Adopter\n", _adopter_module("zz_first")
    )
    _install_distribution(
        tmp_path / "second",
        "aa_second_on_path",
        "same_name = aa_second_on_path:Adopter\nan_earlier_name = aa_second_on_path:Adopter2\n",
        _adopter_module("aa_second") + "\n" + _adopter_module("aa_earlier").replace("class Adopter", "class Adopter2"),
    )
    monkeypatch.syspath_prepend(str(tmp_path / "second"))
    monkeypatch.syspath_prepend(str(tmp_path / "first"))  # now first on sys.path
    names = [r.name for r in _StateAdopterRegistry().registrations()]
    ours = [n for n in names if n in ("zz_first", "aa_second", "aa_earlier")]
    assert ours == ["aa_earlier", "zz_first", "aa_second"]
    for module in ("zz_first_on_path", "aa_second_on_path"):
        monkeypatch.delitem(sys.modules, module, raising=False)


def test_no_adopter_is_disabled_while_the_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLED_ADOPTERS_ENV_VAR, raising=False)
    assert _disabled_adopter_names() == frozenset()
    monkeypatch.setenv(DISABLED_ADOPTERS_ENV_VAR, " a ,, b,")
    assert _disabled_adopter_names() == frozenset({"a", "b"})
