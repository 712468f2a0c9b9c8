"""The public surface: twelve names, documented, in files small enough to review one by one."""

import ast
import re
from pathlib import Path

import megatron.core.optimizer.state_adoption as state_adoption

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "megatron/core/optimizer/state_adoption"
PUBLIC = {
    "AdoptionContext", "AdoptionOutcome", "StateAdopter", "StateAdopterRegistry",
    "TEFusedAdamPrecisionAwareStateAdopter", "default_registry",
    "export_inner_optimizer_state_dict", "initialize_inner_optimizer_state",
    "load_inner_optimizer_state_dict", "reading_optimizer_state",
    "store_read_optimizer_state", "unscaled_state_or_read_target",
}  # fmt: skip


def test_the_package_exports_exactly_twelve_names_defined_in_its_modules() -> None:
    """The package's ``__all__`` is the public surface; its modules are internal (none declares
    an ``__all__`` of its own)."""
    assert sorted(state_adoption.__all__) == sorted(PUBLIC) and len(PUBLIC) == 12
    for name in PUBLIC:
        assert getattr(state_adoption, name).__module__.startswith(state_adoption.__name__)
    paths = sorted(SOURCE.glob("*.py"))
    assert "__init__.py" in [path.name for path in paths]
    for path in paths:
        declares = [n for n in ast.parse(path.read_text()).body if "__all__" in ast.unparse(n).split("=")[0]]
        assert (path.name == "__init__.py") == bool(declares), path.name


def test_the_api_page_documents_exactly_the_public_names() -> None:
    page = (REPO / "docs/api.rst").read_text()
    documented = set(re.findall(r"^\.\. auto\w+:: megatron\.core\.optimizer\.state_adoption\.(\w+)", page, re.M))
    assert documented == PUBLIC


def test_no_file_of_the_subsystem_is_over_450_lines() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in SOURCE.glob("*.py")}
    assert "registry.py" in sizes and max(sizes.values()) <= 450, sizes


def test_the_registry_depends_on_nothing_concrete() -> None:
    """The generic modules import no adopter; the built-in one registers from ``__init__``."""
    for name in ("registry.py", "dispatch.py", "checks.py", "adopter.py"):
        imports = [n for n in ast.walk(ast.parse((SOURCE / name).read_text())) if isinstance(n, ast.ImportFrom)]
        assert not any((n.module or "").startswith(("te_", "call_sites")) for n in imports), name
