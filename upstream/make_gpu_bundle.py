"""Pack what upstream/run-unit-tests.sh needs from a Megatron-LM snapshot, per branch.

For each branch recorded in upstream/series.json this writes
``.gpu-mlm/megatron-lm-<branch>.tar.gz`` (not committed: it holds Megatron-LM's code) with

* from the snapshot commit recorded in series.json: ``megatron/``, ``tests/__init__.py``,
  ``tests/unit_tests/`` (the test files, their conftest.py files and the shared utilities they
  import), ``tests/test_utils/python_scripts/download_unit_tests_dataset.py`` (imported by
  ``tests/unit_tests/conftest.py``), ``pyproject.toml`` (pytest's options and markers) and
  ``docs/api-guide/core/index.md`` (the docs patch adds a line to it, so the whole series applies);
* ``upstream-series/*.patch``: the series for that branch, built here from the current sources at
  that commit by upstream/build_series.py (without the cover letter, which ``git apply`` cannot
  take), applied by the runner for the "with" variant.

Usage: python upstream/make_gpu_bundle.py --git-dir MIRROR.git [--out .gpu-mlm]
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import build_series  # type: ignore[import-not-found]  # upstream/, next to this file

REPO_ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT_PATHS = (
    "megatron",
    "tests/__init__.py",
    "tests/unit_tests",
    "tests/test_utils/python_scripts/download_unit_tests_dataset.py",
    "pyproject.toml",
    "docs/api-guide/core/index.md",
)


def bundle(git_dir: Path, branch: str, commit: str, patches: Sequence[Path], out: Path) -> Path:
    """Write the bundle of ``branch`` at ``commit`` with ``patches`` into ``out``; return its path."""
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", "--format=tar", commit, *SNAPSHOT_PATHS],
        check=True,
        capture_output=True,
    ).stdout
    target = out / f"megatron-lm-{branch}.tar.gz"
    with tarfile.open(target, "w:gz", compresslevel=9) as packed:
        with tarfile.open(fileobj=io.BytesIO(archive)) as snapshot:
            for member in snapshot.getmembers():
                packed.addfile(member, snapshot.extractfile(member) if member.isfile() else None)
        for patch in build_series.code_patches(patches):
            packed.add(patch, arcname=f"upstream-series/{patch.name}")
        info = tarfile.TarInfo("SNAPSHOT_COMMIT")
        data = f"{branch} {commit}\n".encode()
        info.size = len(data)
        packed.addfile(info, io.BytesIO(data))
    return target


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Build the series of every branch of upstream/series.json and bundle it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git-dir", type=Path, required=True, help="bare Megatron-LM clone")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".gpu-mlm")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for branch, entry in sorted(build_series.manifest().items()):
        commit = str(entry["snapshot_commit"])
        snapshot = build_series.Snapshot.from_git_dir(args.git_dir, branch, commit)
        with tempfile.TemporaryDirectory() as scratch:
            patches = build_series.build(snapshot, Path(scratch))
            path = bundle(args.git_dir, branch, commit, patches, args.out)
        print(
            f"{path} {path.stat().st_size / 2**20:.1f} MiB ({branch} @ {entry['snapshot_commit']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
