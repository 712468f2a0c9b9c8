"""Tests of the composed ``megatron-core`` wheel, of release selection and of the composition.

The installed-wheel tests need this repository's wheel installed (built for the release the
environment selects, by default the newest). The composition tests need the selected
upstream wheel: ``$MCORE_UPSTREAM_WHEEL`` if set, else the build cache ``build/upstream/``
(filled by ``pip install .``), else they are skipped. The per-release tests compose every
supported release; they take each upstream wheel from the cache or download it with pip into
the cache, and are skipped, saying why, only when that fails outside CI (``$CI`` unset).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import os
import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCH_FILE = (
    REPO_ROOT / "patches" / "0001-distrib-optimizer-route-inner-load-through-state-adoption.patch"
)
DISTRIB_OPTIMIZER = "megatron/core/optimizer/distrib_optimizer.py"
OPTIMIZER_CONFIG = "megatron/core/optimizer/optimizer_config.py"
OPTIMIZER = "megatron/core/optimizer/optimizer.py"
MLP = "megatron/core/transformer/mlp.py"
TRANSFORMER_UTILS = "megatron/core/transformer/utils.py"
UPSTREAM_CACHE_DIR = REPO_ROOT / "build" / "upstream"
SUPPORTED = ("0.16.1", "0.17.1", "0.18.2", "0.19.0", "0.19.2")


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


def _selected_version() -> str:
    """The upstream release this environment builds (what 'pip install .' would use)."""
    return str(_load_build_module("releases").select_upstream_version(os.environ))


def _expected_local_version() -> str:
    return f"{_selected_version()}+stateadoption"


def _upstream_wheel() -> Path:
    """Return the upstream wheel from $MCORE_UPSTREAM_WHEEL or the build cache, else skip."""
    releases = _load_build_module("releases")
    override = os.environ.get(releases.UPSTREAM_WHEEL_ENV)
    if override:
        return Path(override)
    cached = _load_build_module("upstream").cached_upstream_wheel(
        UPSTREAM_CACHE_DIR, _selected_version()
    )
    if cached is None:
        pytest.skip(
            f"upstream megatron-core wheel not available: set {releases.UPSTREAM_WHEEL_ENV} "
            "or run 'pip install .' first to fill build/upstream/"
        )
    return Path(cached)


def _release_wheel(version: str) -> Path:
    """The hash-checked upstream wheel of ``version`` (cache or pip download).

    Outside CI a failed download skips the test with the reason; in CI it fails the test.
    """
    upstream = _load_build_module("upstream")
    errors = _load_build_module("errors")
    try:
        return Path(upstream.ensure_upstream_wheel(UPSTREAM_CACHE_DIR, version, environ={}))
    except (errors.UpstreamFetchError, errors.ToolMissingError) as error:
        message = f"megatron-core {version} wheel neither cached nor downloadable: {error}"
        if os.environ.get("CI", "").lower() in ("", "0", "false", "no"):
            pytest.skip(message)
        pytest.fail(message)


def _state_adoption_imports(source: str) -> set[str]:
    """Names a module's source imports from ``megatron.core.optimizer.state_adoption``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (
            (node.level == 0 and node.module == "megatron.core.optimizer.state_adoption")
            or (node.level == 1 and node.module == "state_adoption")
        ):
            names.update(alias.name for alias in node.names)
    return names


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
    assert _installed_distribution().version == _expected_local_version()


