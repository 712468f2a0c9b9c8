"""Tests of the composed ``megatron-core`` wheel and of the composition's failure modes.

The installed-wheel tests need this repository's wheel installed. The composition tests
need the upstream wheel: ``$MCORE_UPSTREAM_WHEEL`` if set, else the build cache
``build/upstream/`` (filled by ``pip install .``), else they are skipped. They never
download anything.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import os
import shutil
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PATCH_FILE = (
    REPO_ROOT / "patches" / "0001-distrib-optimizer-route-inner-load-through-state-adoption.patch"
)
DISTRIB_OPTIMIZER = "megatron/core/optimizer/distrib_optimizer.py"
EXPECTED_VERSION = "0.19.2+stateadoption"


def _load_build_module(name: str) -> ModuleType:
    """Import ``build_tools.<name>`` from the repository without putting it on sys.path.

    Adding the repository root to sys.path would let its ``megatron/`` directory shadow
    parts of the installed ``megatron`` package, so the modules are loaded by file.
    """
    package = "build_tools"
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            package, REPO_ROOT / package / "__init__.py",
            submodule_search_locations=[str(REPO_ROOT / package)],
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.{name}")


def _installed_distribution() -> importlib.metadata.Distribution:
    """Return the installed megatron-core that ships distrib_optimizer.py.

    A source checkout may hold a ``megatron_core.egg-info`` from a build; it ships no
    files, so it is skipped here.
    """
    for dist in importlib.metadata.distributions(name="megatron-core"):
        if any(str(f) == DISTRIB_OPTIMIZER for f in dist.files or []):
            return dist
    pytest.fail("no installed megatron-core distribution ships " + DISTRIB_OPTIMIZER)


def _upstream_wheel() -> Path:
    """Return the upstream wheel from $MCORE_UPSTREAM_WHEEL or the build cache, else skip."""
    upstream = _load_build_module("upstream")
    override = os.environ.get(upstream.UPSTREAM_WHEEL_ENV)
    if override:
        return Path(override)
    cached = upstream.cached_upstream_wheel(REPO_ROOT / "build" / "upstream")
    if cached is None:
        pytest.skip(
            f"upstream megatron-core wheel not available: set {upstream.UPSTREAM_WHEEL_ENV} "
            "or run 'pip install .' first to fill build/upstream/"
        )
    return Path(cached)


@pytest.fixture
def upstream_copy(tmp_path: Path) -> Path:
    """A copy of the upstream wheel in tmp_path, under its original file name."""
    source = _upstream_wheel()
    target = tmp_path / "upstream" / source.name
    target.parent.mkdir()
    shutil.copyfile(source, target)
    return target


# (a) the installed wheel


def test_installed_version_is_local_build() -> None:
    assert _installed_distribution().version == EXPECTED_VERSION


def test_installed_distrib_optimizer_is_patched() -> None:
    path = Path(str(_installed_distribution().locate_file(DISTRIB_OPTIMIZER)))
    text = path.read_text(encoding="utf-8")
    assert (
        "from .state_adoption import export_inner_optimizer_state_dict, "
        "load_inner_optimizer_state_dict" in text
    )
    assert "inner_state_dict = export_inner_optimizer_state_dict(self)" in text
    assert "load_inner_optimizer_state_dict(\n            self, {" in text
    assert "self.optimizer.load_state_dict(\n" not in text


def test_installed_distrib_optimizer_imports() -> None:
    pytest.importorskip("torch")
    module = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    installed = Path(str(_installed_distribution().locate_file(DISTRIB_OPTIMIZER)))
    assert Path(module.__file__ or "").resolve() == installed.resolve()
    assert callable(module.load_inner_optimizer_state_dict)
    assert callable(module.export_inner_optimizer_state_dict)


def test_installed_requirements_match_upstream() -> None:
    upstream = _load_build_module("upstream")
    requirements = _load_build_module("requirements")
    expected = requirements.requirements_from_metadata(
        upstream.read_wheel_metadata(_upstream_wheel())
    )
    metadata_text = _installed_distribution().read_text("METADATA") or ""
    actual = requirements.requirements_from_metadata(metadata_text)
    assert actual == expected
    assert expected.install_requires and expected.extras_require


# (b)-(d) failure modes of the composition


def test_corrupted_upstream_wheel_is_rejected(upstream_copy: Path, tmp_path: Path) -> None:
    compose = _load_build_module("compose_wheel")
    errors = _load_build_module("errors")
    upstream = _load_build_module("upstream")
    expected = upstream.UPSTREAM_WHEEL_SHA256[upstream_copy.name]
    with upstream_copy.open("ab") as stream:
        stream.write(b"corrupted")
    actual = upstream.sha256_of(upstream_copy)
    with pytest.raises(errors.HashMismatchError) as caught:
        compose.compose_wheel(upstream_copy, REPO_ROOT, [PATCH_FILE], tmp_path / "out")
    message = str(caught.value)
    assert expected in message and actual in message and upstream_copy.name in message
    assert not (tmp_path / "out").exists()


def test_patch_with_failing_hunk_names_file_and_hunk(upstream_copy: Path, tmp_path: Path) -> None:
    compose = _load_build_module("compose_wheel")
    errors = _load_build_module("errors")
    original = PATCH_FILE.read_text(encoding="utf-8")
    broken_line = "-        self.optimizer.load_state_dict(\n"
    assert broken_line in original
    broken = tmp_path / PATCH_FILE.name
    broken.write_text(
        original.replace(broken_line, "-        self.optimizer.load_state_dict_NOT_UPSTREAM(\n"),
        encoding="utf-8",
    )
    with pytest.raises(errors.PatchError) as caught:
        compose.compose_wheel(upstream_copy, REPO_ROOT, [broken], tmp_path / "out")
    message = str(caught.value)
    assert PATCH_FILE.name in message
    assert DISTRIB_OPTIMIZER in message
    assert "hunk #3 FAILED" in message and "hunk #1" not in message and "hunk #2" not in message
    assert not (tmp_path / "out").exists()


def test_repository_file_colliding_with_upstream_is_rejected(
    upstream_copy: Path, tmp_path: Path
) -> None:
    compose = _load_build_module("compose_wheel")
    errors = _load_build_module("errors")
    source = tmp_path / "source"
    ours = source / "megatron" / "core" / "optimizer" / "state_adoption" / "__init__.py"
    ours.parent.mkdir(parents=True)
    ours.write_text("", encoding="utf-8")
    colliding = source / "megatron" / "core" / "optimizer" / "optimizer.py"
    colliding.write_text("# not upstream's\n", encoding="utf-8")
    with pytest.raises(errors.OverlayCollisionError) as caught:
        compose.compose_wheel(upstream_copy, source, [PATCH_FILE], tmp_path / "out")
    message = str(caught.value)
    assert "megatron/core/optimizer/optimizer.py" in message
    assert "state_adoption" not in message
    assert not (tmp_path / "out").exists()


def test_composition_succeeds_on_pristine_inputs(upstream_copy: Path, tmp_path: Path) -> None:
    compose = _load_build_module("compose_wheel")
    wheel = compose.compose_wheel(upstream_copy, REPO_ROOT, [PATCH_FILE], tmp_path / "out")
    upstream_tags = upstream_copy.name.split("-", 2)[2]
    assert wheel.name == f"megatron_core-{EXPECTED_VERSION}-{upstream_tags}"
    dist_info = f"megatron_core-{EXPECTED_VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as composed, zipfile.ZipFile(upstream_copy) as original:
        names = set(composed.namelist())
        ours = {f"megatron/{p.relative_to(REPO_ROOT / 'megatron').as_posix()}"
                for p in (REPO_ROOT / "megatron").rglob("*.py") if "__pycache__" not in p.parts}
        assert ours and ours <= names
        upstream_files = {n for n in original.namelist() if not n.endswith("/")}
        assert {n for n in upstream_files if ".dist-info/" not in n} <= names
        patched = composed.read(DISTRIB_OPTIMIZER).decode()
        assert "inner_state_dict = export_inner_optimizer_state_dict(self)" in patched
        metadata = composed.read(f"{dist_info}/METADATA").decode()
        assert f"\nVersion: {EXPECTED_VERSION}\n" in metadata
        with composed.open(f"{dist_info}/RECORD") as record_file:
            record = list(csv.reader(io.TextIOWrapper(record_file, encoding="utf-8")))
        assert {row[0] for row in record} == names
        for path, digest, size in record:
            if path == f"{dist_info}/RECORD":
                continue
            data = composed.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert (digest, int(size)) == (f"sha256={expected.decode()}", len(data)), path


# metadata conversion used by setup.py (no upstream wheel needed)


def test_requires_dist_markers_convert_to_setuptools_form() -> None:
    requirements = _load_build_module("requirements")
    errors = _load_build_module("errors")
    metadata = (
        "Metadata-Version: 2.4\nName: x\nVersion: 1\nRequires-Python: >=3.12\n"
        "Requires-Dist: numpy\n"
        'Requires-Dist: pywin32; sys_platform == "win32"\n'
        "Provides-Extra: dev\n"
        'Requires-Dist: a[b]>=1; (sys_platform != "darwin" or python_version < "3.13") '
        'and extra == "dev"\n'
        'Requires-Dist: c~=0.8; extra == "dev"\n'
        "Provides-Extra: empty\n\nbody\n"
    )
    converted = requirements.requirements_from_metadata(metadata)
    assert converted.python_requires == ">=3.12"
    assert converted.install_requires == ["numpy", 'pywin32; sys_platform == "win32"']
    assert converted.extras_require == {
        # the condition becomes the whole marker; setuptools re-adds it as "(cond) and extra"
        "dev": ['a[b]>=1; sys_platform != "darwin" or python_version < "3.13"', "c~=0.8"],
        "empty": [],
    }
    for marker in ('python_version < "3" or extra == "dev"', 'extra == "dev" and os_name == "nt"'):
        with pytest.raises(errors.MetadataError, match="cannot convert"):
            requirements.requirements_from_metadata(
                f"Name: x\nProvides-Extra: dev\nRequires-Dist: a; {marker}\n"
            )
