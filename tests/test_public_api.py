"""The public surface is small, deliberate, documented exactly, and the only one used.

Public means: in a module's ``__all__``. The package re-exports the protocols, contexts,
registry, outcome and loader functions; ``registry`` adds ``default_registry``;
``te_fused_adam`` (the built-in adopter), ``validation`` (checks for adopter authors) and
``testing`` (conformance helpers) are public modules. Every other module-level name is
underscored. docs/api.rst documents exactly the public names, and neither the tests nor the
example plugin use any other name of the subsystem (the one exception: tests/conftest.py
resets the once-per-process warnings, ``loader._warned``, between tests).
"""

import ast
import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Dict, Iterator, List, Set, Tuple

import megatron.core.optimizer.state_adoption as package

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBSYSTEM = REPO_ROOT / "megatron" / "core" / "optimizer" / "state_adoption"
PACKAGE = "megatron.core.optimizer.state_adoption"
PLUGIN = REPO_ROOT / "examples" / "te-precision-aware-adopter"
MODULES = sorted(path.stem for path in SUBSYSTEM.glob("*.py") if path.stem != "__init__")
# The one private name a test may use: conftest.py clears the once-per-process warnings.
ALLOWED_PRIVATE = {("tests/conftest.py", f"{PACKAGE}.loader._warned")}


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{PACKAGE}.{name}")


def _public_names() -> Set[str]:
    """Every public name, under the path it is documented at: the package's names under the
    package, a module's other ``__all__`` names under the module."""
    names = {f"{PACKAGE}.{name}" for name in package.__all__}
    for module_name in MODULES:
        for name in _module(module_name).__all__:
            if name not in package.__all__:
                names.add(f"{PACKAGE}.{module_name}.{name}")
    return names


def test_the_public_surface_is_this_small() -> None:
    assert sorted(package.__all__) == [
        "StateAdopter",
        "StateAdopterRegistration",
        "StateAdopterRegistry",
        "StateAdoptionContext",
        "StateAdoptionOutcome",
        "StateExportContext",
        "StateExporter",
        "StateInitializer",
        "StateReadTargetProvider",
        "export_inner_optimizer_state_dict",
        "initialize_inner_optimizer_state",
        "load_inner_optimizer_state_dict",
        "reading_optimizer_state",
        "register_outcome_hook",
        "register_state_adopter",
        "registered_state_adopters",
        "store_read_optimizer_state",
        "unscaled_state_or_read_target",
    ]
    beyond_the_package = {
        name: sorted(set(_module(name).__all__) - set(package.__all__)) for name in MODULES
    }
    assert beyond_the_package == {
        "adopter": [],
        "loader": [],
        "outcome": [],
        "registry": ["default_registry"],
        "te_fused_adam": ["TEFusedAdamFP32StateAdopter", "te_fused_adam_decline_reason"],
        "testing": [
            "assert_adoption_matches_own_loader",
            "assert_check_is_side_effect_free",
            "assert_export_matches_own_state_dict",
        ],
        "validation": [
            "ExpectedState",
            "exported_state_dict_decline_reason",
            "first_decline_reason",
            "incoming_state_decline_reason",
            "installed_state_decline_reason",
            "one_entry_per_param_decline_reason",
            "owner_decline_reason",
            "param_state_pairs",
            "state_entry_decline_reason",
        ],
    }
    assert len(_public_names()) == 18 + 1 + 2 + 3 + 9


def test_the_package_re_exports_the_defining_modules_objects() -> None:
    definers: Dict[str, List[str]] = {}
    for module_name in MODULES:
        module = _module(module_name)
        for name in module.__all__:
            assert hasattr(module, name), f"{module_name}.__all__ names the missing {name}"
            if name in package.__all__:
                assert getattr(package, name) is getattr(module, name), f"{module_name}.{name}"
            if getattr(getattr(module, name), "__module__", None) == module.__name__:
                definers.setdefault(name, []).append(module_name)
    assert all(hasattr(package, name) for name in package.__all__)
    assert all(len(modules) == 1 for modules in definers.values()), definers
    assert set(package.__all__) <= set(definers)  # each re-exported name is defined once


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
        undeclared_public = {
            n for n in defined if not n.startswith("_") and n not in declared and n != "logger"
        }
        assert undeclared_public == set(), f"{path.name}: public names missing from __all__: {undeclared_public}"
        if path.stem != "__init__":  # the package re-exports what its modules define
            assert declared <= defined, path.name


