"""Build the Megatron-LM pull request for optimizer-state adoption as a ``git format-patch`` series.

Nothing of the series is committed: one command builds it from this repository's files and a
Megatron-LM snapshot into an ignored folder, byte for byte the same every time, and records in
``upstream/series.json`` what it was built against (see upstream/README.md).

* ``megatron/core/optimizer/state_adoption/*.py``  -> the subsystem, at the same path upstream
  (Megatron-LM's copyright line is prepended, as its copyright check requires), exactly the
  modules that exist here;
* ``patches/*.patch``                              -> the hunks in ``distrib_optimizer.py`` and
  ``optimizer.py`` (the call sites and the plugin loading) and the
  ``OptimizerConfig.optimizer_state_adoption`` field in ``optimizer_config.py``; only the patches
  for the newest release (``find_patches``), which ``main`` and ``dev`` follow;
* ``BUG_FIX_PATCH``                                -> the first commit, alone: our fix of an
  upstream bug in ``distrib_optimizer.py`` (the call sites' hunks apply to the fixed file);
* ``megatron/core/dist_checkpointing/in_place_merge.py`` and the hunks in
  ``megatron/core/transformer/utils.py`` -> the last commit, independent of state adoption (the
  loaded pieces of a ShardedTensorFactory merge into a view), with its unit test from
  ``upstream/tests/unit_tests/dist_checkpointing/``;
* the config field                                 -> its Megatron-LM argument
  (``--no-optimizer-state-adoption`` in ``megatron/training/arguments.py``), generated from the
  field our patch adds; ``training.py``'s ``get_megatron_optimizer_config`` is checked to copy
  every ``OptimizerConfig`` field from the arguments by name, so it needs no change;
* ``upstream/tests/unit_tests/...``                -> the unit tests, at the same path upstream;
* ``upstream/docs/...``                            -> the docs entry, at the same path upstream,
  plus one toctree line in ``docs/api-guide/core/index.md``;
* the cover letter (``0000-cover-letter.patch``, by ``git format-patch --cover-letter``): its text
  here plus the docs page's sections on why this is not in Transformer Engine and on the review
  of Megatron-LM PR 7288, re-wrapped for e-mail.

Our hunks are carried by content, not by line number: a hunk's removed lines (an insertion's
last leading context line) with the fewest context lines around them that occur exactly once in
the snapshot's file, compared without indentation; the added lines are indented as much deeper
as the snapshot indents the removed ones. Where the snapshot's ``DistributedOptimizer`` has the
chunked optimizer-state offloader's special case (``dev``: ``self._optimizer_state_offloader``
with ``load_state_dict_without_device_cast``), the export and the load are routed only on the path
without an offloader: the offloaded path keeps upstream's calls (see upstream/README.md). Tests
that only make sense with the offloader (``*_offloader.py``) are added only there.

The config field is inserted before the section that follows it in our patch (the
``Miscellaneous`` header), which must occur exactly once in ``class OptimizerConfig``. The
argument goes right after the ``--optimizer`` argument in ``_add_training_args``, written in that
file's style (``main``: the old hand-wrapped style, ``dev``: black). The generator refuses
(``SeriesError``) an anchor that is missing or ambiguous.

The series is reproducible byte for byte: fixed dates, ``--zero-commit``, no signature. The base
commit holds only the snapshot files the series touches, which is all ``git format-patch`` reads.

Usage::

    python upstream/build_series.py build --git-dir MIRROR.git    # -> build/upstream-series/<branch>/
    python upstream/build_series.py check --git-dir MIRROR.git    # git apply --check of that build
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
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # build_tools, next to upstream/

from build_tools.patching import find_patches  # noqa: E402
from build_tools.releases import DEFAULT_UPSTREAM_VERSION  # noqa: E402

UPSTREAM_DIR = REPO_ROOT / "upstream"
MANIFEST = UPSTREAM_DIR / "series.json"
DEFAULT_OUT = REPO_ROOT / "build" / "upstream-series"
"""Where ``build`` writes the series (``<branch>/*.patch``); ignored by git."""

SUBSYSTEM = "megatron/core/optimizer/state_adoption"
CALL_SITE = "megatron/core/optimizer/distrib_optimizer.py"
NON_DISTRIBUTED_FILE = "megatron/core/optimizer/optimizer.py"
"""MegatronOptimizer (plugin loading), Float16OptimizerWithFloat16Params and FP32Optimizer."""
CONFIG_FILE = "megatron/core/optimizer/optimizer_config.py"
CONFIG_CLASS = "OptimizerConfig"
ARGUMENTS_FILE = "megatron/training/arguments.py"
ARGUMENTS_FUNCTION = "_add_training_args"
ARGUMENT_ANCHOR = "--optimizer"
TRAINING_FILE = "megatron/training/training.py"
CONFIG_FROM_ARGS = "get_megatron_optimizer_config"
UTILS_FILE = "megatron/core/transformer/utils.py"
"""``cat_with_oom_fallback``: the merge of a ShardedTensorFactory's loaded pieces."""
IN_PLACE_MERGE = "megatron/core/dist_checkpointing/in_place_merge.py"
IN_PLACE_MERGE_TEST = "tests/unit_tests/dist_checkpointing/test_in_place_merge.py"
DOCS_INDEX = "docs/api-guide/core/index.md"
DOCS_PAGE = "docs/api-guide/core/optimizer_state_adoption.md"
TESTS_ROOT = "tests/unit_tests"
BRANCHES = ("main", "dev")
PATCHED_FILES = (CALL_SITE, NON_DISTRIBUTED_FILE, CONFIG_FILE, UTILS_FILE)
"""The files the newest release's ``patches/*.patch`` may change; a patch changing any other is
refused."""
BUG_FIX_PATCH = "0006-distrib-optimizer-keep-the-loaded-adam-step-with-cpu-offload.patch"
"""Our fix of an upstream bug (NVIDIA/Megatron-LM#1842): the first commit of the series, alone;
every other patch's hunks go to the commits that carry their files."""
TOUCHED_UPSTREAM_FILES = (
    CALL_SITE,
    NON_DISTRIBUTED_FILE,
    CONFIG_FILE,
    UTILS_FILE,
    ARGUMENTS_FILE,
    DOCS_INDEX,
)
"""The snapshot files the series changes (the base commit of the series holds exactly these)."""
CHECKED_UPSTREAM_FILES = (TRAINING_FILE,)
"""Snapshot files the generator reads to check an assumption, but does not change."""
COVER_LETTER = "0000-cover-letter.patch"

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
            hunks.extend(parse_hunks(text, path, split_blocks=True))
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
    """Apply our hunks for ``path`` to the snapshot's ``text``.

    Args:
        text: the snapshot's file.
        hunks: our patch's hunks for it.
        path: its path (for messages).
        offloader: whether the snapshot's ``DistributedOptimizer`` has the offloader's special
            case (then the export and the load are routed only without an offloader).

    Returns:
        The changed file. Raises :class:`SeriesError` if a hunk's place is missing or ambiguous.
    """
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


# ---------------------------------------------------------------------------------------------
# The config switch: the OptimizerConfig field and its Megatron-LM argument
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


def adoption_switch(hunks: Sequence[Hunk]) -> ConfigField:
    """The one field our patch adds: a ``bool`` that is True by default (the argument turns it off)."""
    fields = config_fields(hunks)
    if len(fields) != 1 or fields[0].annotation != "bool" or fields[0].default is not True:
        raise SeriesError(
            f"expected one 'bool = True' field in our {CONFIG_FILE} hunks, found {fields}; "
            "teach upstream/build_series.py which arguments they need"
        )
    return fields[0]


def change_optimizer_config(text: str, hunks: Sequence[Hunk]) -> str:
    """Insert our fields into a snapshot's ``OptimizerConfig``, matched by content.

    Each hunk must be a pure insertion. Its anchor is the last line of its leading context
    followed by its trailing context (on ``main`` and ``dev``: the blank line before the
    ``Miscellaneous`` section header); it must occur exactly once inside ``class
    OptimizerConfig``. The earlier leading context may differ (``dev`` has more offload
    fields before that header), so the new section lands before the same section everywhere.

    Args:
        text: the snapshot's ``optimizer_config.py``.
        hunks: our patch's hunks for it.

    Returns:
        The changed file. Raises :class:`SeriesError` if an anchor is missing or ambiguous, or
        if the class already has a field of that name.
    """
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


ARGUMENT_HELP = (
    "Always run the inner optimizer's own code where Megatron Core hands it optimizer state "
    "while loading a checkpoint (e.g. its load_state_dict and state_dict), and load no state "
    "adopter plugins. By default, registered state adopters "
    "(megatron.core.optimizer.state_adoption) may do that work, e.g. install Transformer Engine "
    "FusedAdam's FP32 moments by reference instead of as a second copy."
)
"""Help text of the Megatron-LM argument that switches state adoption off."""


def argument_flag(switch: ConfigField) -> str:
    """``--no-optimizer-state-adoption`` for the field ``optimizer_state_adoption``."""
    return "--no-" + switch.name.replace("_", "-")


def _help_segments(width: int) -> List[str]:
    """The help text as implicitly concatenated string literals of at most ``width`` characters."""
    lines = textwrap.wrap(ARGUMENT_HELP, width=width - 3, break_on_hyphens=False)
    quote = '"' if "'" in ARGUMENT_HELP else "'"
    return [
        quote + line + (" " if i < len(lines) - 1 else "") + quote for i, line in enumerate(lines)
    ]


def render_argument(switch: ConfigField, group: str, black_style: bool) -> List[str]:
    """The ``add_argument`` statement for ``switch``, in the style of the file it goes into.

    Args:
        switch: the config field the argument sets (``action='store_false'``).
        group: the argument group's variable name.
        black_style: black's layout (``dev``) instead of the hand-wrapped one (``main``).
    """
    flag, dest = argument_flag(switch), switch.name
    if black_style:
        indent = " " * 8
        opening = [f"    {group}.add_argument("]
        options = [
            f"{indent}'{flag}',",
            f"{indent}action='store_false',",
            f"{indent}dest='{dest}',",
        ]
        closing = ",\n    )"
    else:
        head = f"    {group}.add_argument("
        indent = " " * len(head)
        opening = []
        options = [f"{head}'{flag}', action='store_false',", f"{indent}dest='{dest}',"]
        closing = ")"
    segments = _help_segments(100 - len(indent) - len("help="))
    help_lines = [f"{indent}help={segments[0]}", *(indent + s for s in segments[1:])]
    return [*opening, *options, *help_lines[:-1], *(help_lines[-1] + closing).split("\n")]


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


def _argument_mentions(tree: ast.AST, switch: ConfigField) -> List[str]:
    """Every option string or ``dest`` in ``tree`` that already names ``switch``."""
    taken = {argument_flag(switch), "--" + switch.name.replace("_", "-"), switch.name}
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


def add_switch_argument(text: str, switch: ConfigField) -> str:
    """Add the argument for ``switch`` right after ``--optimizer`` in ``_add_training_args``.

    Args:
        text: the snapshot's ``megatron/training/arguments.py``.
        switch: the config field the argument sets.

    Returns:
        The changed file. Raises :class:`SeriesError` if the anchor is missing or ambiguous,
        or if an argument of that name or ``dest`` exists already.
    """
    tree = ast.parse(text)
    taken = _argument_mentions(tree, switch)
    if taken:
        raise SeriesError(f"{ARGUMENTS_FILE} already has an argument for {switch.name}: {taken}")
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
    rendered = render_argument(switch, func.value.id, black_style)
    text = text[:end] + _block(rendered) + text[end:]
    check_switch_argument(_block(rendered), switch)
    return text


def check_switch_argument(statement: str, switch: ConfigField) -> None:
    """Run the added statement against a parser: the field is True by default, False with the flag."""
    import argparse as _argparse

    parser = _argparse.ArgumentParser(allow_abbrev=False)
    namespace: Dict[str, object] = {}
    tree = ast.parse(textwrap.dedent(statement))
    if len(tree.body) != 1 or not _is_add_argument(tree.body[0]):
        raise SeriesError(f"the argument for {switch.name} is not one add_argument statement")
    call = tree.body[0]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
    assert isinstance(call.value.func, ast.Attribute) and isinstance(
        call.value.func.value, ast.Name
    )
    namespace[call.value.func.value.id] = parser
    exec(compile(tree, "<argument>", "exec"), namespace)
    default = getattr(parser.parse_args([]), switch.name)
    flagged = getattr(parser.parse_args([argument_flag(switch)]), switch.name)
    if default is not switch.default or flagged is not (not switch.default):
        raise SeriesError(
            f"{argument_flag(switch)} gives {default} by default and {flagged} when set"
        )


def check_config_copied_from_args(text: str, switch: ConfigField) -> None:
    """Assert that ``get_megatron_optimizer_config`` copies every config field from the arguments.

    Megatron-LM builds ``OptimizerConfig`` from ``args`` by field name::

        for f in dataclasses.fields(OptimizerConfig):
            if hasattr(args, f.name):
                kwargs[f.name] = getattr(args, f.name)
        config = OptimizerConfig(**kwargs)

    so the argument's ``dest`` reaches the field with no change to ``training.py``. Refuses a
    snapshot where that loop is gone or where the function sets the field itself.
    """
    function = _module_node(ast.parse(text), ast.FunctionDef, CONFIG_FROM_ARGS, TRAINING_FILE)
    loops = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.For)
        and isinstance(node.target, ast.Name)
        and ast.unparse(node.iter) == f"dataclasses.fields({CONFIG_CLASS})"
    ]
    copied = False
    for loop in loops:
        assert isinstance(loop.target, ast.Name)
        f = loop.target.id
        expected = (
            f"for {f} in dataclasses.fields({CONFIG_CLASS}):\n"
            f"    if hasattr(args, {f}.name):\n"
            f"        kwargs[{f}.name] = getattr(args, {f}.name)"
        )
        copied = copied or ast.unparse(loop) == expected
    if not copied:
        raise SeriesError(
            f"{TRAINING_FILE}: {CONFIG_FROM_ARGS} no longer copies every {CONFIG_CLASS} field "
            "from args by name; the argument needs a change there too"
        )
    source = ast.unparse(function)
    if "OptimizerConfig(**kwargs)" not in source:
        raise SeriesError(
            f"{TRAINING_FILE}: {CONFIG_FROM_ARGS} does not build OptimizerConfig(**kwargs)"
        )
    if switch.name in source:
        raise SeriesError(f"{TRAINING_FILE}: {CONFIG_FROM_ARGS} sets {switch.name} itself")


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


def with_header(source: str) -> str:
    """``source`` after Megatron-LM's copyright line (once: a file of ours may have it already)."""
    return source if source.startswith(PYTHON_HEADER) else PYTHON_HEADER + source


def subsystem_files() -> Dict[str, str]:
    """Upstream path -> content of every subsystem module (our file, with the copyright line)."""
    files = {}
    for source in sorted((REPO_ROOT / SUBSYSTEM).glob("*.py")):
        files[f"{SUBSYSTEM}/{source.name}"] = with_header(source.read_text())
    return files


def in_place_merge_files() -> Dict[str, str]:
    """Upstream path -> content of the in-place merge module (our file, with the copyright line)
    and of its unit test."""
    return {
        IN_PLACE_MERGE: with_header((REPO_ROOT / IN_PLACE_MERGE).read_text()),
        IN_PLACE_MERGE_TEST: (UPSTREAM_DIR / IN_PLACE_MERGE_TEST).read_text(),
    }


def test_files(with_offloader: bool) -> Dict[str, str]:
    """Upstream path -> content of our unit tests of state adoption (the offloader ones only where
    it exists); the in-place merge's test goes with its module (``in_place_merge_files``)."""
    files = {}
    root = UPSTREAM_DIR / "tests" / "unit_tests"
    for source in sorted(root.rglob("*.py")):
        path = f"{TESTS_ROOT}/{source.relative_to(root).as_posix()}"
        if path == IN_PLACE_MERGE_TEST:
            continue
        if source.name.endswith(OFFLOADER_TEST_SUFFIX) and not with_offloader:
            continue
        files[path] = source.read_text()
    return files


def docs_files() -> Dict[str, str]:
    """Upstream path -> content of our docs pages."""
    root = UPSTREAM_DIR / "docs"
    return {
        f"docs/{p.relative_to(root).as_posix()}": p.read_text() for p in sorted(root.rglob("*.md"))
    }


# ---------------------------------------------------------------------------------------------
# Reading a generated series back (for the consistency test)
# ---------------------------------------------------------------------------------------------


@dataclass
class FileDiff:
    """One file's diff in a format-patch file."""

    path: str
    pre_blob: str
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
        index = re.search(r"^index ([0-9a-f]+)\.\.", body, re.MULTILINE)
        if index is None:
            raise SeriesError(f"no index line for {path}")
        body = body.split("\n-- \n")[0]  # a signature, if any
        diffs.append(
            FileDiff(
                path=path,
                pre_blob=index.group(1),
                new_file="\nnew file mode" in "\n" + body.split("@@")[0],
                hunks=parse_hunks(
                    f"+++ b/{path}\n" + body[body.index("@@") :], path, split_blocks=True
                ),
            )
        )
    return diffs


# ---------------------------------------------------------------------------------------------
# Commits, cover letter and format-patch
# ---------------------------------------------------------------------------------------------

BUG_FIX_MESSAGE = """\
Keep the checkpoint's Adam step in CPU-offloaded dp_reshardable loads

With the CPU-offloaded optimizer (HybridDeviceOptimizer), resuming
from a dp_reshardable checkpoint sets every parameter's Adam step back
to 1, so the resumed Adam restarts its bias correction.

DistributedOptimizer.sharded_state_dict(is_loading=True) first runs
load_state_dict(state_dict()), which creates the state with
HybridDeviceOptimizer.dummy_step: its step is 1. The dp_reshardable
template wraps that step in a LocalNonpersistentObject, so it is not
read from the checkpoint. load_state_dict then sets the checkpoint's
step from its param_groups, but load_parameter_state_from_dp_reshardable
goes on to call _set_main_param_and_optimizer_states with the template's
entries, whose HybridDeviceOptimizer branch writes each of them into the
optimizer's state, the template's step included, for every parameter.

Skip 'step' there, as load_parameter_state_from_fully_reshardable and
load_parameter_state_from_fs_model_space already do.

Fixes #1842
"""

SUBSYSTEM_MESSAGE = """\
Add optimizer-state adoption to Megatron Core

Add megatron.core.optimizer.state_adoption. Where a Megatron optimizer
hands its inner optimizer's state to the inner optimizer's own code
while loading a checkpoint, the first registered state adopter that
accepts does that work instead; otherwise the own code runs unchanged.

A StateAdopter has a unique name, one required role and three optional
ones, each a side-effect-free check (None to accept, a reason to
decline) and an action: load (install a {"state", "param_groups"} dict
instead of load_state_dict), export (the state dict as the optimizer
holds it instead of state_dict()'s copies), initialize (the optimizer's
own step() without gradients creates the state a checkpoint is read
into, instead of Megatron-FSDP's dummy step on zero gradients) and read
(the tensors a precision-aware dp_reshardable checkpoint is read into,
instead of get_unscaled_state's FP32 copies). An AdoptionContext tells
it the inner optimizer, the owner's configs and, for a load, the state
dict and whether the call site owns it (only then may tensors the
optimizer does not hold yet be installed by reference).

One dispatcher enforces the rules that keep this safe, at every hook
point. The own code runs, without asking any adopter, when adoption is
switched off (OptimizerConfig.optimizer_state_adoption, added in the
next commit, or MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=1 for the whole
process, read once at import), when the optimizer instance carries the
method itself (a wrapper), or when hooks that the method runs are
registered or cannot be inspected, so every hook runs as often as
before. A check that
raises, or changes the optimizer, is a decline. An action that raises,
or whose result is not what the own code would give (checked after
every action), is undone and the own code runs. Every call ends in
exactly one AdoptionOutcome, also when the own code raises, handed to
the registry's outcome hooks; its byte counts are measured after the
call from storage identity (reused_bytes: installed by reference,
allocated_bytes: newly allocated).

A StateAdopterRegistry holds uniquely named adopters in a fixed order
(built-in, plugins by entry-point name, then code registrations;
prepend=True before all) and returns RemovableHandles. A strict
registry, as in tests, raises RuntimeError for every fallback instead
of logging a warning. default_registry() is the process-wide registry
Megatron Core's optimizers consult; installed plugins (entry-point group
megatron_core.optimizer_state_adopters) are loaded into it once, when an
optimizer is constructed.

Built in and registered: te_fused_adam_fp32, for Transformer Engine's
FusedAdam with FP32 moments and no master weights or parameter
remainders (read from the instance). There FusedAdam.load_state_dict
allocates a second copy of both moments while the caller still holds
the incoming ones, 8 bytes per parameter of transient memory on every
resume; the adopter installs the incoming tensors by reference through
PyTorch's loader instead. Built in and opt-in:
TEFusedAdamPrecisionAwareStateAdopter, for FusedAdam with BF16 moments
(the precision-aware optimizer), which loads, exports and reads the
held state without FP32 copies.
"""

CONFIG_MESSAGE = """\
Add an OptimizerConfig switch for optimizer state adoption

Add OptimizerConfig.optimizer_state_adoption (default True). When it is
False, the optimizer's state adoption hook points (the next commit)
always run the inner optimizer's own code and consult no adopter, and
the optimizer does not load adopter plugins.

Megatron-LM: --no-optimizer-state-adoption sets it to False. It sits
with the optimizer arguments in _add_training_args;
get_megatron_optimizer_config copies every OptimizerConfig field from
the arguments by name, so training.py needs no change.
"""

CALL_SITE_MESSAGE = """\
Route inner-optimizer state loads through state adoption

Every place where Megatron Core hands loaded optimizer state to the
inner optimizer's own code now goes through a state-adoption hook point:

- DistributedOptimizer.load_state_dict reads the inner optimizer's
  state with export_inner_optimizer_state_dict(self) and installs the
  state it assembled with load_inner_optimizer_state_dict(self, ...,
  owns_state_dict=True): it built that dict from the tensors just read,
  so an adopter may install them by reference;
- its Megatron-FSDP branch (fsdp_dtensor checkpoints) installs the
  loaded DTensor state with load_inner_optimizer_state_dict(self, ...),
  and sharded_param_state_fsdp_dtensor creates the state the checkpoint
  is read into with initialize_inner_optimizer_state(self, ...), which
  runs the dummy step unless an adopter accepts that the optimizer's
  own step() without gradients creates that state;
- with the precision-aware optimizer, sharded_param_state_dp_reshardable
  builds the tensors a checkpoint is read into inside
  reading_optimizer_state(self, is_loading): each comes from
  unscaled_state_or_read_target(self, ...), which is get_unscaled_state
  unless an adopter supplies the held tensor itself, and
  _set_main_param_and_optimizer_states stores what was read with
  store_read_optimizer_state(self, ...), which leaves a tensor read in
  place as it is and otherwise calls set_scaled_state;
- Float16OptimizerWithFloat16Params and FP32Optimizer (without the
  distributed optimizer) install their loaded state with
  load_inner_optimizer_state_dict(self, ...).

MegatronOptimizer.__init__ loads the installed adopter plugins once,
with default_registry().load_plugins(), when
config.optimizer_state_adoption is set.

With no adopter accepting, each call does exactly what the direct call
did. Each call site is one small hunk; the logic stays in the subsystem.
"""

CALL_SITE_MESSAGE_OFFLOADER = """
With chunked optimizer-state offload (self._optimizer_state_offloader),
load_state_dict keeps making upstream's calls (the inner optimizer's
state_dict() and the offloader's load_state_dict_without_device_cast())
exactly as before: the offloader's loader is part of the offload
mechanism, not an optional memory optimisation, so it is never subject
to adoption, the switch or a fallback.
"""

TESTS_MESSAGE = """\
Add unit tests for optimizer state adoption

Cover the registry (the built-in adopter, unique and well-formed names,
order and prepend, handles, plugins loaded once in entry-point name
order and skipped when broken, strict registries), the switches (the
OptimizerConfig field and its Megatron-LM argument), the dispatcher's
rules (an instance-level method and registered hooks run as upstream,
without asking adopters; a raising check declines; a raising adoption,
or one that installs nothing, is undone and the own loader runs; a
malformed export is not used; an own loader that raises is reported and
re-raised), the measured outcome (bytes installed by reference or newly
allocated, which pins PyTorch's by-reference install on CPU), every
call site (DistributedOptimizer's load and export, its Megatron-FSDP
load and state creation, the loads of Float16OptimizerWithFloat16Params
and FP32Optimizer, the plugin loading in MegatronOptimizer.__init__),
and, with Transformer Engine on CUDA, the built-in adopter and a
DistributedOptimizer save and load through dist_checkpointing with
bitwise-equal state.
"""

TESTS_MESSAGE_OFFLOADER = """
Also check that with a chunked optimizer-state offloader set,
load_state_dict consults no adopter and hands the offloader exactly the
state it received before.
"""

DOCS_MESSAGE = """\
Document optimizer state adoption in the API guide

Add an API guide page on what state adoption does, the built-in
adopters, what the dispatcher guarantees, how to observe loads, how to
write, register, ship as a plugin and test an adopter, how to switch
adoption off, and why this lives in Megatron Core rather than in
Transformer Engine.
"""

IN_PLACE_MERGE_MESSAGE = """\
Merge ShardedTensorFactory pieces read in place without a copy

SwiGLU's linear_fc1 (dense MLPs and MoE experts) and Mamba's in_proj
are saved through a ShardedTensorFactory as several pieces, which
cat_with_oom_fallback merges on load. torch_dist reads the pieces in
place into views of the tensor being loaded (the parameter, or an
optimizer state), so their concatenation is already in memory; the
merge allocated a second, full copy of it, held until load_checkpoint
returns. Measured on an H200 for a 1.02 B-parameter Llama-style model,
that copy added 0.82 bytes per parameter to the peak memory of a load
with the distributed optimizer, and 4.9 bytes per parameter with FP32
parameters without it.

Add megatron.core.dist_checkpointing.in_place_merge.concatenated_view:
when the pieces are plain, contiguous tensors of one dtype, device and
trailing shape that lie back to back in one storage, it returns their
concatenation as a view of that storage, else None.
cat_with_oom_fallback returns that view when there is one and
concatenates as before otherwise. The values are identical; the merged
tensor aliases the one the checkpoint was read into, as documented.

Unit tests (tests/unit_tests/dist_checkpointing/test_in_place_merge.py,
on CPU): back-to-back pieces merge into a view equal to torch.cat;
reversed, gapped, overlapping, separately stored, non-contiguous and
mixed-dtype pieces are concatenated as before; the SwiGLU factory's
merge of halves read in place is the tensor itself.
"""

COVER_SUBJECT = "Optimizer-state adoption for Megatron Core checkpoint loading"

COVER_INTRO = """\
When a Megatron optimizer with Transformer Engine's FusedAdam resumes
from a checkpoint, FusedAdam.load_state_dict allocates a second copy of
both Adam moments while the caller still holds the incoming ones: a
transient 8 bytes per parameter on every rank. This series lets
Megatron Core's optimizers hand the loaded inner state to registered
state adopters; the built-in one installs FP32 moments by reference
through PyTorch's loader where DistributedOptimizer assembled the state
itself. Every other configuration, and every case the dispatcher cannot
prove safe, runs the inner optimizer's own code exactly as today.
Adoption is on by default and switched off with
OptimizerConfig.optimizer_state_adoption = False
(--no-optimizer-state-adoption), or for a whole process with
MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=1.

1. a bug fix, independent of the rest: with the CPU-offloaded
   optimizer, a dp_reshardable load keeps the checkpoint's Adam step
   instead of the load template's (#1842);
2. the subsystem (megatron/core/optimizer/state_adoption/): the
   StateAdopter interface, the dispatcher, the registry with its
   plugins, the built-in adopters;
3. the switch: OptimizerConfig.optimizer_state_adoption and
   --no-optimizer-state-adoption;
4. the call sites: one import and one small hunk per call in
   DistributedOptimizer (its load, export, Megatron-FSDP and
   precision-aware paths) and in the load_state_dict of
   Float16OptimizerWithFloat16Params and FP32Optimizer, and the plugin
   loading in MegatronOptimizer.__init__;
5. unit tests (tests/unit_tests/optimizer/test_state_adoption.py);
6. the API guide page (docs/api-guide/core/optimizer_state_adoption.md);
7. independent of state adoption: the pieces of a ShardedTensorFactory
   read in place (SwiGLU's linear_fc1, Mamba's in_proj) merge into a
   view of the loaded tensor instead of a second copy
   (megatron/core/dist_checkpointing/in_place_merge.py), with its tests.
"""

COVER_OFFLOADER = """\
On dev, the chunked optimizer-state offloader keeps its own path: with
self._optimizer_state_offloader set, load_state_dict makes exactly the
calls it makes today and consults no adopter, because the offloader's
loader is part of the offload mechanism, not an optional optimisation
(tests/unit_tests/optimizer/test_state_adoption_offloader.py).
"""

COVER_SECTIONS = ("Why not in Transformer Engine", "Review of Megatron-LM PR 7288")
"""The docs page's sections that the cover letter carries (re-wrapped for e-mail)."""

COVER_WIDTH = 72


def docs_section(page: str, title: str) -> str:
    """The body of the ``## title`` section of a Markdown page (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", page, re.MULTILINE | re.DOTALL)
    if match is None:
        raise SeriesError(f"{DOCS_PAGE} has no section '## {title}'")
    return match.group(1).strip("\n") + "\n"


def rewrap(markdown: str, width: int = COVER_WIDTH) -> str:
    """Re-wrap Markdown paragraphs and list items to ``width`` (no code blocks expected)."""
    if "```" in markdown:
        raise SeriesError("a section carried into the cover letter has a code block")
    out = []
    for block in re.split(r"\n\s*\n", markdown.strip("\n")):
        items = re.split(r"\n(?=(?:[-*]|\d+\.) )", block)
        for item in items:
            bullet = re.match(r"(?:[-*]|\d+\.) ", item)
            prefix = bullet.group(0) if bullet else ""
            words = " ".join(item[len(prefix) :].split())
            out.append(
                textwrap.fill(
                    words,
                    width=width,
                    initial_indent=prefix,
                    subsequent_indent=" " * len(prefix),
                    break_on_hyphens=False,
                    break_long_words=False,
                )
            )
        out.append("")
    return "\n".join(out)


def cover_letter_text(offloader: bool) -> str:
    """The cover letter: subject line, blank line, body (``git format-patch`` adds the rest)."""
    page = (UPSTREAM_DIR / "docs" / Path(DOCS_PAGE).relative_to("docs")).read_text()
    parts = [COVER_SUBJECT, "", COVER_INTRO]
    if offloader:
        parts.append(COVER_OFFLOADER)
    for title in COVER_SECTIONS:
        parts += [title, "-" * len(title), "", rewrap(docs_section(page, title))]
    return "\n".join(parts).rstrip("\n") + "\n"


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
    """The Megatron-LM files the series reads, from one commit of one branch.

    Attributes:
        files: the files the series changes (``TOUCHED_UPSTREAM_FILES``).
        checked: the files it only reads to check an assumption (``CHECKED_UPSTREAM_FILES``).
    """

    branch: str
    commit: str
    files: Dict[str, str]
    checked: Dict[str, str]

    @classmethod
    def from_git_dir(cls, git_dir: Path, branch: str, commit: Optional[str] = None) -> "Snapshot":
        """Read the files of ``commit`` (any revision; default: the tip of ``branch``)."""
        revision = commit or f"refs/heads/{branch}"
        commit = _git(git_dir, "rev-parse", f"{revision}^{{commit}}").strip()
        files = {p: _git(git_dir, "show", f"{commit}:{p}") for p in TOUCHED_UPSTREAM_FILES}
        checked = {p: _git(git_dir, "show", f"{commit}:{p}") for p in CHECKED_UPSTREAM_FILES}
        return cls(branch, commit, files, checked)

    @property
    def offloader(self) -> bool:
        """Whether ``DistributedOptimizer.load_state_dict`` has the offloader's special case."""
        return has_offloader_special_case(self.files[CALL_SITE])


def series_commits(snapshot: Snapshot) -> List[Tuple[str, Dict[str, str]]]:
    """The series for ``snapshot``: (commit message, files written) per commit, in order.

    The bug fix comes first, on its own, and the call sites' hunks apply to the fixed file. The
    switch comes before the call sites: ``MegatronOptimizer.__init__`` reads it. The in-place
    merge, independent of state adoption, comes last, with its test.
    """
    config_hunks = our_hunks(CONFIG_FILE)
    switch = adoption_switch(config_hunks)
    check_config_copied_from_args(snapshot.checked[TRAINING_FILE], switch)
    offloader = snapshot.offloader
    page = Path(DOCS_PAGE).stem
    # The fix is an insertion, not an export or load that the offloader's special case routes.
    fixed = change_file(
        snapshot.files[CALL_SITE], our_hunks(CALL_SITE, bug_fix=True), CALL_SITE, False
    )
    after_fix = {**snapshot.files, CALL_SITE: fixed}
    return [
        (BUG_FIX_MESSAGE, {CALL_SITE: fixed}),
        (SUBSYSTEM_MESSAGE, subsystem_files()),
        (
            CONFIG_MESSAGE,
            {
                CONFIG_FILE: change_optimizer_config(snapshot.files[CONFIG_FILE], config_hunks),
                ARGUMENTS_FILE: add_switch_argument(snapshot.files[ARGUMENTS_FILE], switch),
            },
        ),
        (
            CALL_SITE_MESSAGE + (CALL_SITE_MESSAGE_OFFLOADER if offloader else ""),
            {
                path: change_file(after_fix[path], our_hunks(path), path, offloader)
                for path in (CALL_SITE, NON_DISTRIBUTED_FILE)
            },
        ),
        (TESTS_MESSAGE + (TESTS_MESSAGE_OFFLOADER if offloader else ""), test_files(offloader)),
        (
            DOCS_MESSAGE,
            {**docs_files(), DOCS_INDEX: add_docs_toctree_entry(snapshot.files[DOCS_INDEX], page)},
        ),
        (
            IN_PLACE_MERGE_MESSAGE,
            {
                **in_place_merge_files(),
                UTILS_FILE: change_file(
                    snapshot.files[UTILS_FILE], our_hunks(UTILS_FILE), UTILS_FILE, offloader
                ),
            },
        ),
    ]


def added_files(offloader: bool) -> List[str]:
    """The paths of the files the series adds (recorded in series.json)."""
    return sorted(
        {**subsystem_files(), **test_files(offloader), **docs_files(), **in_place_merge_files()}
    )


SERIES_BRANCH = "optimizer-state-adoption"
"""The branch the series is committed on in the scratch repository (its description is the cover)."""


def build(
    snapshot: Snapshot, out_dir: Path, identity: Optional[Tuple[str, str]] = None
) -> List[Path]:
    """Write the series for ``snapshot`` into ``out_dir`` (emptied first); return the patches.

    The patches are the cover letter (``0000-cover-letter.patch``, from the scratch branch's
    description) and one patch per commit.

    Args:
        snapshot: the Megatron-LM files the series changes.
        out_dir: where the patches go.
        identity: (name, email) of the author; defaults to this repository's git user.
    """
    name, email = identity or _identity()
    env = _commit_env(name, email)
    commits = series_commits(snapshot)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        _git(work, "init", "-q", "-b", "base", env=env)
        _write(work, snapshot.files)
        _git(work, "add", "-A", env=env)
        _git(
            work, "commit", "-q", "-m", f"Megatron-LM {snapshot.branch} {snapshot.commit}", env=env
        )
        base = _git(work, "rev-parse", "HEAD").strip()
        _git(work, "checkout", "-q", "-b", SERIES_BRANCH, env=env)
        cover = cover_letter_text(snapshot.offloader)
        _git(work, "config", f"branch.{SERIES_BRANCH}.description", cover, env=env)
        for message, files in commits:
            _write(work, files)
            _git(work, "add", "-A", env=env)
            subprocess.run(
                ["git", "commit", "-q", "-s", "-F", "-"],
                cwd=work,
                env=env,
                input=message,
                text=True,
                check=True,
                capture_output=True,
            )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        _git(
            work,
            "format-patch",
            "-q",
            "--zero-commit",
            "--no-signature",
            "--no-numbered-files",
            "--cover-letter",
            "--cover-from-description=subject",
            "-o",
            str(out_dir),
            f"{base}..{SERIES_BRANCH}",
            env=env,
        )
    return sorted(out_dir.glob("*.patch"))


def code_patches(patches: Sequence[Path]) -> List[Path]:
    """The patches without the cover letter (which ``git apply`` and ``git am`` cannot take)."""
    return [p for p in patches if p.name != COVER_LETTER]


def manifest() -> Dict[str, Dict[str, object]]:
    """upstream/series.json: per branch, what the series was last built against."""
    data: Dict[str, Dict[str, object]] = json.loads(MANIFEST.read_text())
    return data


def blob_id(content: str) -> str:
    """The git blob id of ``content``."""
    result = subprocess.run(
        ["git", "hash-object", "--stdin"], input=content, text=True, check=True, capture_output=True
    )
    return result.stdout.strip()


def record(snapshot: Snapshot, patches: Sequence[Path], apply_check: str) -> None:
    """Record the snapshot commit, its files' blob ids, the patch names and added files."""
    data = manifest() if MANIFEST.exists() else {}
    data[snapshot.branch] = dict(
        snapshot_commit=snapshot.commit,
        offloader_special_case=snapshot.offloader,
        pre_image_blobs={p: blob_id(c) for p, c in sorted(snapshot.files.items())},
        checked_blobs={p: blob_id(c) for p, c in sorted(snapshot.checked.items())},
        cover_letter=COVER_LETTER,
        patches=[p.name for p in code_patches(patches)],
        added_files=added_files(snapshot.offloader),
        git_apply_check=apply_check,
        series_date=SERIES_DATE,
        author="{} <{}>".format(*_identity()),
    )
    MANIFEST.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def work_tree(git_dir: Path, commit: str, into: Path) -> None:
    """Extract the full tree of ``commit`` into ``into`` and make it a git repository."""
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", commit], check=True, capture_output=True
    )
    subprocess.run(["tar", "x", "-C", str(into)], input=archive.stdout, check=True)
    _git(into, "init", "-q")


def apply_check(git_dir: Path, commit: str, patches: Sequence[Path]) -> str:
    """``git apply --check`` the series on a full work tree of ``commit``; return a summary."""
    patches = code_patches(patches)
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch)
        work_tree(git_dir, commit, tree)
        result = subprocess.run(
            ["git", "apply", "--check", *map(str, patches)],
            cwd=tree,
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        raise SeriesError(f"git apply --check failed on {commit}:\n{result.stderr}")
    return f"ok: {len(patches)} patches apply to a full work tree of {commit}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: ``build`` (check and record) or ``check`` the series per branch."""
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
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="series go to OUT/<branch>/")
    args = parser.parse_args(argv)
    branches = args.branch or list(BRANCHES)
    if args.snapshot_commit is not None and len(branches) != 1:
        parser.error("--snapshot-commit needs exactly one --branch")
    recorded = manifest() if MANIFEST.exists() else {}
    for branch in branches:
        commit = args.snapshot_commit or recorded.get(branch, {}).get("snapshot_commit")
        out_dir = args.out / branch
        if args.command == "check":
            print(
                f"{branch}: {apply_check(args.git_dir, str(commit), sorted(out_dir.glob('*.patch')))}"
            )
            continue
        snapshot = Snapshot.from_git_dir(
            args.git_dir, branch, None if commit is None else str(commit)
        )
        patches = build(snapshot, out_dir)
        print(f"{branch} @ {snapshot.commit}: {len(patches)} patches in {out_dir}")
        check = apply_check(args.git_dir, snapshot.commit, patches)
        print(f"  {check}")
        record(snapshot, patches, check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