def test_installed_distrib_optimizer_is_patched() -> None:
    path = Path(str(_installed_distribution().locate_file(DISTRIB_OPTIMIZER)))
    text = path.read_text(encoding="utf-8")
    assert {"export_inner_optimizer_state_dict", "load_inner_optimizer_state_dict"} <= set(
        _state_adoption_imports(text)
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
    expected = _load_build_module("releases").ALL_PINNED_WHEELS[upstream_copy.name]
    with upstream_copy.open("ab") as stream:
        stream.write(b"corrupted")
    actual = upstream.sha256_of(upstream_copy)
    with pytest.raises(errors.HashMismatchError) as caught:
        compose.compose_wheel(upstream_copy, REPO_ROOT, [PATCH_FILE], tmp_path / "out")
    message = str(caught.value)
    assert expected in message and actual in message and upstream_copy.name in message
    assert not (tmp_path / "out").exists()


def test_patches_apply_to_the_releases_their_first_line_names(tmp_path: Path) -> None:
    patching = _load_build_module("patching")
    errors = _load_build_module("errors")
    body = PATCH_FILE.read_text(encoding="utf-8")
    (tmp_path / "0001-all.patch").write_text(body, encoding="utf-8")
    (tmp_path / "0002-new.patch").write_text("Releases: >=0.18\n" + body, encoding="utf-8")
    (tmp_path / "0003-old.patch").write_text("Releases: <0.18\n" + body, encoding="utf-8")
    names = lambda release: [p.name for p in patching.find_patches(tmp_path, release)]  # noqa: E731
    assert names("0.17.1") == ["0001-all.patch", "0003-old.patch"]
    assert names("0.18.2") == names("0.19.2") == ["0001-all.patch", "0002-new.patch"]
    # every supported release gets the shared merge's patch or the nested one, never both
    real = REPO_ROOT / "patches"
    for version in SUPPORTED:
        chosen = {p.name for p in patching.find_patches(real, version)}
        merges = {name for name in chosen if "merge" in name}
        assert len(merges) == 1, (version, chosen)
    (tmp_path / "0004-bad.patch").write_text("Releases: newest\n" + body, encoding="utf-8")
    with pytest.raises(errors.PatchError, match="0004-bad.patch: 'Releases: newest'"):
        patching.find_patches(tmp_path, "0.19.2")


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
    hunk = original[: original.index(broken_line)].count("\n@@ ")
    message = str(caught.value)
    assert PATCH_FILE.name in message
    assert DISTRIB_OPTIMIZER in message
    assert re.findall(r"hunk #(\d+)", message) == [str(hunk)] and "FAILED" in message
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
    expected_version = _expected_local_version()
    assert wheel.name == f"megatron_core-{expected_version}-{upstream_tags}"
    dist_info = f"megatron_core-{expected_version}.dist-info"
    with zipfile.ZipFile(wheel) as composed, zipfile.ZipFile(upstream_copy) as original:
        names = set(composed.namelist())
        ours = {f"megatron/{p.relative_to(REPO_ROOT / 'megatron').as_posix()}"
                for p in (REPO_ROOT / "megatron").rglob("*.py") if "__pycache__" not in p.parts}
        assert ours and ours <= names
        upstream_files = {n for n in original.namelist() if not n.endswith("/")}
        assert {n for n in upstream_files if ".dist-info/" not in n} <= names
        patched = composed.read(DISTRIB_OPTIMIZER).decode()
        assert "load_inner_optimizer_state_dict" in _state_adoption_imports(patched)
        assert "inner_state_dict = export_inner_optimizer_state_dict(self)" in patched
        metadata = composed.read(f"{dist_info}/METADATA").decode()
        assert f"\nVersion: {expected_version}\n" in metadata
        with composed.open(f"{dist_info}/RECORD") as record_file:
            record = list(csv.reader(io.TextIOWrapper(record_file, encoding="utf-8")))
        assert {row[0] for row in record} == names
        for path, digest, size in record:
            if path == f"{dist_info}/RECORD":
                continue
            data = composed.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert (digest, int(size)) == (f"sha256={expected.decode()}", len(data)), path


# release selection and per-release pins (no upstream wheel needed)

WHEEL_0171 = "megatron_core-0.17.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"


def test_supported_releases_and_default_is_newest() -> None:
    releases = _load_build_module("releases")
    assert releases.supported_versions() == SUPPORTED
    assert releases.DEFAULT_UPSTREAM_VERSION == SUPPORTED[-1] == "0.19.2"
    assert releases.select_upstream_version({}) == "0.19.2"
    assert releases.select_upstream_version({"MCORE_UPSTREAM_VERSION": ""}) == "0.19.2"
    assert releases.local_version("0.18.2") == "0.18.2+stateadoption"


@pytest.mark.parametrize("version", SUPPORTED)
def test_version_selected_by_environment_variable(version: str) -> None:
    releases = _load_build_module("releases")
    assert releases.UPSTREAM_VERSION_ENV == "MCORE_UPSTREAM_VERSION"
    assert releases.select_upstream_version({"MCORE_UPSTREAM_VERSION": f" {version} "}) == version


@pytest.mark.parametrize("value", ["0.15.0", "0.19.1", "0.20.0", "latest", "0.19.2+stateadoption"])
def test_unknown_version_is_refused_listing_the_supported_ones(value: str) -> None:
    releases = _load_build_module("releases")
    with pytest.raises(releases.UnsupportedReleaseError) as caught:
        releases.select_upstream_version({"MCORE_UPSTREAM_VERSION": value})
    message = str(caught.value)
    assert f"MCORE_UPSTREAM_VERSION={value}" in message and "does not support" in message
    assert "0.16.1, 0.17.1, 0.18.2, 0.19.0, 0.19.2 (default 0.19.2)" in message


def test_version_inferred_from_offline_wheel_name(tmp_path: Path) -> None:
    releases = _load_build_module("releases")
    env = {"MCORE_UPSTREAM_WHEEL": str(_empty_file(tmp_path / WHEEL_0171))}
    assert releases.select_upstream_version(env) == "0.17.1"
    assert releases.select_upstream_version({**env, "MCORE_UPSTREAM_VERSION": "0.17.1"}) == "0.17.1"
    with pytest.raises(releases.UnsupportedReleaseError, match="disagrees"):
        releases.select_upstream_version({**env, "MCORE_UPSTREAM_VERSION": "0.19.2"})
    for name, match in [
        ("megatron_core-0.15.0-cp312-cp312-manylinux_2_28_x86_64.whl", "does not support"),
        ("megatron_core-0.19.2.tar.gz", "not a wheel file name"),
        ("torch-2.6.0-cp312-cp312-manylinux_2_28_x86_64.whl", "not of megatron-core"),
    ]:
        with pytest.raises(releases.UnsupportedReleaseError, match=match):
            path = _empty_file(tmp_path / name)
            releases.select_upstream_version({"MCORE_UPSTREAM_WHEEL": str(path)})


def _empty_file(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def test_an_offline_wheel_that_is_not_there_is_named_as_missing(tmp_path: Path) -> None:
    """Existence is checked before the file name: a missing wheel is "no such file", whatever
    its name, and a directory is not taken for a wheel."""
    releases = _load_build_module("releases")
    errors = _load_build_module("errors")
    for value, reason in [
        ("/nonexistent.whl", "MCORE_UPSTREAM_WHEEL=/nonexistent.whl: no such file"),
        (str(tmp_path / WHEEL_0171), f"MCORE_UPSTREAM_WHEEL={tmp_path / WHEEL_0171}: no such file"),
        (str(tmp_path), f"MCORE_UPSTREAM_WHEEL={tmp_path}: is a directory, not a wheel file"),
    ]:
        with pytest.raises(errors.UpstreamFetchError) as caught:
            releases.select_upstream_version({"MCORE_UPSTREAM_WHEEL": value})
        assert str(caught.value) == reason


#: How pip runs setup.py: its build backend's first hook, in a process of its own.
_BACKEND_HOOK = "from setuptools import build_meta; build_meta.get_requires_for_build_wheel()"


def _build_refusal(env_changes: dict[str, str]) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("setuptools.command.bdist_wheel", reason="setup.py needs setuptools>=70.1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_UPSTREAM_")}
    return subprocess.run(
        [sys.executable, "-c", _BACKEND_HOOK], cwd=REPO_ROOT, env={**env, **env_changes},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _framed_text(output: str) -> str:
    """The text inside the one framed message ``output`` must be (a box of ``+--+`` and ``| |``
    lines of one width, nothing around it), its lines joined by spaces."""
    lines = output.strip("\n").splitlines()
    assert len(lines) >= 3 and len({len(line) for line in lines}) == 1, output
    assert lines[0] == lines[-1] == "+" + "-" * (len(lines[0]) - 2) + "+", output
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines[1:-1]), output
    return " ".join(line[2:-2].strip() for line in lines[1:-1])


@pytest.mark.parametrize(
    "make_env, expected",
    [
        (lambda t: {"MCORE_UPSTREAM_VERSION": "0.99.0"},
         "MCORE_UPSTREAM_VERSION=0.99.0 selects megatron-core '0.99.0', which this build does not "
         "support; supported releases: 0.16.1, 0.17.1, 0.18.2, 0.19.0, 0.19.2 (default 0.19.2)"),
        (lambda t: {"MCORE_UPSTREAM_WHEEL": "/nonexistent.whl"},
         "MCORE_UPSTREAM_WHEEL=/nonexistent.whl: no such file"),
        (lambda t: {"MCORE_UPSTREAM_WHEEL": str(_empty_file(t / "megatron_core.zip"))},
         "megatron_core.zip is not a wheel file name"),
    ],
    ids=["version", "wheel missing", "wheel misnamed"],
)  # fmt: skip
def test_a_refused_build_prints_one_framed_message_and_no_traceback(
    make_env: Any, expected: str, tmp_path: Path
) -> None:
    done = _build_refusal(make_env(tmp_path))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and done.stdout == "", done.stderr
    text = _framed_text(done.stderr)
    assert len(done.stderr.splitlines()[0]) <= 80  # short messages: a terminal's width
    assert text.startswith("megatron-core build refused: "), text
    assert expected in text, text


def test_the_frame_keeps_a_long_path_whole() -> None:
    errors = _load_build_module("errors")
    path = "/a/" + "b" * 90 + ".whl"
    box = errors.framed(f"MCORE_UPSTREAM_WHEEL={path}: no such file\nsecond line")
    assert _framed_text(box) == f"MCORE_UPSTREAM_WHEEL={path}: no such file second line"
    assert any(line[2:-2].strip() == f"MCORE_UPSTREAM_WHEEL={path}:" for line in box.splitlines())


def test_pip_shows_the_framed_refusal(tmp_path: Path) -> None:
    """``MCORE_UPSTREAM_VERSION=0.99.0 pip install .`` as a user runs it (offline: no index, no
    build isolation, so nothing is fetched): the box, no traceback, a non-zero exit."""
    pytest.importorskip("setuptools.command.bdist_wheel", reason="setup.py needs setuptools>=70.1")
    pytest.importorskip("pip")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MCORE_UPSTREAM_", "PIP_"))}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps",
         "--no-build-isolation", "--disable-pip-version-check", "."],
        cwd=REPO_ROOT, env={**env, "MCORE_UPSTREAM_VERSION": "0.99.0"}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Traceback" not in output, output
    assert "| megatron-core build refused:" in output, output
    assert "| MCORE_UPSTREAM_VERSION=0.99.0 selects megatron-core '0.99.0'" in output, output


