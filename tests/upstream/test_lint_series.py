# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""upstream/lint_series.py: Megatron-LM's lint checks on the series, and that they can fail.

* The committed settings are Megatron-LM's files verbatim (blob ids in upstream/lint/README.md;
  with ``MEGATRON_LM_GIT_DIR``, also against the mirror) and the installed tools are the versions
  that ref pins.
* The files linted are exactly the ones the series adds (series.json, from these sources) and
  changes (the newest release's patches; what the wheel cannot give is outside the lint scope).
* Real tools on temporary files: an added file with an over-long line, no copyright line, a
  missing docstring, unsorted imports, black's formatting, ``print`` or ``yaml.load`` fails; a
  clean one passes; a changed file counts only what its unpatched self lacks, whatever the line
  numbers; Megatron-LM's path rules apply (pylint leaves ``tests/`` alone); the command exits 1
  on a finding and 0 on a copy whose finding the unpatched file already has.
"""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest
from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "upstream"))

import build_series  # noqa: E402  (upstream/ is not a package)
import lint_series  # noqa: E402
from lint_series import LintInput, lint  # noqa: E402

SCRIPT = REPO_ROOT / "upstream" / "lint_series.py"
LINT_README = lint_series.LINT_DIR / "README.md"
MIRROR = Path(os.environ.get("MEGATRON_LM_GIT_DIR", "/nonexistent"))
needs_mirror = pytest.mark.skipif(
    not (MIRROR / "HEAD").exists(),
    reason="no Megatron-LM git directory (set MEGATRON_LM_GIT_DIR to one, e.g. a fetched mirror "
    "of github:NVIDIA/Megatron-LM)",
)
HEADER = lint_series.COPYRIGHT_LINE


def _recorded_blobs() -> Dict[str, str]:
    """``file here -> blob id`` from the README's table."""
    rows = re.findall(
        r"^\| `([^`]+)` \| `([^`]+)` \| `([0-9a-f]{40})` \|", LINT_README.read_text(), re.M
    )
    assert all(here == there for here, there, _ in rows), "a file here keeps Megatron-LM's name"
    return {here: blob for here, _, blob in rows}


def _git_blob(path: Path) -> str:
    return subprocess.run(
        ["git", "hash-object", str(path)], check=True, capture_output=True, text=True
    ).stdout.strip()


# ---------------------------------------------------------------------------------------------
# Settings and tools
# ---------------------------------------------------------------------------------------------


def test_committed_settings_are_megatron_lms_files_verbatim() -> None:
    blobs = _recorded_blobs()
    committed = sorted(p.name for p in lint_series.LINT_DIR.iterdir() if p.name != "README.md")
    assert sorted(blobs) == committed
    assert set(lint_series.CONFIG_FILES) <= set(blobs)
    for name, blob in blobs.items():
        assert _git_blob(lint_series.LINT_DIR / name) == blob, f"upstream/lint/{name} was edited"
    base = str(build_series.manifest()["main"]["snapshot_commit"])
    assert f"`{base}`" in LINT_README.read_text(), "the README names the series' base ref"


@needs_mirror
def test_committed_settings_are_the_base_refs() -> None:
    base = str(build_series.manifest()["main"]["snapshot_commit"])
    for name, blob in _recorded_blobs().items():
        upstream = subprocess.run(
            ["git", "--git-dir", str(MIRROR), "rev-parse", f"{base}:{name}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        assert upstream == blob, name


def _pins() -> Dict[str, str]:
    pins = {}
    for line in (REPO_ROOT / "requirements" / "lint.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    return pins


VERSIONS = "import importlib.metadata as m, sys; print(*(m.version(n) for n in sys.argv[1:]))"


def test_tools_are_pinned_to_megatron_lms_versions_and_installed() -> None:
    pins = _pins()
    assert sorted(pins) == ["astroid", "black", "isort", "pylint", "ruff"]
    config = tomllib.loads((lint_series.LINT_DIR / "pyproject.toml").read_text())
    linting = [Requirement(r) for r in config["dependency-groups"]["linting"]]
    for requirement in linting:
        if requirement.name in pins:
            assert requirement.specifier.contains(pins[requirement.name]), requirement
            if requirement.name != "ruff":  # ruff~=0.9.0; uv.lock resolves 0.9.10
                assert str(requirement.specifier) == f"=={pins[requirement.name]}"
    pre_commit = (lint_series.LINT_DIR / ".pre-commit-config.yaml").read_text()
    revs = dict(re.findall(r"repo: https://github.com/\w+/(\w+)\n\s+rev: '?([^'\n]+)", pre_commit))
    assert revs["black"].endswith(f"refs/tags/{pins['black']}")
    assert revs["pylint"] == f"v{pins['pylint']}"
    assert revs["isort"] == pins["isort"]
    # the interpreter that runs them (MEGATRON_LM_LINT_PYTHON, else this one) has exactly these
    result = subprocess.run(
        [lint_series.tools_python(), "-c", VERSIONS, *pins], capture_output=True, text=True
    )
    assert result.returncode == 0, f"install requirements/lint.txt: {result.stderr}"
    assert dict(zip(pins, result.stdout.split())) == pins, "install requirements/lint.txt"


def test_copyright_line_is_megatron_lms_form_for_the_series_year() -> None:
    year = build_series.SERIES_DATE[:4]
    assert HEADER == f"# Copyright (c) {year} NVIDIA CORPORATION & AFFILIATES. All rights reserved."


# ---------------------------------------------------------------------------------------------
# The files of the series
# ---------------------------------------------------------------------------------------------


def test_added_files_are_the_series_added_files_from_their_sources() -> None:
    inputs = lint_series.added_inputs()
    recorded = {p for entry in build_series.manifest().values() for p in entry["added_files"]}
    assert set(inputs) == recorded
    series = {
        **build_series.subsystem_files(),
        **build_series.test_files(True),
        **build_series.in_place_merge_files(),
        **build_series.docs_files(),
    }
    assert set(series) == recorded
    for path, item in inputs.items():
        assert item.before is None
        assert series[path] in (item.after, build_series.with_header(item.after)), path
        assert (REPO_ROOT / item.origin).read_text() == item.after


def test_changed_files_are_the_series_changed_files() -> None:
    patched = lint_series.patched_paths(build_series.series_patches())
    assert patched == sorted(build_series.PATCHED_FILES)
    touched = set(build_series.TOUCHED_UPSTREAM_FILES)
    assert set(patched) <= touched
    tests = set(build_series.CHANGED_TESTS)
    assert touched | tests == set(build_series.manifest()["main"]["pre_image_blobs"])
    # what the wheel and our patches do not give, no Megatron-LM lint tool reads
    assert not any(lint_series.in_lint_scope(p) for p in touched - set(patched))
    # the wheel has no tests: a changed Megatron-LM test is linted from a Megatron-LM git
    # directory (--changed-from series; test_series_lints_the_changed_megatron_lm_tests)
    assert not tests & touched and all(lint_series.in_lint_scope(p) for p in tests)
    assert all(lint_series.in_lint_scope(p) for p in patched)


# ---------------------------------------------------------------------------------------------
# Real tools on temporary files
# ---------------------------------------------------------------------------------------------

CLEAN = f'''{HEADER}

"""A module."""

import os

import torch

from megatron.core.utils import get_te_version


def size(path: str) -> int:
    """The size of ``path``."""
    return os.path.getsize(path) + torch.zeros(1).numel() + len(str(get_te_version()))
'''
CLEAN_TEST = f'''{HEADER}

import torch

from megatron.core.utils import get_te_version
from tests.unit_tests.test_utilities import Utils


def test_size():
    assert Utils and torch and get_te_version
'''
LONG = "    #" + " an over-long comment" * 5
"""A line black cannot split: pylint's line-too-long."""
DEFECTS = {
    "long_line": (CLEAN.replace("    return os", LONG + "\n    return os"), {("pylint", "C0301")}),
    "no_copyright": (CLEAN.replace(HEADER + "\n\n", ""), {("copyright", "copyright")}),
    "no_docstring": (CLEAN.replace('    """The size of ``path``."""\n', ""), {("pylint", "C0116")}),
    "unsorted": (
        CLEAN.replace("import os\n\nimport torch\n", "import torch\nimport os\n"),
        {("isort", "isort")},
    ),
    "unformatted": (
        CLEAN.replace("def size(path: str)", "def size( path: str )"),
        {("black", "black")},
    ),
    "print": (
        CLEAN.replace("    return os", "    print(path)\n    return os"),
        {("pylint", "W0141")},
    ),
    "yaml_load": (
        CLEAN.replace("import torch\n", "import torch\nimport yaml\n").replace(
            "    return os", "    yaml.load(path)\n    return os"
        ),
        {("ruff", "S506")},
    ),
}


def _codes(findings: List[lint_series.Finding], path: str) -> Set[Tuple[str, str]]:
    return {(f.tool, f.code) for f in findings if f.path == path}


def test_an_added_file_must_be_clean() -> None:
    files = {f"megatron/core/lint_probe/{name}.py": text for name, (text, _) in DEFECTS.items()}
    files["megatron/core/lint_probe/clean.py"] = CLEAN
    files["tests/unit_tests/lint_probe/test_clean.py"] = CLEAN_TEST
    report = lint({p: LintInput(p, text, None, p) for p, text in files.items()})
    assert report.existing == []
    for name, (_, expected) in DEFECTS.items():
        assert _codes(report.new, f"megatron/core/lint_probe/{name}.py") == expected, name
    assert _codes(report.new, "megatron/core/lint_probe/clean.py") == set()
    # Megatron-LM's tests are a package there: Utils is first-party, next to megatron
    assert _codes(report.new, "tests/unit_tests/lint_probe/test_clean.py") == set()


def test_pull_request_b_subsystem_is_clean() -> None:
    """(b)'s modules (the final ones without what upstream/prs/split.toml names) pass
    Megatron-LM's lint as the final ones do."""
    files = build_series.subsystem_files(final=False)
    report = lint({p: LintInput(p, text, None, f"(b) {p}") for p, text in files.items()})
    assert report.new == []


def test_megatron_lms_path_rules_apply() -> None:
    test_file = DEFECTS["long_line"][0].replace(HEADER + "\n\n", "")
    inputs = {
        "tests/unit_tests/lint_probe/test_long.py": LintInput(
            "tests/unit_tests/lint_probe/test_long.py", test_file, None, "t"
        ),
        "megatron/training/probe.py": LintInput("megatron/training/probe.py", test_file, None, "t"),
    }
    report = lint(inputs)
    # pylint's ignore-paths=tests: the test's long line and docstrings are not its business
    assert _codes(report.new, "tests/unit_tests/lint_probe/test_long.py") == {
        ("copyright", "copyright")
    }
    assert report.skipped == {"megatron/training/probe.py": lint_series.OUT_OF_SCOPE}


UNPATCHED = DEFECTS["long_line"][0] + '''

def old(path):
    return path
'''


def test_a_changed_file_counts_only_what_its_patch_introduces() -> None:
    path = "megatron/core/optimizer/probe.py"
    # the patch adds lines above the unpatched findings (they move), a new long line and a
    # function without docstring
    patched = UNPATCHED.replace("import os\n", "import os\nimport sys\n")
    patched = patched.replace(
        '    """The size of ``path``."""\n',
        '    """The size of ``path``."""\n    if sys.argv:\n        path = path\n',
    )
    new_long = LONG.replace("comment", "remark")
    patched += f'''

def new(path):
{new_long}
    return path
'''
    report = lint({path: LintInput(path, patched, UNPATCHED, "probe")})
    too_long = f"Line too long ({len(new_long)}/100) (line-too-long)"
    assert sorted((f.code, f.message, f.subject) for f in report.new) == [
        ("C0116", "Missing function or method docstring (missing-function-docstring)", "new"),
        ("C0301", too_long, new_long.strip()),
    ]
    assert {(f.code, f.subject) for f in report.existing} == {
        ("C0301", LONG.strip()),
        ("C0116", "old"),
    }
    unpatched_lines = {f.line for f in lint({path: LintInput(path, UNPATCHED, None, "u")}).new}
    assert {f.line for f in report.existing}.isdisjoint(unpatched_lines), "moved, still matched"
    # the unpatched file alone has these findings: they are not the patch's
    assert lint({path: LintInput(path, UNPATCHED, UNPATCHED, "same")}).new == []


def test_rewrite_blocks_are_compared_by_content_not_position() -> None:
    before = "a = 1\nb  =  2\n"
    after = "a = 1\nb = 2\n"
    first = lint_series._rewrite_findings("black", "black", "would reformat", "p.py", before, after)
    shifted = lint_series._rewrite_findings(
        "black", "black", "would reformat", "p.py", "# moved\n" + before, "# moved\n" + after
    )
    assert [f.line for f in first] == [2] and [f.line for f in shifted] == [3]
    assert [f.key for f in first] == [f.key for f in shifted]


def _command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False
    )


def test_the_command_fails_on_an_introduced_finding_only(tmp_path: Path) -> None:
    module = "megatron/core/lint_probe.py"
    clean = CLEAN
    copy = tmp_path / "lint_probe.py"
    copy.write_text(clean)
    ok = _command("--added", f"{module}={copy}")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "lint_series: 0 finding(s)" in ok.stdout

    long_line = LONG.strip()
    broken = tmp_path / "broken.py"
    broken.write_text(clean.replace('"""A module."""\n', f'"""A module."""\n\n{long_line}\n'))
    failed = _command("--added", f"{module}={broken}")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    line = broken.read_text().splitlines().index(long_line) + 1
    assert f"{broken}:{line} (as {module}): pylint C0301: Line too long" in failed.stdout

    # the same long line in the unpatched file, moved down by the patch: not the patch's finding
    moved = tmp_path / "moved.py"
    moved.write_text(broken.read_text().replace(f"\n{long_line}", f"\n# A comment.\n{long_line}"))
    kept = _command("--changed", f"{module}={broken},{moved}", "-v")
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "lint_series: 0 finding(s)" in kept.stdout
    assert f"(in the unpatched file too) {module}:{line + 1} ({moved}): pylint C0301" in kept.stdout


@needs_mirror
def test_wheel_and_series_give_the_same_changed_file_findings() -> None:
    """The wheel-based files CI lints stand for the pull request's own (built from the mirror)."""
    wheel = lint(lint_series.changed_inputs_from_wheel())
    series = lint(lint_series.changed_inputs_from_series(MIRROR, "main"))

    def found(report: lint_series.Report) -> Set[Tuple[str, str, str, str]]:
        return {(f.path, f.tool, f.code, f.message) for f in report.new}

    assert found(wheel) == found(series)


@needs_mirror
@pytest.mark.parametrize("branch", build_series.BRANCHES)
def test_series_lints_the_changed_megatron_lm_tests(branch: str) -> None:
    """The Megatron-LM tests a pull request changes are linted as changed files, and introduce
    no finding (black, isort, ruff; pylint leaves ``tests/`` alone)."""
    inputs = lint_series.changed_inputs_from_series(MIRROR, branch)
    for path in build_series.CHANGED_TESTS:
        assert inputs[path].before is not None and inputs[path].after != inputs[path].before
    report = lint({path: inputs[path] for path in build_series.CHANGED_TESTS})
    assert [lint_series.describe(report, f) for f in report.new] == []