def test_the_api_page_documents_exactly_the_public_names() -> None:
    text = (REPO_ROOT / "docs" / "api.rst").read_text()
    documented = re.findall(r"^\.\. auto(?:class|function|data):: (\S+)$", text, re.MULTILINE)
    assert len(documented) == len(set(documented)), "a name is documented twice"
    assert set(documented) == _public_names()


# --- Nobody outside the subsystem uses its private names ------------------------------------------


def _python_files() -> Iterator[Path]:
    """Every test module (helpers and GPU tests included) and every file of the example plugin."""
    yield from sorted((REPO_ROOT / "tests").rglob("*.py"))
    for folder in ("src", "tests"):
        yield from sorted((PLUGIN / folder).rglob("*.py"))


def _private_uses(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, dotted name) for every underscored subsystem name a module imports or reads.

    Covers ``from PACKAGE[.module] import _name``, ``import PACKAGE.module._name`` and
    attribute reads ``alias._name`` where the alias is a subsystem module, however imported.
    """
    aliases: Dict[str, str] = {}  # local name -> subsystem module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
            node.module == PACKAGE or node.module.startswith(PACKAGE + ".")
        ):
            for alias in node.names:
                if alias.name.startswith("_"):
                    yield node.lineno, f"{node.module}.{alias.name}"
                elif alias.name in MODULES and node.module == PACKAGE:
                    aliases[alias.asname or alias.name] = f"{PACKAGE}.{alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module in ("megatron.core.optimizer",):
            for alias in node.names:
                if alias.name == "state_adoption":
                    aliases[alias.asname or alias.name] = PACKAGE
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    parts = alias.name[len(PACKAGE) :].split(".")
                    if any(part.startswith("_") for part in parts):
                        yield node.lineno, alias.name
                    if alias.asname:
                        aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            dotted = _dotted(node.value)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            base = aliases.get(head, head) + (f".{rest}" if rest else "")
            if base == PACKAGE or base.startswith(PACKAGE + "."):
                yield node.lineno, f"{base}.{node.attr}"


def _dotted(node: ast.AST) -> "str | None":
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def test_the_private_name_check_finds_every_form_of_use() -> None:
    """The control for the check below: each way of reaching a private name is found."""
    source = f"""
from {PACKAGE}.loader import _load_inner_state
from {PACKAGE} import loader, registry as reg
import {PACKAGE}.validation as validation
import {PACKAGE}
from megatron.core.optimizer import state_adoption
loader._warned.clear()
reg._DEFAULT_REGISTRY
validation._plain_tensor_decline_reason
{PACKAGE}.testing._Owner
state_adoption.loader._finish
loader.load_inner_optimizer_state_dict
obj._private
"""
    assert sorted(name for _, name in _private_uses(ast.parse(source))) == sorted(
        [
            f"{PACKAGE}.loader._load_inner_state",
            f"{PACKAGE}.loader._warned",
            f"{PACKAGE}.registry._DEFAULT_REGISTRY",
            f"{PACKAGE}.validation._plain_tensor_decline_reason",
            f"{PACKAGE}.testing._Owner",
            f"{PACKAGE}.loader._finish",
        ]
    )


def test_no_test_module_and_no_plugin_module_uses_a_private_subsystem_name() -> None:
    found = []
    for path in _python_files():
        relative = path.relative_to(REPO_ROOT).as_posix()
        for line, name in _private_uses(ast.parse(path.read_text())):
            if (relative, name) not in ALLOWED_PRIVATE:
                found.append(f"{relative}:{line}: {name}")
    assert not found, "private subsystem names used:\n" + "\n".join(found)


def test_the_example_plugin_imports_only_public_names() -> None:
    public = _public_names()
    for folder in ("src", "tests"):
        for path in sorted((PLUGIN / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                    for alias in node.names:
                        qualified = f"{node.module}.{alias.name}"
                        module_name = (node.module or "")[len(PACKAGE) + 1 :]
                        in_all = module_name in MODULES and alias.name in _module(module_name).__all__
                        assert qualified in public or in_all, f"{path.name} imports {qualified}"
