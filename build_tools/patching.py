"""Apply unified-diff patches to a directory tree with GNU ``patch``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from .errors import PatchError, ToolMissingError

PATCH_OPTIONS: Final = (
    "-p1", "--fuzz=0", "--batch", "--forward", "--no-backup-if-mismatch",
    "--reject-file=-", "--quoting-style=literal",
)

_FILE_LINE: Final = re.compile(r"^(?:checking|patching) file (?P<path>.+)$")
_HUNK_FAILED: Final = re.compile(r"^Hunk #(?P<number>\d+) FAILED at (?P<line>\d+)")
_NO_FILE: Final = "can't find file to patch"
#: A patch whose first line is ``Releases: <PEP 440 specifier>`` applies only to the upstream
#: releases the specifier contains (GNU patch skips the line as leading text); a patch without
#: it applies to every release.
RELEASES_HEADER: Final = "Releases: "
_REVERSED: Final = "Reversed (or previously applied) patch detected"


def find_gnu_patch() -> str:
    """Return the path of GNU ``patch``; raise ToolMissingError if it is absent or not GNU."""
    executable = shutil.which("patch")
    if executable is None:
        raise ToolMissingError(
            "GNU patch is required to build this wheel but 'patch' is not on PATH "
            "(install it, e.g. 'apt-get install patch')"
        )
    result = subprocess.run(
        [executable, "--version"], capture_output=True, text=True, check=False
    )
    if "GNU patch" not in result.stdout:
        raise ToolMissingError(f"{executable} is not GNU patch: {result.stdout.strip()!r}")
    return executable


def _failures_by_file(output: str) -> dict[str, list[str]]:
    """Map each file named in GNU patch output to the problems reported for it."""
    failures: dict[str, list[str]] = {}
    current = "<unknown file>"
    for line in output.splitlines():
        if match := _FILE_LINE.match(line):
            current = match["path"]
        elif match := _HUNK_FAILED.match(line):
            failures.setdefault(current, []).append(
                f"hunk #{match['number']} FAILED at {match['line']}"
            )
        elif line.startswith(_REVERSED):
            failures.setdefault(current, []).append("reversed or already applied")
    return failures


def _describe_failure(patch_file: Path, returncode: int, output: str) -> str:
    """Build the error message for a patch that GNU patch refused."""
    failures = _failures_by_file(output)
    if failures and _NO_FILE not in output:
        return "; ".join(
            f"patch {patch_file.name} does not apply to {target}: {', '.join(problems)}"
            for target, problems in failures.items()
        )
    return f"patch {patch_file.name} does not apply (GNU patch exit {returncode}):\n{output}"


def _run_patch(executable: str, tree: Path, patch_file: Path, dry_run: bool) -> None:
    """Run GNU patch once on ``tree``; raise PatchError naming file and hunks on failure."""
    command = [executable, *PATCH_OPTIONS, "-d", str(tree), "-i", str(patch_file.resolve())]
    if dry_run:
        command.append("--dry-run")
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "LC_ALL": "C"},
    )
    output = result.stdout + result.stderr
    if result.returncode != 0 or _failures_by_file(output):
        raise PatchError(_describe_failure(patch_file, result.returncode, output))


def apply_patches(tree: Path, patch_files: Sequence[Path]) -> None:
    """Apply ``patch_files`` in order to ``tree``, each checked with a dry run first.

    A patch is applied only after its own dry run succeeded against the tree as left by
    the patches before it, so no patch is ever half-applied; patches that stack on the
    same file work. Callers compose into a scratch tree that they discard on failure.
    """
    executable = find_gnu_patch()
    for patch_file in patch_files:
        _run_patch(executable, tree, patch_file, dry_run=True)
        _run_patch(executable, tree, patch_file, dry_run=False)


def patch_releases(patch_file: Path) -> SpecifierSet:
    """Return the upstream releases ``patch_file`` applies to (its ``Releases:`` line; all if
    it has none). Raise PatchError for a line that is not a PEP 440 specifier."""
    first_line = patch_file.read_text(encoding="utf-8").split("\n", 1)[0]
    if not first_line.startswith(RELEASES_HEADER):
        return SpecifierSet()
    try:
        return SpecifierSet(first_line.removeprefix(RELEASES_HEADER))
    except InvalidSpecifier as error:
        raise PatchError(f"{patch_file.name}: {first_line!r} is not a release specifier") from error


def find_patches(patches_dir: Path, release: str) -> list[Path]:
    """Return the ``*.patch`` files of ``patches_dir`` that apply to upstream ``release``, in
    sorted order (empty if none)."""
    found = sorted(patches_dir.glob("*.patch")) if patches_dir.is_dir() else []
    return [patch for patch in found if patch_releases(patch).contains(release, prereleases=True)]
