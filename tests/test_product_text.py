"""The repository reads as a product: what it is and does, not how it came to be.

- No development-history markers (issue, pull-request or session numbers, "the mission")
  in README.md, docs/, examples/, upstream/README.md and the Python code under megatron/,
  benchmarks/, scripts/ and tests/. Git history is the history. A reference to another
  project's issue or pull request names that project ("Megatron-LM PR 7288", "TE PR 3507",
  "PyTorch issue 196083", or GitHub's "NVIDIA/Megatron-LM#1842").
- docs/ stays within 3 MB, and no archive (.tgz, .tar.gz) is in the repository.
- The tables of docs/gpu-report.md are those the benchmark's report renders from the committed
  JSON (``python docs/render_gpu_report.py`` rewrites them).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Files other changes are rewriting, whose history markers are left to them. Temporary: each
#: entry is removed with the last marker of its file (test_pending_rewrite_lists_only_files_with_hits).
PENDING_REWRITE: frozenset[str] = frozenset()

DOCS_LIMIT_BYTES = 5_000_000  # the committed H200 runs (JSON, reports, figures) are most of it
_MARKER = re.compile(
    r"\bissues?\s*#?\s*\d+"  # issue #29, issue 5, issues #18 and #28
    r"|\bsessions?[-_ ]?\d+"  # session 16, session-16, session9, sessions 9-12
    r"|\b(?:PRs?|pull requests?)\s*#?\s*\d+"  # PR 12, PR #12, pull request 12
    r"|\bthe mission\b|\bmission's\b"
    r"|\bafter (?:the )?review\b",
    re.IGNORECASE,
)
#: An issue or pull request of another project, named right before it.
_THIRD_PARTY = re.compile(
    r"\b(?:Megatron-LM|Megatron-Bridge|Megatron[- ]Core|MCore|TE|Transformer ?Engine|PyTorch)\s+$"
)


def history_markers(text: str) -> list[re.Match[str]]:
    """The development-history markers in ``text``."""
    return [
        m for m in _MARKER.finditer(text)
        if not (m.group(0)[0] in "iIpP" and _THIRD_PARTY.search(text[max(0, m.start() - 40) : m.start()]))
    ]  # fmt: skip
_TEXT_SUFFIXES = {".md", ".rst", ".txt", ".py", ".json", ".toml", ".cfg", ".ini", ".sh", ".yaml", ".yml"}


def _repository_files() -> list[str]:
    """Tracked and untracked, not ignored, files (paths relative to the repository)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO, capture_output=True, check=True,
        ).stdout.decode()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        skipped = {".git", "build", "dist", "mutants", "__pycache__"}
        return sorted(
            p.relative_to(REPO).as_posix()
            for p in REPO.rglob("*")
            if p.is_file() and not any(part in skipped or part.startswith(".venv") for part in p.parts)
        )
    return sorted(path for path in listed.split("\0") if path and (REPO / path).is_file())


def _scanned(path: str) -> bool:
    suffix = Path(path).suffix
    if path == "tests/test_product_text.py":  # its examples of markers
        return False
    if path in ("README.md", "pyproject.toml", "upstream/README.md"):
        return True
    if path.startswith(("upstream/prs/", "upstream/docs/", "upstream/tests/")):
        return suffix in _TEXT_SUFFIXES
    roots = ("docs/", "examples/", "megatron/", "benchmarks/", "scripts/", "tests/", ".ci/")
    return path.startswith(roots) and (suffix in _TEXT_SUFFIXES or path.startswith(".ci/"))


def _history_markers() -> dict[str, list[str]]:
    """path -> every history marker in it, as ``line N: text``."""
    found: dict[str, list[str]] = {}
    for path in filter(_scanned, _repository_files()):
        text = (REPO / path).read_text(encoding="utf-8", errors="replace")
        for match in history_markers(text):
            line = text.count("\n", 0, match.start()) + 1
            found.setdefault(path, []).append(f"line {line}: {match.group(0)!r}")
    return found


def test_the_history_pattern_finds_what_it_should() -> None:
    for marker in ["issue #29", "Issue 5", "issues #18 and #28", "session 16", "Session-16",
                   "session9", "sessions 9-12", "PR 12", "pull request #4", "by the mission's rule",
                   "after review", "(gpu-results/session-13-megatron-lm)"]:  # fmt: skip
        assert history_markers(marker), marker
    for fine in ["Megatron-LM PR 7288", "TE PR 3507", "PyTorch issue 196083", "Megatron-LM\n  PR 7288",
                 "NVIDIA/Megatron-LM#1842", "https://github.com/NVIDIA/Megatron-LM/issues/1842",
                 "scope='session'", "in its own session", "pytest_sessionfinish(session)",
                 "the first run loads nothing", "no issue"]:  # fmt: skip
        assert not history_markers(fine), fine


def test_no_development_history_in_the_product_text() -> None:
    found = {p: hits for p, hits in _history_markers().items() if p not in PENDING_REWRITE}
    assert not found, "history markers (issue/PR/session numbers) in:\n" + "\n".join(
        f"{path}: {', '.join(hits)}" for path, hits in sorted(found.items())
    )


def test_pending_rewrite_lists_only_files_with_hits() -> None:
    clean = sorted(PENDING_REWRITE - set(_history_markers()))
    assert not clean, f"no history markers left: remove from PENDING_REWRITE: {clean}"


def test_docs_stay_small() -> None:
    size = sum((REPO / p).stat().st_size for p in _repository_files() if p.startswith("docs/"))
    assert size <= DOCS_LIMIT_BYTES, f"docs/ holds {size:,} bytes, over {DOCS_LIMIT_BYTES:,}"


def test_no_archives_in_the_repository() -> None:
    archives = [p for p in _repository_files() if p.endswith((".tgz", ".tar.gz"))]
    assert not archives, f"archives do not belong in the repository: {archives}"


def _gpu_report_renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_gpu_report", REPO / "docs/render_gpu_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_report_tables_are_rendered_from_the_committed_json() -> None:
    renderer = _gpu_report_renderer()
    text = renderer.REPORT.read_text()
    markers = renderer.MARKER.findall(text)
    assert len(markers) >= 5, "the GPU report's current results name their JSON"
    rendered, stale = renderer.render(text)
    assert not stale, f"stale tables (python docs/render_gpu_report.py rewrites them): {stale}"
    assert rendered == text


@pytest.mark.parametrize("path", ["docs/gpu-report.md", "docs/multi-gpu.md", "docs/reliability.md",
                                  "docs/mutation-report.md", "README.md"])  # fmt: skip
def test_local_links_of_the_docs_resolve(path: str) -> None:
    page = REPO / path
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert not missing, f"{path} links to missing files: {missing}"