def test_offline_wheel_of_another_release_or_unpinned_file_is_refused(tmp_path: Path) -> None:
    upstream = _load_build_module("upstream")
    errors = _load_build_module("errors")
    wheel = tmp_path / WHEEL_0171
    wheel.write_bytes(b"not the real wheel")
    with pytest.raises(errors.UpstreamFetchError, match="not a megatron-core 0.19.2 wheel"):
        upstream.ensure_upstream_wheel(
            tmp_path / "cache", "0.19.2", environ={"MCORE_UPSTREAM_WHEEL": str(wheel)}
        )
    with pytest.raises(errors.HashMismatchError, match="sha256 mismatch"):
        # the release comes from the file name (0.17.1), then the pinned hash is checked
        upstream.ensure_upstream_wheel(tmp_path / "c", environ={"MCORE_UPSTREAM_WHEEL": str(wheel)})
    cp311 = tmp_path / WHEEL_0171.replace("cp312", "cp311")
    cp311.write_bytes(b"")
    with pytest.raises(errors.HashMismatchError, match="no sha256 is pinned.*Python >= 3.12"):
        upstream.ensure_upstream_wheel(tmp_path / "c", environ={"MCORE_UPSTREAM_WHEEL": str(cp311)})


def test_every_release_pins_cp312_and_cp313_wheels_for_both_platforms() -> None:
    releases = _load_build_module("releases")
    platforms = (
        "manylinux_2_24_x86_64.manylinux_2_28_x86_64",
        "manylinux_2_24_aarch64.manylinux_2_28_aarch64",
    )
    for version in SUPPORTED:
        pinned = releases.PINNED_WHEELS[version]
        assert set(pinned) == {
            f"megatron_core-{version}-{tag}-{tag}-{platform}.whl"
            for tag in ("cp312", "cp313") for platform in platforms
        }
        assert all(releases.release_of_wheel(name) == version for name in pinned)
        assert all(re.fullmatch(r"[0-9a-f]{64}", digest) for digest in pinned.values())
    digests = list(releases.ALL_PINNED_WHEELS.values())
    assert len(digests) == len(set(digests)) == 4 * len(SUPPORTED)
    # the sha256 of the 0.19.2 x86_64 wheel measured on the GPU machine (docs/gpu-report.md)
    assert releases.PINNED_WHEELS["0.19.2"][
        "megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    ].startswith("8e3e486f")


# every supported release: the patches apply with --fuzz=0 and the composition succeeds
# (downloads the upstream wheels that are not cached yet)


@pytest.mark.parametrize("version", SUPPORTED)
def test_patches_apply_with_fuzz_0_and_compose_each_release(version: str, tmp_path: Path) -> None:
    patching = _load_build_module("patching")
    compose = _load_build_module("compose_wheel")
    assert "--fuzz=0" in patching.PATCH_OPTIONS
    upstream_wheel = _release_wheel(version)
    patches = patching.find_patches(REPO_ROOT / "patches", version)
    assert patches
    tree = tmp_path / "tree"
    with zipfile.ZipFile(upstream_wheel) as archive:
        for path in (DISTRIB_OPTIMIZER, OPTIMIZER_CONFIG, OPTIMIZER, MLP, TRANSFORMER_UTILS):
            archive.extract(path, tree)
    original = (tree / DISTRIB_OPTIMIZER).read_text(encoding="utf-8")
    patching.apply_patches(tree, patches)  # dry run, then apply; raises PatchError naming hunks
    patched = (tree / DISTRIB_OPTIMIZER).read_text(encoding="utf-8")
    config = (tree / OPTIMIZER_CONFIG).read_text(encoding="utf-8")
    assert patched != original
    assert "load_inner_optimizer_state_dict" in _state_adoption_imports(patched)
    assert "        self.optimizer.load_state_dict(\n            {\"state\"" not in patched
    assert "\n    optimizer_state_adoption: bool = True\n" in config
    non_distributed = (tree / OPTIMIZER).read_text(encoding="utf-8")
    assert "load_inner_optimizer_state_dict" in _state_adoption_imports(non_distributed)
    assert non_distributed.count("load_inner_optimizer_state_dict(self, state_dict") == 2
    assert "self.optimizer.load_state_dict(state_dict" not in non_distributed
    assert patched.count("load_inner_optimizer_state_dict(self, state_dict)") == 1  # Megatron-FSDP
    # the factory merge (SwiGLU's linear_fc1) returns a view of pieces read in place: nested in
    # apply_swiglu_sharded_factory up to 0.17, transformer/utils.py's shared merge since 0.18
    merge_file = MLP if Version(version) < Version("0.18") else TRANSFORMER_UTILS
    merge = (tree / merge_file).read_text(encoding="utf-8")
    assert merge.count("merged = concatenated_view(sub_state_dict)") == 1
    assert "from megatron.core.dist_checkpointing.in_place_merge import concatenated_view\n" in merge
    wheel = compose.compose_wheel(upstream_wheel, REPO_ROOT, patches, tmp_path / "out")
    assert wheel.name == upstream_wheel.name.replace(f"-{version}-", f"-{version}+stateadoption-")
    with zipfile.ZipFile(wheel) as composed:
        assert composed.read(DISTRIB_OPTIMIZER).decode("utf-8") == patched
        assert composed.read(OPTIMIZER_CONFIG).decode("utf-8") == config
        assert composed.read(OPTIMIZER).decode("utf-8") == non_distributed
        assert composed.read(merge_file).decode("utf-8") == merge


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
