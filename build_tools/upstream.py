"""Locate, fetch, cache and hash-check the upstream ``megatron-core`` wheel."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from packaging.tags import Tag, sys_tags
from packaging.utils import parse_wheel_filename

from .errors import HashMismatchError, MetadataError, ToolMissingError, UpstreamFetchError

DIST_NAME: Final = "megatron-core"
UPSTREAM_VERSION: Final = "0.19.2"
LOCAL_VERSION_LABEL: Final = "stateadoption"
LOCAL_VERSION: Final = f"{UPSTREAM_VERSION}+{LOCAL_VERSION_LABEL}"

#: Environment variable naming a local copy of the upstream wheel (offline builds).
UPSTREAM_WHEEL_ENV: Final = "MCORE_UPSTREAM_WHEEL"

#: Every file the package index serves for megatron-core 0.19.2 as a wheel, with its sha256.
UPSTREAM_WHEEL_SHA256: Final[Mapping[str, str]] = {
    "megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl": (
        "8e3e486f13f559450415b9b9dc0ff3331a0bb83dd154553f7f350a75ff9c42b5"
    ),
    "megatron_core-0.19.2-cp313-cp313-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl": (
        "10c70ab5273457f3c8232e35bc18633aa20abc6f6ac2d190914acd6323537826"
    ),
    "megatron_core-0.19.2-cp312-cp312-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl": (
        "e1717c0cdb7669d2112c3f3d80a2e748d2721b4798044d750cab5a3b2dffe38f"
    ),
    "megatron_core-0.19.2-cp313-cp313-manylinux_2_24_aarch64.manylinux_2_28_aarch64.whl": (
        "346872950e729433c9477c59b5456b859fb7e457a1c0bb39c0c771c302a1d1ea"
    ),
}


def sha256_of(path: Path) -> str:
    """Return the hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, pinned: Mapping[str, str] = UPSTREAM_WHEEL_SHA256) -> None:
    """Check ``path`` against the sha256 pinned for its file name; raise on any difference."""
    expected = pinned.get(path.name)
    if expected is None:
        raise HashMismatchError(
            f"no sha256 is pinned for {path.name} ({path}); pinned files: {', '.join(sorted(pinned))}"
        )
    actual = sha256_of(path)
    if actual != expected:
        raise HashMismatchError(
            f"sha256 mismatch for {path}: expected {expected}, actual {actual}"
        )


def _pinned_wheel_for(tags: list[Tag], pinned: Mapping[str, str]) -> str | None:
    """Return the pinned wheel name that best matches ``tags`` (most preferred first)."""
    rank = {tag: index for index, tag in enumerate(tags)}
    best: tuple[int, str] | None = None
    for name in pinned:
        wheel_tags = parse_wheel_filename(name)[3]
        score = min((rank[tag] for tag in wheel_tags if tag in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, name)
    return None if best is None else best[1]


def cached_upstream_wheel(cache_dir: Path) -> Path | None:
    """Return the cached upstream wheel for this interpreter, or None if it is not cached."""
    name = _pinned_wheel_for(list(sys_tags()), UPSTREAM_WHEEL_SHA256)
    if name is None:
        return None
    candidate = cache_dir / name
    return candidate if candidate.is_file() else None


def _pip_download(dest: Path) -> Path:
    """Run this interpreter's pip to download the upstream wheel into ``dest``; return it."""
    command = [
        sys.executable, "-m", "pip", "download", f"{DIST_NAME}=={UPSTREAM_VERSION}",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        if "No module named pip" in result.stderr:
            raise ToolMissingError(
                f"pip is not importable by {sys.executable}; cannot fetch "
                f"{DIST_NAME}=={UPSTREAM_VERSION} (set {UPSTREAM_WHEEL_ENV} to a local copy)"
            )
        raise UpstreamFetchError(
            f"'{' '.join(command)}' failed (exit {result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise UpstreamFetchError(f"pip download left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def fetch_upstream_wheel(cache_dir: Path) -> Path:
    """Download the upstream wheel with pip, hash-check it and move it into ``cache_dir``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as scratch:
        downloaded = _pip_download(Path(scratch))
        verify_sha256(downloaded)
        target = cache_dir / downloaded.name
        shutil.move(downloaded, target)
    return target


def ensure_upstream_wheel(cache_dir: Path) -> Path:
    """Return a hash-checked upstream wheel: ``$MCORE_UPSTREAM_WHEEL``, the cache, or pip."""
    override = os.environ.get(UPSTREAM_WHEEL_ENV)
    if override:
        path = Path(override).expanduser().resolve()
        if not path.is_file():
            raise UpstreamFetchError(f"{UPSTREAM_WHEEL_ENV}={override} is not a file")
        verify_sha256(path)
        return path
    cached = cached_upstream_wheel(cache_dir)
    if cached is not None:
        verify_sha256(cached)
        return cached
    return fetch_upstream_wheel(cache_dir)


def read_wheel_metadata(wheel: Path) -> str:
    """Return the text of the ``METADATA`` file inside ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise MetadataError(f"{wheel} has {len(names)} .dist-info/METADATA files, expected 1")
        return archive.read(names[0]).decode("utf-8")
