"""The Megatron-LM series that upstream/build_series.py builds, and upstream/series.json.

The series is not committed: one command builds it into build/upstream-series/ (see
upstream/README.md). Two levels, because CI has no copy of Megatron-LM (only PyPI is reachable
there):

* always, in seconds: series.json agrees with the current sources where that needs no snapshot
  (its patch names are the generator's commit subjects, the files it lists as added are exactly
  the subsystem modules, the in-place merge module, unit tests and docs page here, its blob ids
  are of the files the generator changes and reads), only the newest release's patches enter the
  series, the bug fix's hunk only its own commit, every Python file the series adds passes black
  26 with Megatron-LM's settings, the cover letter has its required content, README's table of exported
  names lists exactly the package's ``__all__``, and the generator's rules are exercised on
  small synthetic files of every shape, refusing what they must refuse;
* with ``MEGATRON_LM_GIT_DIR`` (a Megatron-LM git directory, e.g. the fetched mirror
  /work/.mirror/NVIDIA+Megatron-LM/repo): the series is built at the recorded snapshots into a
  temporary folder and checked: the snapshot's blob ids and the patch names are those recorded,
  ``git apply --check`` passes on a full work tree, on main the call-site diffs make exactly the
  changes of patches/*.patch and on dev they keep the offloader's path, the bug fix is the first
  commit alone and the call sites apply to the fixed file, the in-place merge commit adds our
  module and changes ``cat_with_oom_fallback``, the config field and argument are the generated
  ones, every added file equals its source, and the changed Python files pass black where the
  snapshot's did. Skipped, with the reason, without it.
"""

import argparse
import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "upstream"))

import build_series  # noqa: E402  (upstream/ is not a package)
from build_series import (  # noqa: E402
    ARGUMENTS_FILE,
    CALL_SITE,
    CONFIG_FILE,
    COVER_LETTER,
    IN_PLACE_MERGE,
    IN_PLACE_MERGE_TEST,
    NON_DISTRIBUTED_FILE,
    UTILS_FILE,
    FileDiff,
    Hunk,
    SeriesError,
)
from build_tools.patching import patch_releases  # noqa: E402  (build_series puts it on the path)
from build_tools.releases import DEFAULT_UPSTREAM_VERSION  # noqa: E402

MANIFEST = build_series.manifest()
BRANCHES = sorted(MANIFEST)
MIRROR = Path(os.environ.get("MEGATRON_LM_GIT_DIR", "/nonexistent"))
# Megatron-LM's pyproject.toml: black 26, line_length 100, skip_string_normalization,
# skip_magic_trailing_comma.
BLACK_MODE = dict(line_length=100, string_normalization=False, magic_trailing_comma=False)


def _switch() -> build_series.ConfigField:
    return build_series.adoption_switch(build_series.our_hunks(CONFIG_FILE))


def _changes(hunks: List[Hunk], strip: bool = False) -> List[Tuple[Tuple[str, ...], ...]]:
    def lines(block: List[str]) -> Tuple[str, ...]:
        return tuple(line.strip() if strip else line for line in block)

    return [(lines(h.removed), lines(h.added)) for h in hunks]


def _black_clean(content: str) -> bool:
    import black

    assert black.__version__.startswith("26."), "Megatron-LM requires black 26"
    return bool(black.format_str(content, mode=black.Mode(**BLACK_MODE)) == content)


# ---------------------------------------------------------------------------------------------
# series.json and the sources, without a snapshot
# ---------------------------------------------------------------------------------------------


def test_manifest_records_main_and_dev() -> None:
    assert BRANCHES == ["dev", "main"]
    for branch, entry in MANIFEST.items():
        assert len(str(entry["snapshot_commit"])) == 40
        assert entry["git_apply_check"] == (
            f"ok: {len(entry['patches'])} patches apply to a full work tree of "
            f"{entry['snapshot_commit']}"
        )
        assert entry["cover_letter"] == COVER_LETTER
        assert sorted(entry["pre_image_blobs"]) == sorted(build_series.TOUCHED_UPSTREAM_FILES)
        assert sorted(entry["checked_blobs"]) == sorted(build_series.CHECKED_UPSTREAM_FILES)
    assert MANIFEST["main"]["offloader_special_case"] is False
    assert MANIFEST["dev"]["offloader_special_case"] is True


@pytest.mark.parametrize("branch", BRANCHES)
def test_manifest_lists_the_files_the_series_adds_from_these_sources(branch: str) -> None:
    """A subsystem module, test or docs page added or removed here needs a rebuild."""
    expected = build_series.added_files(bool(MANIFEST[branch]["offloader_special_case"]))
    modules = [
        f"{build_series.SUBSYSTEM}/{p.name}"
        for p in (REPO_ROOT / build_series.SUBSYSTEM).glob("*.py")
    ]
    assert set(modules) <= set(expected)
    assert MANIFEST[branch]["added_files"] == expected, f"{branch}: rebuild the series"


