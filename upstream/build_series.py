"""Build the Megatron-LM pull requests of this change as ``git format-patch`` series.

Nothing of them is committed: one command builds, per Megatron-LM branch, four pull requests
from this repository's files and a Megatron-LM snapshot, byte for byte the same every time, into
``build/upstream-series/<branch>/<pull request>/`` (its description ``0000-cover-letter.patch``
and its commits), and records in ``upstream/series.json`` what they were built against. They
stack in the order of ``PULL_REQUESTS``; (a) and (c) also apply alone (see upstream/README.md):

* (a) the CPU-offload Adam-step fix (``BUG_FIX_PATCH``) and its test;
* (b) FP32 in-place adoption: the subsystem without what ``upstream/prs/split.toml`` names, the
  config field and argument it keeps, ``DistributedOptimizer``'s two loads, its test;
* (c) the in-place SwiGLU merge (``in_place_merge.py``, ``transformer/utils.py``), its test and
  the change to the existing SwiGLU OOM test it needs (``PR_TEST_CHANGES``);
* (d) the rest: the subsystem as it is here, the other field and argument, the other call sites
  (``optimizer.py``'s too), its tests (``*_offloader.py`` only with the chunked offloader), docs.

Descriptions and commit messages: ``upstream/prs/<pull request>.md``. Our hunks (only the
newest release's ``patches/*.patch``, and ``upstream/<test>.diff`` for a Megatron-LM test a pull
request changes) are carried by content, not by line number (``locate``);
where ``DistributedOptimizer`` has the chunked offloader's special case (``dev``), the export and
the load are routed only without an offloader. A missing or ambiguous anchor, or a name of
split.toml that is gone, is a ``SeriesError``.

Usage::

    python upstream/build_series.py build --git-dir MIRROR.git    # -> build/upstream-series/
    python upstream/build_series.py check --git-dir MIRROR.git    # the apply checks of that build
"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # build_tools, next to upstream/

from build_tools.patching import find_patches  # noqa: E402
from build_tools.releases import DEFAULT_UPSTREAM_VERSION  # noqa: E402

UPSTREAM_DIR = REPO_ROOT / "upstream"
PRS_DIR = UPSTREAM_DIR / "prs"
SPLIT = PRS_DIR / "split.toml"
MANIFEST = UPSTREAM_DIR / "series.json"
README = UPSTREAM_DIR / "README.md"
DEFAULT_OUT = REPO_ROOT / "build" / "upstream-series"
"""Where ``build`` writes the pull requests (``<branch>/<pull request>/*.patch``); ignored."""

SUBSYSTEM = "megatron/core/optimizer/state_adoption"
CALL_SITE = "megatron/core/optimizer/distrib_optimizer.py"
NON_DISTRIBUTED_FILE = "megatron/core/optimizer/optimizer.py"
CONFIG_FILE = "megatron/core/optimizer/optimizer_config.py"
CONFIG_CLASS = "OptimizerConfig"
ARGUMENTS_FILE = "megatron/training/arguments.py"
ARGUMENTS_FUNCTION = "_add_training_args"
ARGUMENT_ANCHOR = "--optimizer"
TRAINING_FILE = "megatron/training/training.py"
CONFIG_FROM_ARGS = "get_megatron_optimizer_config"
UTILS_FILE = "megatron/core/transformer/utils.py"
IN_PLACE_MERGE = "megatron/core/dist_checkpointing/in_place_merge.py"
DOCS_INDEX = "docs/api-guide/core/index.md"
DOCS_PAGE = "docs/api-guide/core/optimizer_state_adoption.md"
ADAM_STEP_TEST = "tests/unit_tests/optimizer/test_distrib_optimizer_cpu_offload_step.py"
ADOPTION_TEST = "tests/unit_tests/optimizer/test_state_adoption.py"
ROLES_TEST = "tests/unit_tests/optimizer/test_state_adoption_roles.py"
OFFLOADER_TEST = "tests/unit_tests/optimizer/test_state_adoption_offloader.py"
IN_PLACE_MERGE_TEST = "tests/unit_tests/dist_checkpointing/test_in_place_merge.py"
MLP_GLU_TEST = "tests/unit_tests/dist_checkpointing/models/test_mlp_glu.py"
BRANCHES = ("main", "dev")
PULL_REQUESTS = A, B, C, D = (
    "a-cpu-offload-adam-step",
    "b-fp32-state-adoption",
    "c-in-place-swiglu-merge",
    "d-state-adoption-roles",
)
"""In the order they stack; each is a folder of the build and ``upstream/prs/<name>.md``."""
STANDALONE = (A, C)
"""The pull requests that also apply alone on the snapshot."""
PATCHED_FILES = (CALL_SITE, NON_DISTRIBUTED_FILE, CONFIG_FILE, UTILS_FILE)
"""The files the newest release's ``patches/*.patch`` may change; a patch changing any other is
refused."""
BUG_FIX_PATCH = "0006-distrib-optimizer-keep-the-loaded-adam-step-with-cpu-offload.patch"
"""Our fix of an upstream bug (NVIDIA/Megatron-LM#1842): pull request (a), alone."""
TOUCHED_UPSTREAM_FILES = (*PATCHED_FILES, ARGUMENTS_FILE, DOCS_INDEX)
"""The snapshot files of Megatron-LM's code and docs the pull requests change (what
``lint_series.py`` gets from the upstream wheel and our patches, or knows to be out of its scope)."""
PR_TEST_CHANGES = {C: [MLP_GLU_TEST]}
"""The existing Megatron-LM unit tests each pull request changes: ``upstream/<path>.diff`` is the
change, a unified diff against the snapshot's file, whose hunks are carried by content."""
CHANGED_TESTS = tuple(path for paths in PR_TEST_CHANGES.values() for path in paths)
SNAPSHOT_FILES = (*TOUCHED_UPSTREAM_FILES, *CHANGED_TESTS)
"""Every snapshot file the pull requests change (the base commit holds exactly these)."""
CHECKED_UPSTREAM_FILES = (TRAINING_FILE,)
"""Snapshot files the generator reads to check an assumption, but does not change."""
COVER_LETTER = "0000-cover-letter.patch"
FORMAT_PATCH = "format-patch -q --zero-commit --no-signature --cover-letter".split()
FORMAT_PATCH.append("--cover-from-description=subject")

PYTHON_HEADER = "# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.\n\n"
SERIES_DATE = "2026-11-29T12:00:00+00:00"
"""Author and committer date of every commit (keeps the patches reproducible)."""
LINE_LENGTH, MESSAGE_WIDTH = 100, 72
"""Megatron-LM's black line length; the width of descriptions and commit messages."""

OFFLOADER_GUARD = "if self._optimizer_state_offloader is None:"
OFFLOADER_LOADER = "self._optimizer_state_offloader.load_state_dict_without_device_cast("
DEV_LOAD_COMMENT = (
    "# With chunked optimizer-state offload, the offloader's own loader runs, as before."
)
TABLE_BEGIN = "<!-- pull-request table: written by `build_series.py build` from series.json -->"
TABLE_END = "<!-- end of the pull-request table -->"


class SeriesError(RuntimeError):
    """The pull requests cannot be built from these sources for this snapshot."""


# ---------------------------------------------------------------------------------------------
# Our patches, parsed into hunks
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
        """``insert`` (nothing removed), ``export`` (it replaces ``self.optimizer.state_dict()``),
        ``load`` (it replaces a ``self.optimizer.load_state_dict(`` call written over several
        lines: the assembled state of ``DistributedOptimizer.load_state_dict``) or ``replace``.
        Only ``export`` and ``load`` differ where the snapshot has the offloader."""
        code = [line for line in self.removed if not line.lstrip().startswith("#")]
        if not code:
            return "insert" if not self.removed else "replace"
        if any("self.optimizer.state_dict()" in line for line in code):
            return "export"
        if len(code) > 1 and "self.optimizer.load_state_dict(" in code[0]:
            return "load"
        return "replace"


def parse_hunks(patch_text: str, path: str) -> List[Hunk]:
    """The hunks of the unified diff ``patch_text`` that change ``path``, one per change block
    (a hunk with several is split; the context between them is shared), in order."""
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
                hunk = Hunk(before=hunk.after)
                hunks.append(hunk)
            (hunk.removed if tag == "-" else hunk.added).append(text)
    return hunks


def series_patches() -> List[Path]:
    """Our patches for the newest upstream release (``DEFAULT_UPSTREAM_VERSION``), which
    Megatron-LM ``main`` and ``dev`` follow; a patch only for older releases (its ``Releases:``
    line) never enters the series."""
    return find_patches(REPO_ROOT / "patches", DEFAULT_UPSTREAM_VERSION)


def our_hunks(path: str, bug_fix: bool = False) -> List[Hunk]:
    """The hunks for ``path`` of our patches for the newest release, in patch order: of every
    patch but ``BUG_FIX_PATCH`` (its own commit), or with ``bug_fix`` of that patch only.

    Refuses a patch that changes a file the series does not know how to carry, so that a new
    hunk cannot be dropped silently.
    """
    patches = series_patches()
    if BUG_FIX_PATCH not in [patch.name for patch in patches]:
        raise SeriesError(f"patches/{BUG_FIX_PATCH} is gone; update BUG_FIX_PATCH")
    hunks: List[Hunk] = []
    for patch in patches:
        text = patch.read_text()
        for line in text.splitlines():
            changed = line[4:].strip().removeprefix("b/")
            if line.startswith("+++ ") and changed not in PATCHED_FILES:
                raise SeriesError(
                    f"patches/{patch.name} changes {changed}, which the series does not carry; "
                    "teach upstream/build_series.py where it goes"
                )
        if (patch.name == BUG_FIX_PATCH) is bug_fix:
            hunks.extend(parse_hunks(text, path))
    if not hunks:
        which = BUG_FIX_PATCH if bug_fix else "*.patch"
        raise SeriesError(f"patches/{which} has no hunk for {path}")
    return hunks


# ---------------------------------------------------------------------------------------------
# The call sites (distrib_optimizer.py, optimizer.py)
# ---------------------------------------------------------------------------------------------


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


def _width(line: str) -> int:
    return len(line) - len(line.lstrip())


def locate(lines: Sequence[str], hunk: Hunk, path: str) -> Tuple[int, int]:
    """Where ``hunk`` goes in a snapshot's ``lines``: (first, end) of its removed lines (for an
    insertion, first == end: right after its last leading context line).

    Lines are compared without indentation. The removed lines must occur exactly once together
    with the fewest context lines of the hunk around them (the nearest leading line first, then
    alternately trailing and leading ones); every context line used must match.
    """
    stripped = [line.strip() for line in lines]
    lead, trail = (0 if hunk.removed else 1), 0
    while True:
        block = [
            line.strip()
            for line in [
                *hunk.before[len(hunk.before) - lead :],
                *hunk.removed,
                *hunk.after[:trail],
            ]
        ]
        starts = [
            i
            for i in range(len(stripped) - len(block) + 1)
            if stripped[i : i + len(block)] == block
        ]
        exhausted = lead >= len(hunk.before) and trail >= len(hunk.after)
        if len(starts) == 1 or not starts or exhausted:
            break
        if trail >= len(hunk.after) or (lead <= trail and lead < len(hunk.before)):
            lead += 1
        else:
            trail += 1
    if len(starts) != 1:
        what = hunk.removed[:1] or hunk.before[-1:]
        raise SeriesError(
            f"{path}: {hunk.kind} hunk at {what!r}: found {len(starts)} times in the snapshot "
            "with its context; expected exactly once"
        )
    return starts[0] + lead, starts[0] + lead + len(hunk.removed)


def _shifted(found: Sequence[str], hunk: Hunk, path: str) -> List[str]:
    """The hunk's added lines, indented as much deeper as ``found`` (the snapshot's removed lines;
    on ``dev`` a load may sit inside the offloader's guard) is than our removed lines."""
    if not hunk.removed:
        return list(hunk.added)
    shift = _width(found[0]) - _width(hunk.removed[0])
    if shift < 0 or any(
        line != " " * shift + ours for line, ours in zip(found, hunk.removed) if ours.strip()
    ):
        raise SeriesError(f"{path}: {hunk.removed[0].strip()!r} is indented otherwise there")
    return _indent(hunk.added, " " * shift)


def _guarded_export(found: Sequence[str], hunk: Hunk, path: str) -> List[str]:
    """Export through the subsystem only without an offloader; the offloaded path keeps
    upstream's ``self.optimizer.state_dict()``."""
    comments, code = _split_comments(_shifted(found, hunk, path))
    indent = " " * _width(found[0])
    return [*comments, indent + OFFLOADER_GUARD, *_indent(code), indent + "else:", *_indent(found)]


def _offloader_load(text: str, hunk: Hunk) -> str:
    """Route the load in the no-offloader branch of the snapshot's special case; the offloader's
    branch stays as it is. Our call is the patch's, with the snapshot's variable for the dict."""
    pattern = (
        r"\n(?P<i>[ ]+)# Optimizer\.\n"
        r"(?P=i)(?P<var>\w+) = (?P<value>\{[^\n]*\})\n"
        r"(?P=i)" + re.escape(OFFLOADER_GUARD) + r"\n"
        r"(?P=i)    self\.optimizer\.load_state_dict\((?P=var)\)\n"
    )
    matches = list(re.finditer(pattern, text))
    if len(matches) != 1:
        raise SeriesError(f"{CALL_SITE}: the offloader's load has an unknown shape")
    (match,) = matches
    indent, var = match.group("i"), match.group("var")
    comments, code = _split_comments(hunk.added)
    call: Optional[ast.stmt] = None
    for end in range(len(hunk.after) + 1):  # the call's closing lines may be context
        try:
            (call,) = ast.parse(textwrap.dedent(_block([*code, *hunk.after[:end]]))).body
            break
        except (SyntaxError, ValueError):
            continue
    if not (isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)):
        raise SeriesError(f"{CALL_SITE}: our load hunk is not one call")
    value = ast.dump(ast.parse(match.group("value"), mode="eval").body)
    arguments = [ast.dump(argument) for argument in call.value.args]
    if arguments.count(value) != 1:
        raise SeriesError(f"{CALL_SITE}: our load call does not take the snapshot's dict")
    call.value.args[arguments.index(value)] = ast.Name(var)
    routed = f"{indent}    {ast.unparse(call)}"
    if len(routed) > 100:
        raise SeriesError(f"{CALL_SITE}: {routed.strip()!r} is longer than black allows")
    new = [
        "",
        *(indent + line.strip() for line in [*comments, DEV_LOAD_COMMENT]),
        f"{indent}{var} = {match.group('value')}",
        indent + OFFLOADER_GUARD,
        routed,
    ]
    return text[: match.start()] + _block(new) + text[match.end() :]


def _method_span(text: str, name: str) -> Tuple[int, int]:
    """Character span of the first method ``name`` (from its ``def`` to the next method)."""
    start = text.find(f"\n    def {name}(")
    if start < 0:
        raise SeriesError(f"{CALL_SITE} has no method {name}")
    end = text.find("\n    def ", start + 1)
    return start, len(text) if end < 0 else end


def has_offloader_special_case(text: str) -> bool:
    """True if ``DistributedOptimizer.load_state_dict`` hands the inner state to the chunked
    offloader when it is set."""
    start, end = _method_span(text, "load_state_dict")
    return OFFLOADER_LOADER in text[start:end]


def change_file(text: str, hunks: Sequence[Hunk], path: str, offloader: bool) -> str:
    """The snapshot's ``text`` of ``path`` with our ``hunks``; with ``offloader`` (the
    snapshot's ``DistributedOptimizer`` has the offloader's special case) the export and the load
    are routed only without an offloader. Raises :class:`SeriesError` for a hunk whose place is
    missing or ambiguous."""
    for hunk in hunks:
        if offloader and hunk.kind == "load":
            text = _offloader_load(text, hunk)
            continue
        lines = text.split("\n")
        first, end = locate(lines, hunk, path)
        found = lines[first:end]
        new = (_guarded_export if offloader and hunk.kind == "export" else _shifted)(
            found, hunk, path
        )
        text = "\n".join([*lines[:first], *new, *lines[end:]])
    ast.parse(text)
    if offloader and path == CALL_SITE:
        check_offloader_path_kept(text)
    return text


def check_offloader_path_kept(text: str) -> None:
    """Assert that with an offloader ``load_state_dict`` still makes exactly upstream's calls."""
    start, end = _method_span(text, "load_state_dict")
    body = text[start:end]
    if body.count(OFFLOADER_LOADER) != 1:
        raise SeriesError("the offloader's load_state_dict_without_device_cast call is gone")
    guards = body.count(OFFLOADER_GUARD)
    # the Megatron-FSDP branch's direct load never went to the offloader: it needs no guard
    new_calls = len(
        re.findall(
            r"\n\s+(?:\w+ = )?\w+_inner_optimizer_state_dict\((?!self, state_dict\)\n)", body
        )
    )
    if new_calls != guards:
        raise SeriesError(f"{new_calls} subsystem calls but {guards} offloader guards")


def staged_call_site_hunks(hunks: Sequence[Hunk], available: Set[str]) -> List[Hunk]:
    """Of our ``distrib_optimizer.py`` ``hunks``, those that call only subsystem functions in
    ``available`` (what the subsystem exports at this stage), after the subsystem's import hunk
    trimmed to the names they call."""
    package = SUBSYSTEM.replace("/", ".")
    exported = set(package_names((REPO_ROOT / SUBSYSTEM / "__init__.py").read_text()))
    staged: List[Hunk] = []
    imports: List[Tuple[ast.ImportFrom, Hunk]] = []
    called: Set[str] = set()
    for hunk in hunks:
        added = textwrap.dedent(_block(hunk.added))
        if added.startswith(f"from {package} import"):
            node = ast.parse(added).body[0]
            assert isinstance(node, ast.ImportFrom)
            imports.append((node, hunk))
            continue
        names = set(re.findall(r"\b\w+\b", added)) & exported
        if names <= available:
            staged.append(hunk)
            called |= names
    if len(imports) != 1:
        raise SeriesError(f"{CALL_SITE}: expected one hunk importing {package}")
    ((node, hunk),) = imports
    kept = [alias for alias in node.names if alias.name in called]
    trimmed = Hunk(hunk.before, hunk.removed, render_import(node, kept, ""), hunk.after)
    return [trimmed, *staged] if kept else staged


# ---------------------------------------------------------------------------------------------
# The config fields and their Megatron-LM arguments
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigField:
    """A field our patch adds to ``OptimizerConfig``."""

    name: str
    annotation: str
    default: object


def _module_node(tree: ast.Module, kind: type, name: str, what: str) -> ast.AST:
    """The single module-level class or function ``name`` of ``tree``."""
    nodes = [n for n in tree.body if isinstance(n, kind) and getattr(n, "name", None) == name]
    if len(nodes) != 1:
        raise SeriesError(f"{what}: expected exactly one {name}, found {len(nodes)}")
    return nodes[0]


def _line_start(text: str, lineno: int) -> int:
    """Character offset of the start of 1-based line ``lineno`` (``len(text)`` past the end)."""
    return min(len(text), sum(len(line) + 1 for line in text.split("\n")[: lineno - 1]))


def _node_span(text: str, node: ast.AST) -> Tuple[int, int]:
    """Character span of the whole lines of a statement ``node`` (decorators included)."""
    assert isinstance(node, ast.stmt) and node.end_lineno is not None
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return _line_start(text, first), _line_start(text, node.end_lineno + 1)


def config_fields(hunks: Sequence[Hunk]) -> List[ConfigField]:
    """The fields our config hunks add, in order (read from their added lines)."""
    fields = []
    for hunk in hunks:
        try:
            tree = ast.parse(textwrap.dedent(_block(hunk.added)))
        except SyntaxError as error:
            raise SeriesError(f"the added lines of a {CONFIG_FILE} hunk do not parse: {error}")
        for node in tree.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if node.value is None:
                    raise SeriesError(f"{CONFIG_FILE}: field {node.target.id} has no default")
                fields.append(
                    ConfigField(
                        node.target.id, ast.unparse(node.annotation), ast.literal_eval(node.value)
                    )
                )
    if not fields:
        raise SeriesError(f"patches/*.patch adds no field to {CONFIG_CLASS}")
    return fields


def change_optimizer_config(text: str, hunks: Sequence[Hunk]) -> str:
    """Insert our fields (each hunk a pure insertion) into a snapshot's ``OptimizerConfig``,
    anchored on the last leading context line and the trailing context (the blank line before
    the ``Miscellaneous`` header), which must occur exactly once in the class; the earlier
    leading context may differ (``dev`` has more offload fields). Raises :class:`SeriesError` for
    a missing or ambiguous anchor and for a field the class has already."""
    fields = config_fields(hunks)
    for hunk in hunks:
        if hunk.removed or not hunk.added or not hunk.after or not hunk.before:
            raise SeriesError(
                f"a hunk of our patch for {CONFIG_FILE} is not an insertion between context lines"
            )
        config_class = _module_node(ast.parse(text), ast.ClassDef, CONFIG_CLASS, CONFIG_FILE)
        start, end = _node_span(text, config_class)
        anchor = _block([hunk.before[-1], *hunk.after])
        body = text[start:end]
        matches = [m.start() for m in re.finditer("^" + re.escape(anchor), body, re.MULTILINE)]
        if len(matches) != 1:
            raise SeriesError(
                f"{CONFIG_FILE}: the anchor {anchor!r} occurs {len(matches)} times in class "
                f"{CONFIG_CLASS}; expected exactly once"
            )
        insert_at = start + matches[0] + len(hunk.before[-1]) + 1
        text = text[:insert_at] + _block(hunk.added) + text[insert_at:]
    changed_class = _module_node(ast.parse(text), ast.ClassDef, CONFIG_CLASS, CONFIG_FILE)
    assert isinstance(changed_class, ast.ClassDef)
    names = [
        n.target.id
        for n in changed_class.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]
    for field_ in fields:
        if names.count(field_.name) != 1:
            raise SeriesError(
                f"{CONFIG_CLASS} would have {names.count(field_.name)} fields {field_.name}"
            )
    return text


def argument_flag(field_: ConfigField) -> str:
    """``--no-optimizer-state-adoption`` for a field that is True by default, else ``--<name>``."""
    return ("--no-" if field_.default else "--") + field_.name.replace("_", "-")


def argument_help(field_: ConfigField) -> str:
    """The help text of the argument of ``field_`` (split.toml's ``[arguments]``)."""
    helps: Dict[str, str] = split_manifest().get("arguments", {})
    if field_.name not in helps:
        raise SeriesError(f"{SPLIT.name} has no [arguments] help text for {field_.name}")
    return helps[field_.name]


def _help_segments(text: str, width: int) -> List[str]:
    """``text`` as implicitly concatenated string literals of at most ``width`` characters."""
    lines = textwrap.wrap(text, width=width - 3, break_on_hyphens=False)
    quote = '"' if "'" in text else "'"
    return [
        quote + line + (" " if i < len(lines) - 1 else "") + quote for i, line in enumerate(lines)
    ]


def render_argument(field_: ConfigField, group: str, black_style: bool) -> List[str]:
    """The ``<group>.add_argument`` statement for the bool ``field_`` (``store_false`` for one
    that is True by default, else ``store_true``), in black's layout (``dev``) or the
    hand-wrapped one (``main``)."""
    if field_.annotation != "bool" or not isinstance(field_.default, bool):
        raise SeriesError(f"{CONFIG_FILE}: {field_.name} is no bool with a default; no argument")
    flag = argument_flag(field_)
    options = [f"'{flag}'", f"action='{'store_false' if field_.default else 'store_true'}'"]
    if flag.lstrip("-").replace("-", "_") != field_.name:
        options.append(f"dest='{field_.name}'")
    if black_style:
        indent = " " * 8
        opening, lines, closing = (
            [f"    {group}.add_argument("],
            [indent + o + "," for o in options],
            ",\n    )",
        )
    else:
        head = f"    {group}.add_argument("
        indent = " " * len(head)
        opening, closing = [], ")"
        lines = [f"{head}{options[0]}, {options[1]},", *(indent + o + "," for o in options[2:])]
    segments = _help_segments(argument_help(field_), LINE_LENGTH - len(indent) - len("help="))
    help_lines = [f"{indent}help={segments[0]}", *(indent + s for s in segments[1:])]
    return [*opening, *lines, *help_lines[:-1], *(help_lines[-1] + closing).split("\n")]


def _is_add_argument(node: ast.AST, flag: Optional[str] = None) -> bool:
    """True for a statement ``<group>.add_argument(...)`` (whose first argument is ``flag``)."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    call = node.value
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"):
        return False
    if flag is None:
        return True
    first = call.args[0] if call.args else None
    return isinstance(first, ast.Constant) and first.value == flag


def _argument_mentions(tree: ast.AST, field_: ConfigField) -> List[str]:
    """Every option string or ``dest`` in ``tree`` that already names ``field_``."""
    dashed = field_.name.replace("_", "-")
    taken = {f"--no-{dashed}", f"--{dashed}", field_.name}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr != "add_argument":
                continue
            values = [a.value for a in node.args if isinstance(a, ast.Constant)]
            values += [
                k.value.value
                for k in node.keywords
                if k.arg == "dest" and isinstance(k.value, ast.Constant)
            ]
            found += [v for v in values if v in taken]
    return found


def add_switch_arguments(text: str, fields: Sequence[ConfigField]) -> str:
    """The snapshot's ``arguments.py`` with the arguments of ``fields``, in order, right after
    ``--optimizer`` in ``_add_training_args``. Raises :class:`SeriesError` for a missing or
    ambiguous anchor and for an argument of such a name or ``dest`` that exists already."""
    tree = ast.parse(text)
    for field_ in fields:
        taken = _argument_mentions(tree, field_)
        if taken:
            raise SeriesError(
                f"{ARGUMENTS_FILE} already has an argument for {field_.name}: {taken}"
            )
    function = _module_node(tree, ast.FunctionDef, ARGUMENTS_FUNCTION, ARGUMENTS_FILE)
    anchors = [n for n in ast.walk(function) if _is_add_argument(n, ARGUMENT_ANCHOR)]
    if len(anchors) != 1:
        raise SeriesError(
            f"{ARGUMENTS_FILE}: expected exactly one add_argument('{ARGUMENT_ANCHOR}', ...) in "
            f"{ARGUMENTS_FUNCTION}, found {len(anchors)}"
        )
    (anchor,) = anchors
    assert isinstance(anchor, ast.Expr) and isinstance(anchor.value, ast.Call)
    func = anchor.value.func
    assert isinstance(func, ast.Attribute)
    if not isinstance(func.value, ast.Name):
        raise SeriesError(
            f"{ARGUMENTS_FILE}: the {ARGUMENT_ANCHOR} argument is not group.add_argument"
        )
    start, end = _node_span(text, anchor)
    black_style = text[start:end].split("\n", 1)[0].rstrip().endswith("(")
    statements = [render_argument(f, func.value.id, black_style) for f in fields]
    for field_, statement in zip(fields, statements):
        check_switch_argument(_block(statement), field_)
    return text[:end] + "".join(_block(s) for s in statements) + text[end:]


def check_switch_argument(statement: str, field_: ConfigField) -> None:
    """Run the added statement against a parser: the field's default without the flag, the
    other value with it."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    tree = ast.parse(textwrap.dedent(statement))
    if len(tree.body) != 1 or not _is_add_argument(tree.body[0]):
        raise SeriesError(f"the argument for {field_.name} is not one add_argument statement")
    call = tree.body[0]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
    assert isinstance(call.value.func, ast.Attribute)
    assert isinstance(call.value.func.value, ast.Name)
    exec(compile(tree, "<argument>", "exec"), {call.value.func.value.id: parser})
    default = getattr(parser.parse_args([]), field_.name)
    flagged = getattr(parser.parse_args([argument_flag(field_)]), field_.name)
    if default is not field_.default or flagged is not (not field_.default):
        raise SeriesError(
            f"{argument_flag(field_)} gives {default} by default and {flagged} when set"
        )


def check_config_copied_from_args(text: str, field_: ConfigField) -> None:
    """Assert that ``get_megatron_optimizer_config`` builds ``OptimizerConfig(**kwargs)`` from
    every field of ``args`` by name (``for f in dataclasses.fields(OptimizerConfig): if
    hasattr(args, f.name): kwargs[f.name] = getattr(args, f.name)``) and does not set ``field_``
    itself, so that the argument's ``dest`` reaches the field with no change to training.py."""
    function = _module_node(ast.parse(text), ast.FunctionDef, CONFIG_FROM_ARGS, TRAINING_FILE)
    source = ast.unparse(function)
    loops = [ast.unparse(n) for n in ast.walk(function) if isinstance(n, ast.For)]
    loops = [re.sub(r"\b(\w+)(?=\.name\b)|(?<=for )\w+", "f", loop) for loop in loops]
    expected = (
        f"for f in dataclasses.fields({CONFIG_CLASS}):\n"
        "    if hasattr(args, f.name):\n"
        "        kwargs[f.name] = getattr(args, f.name)"
    )
    if expected not in loops:
        raise SeriesError(
            f"{TRAINING_FILE}: {CONFIG_FROM_ARGS} no longer copies every {CONFIG_CLASS} field "
            "from args by name; the argument needs a change there too"
        )
    if f"{CONFIG_CLASS}(**kwargs)" not in source:
        raise SeriesError(f"{TRAINING_FILE}: {CONFIG_FROM_ARGS} does not build it from kwargs")
    if field_.name in source:
        raise SeriesError(f"{TRAINING_FILE}: {CONFIG_FROM_ARGS} sets {field_.name} itself")


# ---------------------------------------------------------------------------------------------
# Pull request (b)'s files: the final ones without what split.toml names
# ---------------------------------------------------------------------------------------------


def split_manifest() -> Dict[str, Any]:
    """upstream/prs/split.toml: what (b) leaves out of the final files for (d) to add."""
    return tomllib.loads(SPLIT.read_text())


def _is_string(node: Optional[ast.stmt]) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _defined(node: ast.stmt) -> List[str]:
    """The names a statement binds at its level (imports, definitions, assignments)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    if isinstance(node, ast.If):
        return [name for inner in node.body for name in _defined(inner)]
    targets = node.targets if isinstance(node, ast.Assign) else []
    targets = [node.target] if isinstance(node, ast.AnnAssign) else targets
    elements = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return [e.id for e in elements if isinstance(e, ast.Name)]


def _apply(lines: List[str], removed: List[Tuple[int, int]], replaced: List[Edit]) -> str:
    """Join ``lines`` without the 0-based [first, end) spans ``removed`` (adjacent ones merged;
    where blank lines surround one, those above it go too) and with ``replaced``."""
    merged: List[Tuple[int, int]] = []
    for first, end in sorted(removed):
        if merged and merged[-1][1] >= first:
            first = merged.pop()[0]
        merged.append((first, end))
    edits = list(replaced)
    for first, end in merged:
        if (first == 0 or not lines[first - 1].strip()) and (
            end >= len(lines) - 1 or not lines[end].strip()
        ):
            while first > 0 and not lines[first - 1].strip():
                first -= 1
        edits.append((first, end, []))
    for first, end, new in sorted(edits, reverse=True):
        lines[first:end] = new
    return "\n".join(lines)


Edit = Tuple[int, int, List[str]]


def _span(lines: Sequence[str], body: Sequence[ast.stmt], index: int) -> Tuple[int, int]:
    """0-based [first, end) lines of ``body[index]``: its decorators, the comment lines right
    above it and, for an assignment, the string statement right below it (its docstring)."""
    node = body[index]
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
    while first > 0 and lines[first - 1].strip().startswith("#"):
        first -= 1
    end = node.end_lineno or node.lineno
    following = body[index + 1] if index + 1 < len(body) else None
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_string(following):
        assert following is not None
        end = following.end_lineno or end
    return first, end


def prune_source(source: str, remove: Sequence[str], docstrings: Dict[str, str], what: str) -> str:
    """``source`` without the statements ``remove`` names (``name`` or ``Class.name``) and with
    the docstrings ``docstrings`` names (``""``: the module's; a class, function or constant)
    replaced. Raises :class:`SeriesError` for a name that is not there."""
    tree = ast.parse(source)
    lines = source.split("\n")
    scopes: Dict[str, List[ast.stmt]] = {"": tree.body}
    scopes.update({n.name: n.body for n in tree.body if isinstance(n, ast.ClassDef)})

    def find(name: str) -> Tuple[List[ast.stmt], int]:
        scope, _, member = name.rpartition(".")
        body = scopes.get(scope, [])
        found = [i for i, node in enumerate(body) if member in _defined(node)]
        if len(found) != 1:
            raise SeriesError(f"{SPLIT.name} names {name} in {what}, which has no such name")
        return body, found[0]

    removed = [_span(lines, *find(name)) for name in remove]
    replaced: List[Edit] = []
    for name, text in docstrings.items():
        target: Optional[ast.stmt] = tree.body[0] if tree.body else None
        if name:
            body, index = find(name)
            node = body[index]
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                target = node.body[0]
            else:  # a constant's docstring is the string right below it
                target = body[index + 1] if index + 1 < len(body) else None
        if target is None or not _is_string(target):
            raise SeriesError(f"{SPLIT.name}: {name or 'the module'} in {what} has no docstring")
        indent = " " * target.col_offset
        new = f'{indent}"""{text}"""'.split("\n")
        new[1:] = [indent + line if line.strip() else line for line in new[1:]]
        replaced.append((target.lineno - 1, target.end_lineno or target.lineno, new))
    return _apply(lines, removed, replaced)


def _used_names(tree: ast.AST) -> Set[str]:
    """The names a module reads: in its code, its string annotations and ``__all__``."""
    used: Set[str] = set()
    annotations: List[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.arg) and node.annotation is not None:
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        elif isinstance(node, ast.Assign) and "__all__" in _defined(node):
            used |= {str(e.value) for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
    for constant in (c for a in annotations for c in ast.walk(a)):
        if isinstance(constant, ast.Constant) and isinstance(constant.value, str):
            try:
                quoted = ast.parse(constant.value, mode="eval")
            except SyntaxError:
                continue
            used |= {n.id for n in ast.walk(quoted) if isinstance(n, ast.Name)}
    return used


def render_import(node: ast.ImportFrom, names: Sequence[ast.alias], indent: str) -> List[str]:
    """``from <module> import <names>`` as black writes it: one line if it fits, else one name
    per line."""
    module = "." * node.level + (node.module or "")
    parts = [a.name if a.asname is None else f"{a.name} as {a.asname}" for a in names]
    line = f"{indent}from {module} import {', '.join(parts)}"
    if len(line) <= LINE_LENGTH:
        return [line]
    return [f"{indent}from {module} import (", *(f"{indent}    {p}," for p in parts), f"{indent})"]


def _keep_imports(source: str, keep: Any) -> str:
    """``source`` with each import reduced to the aliases ``keep(node, alias)`` accepts; an
    import, or an ``if`` block of imports, left with none goes."""
    tree = ast.parse(source)
    lines = source.split("\n")
    removed: List[Tuple[int, int]] = []
    replaced: List[Edit] = []
    bodies = [tree.body, *(n.body for n in tree.body if isinstance(n, ast.If))]
    for body in bodies:
        for node in body:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [alias for alias in node.names if keep(node, alias)]
            span = (node.lineno - 1, node.end_lineno or node.lineno)
            if not names:
                removed.append(span)
            elif len(names) < len(node.names):
                indent = " " * node.col_offset
                if isinstance(node, ast.ImportFrom):
                    replaced.append((*span, render_import(node, names, indent)))
                else:
                    replaced.append(
                        (*span, [f"{indent}import {', '.join(map(ast.unparse, names))}"])
                    )
    for node in tree.body:
        if isinstance(node, ast.If) and node.body and not node.orelse:
            inner = {(n.lineno - 1, n.end_lineno or n.lineno) for n in node.body}
            if inner <= set(removed):
                removed = [s for s in removed if s not in inner]
                removed.append((node.lineno - 1, node.end_lineno or node.lineno))
    return _apply(lines, removed, replaced)


def prune_package(sources: Dict[str, str], split: Dict[str, Any]) -> Dict[str, str]:
    """(b)'s modules, by file name, made from the final ``sources`` and split.toml's ``modules``.

    A module split.toml marks ``omit`` is left out. Each module loses the names split.toml lists
    and the imports only they used; ``__init__.py``
    also the names the modules no longer define, the statements that use them and their
    ``__all__`` entries. Raises :class:`SeriesError` for a module or name that does not exist,
    and for a name a module reads that nothing defines any more.
    """
    unknown = sorted(set(split) - set(sources))
    if unknown:
        raise SeriesError(f"{SPLIT.name} names modules that do not exist: {unknown}")
    pruned = {}
    for name, source in sources.items():
        entry = split.get(name, {})
        if entry.get("omit", False):
            continue
        text = prune_source(source, entry.get("remove", []), entry.get("docstrings", {}), name)
        was = _used_names(ast.parse(source))
        while True:  # an emptied ``if TYPE_CHECKING:`` frees TYPE_CHECKING
            used = _used_names(ast.parse(text))
            previous, text = text, _keep_imports(
                text, lambda node, a: _bound(a) in used or _bound(a) not in was
            )
            if text == previous:
                break
        pruned[name] = text
    defined = {
        name.removesuffix(".py"): {n for s in ast.parse(text).body for n in _defined(s)}
        for name, text in pruned.items()
    }
    init = pruned.get("__init__.py")
    if init is not None:
        init = _keep_imports(
            init,
            lambda node, a: not (
                isinstance(node, ast.ImportFrom)
                and node.level == 1
                and node.module in defined
                and a.name not in defined[node.module]
            ),
        )
        tree = ast.parse(init)
        lines = init.split("\n")
        bound = {n for s in tree.body for n in _defined(s)} | set(dir(builtins))
        removed = [
            _span(lines, tree.body, i)
            for i, node in enumerate(tree.body)
            if not _defined(node) and _used_names(node) - bound
        ]
        replaced: List[Edit] = []
        for node in tree.body:
            if isinstance(node, ast.Assign) and _defined(node) == ["__all__"]:
                names = [e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)]
                kept = [f'"{n}"' for n in names if n in bound]
                line = f"__all__ = [{', '.join(kept)}]"
                new = (
                    [line]
                    if len(line) <= LINE_LENGTH
                    else ["__all__ = [", *(f"    {n}," for n in kept), "]"]
                )
                replaced.append((node.lineno - 1, node.end_lineno or node.lineno, new))
        pruned["__init__.py"] = _apply(lines, removed, replaced)
    for name, text in pruned.items():
        _check_names(name, ast.parse(text), defined)
    return pruned


def _bound(alias: ast.alias) -> str:
    return (alias.asname or alias.name).split(".")[0]


def _check_names(name: str, tree: ast.Module, defined: Dict[str, Set[str]]) -> None:
    """Refuse a module that reads a name nothing binds, or a sibling module's name it lacks."""
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.stmt):
            bound |= set(_defined(node))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    missing = _used_names(tree) - bound
    siblings = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                if node.module is None and alias.name in defined:
                    siblings[_bound(alias)] = alias.name
                elif node.module in defined and alias.name not in defined[str(node.module)]:
                    missing.add(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = siblings.get(node.value.id)
            if module is not None and node.attr not in defined[module]:
                missing.add(f"{module}.{node.attr}")
    if missing:
        raise SeriesError(
            f"(b)'s {name} would read {sorted(missing)}, which it no longer has: "
            f"{SPLIT.name} must remove what uses them too"
        )


# ---------------------------------------------------------------------------------------------
# The files of the pull requests
# ---------------------------------------------------------------------------------------------


def add_docs_toctree_entry(text: str, entry: str) -> str:
    """Append ``entry`` to the (single) toctree of ``docs/api-guide/core/index.md``."""
    match = re.search(r"```\{toctree\}\n(?:.*\n)*?(?=```)", text)
    if match is None:
        raise SeriesError(f"{DOCS_INDEX} has no toctree")
    if re.search(rf"^{re.escape(entry)}$", match.group(0), re.MULTILINE):
        raise SeriesError(f"{DOCS_INDEX} already lists {entry}")
    return text[: match.end()] + entry + "\n" + text[match.end() :]


def with_header(source: str) -> str:
    """``source`` after Megatron-LM's copyright line (once: a file of ours may have it already)."""
    return source if source.startswith(PYTHON_HEADER) else PYTHON_HEADER + source


def subsystem_files(final: bool = True) -> Dict[str, str]:
    """Upstream path -> content of every subsystem module: ours (``final``, pull request (d)'s)
    or (b)'s, with the copyright line."""
    sources = {p.name: p.read_text() for p in sorted((REPO_ROOT / SUBSYSTEM).glob("*.py"))}
    if not final:
        sources = prune_package(sources, split_manifest().get("modules", {}))
    return {f"{SUBSYSTEM}/{name}": with_header(text) for name, text in sources.items()}


def in_place_merge_files() -> Dict[str, str]:
    """Upstream path -> content of the in-place merge module (with the copyright line) and of
    its unit test: pull request (c)'s new files."""
    return {
        IN_PLACE_MERGE: with_header((REPO_ROOT / IN_PLACE_MERGE).read_text()),
        **test_files(True, [IN_PLACE_MERGE_TEST]),
    }


PR_TESTS = {
    A: [ADAM_STEP_TEST],
    B: [ADOPTION_TEST],
    C: [IN_PLACE_MERGE_TEST],
    D: [ROLES_TEST, OFFLOADER_TEST],
}
"""The unit tests (``upstream/tests/unit_tests/...``, at their Megatron-LM path) of each pull
request; ``OFFLOADER_TEST`` only where the snapshot has the chunked offloader."""


def test_files(offloader: bool, paths: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """Upstream path -> content of the unit tests ``paths`` (default: every pull request's).

    Raises :class:`SeriesError` for a test file (or ``.diff`` of a Megatron-LM test) here that no
    pull request carries and for one a pull request needs that does not exist (yet).
    """
    root = UPSTREAM_DIR / "tests" / "unit_tests"
    known = {path for tests in PR_TESTS.values() for path in tests}
    here = {f"tests/unit_tests/{p.relative_to(root).as_posix()}" for p in root.rglob("*.py")}
    if here - known:
        raise SeriesError(f"no pull request carries {sorted(here - known)}; add them to PR_TESTS")
    changes = {p.relative_to(UPSTREAM_DIR).as_posix() for p in root.rglob("*.diff")}
    unknown = changes - {f"{path}.diff" for path in CHANGED_TESTS}
    if unknown:
        raise SeriesError(f"no pull request carries {sorted(unknown)}; add to PR_TEST_CHANGES")
    files = {}
    for path in known if paths is None else paths:
        if path == OFFLOADER_TEST and not offloader:
            continue
        source = UPSTREAM_DIR / path
        if not source.exists():
            raise SeriesError(
                f"{source.relative_to(REPO_ROOT)} does not exist (yet): its pull request needs it"
            )
        files[path] = source.read_text()
    return dict(sorted(files.items()))


def changed_test_hunks(path: str) -> List[Hunk]:
    """The hunks of ``upstream/<path>.diff``, our change to the Megatron-LM test ``path``.

    Raises :class:`SeriesError` where the diff is missing, changes another file or has no hunk.
    """
    source = UPSTREAM_DIR / f"{path}.diff"
    if not source.exists():
        raise SeriesError(f"{source.relative_to(REPO_ROOT)} does not exist: it changes {path}")
    text = source.read_text()
    changed = {
        line[4:].strip().removeprefix("b/") for line in text.splitlines() if line.startswith("+++ ")
    }
    hunks = parse_hunks(text, path)
    if changed != {path} or not hunks:
        raise SeriesError(f"{source.name} must change {path} only, with at least one hunk")
    return hunks


def changed_tests(files: Dict[str, str], name: str) -> Dict[str, str]:
    """Upstream path -> the snapshot's test (in ``files``) with our change, for every Megatron-LM
    test pull request ``name`` changes (``PR_TEST_CHANGES``). Raises :class:`SeriesError` for a
    hunk whose removed lines and context are missing or ambiguous in the snapshot's file."""
    return {
        path: change_file(files[path], changed_test_hunks(path), path, False)
        for path in PR_TEST_CHANGES.get(name, [])
    }


def docs_files() -> Dict[str, str]:
    """Upstream path -> content of our docs pages."""
    root = UPSTREAM_DIR / "docs"
    return {
        f"docs/{p.relative_to(root).as_posix()}": p.read_text() for p in sorted(root.rglob("*.md"))
    }


def added_files(offloader: bool) -> List[str]:
    """The paths of the files the pull requests add (recorded in series.json)."""
    return sorted(
        {**subsystem_files(), **test_files(offloader), **docs_files(), **in_place_merge_files()}
    )


def docs_section(page: str, title: str) -> str:
    """The body of the ``## title`` section of a Markdown page (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", page, re.MULTILINE | re.DOTALL)
    if match is None:
        raise SeriesError(f"{DOCS_PAGE} has no section '## {title}'")
    return match.group(1).strip("\n") + "\n"


def rewrap(markdown: str, width: int = MESSAGE_WIDTH) -> str:
    """Re-wrap Markdown paragraphs and list items to ``width`` (no code blocks expected)."""
    if "```" in markdown:
        raise SeriesError("a section carried into a description has a code block")
    out = []
    for block in re.split(r"\n\s*\n", markdown.strip("\n")):
        for item in re.split(r"\n(?=(?:[-*]|\d+\.) )", block):
            bullet = re.match(r"(?:[-*]|\d+\.) ", item)
            prefix = bullet.group(0) if bullet else ""
            out.append(
                textwrap.fill(
                    " ".join(item[len(prefix) :].split()),
                    width=width,
                    initial_indent=prefix,
                    subsequent_indent=" " * len(prefix),
                    break_on_hyphens=False,
                    break_long_words=False,
                )
            )
        out.append("")
    return "\n".join(out)


@dataclass
class PullRequest:
    """One pull request: its folder name, description and commits."""

    name: str
    description: str
    """The cover letter's text: the title, a blank line, the body."""
    commits: List[Tuple[str, Dict[str, str]]] = field(default_factory=list)
    """(commit message, files written) per commit, in order."""


def pr_texts(name: str, offloader: bool) -> Tuple[str, List[str]]:
    """The description and the commit messages of pull request ``name`` (``prs/<name>.md``).

    The file is ``# <title>``, the description, then ``## Commit: <subject>`` and its message
    per commit. A paragraph ``[offloader] ...`` is kept, without the marker, only where the
    snapshot has the chunked offloader; a paragraph ``[docs: <title>]`` becomes that section of
    the docs page, re-wrapped. Every line fits in 72 columns.
    """
    path = PRS_DIR / f"{name}.md"
    page = (UPSTREAM_DIR / "docs" / Path(DOCS_PAGE).relative_to("docs")).read_text()
    paragraphs = []
    for paragraph in path.read_text().strip("\n").split("\n\n"):
        if paragraph.startswith("[offloader] "):
            if not offloader:
                continue
            paragraph = paragraph.removeprefix("[offloader] ")
        docs = re.fullmatch(r"\[docs: (.+)\]", paragraph)
        if docs:
            paragraph = f"## {docs.group(1)}\n\n" + rewrap(docs_section(page, docs.group(1)))
        paragraphs.append(paragraph.strip("\n"))
    head, *commits = re.split(r"^## Commit: ", "\n\n".join(paragraphs) + "\n", flags=re.M)
    if not head.startswith("# ") or not commits:
        raise SeriesError(f"{path.name}: expected '# <title>', the text and '## Commit: ' sections")
    title, _, body = head[2:].partition("\n")
    texts = [f"{title}\n\n{body.strip()}\n", *(c.strip("\n") + "\n" for c in commits)]
    too_wide = [line for text in texts for line in text.splitlines() if len(line) > MESSAGE_WIDTH]
    if too_wide:
        raise SeriesError(f"{path.name}: lines wider than {MESSAGE_WIDTH} columns: {too_wide}")
    return texts[0], texts[1:]


def pull_requests(snapshot: "Snapshot") -> List[PullRequest]:
    """The four pull requests for ``snapshot``, in the order they stack."""
    files, off = snapshot.files, snapshot.offloader
    config_hunks = our_hunks(CONFIG_FILE)
    for field_ in config_fields(config_hunks):
        check_config_copied_from_args(snapshot.checked[TRAINING_FILE], field_)
    later = split_manifest().get("optimizer_config", {})
    b_config = [Hunk(h.before, [], _pruned_block(h.added, later), h.after) for h in config_hunks]
    b_subsystem = subsystem_files(final=False)
    b_names = set(package_names(b_subsystem[f"{SUBSYSTEM}/__init__.py"]))
    # The fix is an insertion, not an export or load that the offloader's special case routes.
    fixed = change_file(files[CALL_SITE], our_hunks(CALL_SITE, bug_fix=True), CALL_SITE, False)

    def config(hunks: List[Hunk]) -> Dict[str, str]:
        return {
            CONFIG_FILE: change_optimizer_config(files[CONFIG_FILE], hunks),
            ARGUMENTS_FILE: add_switch_arguments(files[ARGUMENTS_FILE], config_fields(hunks)),
        }

    def changed(path: str, text: str, hunks: Optional[List[Hunk]] = None) -> Dict[str, str]:
        return {path: change_file(text, our_hunks(path) if hunks is None else hunks, path, off)}

    def tests(name: str) -> Dict[str, str]:
        return test_files(off, PR_TESTS[name])

    commits = {
        A: [{CALL_SITE: fixed, **tests(A)}],
        B: [
            {**b_subsystem, **config(b_config)},
            {**changed(CALL_SITE, fixed, staged_call_site_hunks(our_hunks(CALL_SITE), b_names))}
            | tests(B),
        ],
        C: [
            {
                **in_place_merge_files(),
                **changed(UTILS_FILE, files[UTILS_FILE]),
                **changed_tests(files, C),
            }
        ],
        D: [
            {**subsystem_files(), **config(config_hunks)},
            {
                **changed(CALL_SITE, fixed),
                **changed(NON_DISTRIBUTED_FILE, files[NON_DISTRIBUTED_FILE]),
            }
            | tests(D),
            {
                **docs_files(),
                DOCS_INDEX: add_docs_toctree_entry(files[DOCS_INDEX], Path(DOCS_PAGE).stem),
            },
        ],
    }
    prs = []
    for name in PULL_REQUESTS:
        description, messages = pr_texts(name, off)
        if len(messages) != len(commits[name]):
            raise SeriesError(
                f"prs/{name}.md: {len(messages)} messages, {len(commits[name])} commits"
            )
        prs.append(PullRequest(name, description, list(zip(messages, commits[name]))))
    return prs


def _pruned_block(lines: Sequence[str], split: Dict[str, Any]) -> List[str]:
    """Added lines of a class body without the fields ``split["remove"]`` names (and with its
    ``docstrings``), as :func:`prune_source` does to a module."""
    indent = " " * min(_width(line) for line in lines if line.strip())
    text = textwrap.dedent(_block(lines))
    pruned = prune_source(text, split.get("remove", []), split.get("docstrings", {}), CONFIG_FILE)
    return _indent(pruned.split("\n")[:-1], indent)


def package_names(init: str) -> List[str]:
    """The ``__all__`` of a subsystem ``__init__.py`` (default: ours, the final one)."""
    for node in ast.parse(init).body:
        if isinstance(node, ast.Assign) and _defined(node) == ["__all__"]:
            return [str(e.value) for e in ast.walk(node.value) if isinstance(e, ast.Constant)]
    raise SeriesError(f"{SUBSYSTEM}/__init__.py has no __all__")


def series_commits(snapshot: "Snapshot") -> List[Tuple[str, Dict[str, str]]]:
    """Every commit of the four pull requests, in order: (commit message, files written)."""
    return [commit for pr in pull_requests(snapshot) for commit in pr.commits]


# ---------------------------------------------------------------------------------------------
# git and the snapshot
# ---------------------------------------------------------------------------------------------


def _git(
    cwd: Path, *args: str, env: Optional[Dict[str, str]] = None, input: Optional[str] = None
) -> str:
    result = subprocess.run(
        ["git", *args], cwd=cwd, env=env, input=input, check=True, capture_output=True, text=True
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
    """The Megatron-LM files the pull requests change (``files``) and only read to check an
    assumption (``checked``), from one commit of one branch."""

    branch: str
    commit: str
    files: Dict[str, str]
    checked: Dict[str, str]

    @classmethod
    def from_git_dir(cls, git_dir: Path, branch: str, commit: Optional[str] = None) -> "Snapshot":
        """Read the files of ``commit`` (any revision; default: the tip of ``branch``)."""
        revision = commit or f"refs/heads/{branch}"
        commit = _git(git_dir, "rev-parse", f"{revision}^{{commit}}").strip()
        files = {p: _git(git_dir, "show", f"{commit}:{p}") for p in SNAPSHOT_FILES}
        checked = {p: _git(git_dir, "show", f"{commit}:{p}") for p in CHECKED_UPSTREAM_FILES}
        return cls(branch, commit, files, checked)

    @property
    def offloader(self) -> bool:
        """Whether ``DistributedOptimizer.load_state_dict`` has the offloader's special case."""
        return has_offloader_special_case(self.files[CALL_SITE])


# ---------------------------------------------------------------------------------------------
# Building, checking and recording
# ---------------------------------------------------------------------------------------------


def build(
    snapshot: Snapshot, out_dir: Path, identity: Optional[Tuple[str, str]] = None
) -> List[Path]:
    """Write the pull requests for ``snapshot`` into ``out_dir/<pull request>/`` (``out_dir``
    emptied first) and return every patch, cover letters included, in the order they apply.
    Each is a branch on the previous one's tip in a scratch repository, whose description is its
    cover letter's. ``identity``: (name, email) of the author, default this repository's user."""
    name, email = identity or _identity()
    env = _commit_env(name, email)
    prs = pull_requests(snapshot)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    patches: List[Path] = []
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        _git(work, "init", "-q", "-b", "base", env=env)
        _write(work, snapshot.files)
        _git(work, "add", "-A", env=env)
        _git(
            work, "commit", "-q", "-m", f"Megatron-LM {snapshot.branch} {snapshot.commit}", env=env
        )
        for pr in prs:
            start = _git(work, "rev-parse", "HEAD").strip()
            _git(work, "checkout", "-q", "-b", pr.name, env=env)
            _git(work, "config", f"branch.{pr.name}.description", pr.description, env=env)
            for message, files in pr.commits:
                _write(work, files)
                _git(work, "add", "-A", env=env)
                _git(work, "commit", "-q", "-s", "-F", "-", env=env, input=message)
            folder = out_dir / pr.name
            folder.mkdir(parents=True)
            range_ = f"{start}..{pr.name}"
            _git(work, *FORMAT_PATCH, "-o", str(folder), range_, env=env)
            patches += sorted(folder.glob("*.patch"))
    return patches


def code_patches(patches: Sequence[Path]) -> List[Path]:
    """The patches without the cover letters (which ``git apply`` and ``git am`` cannot take)."""
    return [p for p in patches if p.name != COVER_LETTER]


def by_pull_request(patches: Sequence[Path]) -> Dict[str, List[Path]]:
    """The code patches of each pull request (their folder), in ``PULL_REQUESTS`` order."""
    grouped: Dict[str, List[Path]] = {name: [] for name in PULL_REQUESTS}
    for patch in code_patches(patches):
        if patch.parent.name not in grouped:
            raise SeriesError(f"{patch} is in no pull request's folder")
        grouped[patch.parent.name].append(patch)
    return grouped


def line_counts(patches: Sequence[Path]) -> Dict[str, List[int]]:
    """Per file, the lines ``patches`` add and remove (``git apply --numstat``)."""
    counts: Dict[str, List[int]] = {}
    if not patches:
        return counts
    result = subprocess.run(
        ["git", "apply", "--numstat", *map(str, patches)],
        check=True,
        capture_output=True,
        text=True,
    )
    for line in result.stdout.splitlines():
        added, removed, path = line.split("\t")
        total = counts.setdefault(path, [0, 0])
        total[0] += int(added)
        total[1] += int(removed)
    return dict(sorted(counts.items()))


def manifest() -> Dict[str, Dict[str, Any]]:
    """upstream/series.json: per branch, what the pull requests were last built against."""
    data: Dict[str, Dict[str, Any]] = json.loads(MANIFEST.read_text())
    return data


def blob_id(content: str) -> str:
    """The git blob id of ``content``."""
    result = subprocess.run(
        ["git", "hash-object", "--stdin"], input=content, text=True, check=True, capture_output=True
    )
    return result.stdout.strip()


def record(snapshot: Snapshot, patches: Sequence[Path], apply_check: str) -> None:
    """Record the snapshot, its files' blob ids, each pull request's patches and line counts,
    and rewrite README's table of them."""
    data = manifest() if MANIFEST.exists() else {}
    data[snapshot.branch] = dict(
        snapshot_commit=snapshot.commit,
        offloader_special_case=snapshot.offloader,
        pre_image_blobs={p: blob_id(c) for p, c in sorted(snapshot.files.items())},
        checked_blobs={p: blob_id(c) for p, c in sorted(snapshot.checked.items())},
        pull_requests={
            name: dict(patches=[p.name for p in prs], lines=line_counts(prs))
            for name, prs in by_pull_request(patches).items()
        },
        added_files=added_files(snapshot.offloader),
        git_apply_check=apply_check,
        series_date=SERIES_DATE,
        author="{} <{}>".format(*_identity()),
    )
    MANIFEST.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    README.write_text(with_table(README.read_text(), data))


def _count(counts: Optional[Sequence[int]]) -> str:
    return "—" if counts is None else f"+{counts[0]} −{counts[1]}"


def _cell(per_branch: Dict[str, Optional[Sequence[int]]]) -> str:
    """One count, or one per branch where they differ."""
    values = list(per_branch.values())
    if all(v == values[0] for v in values):
        return _count(values[0])
    return "; ".join(f"{branch} {_count(v)}" for branch, v in per_branch.items())


def pr_table(data: Dict[str, Dict[str, Any]]) -> str:
    """README's table: per pull request, its files and the lines it adds and removes."""
    branches = [b for b in BRANCHES if "pull_requests" in data.get(b, {})]
    rows = ["| pull request | file | lines |", "|---|---|---|"]
    for name in PULL_REQUESTS:
        lines = {b: data[b]["pull_requests"][name]["lines"] for b in branches}
        for path in sorted({p for b in branches for p in lines[b]}):
            rows.append(
                f"| {name} | `{path}` | {_cell({b: lines[b].get(path) for b in branches})} |"
            )
        totals = {b: [sum(c[i] for c in lines[b].values()) for i in (0, 1)] for b in branches}
        rows.append(f"| **{name}** | **all files** | **{_cell(dict(totals.items()))}** |")
    return "\n".join(rows) + "\n"


def with_table(readme: str, data: Dict[str, Dict[str, Any]]) -> str:
    """``readme`` with the table between ``TABLE_BEGIN`` and ``TABLE_END`` rewritten."""
    pattern = re.escape(TABLE_BEGIN) + r"\n.*?" + re.escape(TABLE_END)
    if len(re.findall(pattern, readme, flags=re.DOTALL)) != 1:
        raise SeriesError(f"{README.name} needs the lines {TABLE_BEGIN!r} and {TABLE_END!r} once")
    table = f"{TABLE_BEGIN}\n{pr_table(data)}{TABLE_END}"
    return re.sub(pattern, lambda _: table, readme, flags=re.DOTALL)


def work_tree(git_dir: Path, commit: str, into: Path) -> None:
    """Extract the full tree of ``commit`` into ``into`` and make it a git repository."""
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", commit], check=True, capture_output=True
    )
    subprocess.run(["tar", "x", "-C", str(into)], input=archive.stdout, check=True)
    _git(into, "init", "-q")


def apply_check(git_dir: Path, commit: str, patches: Sequence[Path]) -> str:
    """On a full work tree of ``commit``, ``git apply --check`` each patch, then apply it: every
    pull request in turn on its predecessors, and each of ``STANDALONE`` alone; return a
    summary. Raises :class:`SeriesError` at the first patch that does not apply."""
    prs = by_pull_request(patches)
    letters = {name: name[0] for name in PULL_REQUESTS}
    runs = [list(PULL_REQUESTS), *([n] for n in STANDALONE if n != PULL_REQUESTS[0])]
    for run in runs:
        with tempfile.TemporaryDirectory() as scratch:
            tree = Path(scratch)
            work_tree(git_dir, commit, tree)
            for index, name in enumerate(run):
                if not prs[name]:
                    raise SeriesError(f"pull request {name} has no patches")
                for patch in prs[name]:
                    result = subprocess.run(
                        ["git", "apply", "--check", str(patch)],
                        cwd=tree,
                        capture_output=True,
                        text=True,
                    )
                    if result.returncode != 0:
                        on = "+".join(letters[n] for n in run[:index]) or "the snapshot"
                        message = f"{name}/{patch.name} does not apply on {on} at {commit}"
                        raise SeriesError(f"{message}:\n{result.stderr}")
                    subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True)
    alone = " and ".join(letters[n] for n in STANDALONE)
    stacked = ", ".join(letters[n] for n in PULL_REQUESTS)
    return f"ok: {stacked} apply in turn and {alone} alone to a full work tree of {commit}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: ``build`` (check and record) or ``check`` the pull requests per branch."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("build", "check"))
    parser.add_argument(
        "--git-dir", type=Path, required=True, help="Megatron-LM git directory (fetched mirror)"
    )
    parser.add_argument("--branch", choices=BRANCHES, action="append")
    parser.add_argument(
        "--snapshot-commit",
        help="build at this revision (default: the one in series.json, else the branch's tip)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="goes to OUT/<branch>/<pr>/")
    args = parser.parse_args(argv)
    branches = args.branch or list(BRANCHES)
    if args.snapshot_commit is not None and len(branches) != 1:
        parser.error("--snapshot-commit needs exactly one --branch")
    recorded = manifest() if MANIFEST.exists() else {}
    for branch in branches:
        commit = args.snapshot_commit or recorded.get(branch, {}).get("snapshot_commit")
        out_dir = args.out / branch
        if args.command == "check":
            patches = [
                p for name in PULL_REQUESTS for p in sorted((out_dir / name).glob("*.patch"))
            ]
            print(f"{branch}: {apply_check(args.git_dir, str(commit), patches)}")
            continue
        snapshot = Snapshot.from_git_dir(
            args.git_dir, branch, None if commit is None else str(commit)
        )
        patches = build(snapshot, out_dir)
        print(f"{branch} @ {snapshot.commit}: {len(PULL_REQUESTS)} pull requests in {out_dir}")
        for name, prs in by_pull_request(patches).items():
            added, removed = (sum(c[i] for c in line_counts(prs).values()) for i in (0, 1))
            print(f"  {name}: {len(prs)} commits, +{added} -{removed}")
        check = apply_check(args.git_dir, snapshot.commit, patches)
        print(f"  {check}")
        record(snapshot, patches, check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
