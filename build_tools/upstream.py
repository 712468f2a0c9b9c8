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

from packaging.tags import Tag, sys_tags
from packaging.utils import parse_wheel_filename

from .errors import HashMismatchError, MetadataError, ToolMissingError, UpstreamFetchError
from .releases import (
    ALL_PINNED_WHEELS,
    DIST_NAME,
    PINNED_WHEELS,
    UPSTREAM_WHEEL_ENV,
    release_of_wheel,
    select_upstream_version,
    wheel_file_problem,
)


def sha256_of(path: Path) -> str:
    """Return the hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, pinned: Mapping[str, str] = ALL_PINNED_WHEELS) -> None:
    """Check ``path`` against the sha256 pinned for its file name; raise on any difference."""
    expected = pinned.get(path.name)
    if expected is None:
        release_prefix = "-".join(path.name.split("-")[:2]) + "-"
        same_release = sorted(name for name in pinned if name.startswith(release_prefix))
        raise HashMismatchError(
            f"no sha256 is pinned for {path.name} ({path}); only the cp312/cp313 wheels of "
            "the supported releases are pinned (Python >= 3.12); pinned "
            + ("for this release: " if same_release else "files: ")
            + ", ".join(same_release or sorted(pinned))
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


def cached_upstream_wheel(cache_dir: Path, version: str) -> Path | None:
    """Return the cached wheel of release ``version`` for this interpreter, or None."""
    name = _pinned_wheel_for(list(sys_tags()), PINNED_WHEELS[version])
    if name is None:
        return None
    candidate = cache_dir / name
    return candidate if candidate.is_file() else None


def _pip_download(dest: Path, version: str) -> Path:
    """Run this interpreter's pip to download the release's wheel into ``dest``; return it."""
    command = [
        sys.executable, "-m", "pip", "download", f"{DIST_NAME}=={version}",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        if "No module named pip" in result.stderr:
            raise ToolMissingError(
                f"pip is not importable by {sys.executable}; cannot fetch "
                f"{DIST_NAME}=={version} (set {UPSTREAM_WHEEL_ENV} to a local copy)"
            )
        raise UpstreamFetchError(
            f"'{' '.join(command)}' failed (exit {result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise UpstreamFetchError(f"pip download left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def fetch_upstream_wheel(cache_dir: Path, version: str) -> Path:
    """Download release ``version`` with pip, hash-check it and move it into ``cache_dir``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as scratch:
        downloaded = _pip_download(Path(scratch), version)
        verify_sha256(downloaded, PINNED_WHEELS[version])
        target = cache_dir / downloaded.name
        shutil.move(downloaded, target)
    return target


def ensure_upstream_wheel(
    cache_dir: Path, version: str | None = None, environ: Mapping[str, str] | None = None
) -> Path:
    """Return a hash-checked upstream wheel: ``$MCORE_UPSTREAM_WHEEL``, the cache, or pip.

    ``version`` defaults to the release the environment selects (see
    ``releases.select_upstream_version``); ``$MCORE_UPSTREAM_WHEEL`` must be a wheel of it.
    """
    env = os.environ if environ is None else environ
    if version is None:
        version = select_upstream_version(env)
    override = env.get(UPSTREAM_WHEEL_ENV, "").strip()
    if override:
        problem = wheel_file_problem(override)
        if problem is not None:
            raise UpstreamFetchError(problem)
        path = Path(override).expanduser().resolve()
        if release_of_wheel(path) != version:
            raise UpstreamFetchError(
                f"{UPSTREAM_WHEEL_ENV}={override} is not a megatron-core {version} wheel"
            )
        verify_sha256(path, PINNED_WHEELS[version])
        return path
    cached = cached_upstream_wheel(cache_dir, version)
    if cached is not None:
        verify_sha256(cached, PINNED_WHEELS[version])
        return cached
    return fetch_upstream_wheel(cache_dir, version)


def read_wheel_metadata(wheel: Path) -> str:
    """Return the text of the ``METADATA`` file inside ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise MetadataError(f"{wheel} has {len(names)} .dist-info/METADATA files, expected 1")
        return archive.read(names[0]).decode("utf-8")