COMMIT_MESSAGES = [
    build_series.BUG_FIX_MESSAGE,
    build_series.SUBSYSTEM_MESSAGE,
    build_series.CONFIG_MESSAGE,
    build_series.CALL_SITE_MESSAGE,
    build_series.TESTS_MESSAGE,
    build_series.DOCS_MESSAGE,
    build_series.IN_PLACE_MERGE_MESSAGE,
]


@pytest.mark.parametrize("branch", BRANCHES)
def test_manifest_patch_names_are_the_commit_subjects(branch: str) -> None:
    subjects = [m.split("\n", 1)[0] for m in COMMIT_MESSAGES]
    names = MANIFEST[branch]["patches"]
    assert len(names) == len(subjects)
    for index, (name, subject) in enumerate(zip(names, subjects), 1):
        # git format-patch: NNNN-<subject, runs of other characters as one '-'>, cut to 52
        sanitized = re.sub(r"[^A-Za-z0-9._]+", "-", subject).strip("-.")[:52].rstrip("-.")
        assert name == f"{index:04d}-{sanitized}.patch", f"{branch}: rebuild the series"


def test_commit_messages_fit_e_mail() -> None:
    for message in [*COMMIT_MESSAGES, build_series.CALL_SITE_MESSAGE_OFFLOADER]:
        assert max(len(line) for line in message.splitlines()) <= 72
    assert [m.split("\n")[1] for m in COMMIT_MESSAGES] == [""] * len(COMMIT_MESSAGES)


def test_added_python_files_follow_megatron_lm_black() -> None:
    files = {
        **build_series.subsystem_files(),
        **build_series.test_files(True),
        **build_series.in_place_merge_files(),
    }
    unformatted = [path for path, content in sorted(files.items()) if not _black_clean(content)]
    assert unformatted == [], "black 26 with Megatron-LM's settings would reformat these"


@pytest.mark.parametrize("offloader", [False, True], ids=["main", "dev"])
def test_cover_letter_has_its_required_content(offloader: bool) -> None:
    cover = build_series.cover_letter_text(offloader)
    assert cover.startswith(build_series.COVER_SUBJECT + "\n\n")
    assert max(len(line) for line in cover.splitlines()) <= 72
    page = build_series.docs_files()[build_series.DOCS_PAGE]
    words = " ".join(cover.split())
    for title in build_series.COVER_SECTIONS:
        section = build_series.docs_section(page, title)
        assert f"\n{title}\n{'-' * len(title)}\n\n{build_series.rewrap(section)}" in cover
        assert " ".join(section.split()) in words
    for fact in (
        "https://github.com/NVIDIA/TransformerEngine/pull/3507",
        "Restored states continue to own their storage; checkpoint tensors are copied",
        "https://github.com/pytorch/pytorch/issues/196083",
        "https://github.com/NVIDIA/Megatron-LM/pull/7288",
        "__setstate__",
        "name_to_dtype_map",
        "master_weights",
        "OptimizerConfig.optimizer_state_adoption",
        "--no-optimizer-state-adoption",
        "(#1842)",
        IN_PLACE_MERGE,
    ):
        assert fact in words, fact
    assert (build_series.COVER_OFFLOADER in cover) is offloader


