"""Compose the ``megatron-core`` wheel: upstream wheel + patches + this repository's files.

Unpacking and repacking go through the ``wheel`` package's ``unpack``/``pack`` commands,
which keep file modes and regenerate ``RECORD`` (sha256 and size of every file).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from packaging.utils import canonicalize_name, parse_wheel_filename

from .errors import ComposeError, MetadataError, OverlayCollisionError, ToolMissingError
from .patching import apply_patches
from .releases import DIST_NAME, local_version, release_of_wheel
from .upstream import verify_sha256

#: Top-level directory of this repository whose files are added to the wheel.
OVERLAY_TOP: Final = "megatron"
_SKIPPED_DIRS: Final = frozenset({"__pycache__"})
_SKIPPED_SUFFIXES: Final = (".pyc", ".pyo")


def collect_overlay_files(source_root: Path) -> list[str]:
    """Return the wheel paths (posix, relative) of all files under ``source_root/megatron``."""
    top = source_root / OVERLAY_TOP
    files: list[str] = []
    for directory, subdirs, names in os.walk(top):
        subdirs[:] = sorted(
            d for d in subdirs
            if d not in _SKIPPED_DIRS and not d.startswith(".") and not d.endswith(".egg-info")
        )
        for name in sorted(names):
            if name.endswith(_SKIPPED_SUFFIXES) or name.startswith("."):
                continue
            files.append((Path(directory) / name).relative_to(source_root).as_posix())
    return files


def check_no_collisions(upstream_wheel: Path, overlay_files: Sequence[str]) -> None:
    """Raise OverlayCollisionError if any overlay file is already shipped by upstream."""
    with zipfile.ZipFile(upstream_wheel) as archive:
        shipped = set(archive.namelist())
    collisions = sorted(set(overlay_files) & shipped)
    if collisions:
        raise OverlayCollisionError(
            f"{len(collisions)} file(s) of this repository would overwrite files that "
            f"{upstream_wheel.name} ships (change upstream files through patches/ instead): "
            + ", ".join(collisions)
        )


def _run_wheel_tool(*args: str) -> None:
    """Run ``python -m wheel ARGS`` with this interpreter; raise ComposeError on failure."""
    if importlib.util.find_spec("wheel") is None:
        raise ToolMissingError(
            f"the 'wheel' package is required but not importable by {sys.executable} "
            "(pip install 'wheel>=0.43')"
        )
    command = [sys.executable, "-m", "wheel", *args]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ComposeError(
            f"'{' '.join(command)}' failed (exit {result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )


def unpack_wheel(wheel: Path, dest: Path) -> Path:
    """Unpack ``wheel`` (RECORD-checked, modes kept) under ``dest``; return the tree root."""
    _run_wheel_tool("unpack", "--dest", str(dest), str(wheel))
    roots = [p for p in dest.iterdir() if p.is_dir()]
    if len(roots) != 1:
        raise ComposeError(f"wheel unpack of {wheel.name} produced {len(roots)} directories")
    return roots[0]


def copy_overlay(source_root: Path, overlay_files: Sequence[str], tree: Path) -> None:
    """Copy each overlay file from ``source_root`` to the same relative path in ``tree``."""
    for relative in overlay_files:
        target = tree / relative
        if target.exists():
            raise OverlayCollisionError(f"{relative} already exists in the composed tree")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_root / relative, target)


def _dist_info_stem(version: str) -> str:
    """Return the ``name-version`` stem of the dist-info directory for ``version``."""
    return f"{canonicalize_name(DIST_NAME).replace('-', '_')}-{version}"


def _set_metadata_version(metadata: Path, old: str, new: str) -> None:
    """Replace the single ``Version: old`` header of ``metadata`` by ``Version: new``."""
    text = metadata.read_text(encoding="utf-8")
    headers, separator, body = text.partition("\n\n")
    lines = headers.split("\n")
    hits = [i for i, line in enumerate(lines) if line.startswith("Version:")]
    if len(hits) != 1 or lines[hits[0]].split(":", 1)[1].strip() != old:
        raise MetadataError(f"{metadata} has no single 'Version: {old}' header")
    lines[hits[0]] = f"Version: {new}"
    metadata.write_text("\n".join(lines) + separator + body, encoding="utf-8")


def set_local_version(tree: Path, upstream_version: str) -> None:
    """Rename the dist-info (and any .data) directory and set METADATA's Version."""
    new_version = local_version(upstream_version)
    old_stem, new_stem = _dist_info_stem(upstream_version), _dist_info_stem(new_version)
    dist_info = tree / f"{old_stem}.dist-info"
    if not dist_info.is_dir():
        raise MetadataError(f"upstream wheel has no {dist_info.name} directory")
    _set_metadata_version(dist_info / "METADATA", upstream_version, new_version)
    dist_info.rename(tree / f"{new_stem}.dist-info")
    data_dir = tree / f"{old_stem}.data"
    if data_dir.is_dir():
        data_dir.rename(tree / f"{new_stem}.data")


def pack_wheel(tree: Path, out_dir: Path, upstream_wheel: Path, expected_version: str) -> Path:
    """Pack ``tree`` into ``out_dir``; check the name, ``expected_version`` and upstream's tags."""
    with tempfile.TemporaryDirectory(prefix="mcore-pack-") as scratch:
        _run_wheel_tool("pack", "--dest-dir", scratch, str(tree))
        built = sorted(Path(scratch).glob("*.whl"))
        if len(built) != 1:
            raise ComposeError(f"wheel pack produced {len(built)} wheels, expected 1")
        name, version, _, tags = parse_wheel_filename(built[0].name)
        expected_tags = parse_wheel_filename(upstream_wheel.name)[3]
        if name != canonicalize_name(DIST_NAME) or str(version) != expected_version or (
            tags != expected_tags
        ):
            raise ComposeError(f"unexpected composed wheel name {built[0].name}")
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / built[0].name
        shutil.move(built[0], target)
    return target


def compose_wheel(
    upstream_wheel: Path, source_root: Path, patch_files: Sequence[Path], out_dir: Path
) -> Path:
    """Build the composed wheel in ``out_dir`` and return its path.

    Steps: hash-check ``upstream_wheel`` against the pinned sha256 (which also makes it a
    supported release; its version comes from its file name); refuse any file of
    ``source_root/megatron`` that upstream already ships; unpack; apply ``patch_files`` in
    order; add the repository files; set the local version ``X+stateadoption``; repack
    (new RECORD).
    """
    verify_sha256(upstream_wheel)
    upstream_version = release_of_wheel(upstream_wheel)
    overlay_files = collect_overlay_files(source_root)
    check_no_collisions(upstream_wheel, overlay_files)
    with tempfile.TemporaryDirectory(prefix="mcore-compose-") as scratch:
        tree = unpack_wheel(upstream_wheel, Path(scratch))
        apply_patches(tree, patch_files)
        copy_overlay(source_root, overlay_files, tree)
        set_local_version(tree, upstream_version)
        return pack_wheel(tree, out_dir, upstream_wheel, local_version(upstream_version))
