# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""Megatron-LM's own lint checks on every file the Megatron-LM series adds or changes.

The settings are Megatron-LM's, committed verbatim in ``upstream/lint/`` (see its README for the
ref and blobs), and the tools are the versions that ref pins (``requirements/lint.txt``). What
Megatron-LM's linting job runs (``tools/autoformat.sh`` with ``CHECK_ONLY=true``) is applied to
the changed ``.py`` files under ``megatron/core/`` and ``tests/``: black, isort, pylint and ruff,
each run from the root of a staged tree that has Megatron-LM's layout and configuration files, so
that path rules such as pylint's ``ignore-paths=tests`` act as they do there; plus the copyright
line of ``tools/check_copyright.py`` (``# Copyright (c) <year> NVIDIA CORPORATION & AFFILIATES.
All rights reserved.``, the year of the series).

* A file the series adds must be clean. It is linted as it is in this repository
  (``megatron/core/...``, ``upstream/tests/unit_tests/...``), so a finding names the line to fix.
* A file the series changes counts only findings that its unpatched self does not have. They are
  compared by tool, code, message and subject, never by line number: a pylint message's object
  (the line's text for ``line-too-long``), a ruff finding's line text, one change block of
  black's or isort's rewrite.

The changed files come from the pinned, hash-checked upstream wheel of the newest release
(unpatched) and that wheel with ``patches/*.patch`` applied (patched), which needs only PyPI; or,
with ``--changed-from series``, from a Megatron-LM git directory: the series' base files at the
ref in ``upstream/series.json`` and the files as the series leaves them.

Usage::

    python upstream/lint_series.py                  # exit 1 on a finding the series introduces
    python upstream/lint_series.py --changed-from series --git-dir MEGATRON_LM.git
    python upstream/lint_series.py --added megatron/core/x.py=FILE \\
        --changed megatron/core/y.py=UNPATCHED,PATCHED  # lint these files instead of the series
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import build_series  # type: ignore[import-not-found]  # upstream/, next to this file
from build_tools.patching import apply_patches  # build_series puts the repository on the path
from build_tools.upstream import ensure_upstream_wheel

REPO_ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_DIR = REPO_ROOT / "upstream"
LINT_DIR = UPSTREAM_DIR / "lint"
CONFIG_FILES = (".pylintrc", "pyproject.toml")
"""Megatron-LM's configuration files that the tools read, copied to the staged tree's root."""
LINT_SCOPE = ("megatron/core/", "tests/")
"""``tools/autoformat.sh`` lints the changed ``.py`` files under these folders, nothing else."""
PACKAGE_ROOTS = ("megatron/core", "tests")
"""Every folder from these down is a regular package in Megatron-LM (it has ``__init__.py``);
without one, isort would take ``tests.unit_tests.test_utilities`` for a third-party module."""
COPYRIGHT_LINE: str = build_series.PYTHON_HEADER.splitlines()[0]
WHEEL_CACHE = REPO_ROOT / "build" / "upstream"
TOOLS_PYTHON_ENV = "MEGATRON_LM_LINT_PYTHON"
"""The interpreter that runs the tools (default: this one). Megatron-LM's linting job has only the
lint tools installed (``uv sync --only-group linting``): an environment without torch is both
faster (pylint's inference stops at a missing import) and what upstream's results come from."""

OUT_OF_SCOPE = "outside Megatron-LM's lint scope (.py files under megatron/core/ and tests/)"


class LintError(RuntimeError):
    """A lint tool failed to run, or the files to lint could not be produced."""


@dataclass(frozen=True)
class LintInput:
    """One file of the series.

    Attributes:
        path: its path in Megatron-LM.
        after: its content in the series.
        before: its unpatched content; None for a file the series adds.
        origin: where ``after`` comes from, as findings name it.
    """

    path: str
    after: str
    before: str | None
    origin: str


@dataclass(frozen=True)
class Finding:
    """One lint finding.

    Attributes:
        path: the file's path in Megatron-LM.
        line: the line it is on (1-based; not compared).
        tool: ``black``, ``isort``, ``pylint``, ``ruff`` or ``copyright``.
        code: the tool's code for it.
        message: what is wrong, without a line number.
        subject: what it is about, compared with the unpatched file's findings.
    """

    path: str
    line: int
    tool: str
    code: str
    message: str
    subject: str

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        """What a finding of the patched file is matched on in the unpatched one."""
        return (self.path, self.tool, self.code, self.message, self.subject)


@dataclass
class Report:
    """The outcome of linting the series.

    Attributes:
        inputs: the files linted, by path.
        new: the findings the series introduces.
        existing: the findings of changed files that their unpatched versions have too.
        skipped: the files of the series that no tool lints, with the reason.
    """

    inputs: dict[str, LintInput]
    new: list[Finding] = field(default_factory=list)
    existing: list[Finding] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def where(self, finding: Finding) -> str:
        """``file:line`` of a finding: the repository file for an added file, else the origin."""
        item = self.inputs[finding.path]
        if item.before is None:
            named = "" if item.origin.endswith(item.path) else f" (as {item.path})"
            return f"{item.origin}:{finding.line}{named}"
        return f"{finding.path}:{finding.line} ({item.origin})"


def in_lint_scope(path: str) -> bool:
    """Whether Megatron-LM's lint job checks ``path`` when a change touches it."""
    return path.endswith(".py") and path.startswith(LINT_SCOPE)


# ---------------------------------------------------------------------------------------------
# The tools, each run once on a staged tree
# ---------------------------------------------------------------------------------------------


def tools_python() -> str:
    """The interpreter that runs the lint tools (``$MEGATRON_LM_LINT_PYTHON``, else this one)."""
    return os.environ.get(TOOLS_PYTHON_ENV) or sys.executable


def _run(tool: str, args: Sequence[str], cwd: Path, ok: Iterable[int]) -> str:
    """Run ``python -m tool args`` in ``cwd``; return its stdout, or raise on another status."""
    result = subprocess.run(
        [tools_python(), "-m", tool, *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if result.returncode not in set(ok):
        raise LintError(
            f"{tool} {' '.join(args)} exited {result.returncode} in {cwd}:\n"
            f"{result.stdout}{result.stderr}"
        )
    return result.stdout


def _line(text: str, number: int) -> str:
    lines = text.splitlines()
    return lines[number - 1].strip() if 0 < number <= len(lines) else ""


def _rewrite_findings(
    tool: str, code: str, message: str, path: str, before: str, after: str
) -> list[Finding]:
    """One finding per change block between a file and the tool's rewrite of it."""
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    found = []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        block = "".join("-" + line for line in old[i1:i2]) + "".join(
            "+" + line for line in new[j1:j2]
        )
        text = [line.strip() for line in old[i1:i2] + new[j1:j2] if line.strip()]
        excerpt = text[0][:60] if text else "blank lines"
        found.append(Finding(path, i1 + 1, tool, code, f"{message}: {excerpt}", block))
    return found


def _rewritten_by(
    tool: str, args: Sequence[str], root: Path, paths: Sequence[str]
) -> list[Finding]:
    """Run a formatter in place on a copy of ``root``; one finding per block it would change."""
    with tempfile.TemporaryDirectory(prefix=f"lint-{tool}-") as scratch:
        copy = Path(scratch) / "tree"
        shutil.copytree(root, copy)
        _run(tool, [*args, *paths], copy, ok=[0])
        message = "would reformat" if tool == "black" else "would reorder imports"
        found = []
        for path in paths:
            found += _rewrite_findings(
                tool, tool, message, path, (root / path).read_text(), (copy / path).read_text()
            )
    return found


def black_findings(root: Path, paths: Sequence[str]) -> list[Finding]:
    """Black with Megatron-LM's ``[tool.black]`` (the staged ``pyproject.toml``)."""
    return _rewritten_by("black", ["-q", "--config", "pyproject.toml"], root, paths)


def isort_findings(root: Path, paths: Sequence[str]) -> list[Finding]:
    """Isort with Megatron-LM's ``[tool.isort]`` (the staged ``pyproject.toml``)."""
    return _rewritten_by("isort", ["-q", "--settings-path", "."], root, paths)


LINE_SUBJECT_CODES = ("C0301",)
"""Pylint messages about a line's text rather than an object: compared by that text."""


def pylint_findings(root: Path, paths: Sequence[str]) -> list[Finding]:
    """Pylint with Megatron-LM's ``.pylintrc``, on paths relative to the staged root."""
    # exit status: bit 1 fatal, bit 32 usage error; the others report messages
    output = _run(
        "pylint",
        ["--rcfile=.pylintrc", "--output-format=json", "--score=n", "--persistent=n", *paths],
        root,
        ok=[status for status in range(64) if not status & (1 | 32)],
    )
    found = []
    for item in json.loads(output or "[]"):
        path = PurePosixPath(item["path"]).as_posix()
        text = (root / path).read_text()
        code = item["message-id"]
        subject = _line(text, item["line"]) if code in LINE_SUBJECT_CODES else item["obj"]
        message = f"{item['message']} ({item['symbol']})"
        found.append(Finding(path, item["line"], "pylint", code, message, subject))
    return found


def ruff_findings(root: Path, paths: Sequence[str]) -> list[Finding]:
    """``ruff check`` with Megatron-LM's ``[tool.ruff]`` (the staged ``pyproject.toml``)."""
    output = _run(
        "ruff",
        ["check", "--no-fix", "--no-cache", "--quiet", "--output-format=json", *paths],
        root,
        ok=[0, 1],
    )
    found = []
    for item in json.loads(output or "[]"):
        path = Path(item["filename"]).resolve().relative_to(root.resolve()).as_posix()
        line = item["location"]["row"]
        subject = _line((root / path).read_text(), line)
        found.append(Finding(path, line, "ruff", item["code"], item["message"], subject))
    return found


def copyright_findings(root: Path, paths: Sequence[str]) -> list[Finding]:
    """``tools/check_copyright.py``'s rule: the file starts with the copyright line."""
    return [
        Finding(path, 1, "copyright", "copyright", f"missing '{COPYRIGHT_LINE}'", COPYRIGHT_LINE)
        for path in paths
        if not (root / path).read_text().startswith(COPYRIGHT_LINE)
    ]


Tool = Callable[[Path, Sequence[str]], list[Finding]]
"""A lint tool: (staged root, paths relative to it) -> its findings."""
TOOLS: tuple[Tool, ...] = (
    copyright_findings,
    black_findings,
    isort_findings,
    pylint_findings,
    ruff_findings,
)


# ---------------------------------------------------------------------------------------------
# Staging and comparing
# ---------------------------------------------------------------------------------------------


def stage(root: Path, files: Mapping[str, str]) -> None:
    """Write ``files`` at their Megatron-LM paths under ``root``, with its configuration files and
    an empty ``__init__.py`` in each package folder that has none among ``files``."""
    root.mkdir(parents=True, exist_ok=True)
    for name in CONFIG_FILES:
        shutil.copyfile(LINT_DIR / name, root / name)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    for path in files:
        for folder in PurePosixPath(path).parents:
            inside = any(folder.is_relative_to(package) for package in PACKAGE_ROOTS)
            if inside and not (root / folder / "__init__.py").exists():
                (root / folder / "__init__.py").write_text("")


def lint_tree(files: Mapping[str, str], tools: Sequence[Tool] = TOOLS) -> list[Finding]:
    """Every finding of ``tools`` on ``files`` (Megatron-LM path -> content), staged."""
    if not files:
        return []
    with tempfile.TemporaryDirectory(prefix="lint-series-") as scratch:
        root = Path(scratch) / "megatron-lm"
        stage(root, files)
        paths = sorted(files)
        found: list[Finding] = []
        for tool in tools:
            found += tool(root, paths)
    return found


def lint(inputs: Mapping[str, LintInput], skipped: Mapping[str, str] | None = None) -> Report:
    """Lint the series' files; a changed file's findings count only where its unpatched self
    does not have them.

    Args:
        inputs: the files, by Megatron-LM path.
        skipped: other files of the series that no tool lints, with the reason.

    Returns:
        The report.
    """
    report = Report(inputs=dict(inputs), skipped=dict(skipped or {}))
    linted = {path: item for path, item in inputs.items() if in_lint_scope(path)}
    for path in sorted(set(inputs) - set(linted)):
        report.skipped[path] = OUT_OF_SCOPE
    after = lint_tree({path: item.after for path, item in linted.items()})
    before = lint_tree(
        {path: item.before for path, item in linted.items() if item.before is not None}
    )
    unpatched = Counter(finding.key for finding in before)
    for finding in sorted(after, key=lambda f: (f.path, f.line, f.tool, f.code)):
        if unpatched[finding.key] > 0:
            unpatched[finding.key] -= 1
            report.existing.append(finding)
        else:
            report.new.append(finding)
    return report


# ---------------------------------------------------------------------------------------------
# The files of the series
# ---------------------------------------------------------------------------------------------


def repo_source(path: str) -> Path:
    """The file of this repository that the series adds at ``path``: ``megatron/...`` is here as
    it is there, the tests and docs are under ``upstream/``."""
    return REPO_ROOT / path if path.startswith("megatron/") else UPSTREAM_DIR / path


def added_inputs() -> dict[str, LintInput]:
    """The files the series adds on any branch (``series.json``'s ``added_files``), as they are
    in this repository."""
    paths = set(build_series.added_files(False)) | set(build_series.added_files(True))
    inputs = {}
    for path in sorted(paths):
        source = repo_source(path)
        origin = source.relative_to(REPO_ROOT).as_posix()
        inputs[path] = LintInput(path, source.read_text(), None, origin)
    return inputs


def patched_paths(patches: Sequence[Path]) -> list[str]:
    """The files that ``patches`` change (their ``+++ b/...`` lines)."""
    paths = {
        line[4:].strip().removeprefix("b/")
        for patch in patches
        for line in patch.read_text().splitlines()
        if line.startswith("+++ ")
    }
    return sorted(paths)


def changed_inputs_from_wheel(cache_dir: Path = WHEEL_CACHE) -> dict[str, LintInput]:
    """The files our patches for the newest release change (which the series carries), from the
    pinned upstream wheel of that release and with the patches applied.

    Args:
        cache_dir: where the hash-checked wheel is cached (pip downloads it if absent).
    """
    version = build_series.DEFAULT_UPSTREAM_VERSION
    patches = build_series.series_patches()
    wheel = ensure_upstream_wheel(cache_dir, version, environ={})
    paths = patched_paths(patches)
    with zipfile.ZipFile(wheel) as archive:
        unpatched = {path: archive.read(path).decode("utf-8") for path in paths}
    with tempfile.TemporaryDirectory(prefix="lint-patched-") as scratch:
        tree = Path(scratch)
        for path, text in unpatched.items():
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_text(text)
        apply_patches(tree, patches)
        patched = {path: (tree / path).read_text() for path in paths}
    origin = f"megatron-core {version} + patches/"
    return {path: LintInput(path, patched[path], unpatched[path], origin) for path in paths}


def changed_inputs_from_series(git_dir: Path, branch: str = "main") -> dict[str, LintInput]:
    """The files the series changes, as ``upstream/build_series.py`` builds it at the ref that
    ``series.json`` records for ``branch``, and their base versions."""
    commit = str(build_series.manifest()[branch]["snapshot_commit"])
    snapshot = build_series.Snapshot.from_git_dir(git_dir, branch, commit)
    final = dict(snapshot.files)
    for _message, files in build_series.series_commits(snapshot):
        final.update(files)
    origin = f"Megatron-LM {branch} {commit[:12]} + the series"
    return {
        path: LintInput(path, final[path], before, origin)
        for path, before in sorted(snapshot.files.items())
    }


def series_inputs(
    changed_from: str = "wheel", git_dir: Path | None = None, branch: str = "main"
) -> tuple[dict[str, LintInput], dict[str, str]]:
    """The series' files to lint, and the changed files that are not produced (with the reason).

    Args:
        changed_from: ``wheel`` (the pinned upstream wheel and our patches; PyPI only) or
            ``series`` (the series built from a Megatron-LM git directory).
        git_dir: the Megatron-LM git directory, for ``series``.
        branch: the series' branch, for ``series``.
    """
    inputs = added_inputs()
    if changed_from == "series":
        if git_dir is None:
            raise LintError("--changed-from series needs --git-dir (or MEGATRON_LM_GIT_DIR)")
        changed = changed_inputs_from_series(git_dir, branch)
    else:
        changed = changed_inputs_from_wheel()
    inputs.update(changed)
    skipped = {
        path: OUT_OF_SCOPE
        for path in build_series.TOUCHED_UPSTREAM_FILES
        if path not in changed and not in_lint_scope(path)
    }
    missing = set(build_series.TOUCHED_UPSTREAM_FILES) - set(changed) - set(skipped)
    if missing:
        raise LintError(f"the series changes {sorted(missing)}, which no source here produces")
    return inputs, skipped


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _pair(value: str) -> tuple[str, str]:
    path, separator, files = value.partition("=")
    if not separator or not path or not files:
        raise argparse.ArgumentTypeError(f"expected MEGATRON_LM_PATH=FILE[,FILE], got {value!r}")
    return path, files


def explicit_inputs(
    added: Sequence[tuple[str, str]], changed: Sequence[tuple[str, str]]
) -> dict[str, LintInput]:
    """Inputs from files named on the command line (``--added`` and ``--changed``)."""
    inputs = {}
    for path, file in added:
        inputs[path] = LintInput(path, Path(file).read_text(), None, file)
    for path, files in changed:
        before, separator, after = files.partition(",")
        if not separator:
            raise LintError(f"--changed {path}= needs UNPATCHED,PATCHED")
        inputs[path] = LintInput(path, Path(after).read_text(), Path(before).read_text(), after)
    return inputs


def describe(report: Report, finding: Finding) -> str:
    """``file:line: tool [code]: message``."""
    tool = finding.tool if finding.code == finding.tool else f"{finding.tool} {finding.code}"
    return f"{report.where(finding)}: {tool}: {finding.message}"


def print_report(report: Report, verbose: bool) -> None:
    """Print the findings the series introduces (and, if ``verbose``, the others)."""
    for finding in report.new:
        print(describe(report, finding))
    if verbose:
        for finding in report.existing:
            print(f"(in the unpatched file too) {describe(report, finding)}")
        for path, reason in sorted(report.skipped.items()):
            print(f"(not linted) {path}: {reason}")
    linted = [item for path, item in report.inputs.items() if path not in report.skipped]
    added = sum(item.before is None for item in linted)
    print(
        f"lint_series: {len(report.new)} finding(s) introduced by the series in {len(linted)} "
        f"linted files ({added} added, {len(linted) - added} changed); "
        f"{len(report.existing)} more in changed files are in their unpatched versions too; "
        f"not linted ({OUT_OF_SCOPE}): {', '.join(sorted(report.skipped)) or 'none'}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Lint the series; return 0 if it introduces no finding, 1 if it does, 2 on an error."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changed-from", choices=("wheel", "series"), default="wheel")
    parser.add_argument(
        "--git-dir",
        type=Path,
        default=os.environ.get("MEGATRON_LM_GIT_DIR") or None,
        help="Megatron-LM git directory, for --changed-from series",
    )
    parser.add_argument("--branch", choices=build_series.BRANCHES, default="main")
    parser.add_argument(
        "--added",
        type=_pair,
        action="append",
        default=[],
        metavar="PATH=FILE",
        help="lint FILE as a file the series adds at PATH (instead of the series)",
    )
    parser.add_argument(
        "--changed",
        type=_pair,
        action="append",
        default=[],
        metavar="PATH=UNPATCHED,PATCHED",
        help="lint PATCHED as the series' change of UNPATCHED at PATH (instead of the series)",
    )
    parser.add_argument(
        "--tools-python",
        help=f"interpreter that runs the lint tools (default: ${TOOLS_PYTHON_ENV}, else this one)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.tools_python:
        os.environ[TOOLS_PYTHON_ENV] = args.tools_python
    try:
        if args.added or args.changed:
            inputs, skipped = explicit_inputs(args.added, args.changed), dict[str, str]()
        else:
            inputs, skipped = series_inputs(args.changed_from, args.git_dir, args.branch)
        report = lint(inputs, skipped)
    except (LintError, OSError, RuntimeError) as error:
        print(f"lint_series: error: {error}", file=sys.stderr)
        return 2
    print_report(report, args.verbose)
    return 1 if report.new else 0


if __name__ == "__main__":
    sys.exit(main())