def test_readme_lists_exactly_the_exported_names() -> None:
    import importlib

    package = importlib.import_module("megatron.core.optimizer.state_adoption")
    readme = (REPO_ROOT / "upstream" / "README.md").read_text()
    table = readme.split("## Exported names", 1)[1].split("\n## ", 1)[0]
    listed = [
        name
        for row in table.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([\w.]+)`", row.split(" | ")[0])
    ]
    assert sorted(listed) == sorted(package.__all__)


# ---------------------------------------------------------------------------------------------
# The generator's rules on synthetic files
# ---------------------------------------------------------------------------------------------

# The two variants of DistributedOptimizer.load_state_dict's inner load: before and after the
# chunked offloader's special case; everything around it is the same.
_SYNTHETIC_HEAD = """\
from .param_layout import FullParamLayout

logger = getLogger(__name__)


class DistributedOptimizer:
    def state_dict(self):
        inner_state_dict = self.optimizer.state_dict()
        return inner_state_dict

    def load_state_dict(self, state_dict):
        param_groups_map = {}
        inner_state_dict = self.optimizer.state_dict()
        state_dict_state = inner_state_dict["state"]

        # Optimizer.
"""
_SYNTHETIC_TAIL = """
        # Grad scaler.
"""

SYNTHETIC_PLAIN = _SYNTHETIC_HEAD + """\
        self.optimizer.load_state_dict(
            {"state": state_dict_state, "param_groups": state_dict_param_groups}
        )
""" + _SYNTHETIC_TAIL

SYNTHETIC_OFFLOADER = _SYNTHETIC_HEAD + """\
        optimizer_state_dict = {"state": state_dict_state, "param_groups": state_dict_param_groups}
        if self._optimizer_state_offloader is None:
            self.optimizer.load_state_dict(optimizer_state_dict)
        else:
            self._optimizer_state_offloader.load_state_dict_without_device_cast(
                optimizer_state_dict
            )
""" + _SYNTHETIC_TAIL

CALL_SITE_HUNKS = [
    Hunk(
        before=["from .param_layout import FullParamLayout"],
        added=["from .state_adoption import export_inner_optimizer_state_dict, load_x"],
        after=[""],
    ),
    Hunk(
        before=["        param_groups_map = {}"],
        removed=["        inner_state_dict = self.optimizer.state_dict()"],
        added=[
            "        # Adopters may export it.",
            "        inner_state_dict = export_inner_optimizer_state_dict(self)",
        ],
        after=['        state_dict_state = inner_state_dict["state"]'],
    ),
    Hunk(
        before=[""],
        removed=[
            "        # Optimizer.",
            "        self.optimizer.load_state_dict(",
            '            {"state": state_dict_state, "param_groups": state_dict_param_groups}',
        ],
        added=[
            "        # Optimizer. Adopters may install it.",
            "        load_inner_optimizer_state_dict(",
            "            self,",
            '            {"state": state_dict_state, "param_groups": state_dict_param_groups},',
            "            owns_state_dict=True,",
        ],
        after=["        )", "", "        # Grad scaler."],
    ),
]


def test_call_site_rule_on_main_applies_our_hunks_where_their_context_is_unique() -> None:
    result = build_series.change_file(SYNTHETIC_PLAIN, CALL_SITE_HUNKS, CALL_SITE, False)
    state_dict_method, load_method = result.split("    def load_state_dict")
    assert "inner_state_dict = self.optimizer.state_dict()" in state_dict_method
    assert (
        "        param_groups_map = {}\n"
        "        # Adopters may export it.\n"
        "        inner_state_dict = export_inner_optimizer_state_dict(self)\n"
    ) in load_method
    assert (
        "        # Optimizer. Adopters may install it.\n"
        "        load_inner_optimizer_state_dict(\n"
        "            self,\n"
        '            {"state": state_dict_state, "param_groups": state_dict_param_groups},\n'
        "            owns_state_dict=True,\n"
        "        )\n"
    ) in load_method
    assert result.startswith(
        "from .param_layout import FullParamLayout\n"
        "from .state_adoption import export_inner_optimizer_state_dict, load_x\n\n"
    )


def test_call_site_rule_on_dev_keeps_the_offloader_path() -> None:
    result = build_series.change_file(SYNTHETIC_OFFLOADER, CALL_SITE_HUNKS, CALL_SITE, True)
    assert (
        "        # Adopters may export it.\n"
        "        if self._optimizer_state_offloader is None:\n"
        "            inner_state_dict = export_inner_optimizer_state_dict(self)\n"
        "        else:\n"
        "            inner_state_dict = self.optimizer.state_dict()\n"
    ) in result
    assert (
        "        # Optimizer. Adopters may install it.\n"
        f"        {build_series.DEV_LOAD_COMMENT}\n"
        '        optimizer_state_dict = {"state": state_dict_state, "param_groups": '
        "state_dict_param_groups}\n"
        "        if self._optimizer_state_offloader is None:\n"
        "            load_inner_optimizer_state_dict(self, optimizer_state_dict, owns_state_dict=True)\n"
        "        else:\n"
        "            self._optimizer_state_offloader.load_state_dict_without_device_cast(\n"
        "                optimizer_state_dict\n"
        "            )\n"
    ) in result
    build_series.check_offloader_path_kept(result)
    with pytest.raises(SeriesError, match="subsystem calls but"):
        build_series.check_offloader_path_kept(
            result.replace(
                "if self._optimizer_state_offloader is None:\n            inner",
                "if True:\n            inner",
            )
        )


SYNTHETIC_OPTIMIZER = """\
from .optimizer_config import OptimizerConfig

logger = getLogger(__name__)


class MegatronOptimizer(ABC):
    def __init__(self, optimizer, config, init_state_fn):
        self.config = config
        self.init_state_fn = init_state_fn
{dev_fields}
    def get_parameters(self):
        return []


class FP32Optimizer(MegatronOptimizer):
    def load_state_dict(self, state_dict):
{load}
"""

OPTIMIZER_SHAPES = {
    "main": ("", "        self.optimizer.load_state_dict(state_dict)"),
    "dev": (
        "        self._optimizer_state_offloader = None\n",
        "        if self._optimizer_state_offloader is None:\n"
        "            self.optimizer.load_state_dict(state_dict)\n"
        "        else:\n"
        "            self._optimizer_state_offloader.load_state_dict_without_device_cast(state_dict)",
    ),
}


@pytest.mark.parametrize("shape", sorted(OPTIMIZER_SHAPES))
def test_optimizer_rule_inserts_after_unique_context_and_indents_like_the_snapshot(
    shape: str,
) -> None:
    dev_fields, load = OPTIMIZER_SHAPES[shape]
    text = SYNTHETIC_OPTIMIZER.format(dev_fields=dev_fields, load=load)
    hunks = [
        Hunk(before=["from .optimizer_config import OptimizerConfig"], added=["from .x import y"]),
        Hunk(
            before=["        self.config = config", "        self.init_state_fn = init_state_fn"],
            added=["        if config.switch:", "            y().load()"],
            after=["", "    def get_parameters(self):"],
        ),
        Hunk(
            before=["    def load_state_dict(self, state_dict):"],
            removed=["        self.optimizer.load_state_dict(state_dict)"],
            added=["        load(self, state_dict)"],
        ),
    ]
    result = build_series.change_file(text, hunks, NON_DISTRIBUTED_FILE, shape == "dev")
    assert "from .optimizer_config import OptimizerConfig\nfrom .x import y\n" in result
    assert (
        "        self.init_state_fn = init_state_fn\n"
        "        if config.switch:\n"
        "            y().load()\n" + dev_fields
    ) in result
    indent = "            " if shape == "dev" else "        "
    assert f"\n{indent}load(self, state_dict)\n" in result
    assert "load_state_dict_without_device_cast(state_dict)" in result or shape == "main"


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda text: text.replace("        # Optimizer.\n", "        # Inner optimizer.\n"), "found 0 times"),
        (lambda text: text.replace("        # Grad scaler.\n", SYNTHETIC_PLAIN.split("class ")[1]), "found 2 times"),
        (lambda text: text.replace("        self.optimizer.load_state_dict(\n", "    self.optimizer.load_state_dict(\n"), "indented otherwise"),
    ],
    ids=["missing", "ambiguous", "indented less"],
)  # fmt: skip
def test_call_site_rule_refuses(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SeriesError, match=match):
        build_series.change_file(mutate(SYNTHETIC_PLAIN), CALL_SITE_HUNKS, CALL_SITE, False)


def test_unknown_offloader_shape_is_refused() -> None:
    broken = SYNTHETIC_OFFLOADER.replace(
        "optimizer_state_dict = {", "optimizer_state_dict = dict({"
    )
    with pytest.raises(SeriesError, match="unknown shape"):
        build_series.change_file(broken, CALL_SITE_HUNKS, CALL_SITE, True)


def test_our_patches_carry_to_known_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for path in build_series.PATCHED_FILES:
        assert build_series.our_hunks(path)
    (tmp_path / "patches").mkdir()
    for patch in sorted((REPO_ROOT / "patches").glob("*.patch")):
        (tmp_path / "patches" / patch.name).write_text(patch.read_text())
    (tmp_path / "patches" / "0099-other.patch").write_text(
        "--- a/megatron/core/optimizer/grad_scaler.py\n"
        "+++ b/megatron/core/optimizer/grad_scaler.py\n"
        "@@ -1,1 +1,2 @@\n"
        " import torch\n"
        "+import os\n"
    )
    monkeypatch.setattr(build_series, "REPO_ROOT", tmp_path)
    with pytest.raises(SeriesError, match="does not carry"):
        build_series.our_hunks(CALL_SITE)


OLDER_RELEASES_PATCH = """\
Releases: <0.18
--- a/megatron/core/transformer/mlp.py
+++ b/megatron/core/transformer/mlp.py
@@ -1,1 +1,2 @@
 import torch
+import os
"""


def test_only_the_newest_releases_patches_enter_the_series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A patch for older releases only (patches/0005: mlp.py's nested merge, <0.18) is skipped,
    though it changes a file the series does not carry; without its Releases line it is refused."""
    ours = sorted((REPO_ROOT / "patches").glob("*.patch"))
    older = [p.name for p in ours if not patch_releases(p).contains(DEFAULT_UPSTREAM_VERSION)]
    assert [p.name for p in build_series.series_patches()] == [
        p.name for p in ours if p.name not in older
    ]
    changing_mlp = [
        p.name for p in ours if "\n+++ b/megatron/core/transformer/mlp.py" in p.read_text()
    ]
    assert set(changing_mlp) <= set(older)
    carried = {path: _changes(build_series.our_hunks(path)) for path in build_series.PATCHED_FILES}
    (tmp_path / "patches").mkdir()
    for patch in ours:
        (tmp_path / "patches" / patch.name).write_text(patch.read_text())
    (tmp_path / "patches" / "0098-older.patch").write_text(OLDER_RELEASES_PATCH)
    monkeypatch.setattr(build_series, "REPO_ROOT", tmp_path)
    assert "0098-older.patch" not in [p.name for p in build_series.series_patches()]
    for path, changes in carried.items():
        assert _changes(build_series.our_hunks(path)) == changes, path
    (tmp_path / "patches" / "0098-older.patch").write_text(OLDER_RELEASES_PATCH.split("\n", 1)[1])
    with pytest.raises(SeriesError, match="0098-older.patch changes megatron/core/transformer/mlp"):
        build_series.our_hunks(CALL_SITE)


def test_bug_fix_hunk_is_only_in_its_own_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (REPO_ROOT / "patches" / build_series.BUG_FIX_PATCH).read_text()
    fix = build_series.our_hunks(CALL_SITE, bug_fix=True)
    assert _changes(fix) == _changes(build_series.parse_hunks(text, CALL_SITE, True))
    assert [h.kind for h in fix] == ["insert"]
    assert not set(_changes(fix)) & set(_changes(build_series.our_hunks(CALL_SITE)))
    for path in (NON_DISTRIBUTED_FILE, CONFIG_FILE, UTILS_FILE):
        with pytest.raises(SeriesError, match="has no hunk"):
            build_series.our_hunks(path, bug_fix=True)
    (tmp_path / "patches").mkdir()
    for patch in sorted((REPO_ROOT / "patches").glob("*.patch")):
        if patch.name != build_series.BUG_FIX_PATCH:
            (tmp_path / "patches" / patch.name).write_text(patch.read_text())
    monkeypatch.setattr(build_series, "REPO_ROOT", tmp_path)
    with pytest.raises(SeriesError, match="BUG_FIX_PATCH"):
        build_series.our_hunks(CALL_SITE)


SYNTHETIC_CONFIG = '''\
from dataclasses import dataclass


@dataclass
class OptimizerConfig:
    """Configuration for optimizer."""

    #######################
    # Optimizer Offload
    #######################

    pin_cpu_params: bool = True
    """If True, pin the optimizer parameters to CPU memory."""
{dev_fields}
    ################
    # Miscellaneous
    ################
    clip_grad: float = 1.0
    """Gradient clipping based on global L2 norm."""
'''

DEV_FIELDS = '''
    chunked_optimizer_state_offload: bool = False
    """Keep selected optimizer tensor states and master weights on CPU between updates."""
'''


@pytest.mark.parametrize("dev_fields", ["", DEV_FIELDS], ids=["main", "dev"])
def test_config_rule_inserts_our_section_before_the_next_one(dev_fields: str) -> None:
    hunks = build_series.our_hunks(CONFIG_FILE)
    text = SYNTHETIC_CONFIG.replace("{dev_fields}", dev_fields)
    result = build_series.change_optimizer_config(text, hunks)
    added = build_series._block(hunks[0].added)
    assert result == text.replace(
        "\n    ################\n    # Miscellaneous",
        "\n" + added + "    ################\n    # Miscellaneous",
    )
    namespace: Dict[str, object] = {}
    exec(compile(result, "<config>", "exec"), namespace)
    config_class = namespace["OptimizerConfig"]
    assert callable(config_class)
    assert config_class().optimizer_state_adoption is True
    assert config_class(optimizer_state_adoption=False).optimizer_state_adoption is False


@pytest.mark.parametrize(
    "mutate",
    [
        lambda text: text.replace("# Miscellaneous", "# Other"),
        lambda text: text.replace(
            '    """Gradient clipping based on global L2 norm."""\n',
            '    """Gradient clipping based on global L2 norm."""\n\n'
            "    ################\n    # Miscellaneous\n    ################\n    x: int = 0\n",
        ),
        lambda text: text.replace(
            "    pin_cpu_params: bool = True\n",
            "    optimizer_state_adoption: bool = True\n    pin_cpu_params: bool = True\n",
        ),
        lambda text: text.replace("class OptimizerConfig:", "class OtherConfig:"),
    ],
    ids=["anchor missing", "anchor twice", "field exists", "class missing"],
)
def test_config_rule_refuses(mutate) -> None:  # type: ignore[no-untyped-def]
    text = mutate(SYNTHETIC_CONFIG.replace("{dev_fields}", ""))
    with pytest.raises(SeriesError):
        build_series.change_optimizer_config(text, build_series.our_hunks(CONFIG_FILE))


SYNTHETIC_ARGUMENTS_MAIN = """\
import argparse


def _add_logging_args(parser):
    group = parser.add_argument_group(title='logging')
    group.add_argument('--optimizer-log', action='store_true')
    return parser


def _add_training_args(parser):
    group = parser.add_argument_group(title='training')

    group.add_argument('--optimizer', type=str, default='adam',
                       choices=['adam', 'sgd'],
                       help='Optimizer function.')
    group.add_argument('--optimizer-cpu-offload', action='store_true',
                       help='Offload optimizer state to CPU')
    return parser
"""

SYNTHETIC_ARGUMENTS_DEV = """\
import argparse


def _add_training_args(parser):
    group = parser.add_argument_group(title='training')

    group.add_argument(
        '--optimizer',
        type=str,
        default='adam',
        choices=['adam', 'sgd'],
        help='Optimizer function.',
    )
    group.add_argument(
        '--optimizer-cpu-offload', action='store_true', help='Offload optimizer state to CPU'
    )
    return parser
"""


@pytest.mark.parametrize(
    "text, black_style",
    [(SYNTHETIC_ARGUMENTS_MAIN, False), (SYNTHETIC_ARGUMENTS_DEV, True)],
    ids=["main", "dev"],
)
def test_argument_rule_adds_it_after_optimizer_in_the_files_style(
    text: str, black_style: bool
) -> None:
    switch = _switch()
    result = build_series.add_switch_argument(text, switch)
    rendered = build_series._block(build_series.render_argument(switch, "group", black_style))
    assert result.replace(rendered, "") == text
    before, after = result.split(rendered)
    if black_style:
        assert before.endswith("        help='Optimizer function.',\n    )\n")
        assert after.startswith("    group.add_argument(\n        '--optimizer-cpu-offload'")
    else:
        assert before.endswith("                       help='Optimizer function.')\n")
        assert after.startswith("    group.add_argument('--optimizer-cpu-offload'")
    namespace: Dict[str, object] = {}
    exec(compile(result, "<arguments>", "exec"), namespace)
    add_training_args = namespace["_add_training_args"]
    assert callable(add_training_args)
    parser = add_training_args(argparse.ArgumentParser(allow_abbrev=False))
    assert parser.parse_args([]).optimizer_state_adoption is True
    assert parser.parse_args(["--no-optimizer-state-adoption"]).optimizer_state_adoption is False


@pytest.mark.parametrize(
    "mutate",
    [
        lambda text: text.replace("'--optimizer',", "'--optimizer-name',"),
        lambda text: text.replace(
            "    return parser\n", "    group.add_argument('--optimizer')\n    return parser\n"
        ),
        lambda text: text.replace("'--optimizer-cpu-offload'", "'--no-optimizer-state-adoption'"),
        lambda text: text.replace(
            "action='store_true', help='Offload",
            "action='store_true', dest='optimizer_state_adoption', help='Offload",
        ),
        lambda text: text.replace("def _add_training_args", "def _add_other_args"),
    ],
    ids=["anchor missing", "anchor twice", "flag exists", "dest exists", "function missing"],
)
def test_argument_rule_refuses(mutate) -> None:  # type: ignore[no-untyped-def]
    text = mutate(SYNTHETIC_ARGUMENTS_DEV)
    assert text != SYNTHETIC_ARGUMENTS_DEV
    with pytest.raises(SeriesError):
        build_series.add_switch_argument(text, _switch())


SYNTHETIC_TRAINING = """\
import dataclasses


def get_megatron_optimizer_config(args):
    \"\"\"Return a Megatron optimizer config object from Megatron's arguments.\"\"\"

    kwargs = {}
    for f in dataclasses.fields(OptimizerConfig):
        if hasattr(args, f.name):
            kwargs[f.name] = getattr(args, f.name)
    config = OptimizerConfig(**kwargs)
    return config, None
"""


def test_config_from_args_rule() -> None:
    switch = _switch()
    build_series.check_config_copied_from_args(SYNTHETIC_TRAINING, switch)
    for broken in (
        SYNTHETIC_TRAINING.replace("if hasattr(args, f.name):", "if f.name in ('lr',):"),
        SYNTHETIC_TRAINING.replace(
            "    config = OptimizerConfig(**kwargs)",
            "    kwargs['optimizer_state_adoption'] = True\n    config = OptimizerConfig(**kwargs)",
        ),
        SYNTHETIC_TRAINING.replace("OptimizerConfig(**kwargs)", "OptimizerConfig(lr=1.0)"),
        SYNTHETIC_TRAINING.replace("get_megatron_optimizer_config", "get_config"),
    ):
        with pytest.raises(SeriesError):
            build_series.check_config_copied_from_args(broken, switch)


def test_rewrap_keeps_lists_and_refuses_code() -> None:
    text = (
        "A paragraph\nthat was wrapped\nat another width.\n\n- one item\n  continued here\n- two\n"
    )
    assert build_series.rewrap(text, width=16) == (
        "A paragraph that\nwas wrapped at\nanother width.\n\n- one item\n  continued here\n- two\n"
    )
    with pytest.raises(SeriesError):
        build_series.rewrap("```python\nx = 1\n```\n")
    with pytest.raises(SeriesError):
        build_series.docs_section("# Page\n\n## Other\n\ntext\n", "Why not in Transformer Engine")


# ---------------------------------------------------------------------------------------------
# With a Megatron-LM git directory: the series built at the recorded snapshots
# ---------------------------------------------------------------------------------------------

needs_mirror = pytest.mark.skipif(
    not (MIRROR / "HEAD").exists(),
    reason="no Megatron-LM git directory (set MEGATRON_LM_GIT_DIR, e.g. to the fetched mirror "
    "/work/.mirror/NVIDIA+Megatron-LM/repo); the checks above ran without it",
)


class Built:
    """The series of one branch, built at its recorded snapshot.

    Attributes:
        commits: per commit message (as in ``COMMIT_MESSAGES``), its diffs by path.
        diffs: by path, the diff of the last commit that changes the file.
        first_diffs: by path, the diff of the first commit that changes the file.
    """

    def __init__(self, branch: str, out: Path) -> None:
        entry = MANIFEST[branch]
        self.snapshot = build_series.Snapshot.from_git_dir(
            MIRROR, branch, str(entry["snapshot_commit"])
        )
        name, email = str(entry["author"])[:-1].split(" <")
        self.patches = build_series.build(self.snapshot, out, identity=(name, email))
        patches = build_series.code_patches(self.patches)
        assert len(patches) == len(COMMIT_MESSAGES)
        self.commits: Dict[str, Dict[str, FileDiff]] = {
            message: {d.path: d for d in build_series.read_series_patch(patch.read_text())}
            for message, patch in zip(COMMIT_MESSAGES, patches)
        }
        self.diffs: Dict[str, FileDiff] = {}
        self.first_diffs: Dict[str, FileDiff] = {}
        for diffs in self.commits.values():
            self.diffs.update(diffs)
            for path, diff in diffs.items():
                self.first_diffs.setdefault(path, diff)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Built]]:
    out = tmp_path_factory.mktemp("upstream-series")
    yield {branch: Built(branch, out / branch) for branch in BRANCHES}


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_built_series_is_recorded_and_applies_to_a_full_work_tree(
    built: Dict[str, Built], branch: str
) -> None:
    series, entry = built[branch], MANIFEST[branch]
    for recorded, files in (
        ("pre_image_blobs", series.snapshot.files),
        ("checked_blobs", series.snapshot.checked),
    ):
        assert {p: build_series.blob_id(c) for p, c in files.items()} == entry[recorded]
    assert [p.name for p in series.patches] == [COVER_LETTER, *entry["patches"]]
    check = build_series.apply_check(MIRROR, series.snapshot.commit, series.patches)
    assert check == entry["git_apply_check"]
    added = sorted(path for path, diff in series.diffs.items() if diff.new_file)
    assert added == entry["added_files"]
    changed = sorted(path for path, diff in series.diffs.items() if not diff.new_file)
    assert changed == sorted(build_series.TOUCHED_UPSTREAM_FILES)
    for path in changed:
        assert str(entry["pre_image_blobs"][path]).startswith(series.first_diffs[path].pre_blob)
    cover = " ".join(series.patches[0].read_text().split())
    for patch in series.patches[1:]:  # format-patch's shortlog names every commit
        subject = re.search(
            rf"^Subject: \[PATCH \d/{len(COMMIT_MESSAGES)}\] (.*(?:\n .*)*)",
            patch.read_text(),
            re.MULTILINE,
        )
        assert subject is not None and " ".join(subject.group(1).split()) in cover


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_every_added_file_is_its_source(built: Dict[str, Built], branch: str) -> None:
    offloader = built[branch].snapshot.offloader
    expected = {
        **build_series.subsystem_files(),
        **build_series.test_files(offloader),
        **build_series.docs_files(),
        **build_series.in_place_merge_files(),
    }
    added = {path: d.new_content() for path, d in built[branch].diffs.items() if d.new_file}
    assert sorted(added) == sorted(expected)
    for path, content in expected.items():
        assert added[path] == content, path


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_call_sites_make_our_patch_changes(built: Dict[str, Built], branch: str) -> None:
    diffs = built[branch].commits[build_series.CALL_SITE_MESSAGE]
    assert sorted(diffs) == sorted([CALL_SITE, NON_DISTRIBUTED_FILE])
    if not built[branch].snapshot.offloader:
        for path in (CALL_SITE, NON_DISTRIBUTED_FILE):
            assert _changes(diffs[path].hunks) == _changes(build_series.our_hunks(path)), path
        return
    # dev: optimizer.py as ours, up to indentation (a load inside the offloader's guard)
    ours = build_series.our_hunks(NON_DISTRIBUTED_FILE)
    assert _changes(diffs[NON_DISTRIBUTED_FILE].hunks, True) == _changes(ours, True)
    # dev: distrib_optimizer.py carries every line we add, removes no offloader line and
    # guards each export
    added = [line.strip() for h in diffs[CALL_SITE].hunks for line in h.added]
    removed = [line for h in diffs[CALL_SITE].hunks for line in h.removed]
    ours = build_series.our_hunks(CALL_SITE)
    for hunk in ours:
        comments, code = build_series._split_comments(hunk.added)
        for line in comments if hunk.kind == "load" else hunk.added:
            assert line.strip() in added, line
    # our load call (patches/0001), with dev's variable for the dict it assembles
    assert (
        "load_inner_optimizer_state_dict(self, optimizer_state_dict, owns_state_dict=True)" in added
    )
    assert not any("_optimizer_state_offloader" in line for line in removed)
    assert added.count(build_series.OFFLOADER_GUARD) == sum(h.kind == "export" for h in ours)


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_config_field_and_argument_are_the_generated_ones(
    built: Dict[str, Built], branch: str
) -> None:
    ours = build_series.our_hunks(CONFIG_FILE)
    theirs = built[branch].diffs[CONFIG_FILE].hunks
    assert _changes(theirs) == _changes(ours)
    for mine, their in zip(ours, theirs):  # before the same section, after the same blank line
        assert their.after == mine.after and their.before[-1:] == mine.before[-1:]
        if not built[branch].snapshot.offloader:  # main: our patch as it is
            assert their.before == mine.before
    switch = _switch()
    (hunk,) = built[branch].diffs[ARGUMENTS_FILE].hunks
    assert hunk.removed == []
    assert hunk.added == build_series.render_argument(switch, "group", branch == "dev")
    statement = build_series._block(hunk.added)
    call = ast.parse(textwrap.dedent(statement)).body[0]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
    assert [ast.literal_eval(a) for a in call.value.args] == ["--no-optimizer-state-adoption"]
    build_series.check_switch_argument(statement, switch)


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_changed_python_files_stay_black_clean(
    built: Dict[str, Built], branch: str, tmp_path: Path
) -> None:
    """A changed file the snapshot has black-clean (all but main's arguments.py and dev's
    transformer/utils.py) stays so."""
    series = built[branch]
    build_series.work_tree(MIRROR, series.snapshot.commit, tmp_path)
    subprocess.run(
        ["git", "apply", *map(str, build_series.code_patches(series.patches))],
        cwd=tmp_path,
        check=True,
    )
    checked = []
    for path, before in series.snapshot.files.items():
        if path.endswith(".py") and _black_clean(before):
            assert _black_clean((tmp_path / path).read_text()), path
            checked.append(path)
    assert len(checked) == 4


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_bug_fix_is_the_first_commit_alone_and_not_repeated(
    built: Dict[str, Built], branch: str
) -> None:
    series = built[branch]
    fix = build_series.our_hunks(CALL_SITE, bug_fix=True)
    (first_message, first), *later = series.commits.items()
    assert first_message == build_series.BUG_FIX_MESSAGE and sorted(first) == [CALL_SITE]
    assert _changes(first[CALL_SITE].hunks) == _changes(fix)
    before = series.snapshot.files[CALL_SITE]
    assert build_series.blob_id(before).startswith(first[CALL_SITE].pre_blob)
    # the call sites apply to the fixed file, and only one commit carries the fix
    fixed = build_series.change_file(before, fix, CALL_SITE, False)
    call_site = series.commits[build_series.CALL_SITE_MESSAGE][CALL_SITE]
    assert build_series.blob_id(fixed).startswith(call_site.pre_blob)
    fix_lines = {line for hunk in fix for line in hunk.added}
    for message, diffs in later:
        for diff in diffs.values():
            assert not fix_lines & {line for h in diff.hunks for line in h.added}, message
    assert [message for message, diffs in later if CALL_SITE in diffs] == [
        build_series.CALL_SITE_MESSAGE
    ]


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_in_place_merge_commit_adds_our_module_and_changes_the_merge(
    built: Dict[str, Built], branch: str
) -> None:
    series = built[branch]
    diffs = series.commits[build_series.IN_PLACE_MERGE_MESSAGE]
    assert sorted(diffs) == sorted([IN_PLACE_MERGE, IN_PLACE_MERGE_TEST, UTILS_FILE])
    assert diffs[IN_PLACE_MERGE].new_file and diffs[IN_PLACE_MERGE_TEST].new_file
    header = build_series.PYTHON_HEADER
    module = diffs[IN_PLACE_MERGE].new_content()
    assert module.startswith(header)
    ours = (REPO_ROOT / IN_PLACE_MERGE).read_text()
    assert module.removeprefix(header) == ours.removeprefix(header)
    test = diffs[IN_PLACE_MERGE_TEST].new_content()
    assert test == (REPO_ROOT / "upstream" / IN_PLACE_MERGE_TEST).read_text()
    # utils.py: exactly patches/0004's hunks (the import, cat_with_oom_fallback's view first)
    utils = diffs[UTILS_FILE]
    assert build_series.blob_id(series.snapshot.files[UTILS_FILE]).startswith(utils.pre_blob)
    assert _changes(utils.hunks) == _changes(build_series.our_hunks(UTILS_FILE))
    assert [h for h in utils.hunks if "def cat_with_oom_fallback(sub_state_dict):" in h.before]
    added = [line.strip() for h in utils.hunks for line in h.added]
    assert "from megatron.core.dist_checkpointing.in_place_merge import concatenated_view" in added
    assert "merged = concatenated_view(sub_state_dict)" in added
    # no other commit touches these files, and the merge of older releases (mlp.py) is absent
    for message, other in series.commits.items():
        if message != build_series.IN_PLACE_MERGE_MESSAGE:
            assert not set(other) & set(diffs), message
    assert "megatron/core/transformer/mlp.py" not in series.diffs
