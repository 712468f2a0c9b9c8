"""The public surface is small, deliberate and documented exactly.

Public means: in the ``__all__`` of the package, of ``te_fused_adam``, ``validation`` or
``testing``. Every module of the subsystem declares ``__all__``; every other module-level name
is underscored. docs/api.rst documents exactly the public names, and the example plugin uses
nothing else.
"""

import ast
import importlib
import re
from pathlib import Path
from typing import Set

import megatron.core.optimizer.state_adoption as package

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBSYSTEM = REPO_ROOT / "megatron" / "core" / "optimizer" / "state_adoption"
PACKAGE = "megatron.core.optimizer.state_adoption"
PUBLIC_MODULES = ("te_fused_adam", "validation", "testing")


def _public_names() -> Set[str]:
    names = {f"{PACKAGE}.{name}" for name in package.__all__}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(f"{PACKAGE}.{module_name}")
        names |= {f"{PACKAGE}.{module_name}.{name}" for name in module.__all__}
    return names


def test_the_public_surface_is_this_small() -> None:
    assert sorted(package.__all__) == [
        "StateAdopter",
        "StateAdopterRegistration",
        "StateAdoptionContext",
        "StateAdoptionOutcome",
        "StateExportContext",
        "StateExporter",
        "export_inner_optimizer_state_dict",
        "load_inner_optimizer_state_dict",
        "register_outcome_hook",
        "register_state_adopter",
        "registered_state_adopters",
    ]
    assert len(_public_names()) == 11 + 2 + 9 + 2


def test_every_module_declares_all_and_underscores_everything_else() -> None:
    for path in sorted(SUBSYSTEM.glob("*.py")):
        tree = ast.parse(path.read_text())
        declared = None
        defined = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        if target.id == "__all__":
                            declared = set(ast.literal_eval(node.value)) if node.value else set()
                        else:
                            defined.add(target.id)
        assert declared is not None, f"{path.name} has no __all__"
        undeclared_public = {n for n in defined if not n.startswith("_") and n not in declared and n != "logger"}
        assert undeclared_public == set(), f"{path.name}: public names missing from __all__: {undeclared_public}"
        if path.stem != "__init__":  # the package re-exports what its modules define
            assert declared <= defined, path.name


def test_the_api_page_documents_exactly_the_public_names() -> None:
    text = (REPO_ROOT / "docs" / "api.rst").read_text()
    documented = set(re.findall(r"^\.\. auto(?:class|function|data):: (\S+)$", text, re.MULTILINE))
    assert documented == _public_names()


def test_the_example_plugin_imports_only_public_names() -> None:
    public = _public_names()
    plugin = REPO_ROOT / "examples" / "te-precision-aware-adopter" / "src"
    for path in plugin.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                for alias in node.names:
                    assert f"{node.module}.{alias.name}" in public, f"{path.name} imports {node.module}.{alias.name}"
