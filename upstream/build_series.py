"""Build the Megatron-LM pull request for optimizer-state adoption as a ``git format-patch`` series.

One source: everything in the series is produced from this repository's files.

* ``megatron/core/optimizer/state_adoption/*.py``  -> the subsystem, at the same path upstream
  (Megatron-LM's copyright line is prepended, as its copyright check requires);
* ``patches/*.patch``                              -> the call site in ``distrib_optimizer.py``;
* ``upstream/tests/unit_tests/...``                -> the unit tests, at the same path upstream;
* ``upstream/docs/...``                            -> the docs entry, at the same path upstream,
  plus one toctree line in ``docs/api-guide/core/index.md``.

The call site differs between Megatron-LM branches. Where the snapshot's
``DistributedOptimizer.load_state_dict`` is the plain one (``main``), our patch's hunks are applied
as they are (matched by content, not by line number). Where it has the chunked optimizer-state
offloader's special case (``dev``: ``self._optimizer_state_offloader`` with
``load_state_dict_without_device_cast``), the same hunks are applied only to the path without an
offloader: the offloaded path keeps upstream's calls unchanged (see upstream/README.md). Tests that
only make sense with the offloader (``*_offloader.py``) are added only there.

The series is reproducible byte for byte: fixed dates, ``--zero-commit``, no signature. The base
commit holds only the snapshot files the series touches, which is all ``git format-patch`` reads.

Usage::

    python upstream/build_series.py build --git-dir MIRROR.git            # main and dev
    python upstream/build_series.py build --git-dir MIRROR.git --branch dev
    python upstream/build_series.py build --source-tree CHECKOUT --branch main --snapshot-commit SHA
    python upstream/build_series.py check --git-dir MIRROR.git            # git apply --check
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_DIR = REPO_ROOT / "upstream"
MANIFEST = UPSTREAM_DIR / "series.json"

SUBSYSTEM = "megatron/core/optimizer/state_adoption"
CALL_SITE = "megatron/core/optimizer/distrib_optimizer.py"
DOCS_INDEX = "docs/api-guide/core/index.md"
DOCS_PAGE = "docs/api-guide/core/optimizer_state_adoption.md"
TESTS_ROOT = "tests/unit_tests"
BRANCHES = ("main", "dev")
TOUCHED_UPSTREAM_FILES = (CALL_SITE, DOCS_INDEX)

PYTHON_HEADER = "# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.\n\n"
SERIES_DATE = "2026-11-29T12:00:00+00:00"
"""Author and committer date of every commit in the series (keeps the patches reproducible)."""

OFFLOADER_GUARD = "if self._optimizer_state_offloader is None:"
OFFLOADER_LOADER = "self._optimizer_state_offloader.load_state_dict_without_device_cast("
OFFLOADER_TEST_SUFFIX = "_offloader.py"
DEV_LOAD_COMMENT = (
    "# With chunked optimizer-state offload, the offloader's own loader runs, as before."
)


class SeriesError(RuntimeError):
    """The series cannot be built from these sources for this snapshot."""


# ---------------------------------------------------------------------------------------------
# Our patch, parsed into hunks
# ---------------------------------------------------------------------------------------------


@dataclass
class Hunk:
    """One hunk of a unified diff: context before, removed lines, added lines, context after."""

    before: List[str] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)
    added: List[str] = field(default_factory=list)
    after: List[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """``import`` (pure insertion), ``export`` or ``load`` (which inner call it replaces)."""
        removed = "\n".join(self.removed)
        if not self.removed:
            return "import"
        if "self.optimizer.load_state_dict(" in removed:
            return "load"
        if "self.optimizer.state_dict()" in removed:
            return "export"
        raise SeriesError(f"unrecognised hunk in our patch: {self.removed!r}")


def parse_hunks(patch_text: str, path: str, split_blocks: bool = False) -> List[Hunk]:
    """Return the hunks of ``patch_text`` that change ``path`` (one change block per hunk).

    Args:
        patch_text: a unified diff (``diff --git`` or plain ``---``/``+++`` headers).
        path: the file whose hunks are wanted, relative to the repository root.
        split_blocks: split a hunk with several change blocks into one per block (context
            between them is shared); otherwise such a hunk is refused.

    Returns:
        The hunks, in order.
    """
    hunks: List[Hunk] = []
    current_file: Optional[str] = None
    hunk: Optional[Hunk] = None
    for line in patch_text.splitlines():
        if line.startswith("+++ "):
            current_file = line[4:].strip().removeprefix("b/")
            hunk = None
            continue
        if line.startswith("--- ") or line.startswith("diff --git") or line.startswith("index "):
            continue
        if line.startswith("@@"):
            hunk = Hunk() if current_file == path else None
            if hunk is not None:
                hunks.append(hunk)
            continue
        if hunk is None:
            continue
        tag, text = (line[:1], line[1:]) if line else (" ", "")
        if tag == " ":
            (hunk.after if hunk.removed or hunk.added else hunk.before).append(text)
        elif tag in "-+":
            if hunk.after:
                if not split_blocks:
                    raise SeriesError("a hunk of our patch has two change blocks; split it")
                hunk = Hunk(before=hunk.after)
                hunks.append(hunk)
            (hunk.removed if tag == "-" else hunk.added).append(text)
    return hunks


def our_call_site_hunks() -> List[Hunk]:
    """The hunks of ``patches/*.patch`` for the call site, in patch order."""
    hunks: List[Hunk] = []
    for patch in sorted((REPO_ROOT / "patches").glob("*.patch")):
        hunks.extend(parse_hunks(patch.read_text(), CALL_SITE))
    if not hunks:
        raise SeriesError(f"patches/*.patch has no hunk for {CALL_SITE}")
    return hunks


# ---------------------------------------------------------------------------------------------
# The call-site change
# ---------------------------------------------------------------------------------------------


def _method_span(text: str, name: str) -> Tuple[int, int]:
    """Character span of ``DistributedOptimizer.<name>`` (from its ``def`` to the next method)."""
    start = text.find(f"\n    def {name}(self")
    if start < 0:
        raise SeriesError(f"{CALL_SITE} has no method {name}")
    end = text.find("\n    def ", start + 1)
    return start, len(text) if end < 0 else end


def _replace_once(text: str, old: str, new: str, where: Tuple[int, int], what: str) -> str:
    """Replace the single occurrence of ``old`` inside ``text[where[0]:where[1]]``."""
    start, end = where
    count = text.count(old, start, end)
    if count != 1:
        raise SeriesError(f"{what}: expected exactly one match in the snapshot, found {count}")
    index = text.index(old, start, end)
    return text[:index] + new + text[index + len(old) :]


def _block(lines: Sequence[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _split_comments(lines: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Split leading comment lines from the code lines that follow them."""
    index = 0
    while index < len(lines) and lines[index].lstrip().startswith("#"):
        index += 1
    return list(lines[:index]), list(lines[index:])


def _indent(lines: Sequence[str], by: str = "    ") -> List[str]:
    return [by + line if line.strip() else line for line in lines]


def _apply_import(text: str, hunk: Hunk) -> str:
    anchor = hunk.before[-1]
    span = (0, text.find("\nclass "))
    return _replace_once(text, anchor + "\n", _block([anchor, *hunk.added]), span, "import")


def _apply_plain(text: str, hunk: Hunk) -> str:
    """Apply a replacement hunk as it is, inside ``load_state_dict``."""
    return _replace_once(
        text, _block(hunk.removed), _block(hunk.added), _method_span(text, "load_state_dict"),
        f"{hunk.kind} hunk",
    )


def _apply_export_keeping_offloader(text: str, hunk: Hunk) -> str:
    """Route the export only when no offloader is active; the offloaded path keeps upstream's call."""
    comments, new_code = _split_comments(hunk.added)
    old_comments, old_code = _split_comments(hunk.removed)
    indent = re.match(r"\s*", old_code[0]).group(0)  # type: ignore[union-attr]
    guarded = [
        *comments,
        indent + OFFLOADER_GUARD,
        *_indent(new_code),
        indent + "else:",
        *_indent(old_code),
    ]
    return _replace_once(
        text, _block(hunk.removed), _block(guarded), _method_span(text, "load_state_dict"),
        "export hunk (offloader variant)",
    )


def _new_callee(hunk: Hunk) -> str:
    """Name of the function our patch calls instead of the inner optimizer's method."""
    _, code = _split_comments(hunk.added)
    match = re.match(r"\s*(?:\w+\s*=\s*)?(\w+)\(", code[0])
    if match is None:
        raise SeriesError(f"cannot find the new call in {code[0]!r}")
    return match.group(1)


def _apply_load_keeping_offloader(text: str, hunk: Hunk) -> str:
    """Route the load in the no-offloader branch; the offloader's branch stays as it is."""
    span = _method_span(text, "load_state_dict")
    body = text[span[0] : span[1]]
    match = re.search(
        r"\n(?P<i>[ ]+)# Optimizer\.\n"
        r"(?P=i)(?P<var>\w+) = (?P<value>\{[^\n]*\})\n"
        r"(?P=i)" + re.escape(OFFLOADER_GUARD) + r"\n"
        r"(?P=i)    self\.optimizer\.load_state_dict\((?P=var)\)\n",
        body,
    )
    if match is None:
        raise SeriesError("load hunk: the offloader special case has an unknown shape")
    indent, var = match.group("i"), match.group("var")
    comments, _ = _split_comments(hunk.added)
    comments = [indent + c.strip() for c in comments] + [indent + DEV_LOAD_COMMENT]
    new = _block(
        [
            "",
            *comments,
            f"{indent}{var} = {match.group('value')}",
            indent + OFFLOADER_GUARD,
            f"{indent}    {_new_callee(hunk)}(self, {var})",
        ]
    )
    start = span[0] + match.start()
    return text[:start] + new.rstrip("\n") + "\n" + text[start + len(match.group(0)) :]


def has_offloader_special_case(text: str) -> bool:
    """True if ``load_state_dict`` hands the inner state to the chunked offloader when it is set."""
    start, end = _method_span(text, "load_state_dict")
    return OFFLOADER_LOADER in text[start:end]


def change_call_site(text: str, hunks: Sequence[Hunk]) -> str:
    """Apply our call-site hunks to a snapshot's ``distrib_optimizer.py``.

    Args:
        text: the snapshot's file.
        hunks: our patch's hunks for it.

    Returns:
        The changed file. Raises :class:`SeriesError` if an anchor is missing or ambiguous.
    """
    offloader = has_offloader_special_case(text)
    appliers: Dict[str, Callable[[str, Hunk], str]] = {
        "import": _apply_import,
        "export": _apply_export_keeping_offloader if offloader else _apply_plain,
        "load": _apply_load_keeping_offloader if offloader else _apply_plain,
    }
    for hunk in hunks:
        text = appliers[hunk.kind](text, hunk)
    ast.parse(text)
    if offloader:
        check_offloader_path_kept(text)
    return text


def check_offloader_path_kept(text: str) -> None:
    """Assert that with an offloader ``load_state_dict`` still makes exactly upstream's calls."""
    start, end = _method_span(text, "load_state_dict")
    body = text[start:end]
    if body.count(OFFLOADER_LOADER) != 1:
        raise SeriesError("the offloader's load_state_dict_without_device_cast call is gone")
    guards = body.count(OFFLOADER_GUARD)
    new_calls = len(re.findall(r"\n\s+(?:\w+ = )?\w+_inner_optimizer_state_dict\(", body))
    if new_calls != guards:
        raise SeriesError(f"{new_calls} subsystem calls but {guards} offloader guards")


# ---------------------------------------------------------------------------------------------
# Docs index and copied files
# ---------------------------------------------------------------------------------------------


def add_docs_toctree_entry(text: str, entry: str) -> str:
    """Append ``entry`` to the (single) toctree of ``docs/api-guide/core/index.md``."""
    match = re.search(r"```\{toctree\}\n(?:.*\n)*?(?=```)", text)
    if match is None:
        raise SeriesError(f"{DOCS_INDEX} has no toctree")
    if re.search(rf"^{re.escape(entry)}$", match.group(0), re.MULTILINE):
        raise SeriesError(f"{DOCS_INDEX} already lists {entry}")
    return text[: match.end()] + entry + "\n" + text[match.end() :]


def subsystem_files() -> Dict[str, str]:
    """Upstream path -> content of every subsystem module (our file, with the copyright line)."""
    files = {}
    for source in sorted((REPO_ROOT / SUBSYSTEM).glob("*.py")):
        files[f"{SUBSYSTEM}/{source.name}"] = PYTHON_HEADER + source.read_text()
    return files


def test_files(with_offloader: bool) -> Dict[str, str]:
    """Upstream path -> content of our unit tests (the offloader ones only where it exists)."""
    files = {}
    root = UPSTREAM_DIR / "tests" / "unit_tests"
    for source in sorted(root.rglob("*.py")):
        if source.name.endswith(OFFLOADER_TEST_SUFFIX) and not with_offloader:
            continue
        files[f"{TESTS_ROOT}/{source.relative_to(root).as_posix()}"] = source.read_text()
    return files


def docs_files() -> Dict[str, str]:
    """Upstream path -> content of our docs pages."""
    root = UPSTREAM_DIR / "docs"
    return {f"docs/{p.relative_to(root).as_posix()}": p.read_text() for p in sorted(root.rglob("*.md"))}


# ---------------------------------------------------------------------------------------------
# Reading a generated series back (for the consistency test)
# ---------------------------------------------------------------------------------------------


@dataclass
class FileDiff:
    """One file's diff in a format-patch file."""

    path: str
    pre_blob: str
    post_blob: str
    new_file: bool
    hunks: List[Hunk]

    def new_content(self) -> str:
        """The whole content of a new file (its single hunk's added lines)."""
        assert self.new_file and len(self.hunks) == 1
        return _block(self.hunks[0].added)


def read_series_patch(text: str) -> List[FileDiff]:
    """Split a ``git format-patch`` file into per-file diffs."""
    diffs: List[FileDiff] = []
    sections = re.split(r"^diff --git a/\S+ b/(\S+)\n", text, flags=re.MULTILINE)
    for path, body in zip(sections[1::2], sections[2::2]):
        index = re.search(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)", body, re.MULTILINE)
        if index is None:
            raise SeriesError(f"no index line for {path}")
        body = body.split("\n-- \n")[0]  # a signature, if any
        diffs.append(
            FileDiff(
                path=path,
                pre_blob=index.group(1),
                post_blob=index.group(2),
                new_file="\nnew file mode" in "\n" + body.split("@@")[0],
                hunks=parse_hunks(
                    f"+++ b/{path}\n" + body[body.index("@@") :], path, split_blocks=True
                ),
            )
        )
    return diffs


# ---------------------------------------------------------------------------------------------
# Commits and format-patch
# ---------------------------------------------------------------------------------------------

SUBSYSTEM_MESSAGE = """\
Add an optimizer-state adoption registry for DistributedOptimizer

Add megatron.core.optimizer.state_adoption: a registry of state adopters
that DistributedOptimizer can consult when it loads its inner optimizer's
state, and of exporters for the inner state it reads back. The first
adopter that accepts installs the state; otherwise the inner optimizer's
own load_state_dict runs unchanged. A failing check counts as a decline;
a failing adoption is rolled back and the optimizer's own loader runs.
Each load reports a StateAdoptionOutcome to registered outcome hooks.

The default adopter, te_fused_adam_fp32, covers Transformer Engine's
FusedAdam with FP32 moments and no master weights or parameter
remainders. There FusedAdam.load_state_dict allocates a second copy of
both moments while the caller still holds the incoming ones (8 bytes
per parameter of transient memory on every resume); the adopter installs
the incoming tensors by reference through PyTorch's loader instead.
Every other configuration is declined and keeps FusedAdam's loader.

Third-party adopters are registered in code (register_state_adopter) or
through the entry-point group megatron_core.optimizer_state_adopters.
MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=1 switches adoption off;
MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS=name,... disables adopters by
name.
"""

CALL_SITE_SUBJECT = "Route DistributedOptimizer's inner state load through state adoption\n\n"
CALL_SITE_BODY = {
    ("load",): """\
DistributedOptimizer.load_state_dict now installs the assembled inner
state with load_inner_optimizer_state_dict(self, ...) instead of calling
the inner optimizer's load_state_dict() directly. With no adopter
accepting, it does exactly what the direct call did. The Megatron-FSDP
path is unchanged.
""",
    ("export", "load"): """\
DistributedOptimizer.load_state_dict now reads the inner optimizer's
state with export_inner_optimizer_state_dict(self) and installs the
assembled state with load_inner_optimizer_state_dict(self, ...), instead
of calling the inner optimizer's state_dict() and load_state_dict()
directly. With no adopter accepting, both do exactly what the direct
calls did. The Megatron-FSDP path is unchanged.
""",
}


def call_site_message(hunks: Sequence[Hunk], offloader: bool) -> str:
    """The call-site commit message for the calls our patch actually replaces."""
    kinds = tuple(sorted({h.kind for h in hunks} - {"import"}))
    if kinds not in CALL_SITE_BODY:
        raise SeriesError(f"no commit message for a call-site change of kinds {kinds}")
    return CALL_SITE_SUBJECT + CALL_SITE_BODY[kinds] + (CALL_SITE_MESSAGE_OFFLOADER if offloader else "")


CALL_SITE_MESSAGE_OFFLOADER = """
With chunked optimizer-state offload (self._optimizer_state_offloader),
load_state_dict keeps making upstream's calls (the inner optimizer's
state_dict() and the offloader's load_state_dict_without_device_cast())
exactly as before: the offloader's loader is part of the offload
mechanism, not an optional memory optimisation, so it is never subject
to adoption, the kill switch or a fallback.
"""

TESTS_MESSAGE = """\
Add unit tests for optimizer state adoption

Cover the registry (unique names, ordering, prepend, handles, disabling
by name, the kill switch, outcome hooks), fail-safety (a raising check
declines; a raising adoption is rolled back and the optimizer's own
loader runs), the instance-level load_state_dict rule, the default
adopter with Transformer Engine's FusedAdam, and a DistributedOptimizer
save and load through dist_checkpointing with bitwise-equal state.
"""

TESTS_MESSAGE_OFFLOADER = """
Also check that with a chunked optimizer-state offloader set,
load_state_dict consults no adopter and hands the offloader exactly the
state it received before.
"""

DOCS_MESSAGE = """\
Document optimizer state adoption in the API guide

Add an API guide page on what state adoption does, when the default
adopter applies, how to write and register an adopter, and how to
switch adoption off.
"""


def _git(cwd: Path, *args: str, env: Optional[Dict[str, str]] = None) -> str:
    result = subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    )
    return result.stdout


def _identity() -> Tuple[str, str]:
    """The author of the series: this repository's git user."""
    name = _git(REPO_ROOT, "config", "user.name").strip()
    email = _git(REPO_ROOT, "config", "user.email").strip()
    return name, email


def _commit_env(name: str, email: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_AUTHOR_NAME=name,
        GIT_AUTHOR_EMAIL=email,
        GIT_COMMITTER_NAME=name,
        GIT_COMMITTER_EMAIL=email,
        GIT_AUTHOR_DATE=SERIES_DATE,
        GIT_COMMITTER_DATE=SERIES_DATE,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
    )
    return env


def _write(root: Path, files: Dict[str, str]) -> None:
    for path, content in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)


@dataclass
class Snapshot:
    """The Megatron-LM files the series touches, from one commit of one branch."""

    branch: str
    commit: str
    files: Dict[str, str]

    @classmethod
    def from_git_dir(cls, git_dir: Path, branch: str) -> "Snapshot":
        """Read the touched files of ``branch`` from a bare clone (e.g. the fetched mirror)."""
        commit = _git(git_dir, "rev-parse", f"refs/heads/{branch}^{{commit}}").strip()
        files = {p: _git(git_dir, "show", f"{commit}:{p}") for p in TOUCHED_UPSTREAM_FILES}
        return cls(branch, commit, files)

    @classmethod
    def from_tree(cls, tree: Path, branch: str, commit: Optional[str]) -> "Snapshot":
        """Read the touched files of a checkout; ``commit`` defaults to its git HEAD."""
        if commit is None:
            commit = _git(tree, "rev-parse", "HEAD").strip()
        files = {p: (tree / p).read_text() for p in TOUCHED_UPSTREAM_FILES}
        return cls(branch, commit, files)


def series_commits(snapshot: Snapshot) -> List[Tuple[str, Dict[str, str]]]:
    """The series for ``snapshot``: (commit message, files written) per commit, in order."""
    hunks = our_call_site_hunks()
    call_site = snapshot.files[CALL_SITE]
    offloader = has_offloader_special_case(call_site)
    page = Path(DOCS_PAGE).stem
    return [
        (SUBSYSTEM_MESSAGE, subsystem_files()),
        (
            call_site_message(hunks, offloader),
            {CALL_SITE: change_call_site(call_site, hunks)},
        ),
        (TESTS_MESSAGE + (TESTS_MESSAGE_OFFLOADER if offloader else ""), test_files(offloader)),
        (
            DOCS_MESSAGE,
            {**docs_files(), DOCS_INDEX: add_docs_toctree_entry(snapshot.files[DOCS_INDEX], page)},
        ),
    ]


def build(
    snapshot: Snapshot, out_dir: Path, identity: Optional[Tuple[str, str]] = None
) -> List[Path]:
    """Write the series for ``snapshot`` into ``out_dir`` (emptied first); return the patches.

    Args:
        snapshot: the Megatron-LM files the series changes.
        out_dir: where the patches go.
        identity: (name, email) of the author; defaults to this repository's git user.
    """
    name, email = identity or _identity()
    env = _commit_env(name, email)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        _git(work, "init", "-q", "-b", "base", env=env)
        _write(work, snapshot.files)
        _git(work, "add", "-A", env=env)
        _git(work, "commit", "-q", "-m", f"Megatron-LM {snapshot.branch} {snapshot.commit}", env=env)
        base = _git(work, "rev-parse", "HEAD").strip()
        for message, files in series_commits(snapshot):
            _write(work, files)
            _git(work, "add", "-A", env=env)
            subprocess.run(
                ["git", "commit", "-q", "-s", "-F", "-"],
                cwd=work, env=env, input=message, text=True, check=True, capture_output=True,
            )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        _git(
            work, "format-patch", "-q", "--zero-commit", "--no-signature", "--no-numbered-files",
            "-o", str(out_dir), f"{base}..HEAD", env=env,
        )
    return sorted(out_dir.glob("*.patch"))


def _manifest() -> Dict[str, Dict[str, object]]:
    if MANIFEST.exists():
        data: Dict[str, Dict[str, object]] = json.loads(MANIFEST.read_text())
        return data
    return {}


def _blob_id(content: str) -> str:
    result = subprocess.run(
        ["git", "hash-object", "--stdin"], input=content, text=True, check=True,
        capture_output=True,
    )
    return result.stdout.strip()


def record(snapshot: Snapshot, patches: Sequence[Path], apply_check: Optional[str]) -> None:
    """Record the snapshot commit, its touched files' blob ids and the patch names."""
    manifest = _manifest()
    entry = manifest.get(snapshot.branch, {})
    entry.update(
        snapshot_commit=snapshot.commit,
        offloader_special_case=has_offloader_special_case(snapshot.files[CALL_SITE]),
        pre_image_blobs={p: _blob_id(c) for p, c in sorted(snapshot.files.items())},
        patches=[p.name for p in patches],
        series_date=SERIES_DATE,
        author="{} <{}>".format(*_identity()),
    )
    if apply_check is not None:
        entry["git_apply_check"] = apply_check
    manifest[snapshot.branch] = entry
    MANIFEST.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def apply_check(git_dir: Path, commit: str, patches: Sequence[Path]) -> str:
    """``git apply --check`` the series on a full work tree of ``commit``; return a summary."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch)
        archive = subprocess.run(
            ["git", "--git-dir", str(git_dir), "archive", commit], check=True, capture_output=True
        )
        subprocess.run(["tar", "x", "-C", str(tree)], input=archive.stdout, check=True)
        _git(tree, "init", "-q")
        result = subprocess.run(
            ["git", "apply", "--check", "--verbose", *map(str, patches)],
            cwd=tree, capture_output=True, text=True,
        )
    if result.returncode != 0:
        raise SeriesError(f"git apply --check failed on {commit}:\n{result.stderr}")
    return f"ok: {len(patches)} patches apply to a full work tree of {commit}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: ``build`` (and record) or ``check`` the series per branch."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("build", "check"))
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--git-dir", type=Path, help="bare Megatron-LM clone (fetched mirror)")
    source.add_argument("--source-tree", type=Path, help="a Megatron-LM checkout of --branch")
    parser.add_argument("--branch", choices=BRANCHES, action="append")
    parser.add_argument("--snapshot-commit", help="commit of --source-tree (default: its HEAD)")
    parser.add_argument(
        "--out", type=Path, default=UPSTREAM_DIR, help="series go to OUT/<branch>/ (default upstream/)"
    )
    parser.add_argument("--no-record", action="store_true", help="do not update series.json")
    args = parser.parse_args(argv)
    branches = args.branch or list(BRANCHES)
    if args.source_tree is not None and len(branches) != 1:
        parser.error("--source-tree needs exactly one --branch")
    for branch in branches:
        if args.git_dir is not None:
            snapshot = Snapshot.from_git_dir(args.git_dir, branch)
        else:
            snapshot = Snapshot.from_tree(args.source_tree, branch, args.snapshot_commit)
        out_dir = args.out / branch
        if args.command == "build":
            patches = build(snapshot, out_dir)
            print(f"{branch} @ {snapshot.commit}: {len(patches)} patches in {out_dir}")
            check = apply_check(args.git_dir, snapshot.commit, patches) if args.git_dir else None
            if check:
                print(f"  {check}")
            if not args.no_record:
                record(snapshot, patches, check)
        else:
            if args.git_dir is None:
                parser.error("check needs --git-dir")
            patches = sorted(out_dir.glob("*.patch"))
            print(f"{branch}: {apply_check(args.git_dir, snapshot.commit, patches)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
