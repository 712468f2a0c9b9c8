"""The committed Megatron-LM patch series (upstream/<branch>/) is what upstream/build_series.py makes.

Two levels, because CI has no copy of Megatron-LM (only PyPI is reachable there):

* always: every file the series adds is byte-equal to its source in this repository (the
  subsystem with the copyright line, the unit tests, the docs page), and no file removed here
  is still added; the changed files' diffs were made against the snapshot recorded in
  upstream/series.json (their pre-image blob ids); the call-site diff makes the changes of
  patches/*.patch (on main exactly those hunks; on dev those calls, guarded so that the chunked
  offloader's path keeps upstream's calls); the OptimizerConfig diff makes exactly the changes
  of patches/*.patch, before the same section on both branches; the arguments.py diff is one
  hunk that adds the generated ``--no-optimizer-state-adoption`` argument for that field, and
  the argument works; the cover letter carries the docs page's "why not in Transformer Engine"
  and PR 7288 sections; the generator's rules are exercised on small synthetic files of every
  shape, and what they must refuse is refused.
* when ``MEGATRON_LM_GIT_DIR`` names a Megatron-LM git directory (e.g. the fetched mirror at
  /work/.mirror/NVIDIA+Megatron-LM/repo): the series is rebuilt at the recorded commits into a
  temporary folder and compared byte for byte. Skipped, with the reason, without it.
"""

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "upstream"))

import build_series  # noqa: E402  (upstream/ is not a package)
from build_series import (  # noqa: E402
    ARGUMENTS_FILE,
    CALL_SITE,
    CONFIG_FILE,
    COVER_LETTER,
    FileDiff,
    Hunk,
    SeriesError,
)

MANIFEST = json.loads((REPO_ROOT / "upstream" / "series.json").read_text())
BRANCHES = sorted(MANIFEST)
DEFAULT_MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
DOCS_PAGE = REPO_ROOT / "upstream" / "docs" / "api-guide" / "core" / "optimizer_state_adoption.md"


def _series(branch: str) -> List[List[FileDiff]]:
    names = MANIFEST[branch]["patches"]
    return [
        build_series.read_series_patch((REPO_ROOT / "upstream" / branch / name).read_text())
        for name in names
    ]


def _diffs(branch: str) -> Dict[str, FileDiff]:
    return {d.path: d for patch in _series(branch) for d in patch}


def _switch() -> build_series.ConfigField:
    return build_series.adoption_switch(build_series.our_config_hunks())


def test_manifest_covers_main_and_dev() -> None:
    assert BRANCHES == ["dev", "main"]
    for branch in BRANCHES:
        entry = MANIFEST[branch]
        assert len(entry["snapshot_commit"]) == 40
        assert entry["git_apply_check"].startswith("ok:")
        assert entry["cover_letter"] == COVER_LETTER
        on_disk = sorted(p.name for p in (REPO_ROOT / "upstream" / branch).glob("*.patch"))
        assert on_disk == [COVER_LETTER, *entry["patches"]]
        assert sorted(entry["pre_image_blobs"]) == sorted(build_series.TOUCHED_UPSTREAM_FILES)
        assert sorted(entry["checked_blobs"]) == sorted(build_series.CHECKED_UPSTREAM_FILES)


@pytest.mark.parametrize("branch", BRANCHES)
def test_added_files_are_our_sources(branch: str) -> None:
    offloader = MANIFEST[branch]["offloader_special_case"]
    expected = {
        **build_series.subsystem_files(),
        **build_series.test_files(offloader),
        **build_series.docs_files(),
    }
    added = {path: d.new_content() for path, d in _diffs(branch).items() if d.new_file}
    ours = sorted((REPO_ROOT / build_series.SUBSYSTEM).glob("*.py"))
    added_modules = sorted(p for p in added if p.startswith(build_series.SUBSYSTEM + "/"))
    assert added_modules == [f"{build_series.SUBSYSTEM}/{p.name}" for p in ours], (
        f"{branch}: the series adds other subsystem modules than there are here "
        "(a removed or new file); rebuild"
    )
    assert sorted(added) == sorted(expected)
    for path, content in expected.items():
        assert added[path] == content, f"{branch}: {path} differs from its source; rebuild"


@pytest.mark.parametrize("branch", BRANCHES)
def test_changed_files_were_made_against_the_recorded_snapshot(branch: str) -> None:
    changed = {path: d for path, d in _diffs(branch).items() if not d.new_file}
    assert sorted(changed) == sorted(build_series.TOUCHED_UPSTREAM_FILES)
    for path, diff in changed.items():
        assert MANIFEST[branch]["pre_image_blobs"][path].startswith(diff.pre_blob)


def _changes(hunks: List[Hunk]) -> List[Tuple[Tuple[str, ...], Tuple[str, ...]]]:
    return [(tuple(h.removed), tuple(h.added)) for h in hunks]


@pytest.mark.parametrize("branch", BRANCHES)
def test_call_site_makes_our_patch_changes(branch: str) -> None:
    ours = build_series.our_call_site_hunks()
    theirs = _diffs(branch)[CALL_SITE].hunks
    if not MANIFEST[branch]["offloader_special_case"]:
        assert _changes(theirs) == _changes(ours), "patches/*.patch changed; rebuild the series"
        return
    added = [line for h in theirs for line in h.added]
    removed = [line for h in theirs for line in h.removed]
    for hunk in ours:
        if hunk.kind == "import":
            assert all(line in added for line in hunk.added)
        else:
            callee = build_series._new_callee(hunk)
            assert any(f"{callee}(self" in line for line in added), callee
            comments, _ = build_series._split_comments(hunk.added)
            stripped = {line.strip() for line in added}
            assert all(line.strip() in stripped for line in comments), "rebuild the series"
    assert not any("_optimizer_state_offloader" in line for line in removed)
    assert sum(build_series.OFFLOADER_GUARD in line for line in added) == sum(
        h.kind == "export" for h in ours
    )


@pytest.mark.parametrize("branch", BRANCHES)
def test_config_field_makes_our_patch_changes(branch: str) -> None:
    ours = build_series.our_config_hunks()
    theirs = _diffs(branch)[CONFIG_FILE].hunks
    assert _changes(theirs) == _changes(ours), "patches/*.patch changed; rebuild the series"
    for mine, their in zip(ours, theirs):
        # Before the same section on both branches, after the same blank line.
        assert their.after == mine.after and their.before[-1:] == mine.before[-1:]
        if not MANIFEST[branch]["offloader_special_case"]:  # main: our patch as it is
            assert their.before == mine.before


@pytest.mark.parametrize("branch", BRANCHES)
def test_argument_is_one_hunk_for_the_config_field(branch: str) -> None:
    switch = _switch()
    (hunk,) = _diffs(branch)[ARGUMENTS_FILE].hunks
    assert hunk.removed == []
    styles = {
        black: build_series.render_argument(switch, "group", black) for black in (False, True)
    }
    assert hunk.added in styles.values(), "the argument is not the generated one; rebuild"
    assert hunk.added == styles[branch == "dev"]  # main: hand-wrapped, dev: black
    statement = build_series._block(hunk.added)
    call = ast.parse(textwrap.dedent(statement)).body[0]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
    assert [ast.literal_eval(a) for a in call.value.args] == ["--no-optimizer-state-adoption"]
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.value.keywords}
    assert keywords["action"] == "store_false" and keywords["dest"] == switch.name
    build_series.check_switch_argument(statement, switch)  # True by default, False when given


def _cover(branch: str) -> str:
    return (REPO_ROOT / "upstream" / branch / COVER_LETTER).read_text()


def _unfolded_subject(patch: str) -> str:
    match = re.search(r"^Subject: (.*(?:\n .*)*)", patch, re.MULTILINE)
    assert match is not None
    return re.sub(r"\n ", " ", match.group(1))


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("branch", BRANCHES)
def test_cover_letter_carries_why_not_in_transformer_engine(branch: str) -> None:
    cover = _cover(branch)
    count = len(MANIFEST[branch]["patches"])
    assert _unfolded_subject(cover) == f"[PATCH 0/{count}] {build_series.COVER_SUBJECT}"
    page = DOCS_PAGE.read_text()
    for title in build_series.COVER_SECTIONS:
        section = build_series.docs_section(page, title)
        assert f"\n{title}\n{'-' * len(title)}\n\n" in cover
        assert build_series.rewrap(section) in cover, f"{branch}: '{title}' differs; rebuild"
        assert _words(section) in _words(cover)
    assert max(len(line) for line in build_series.cover_letter_text(True).splitlines()) <= 72
    for fact in (
        "https://github.com/NVIDIA/TransformerEngine/pull/3507",
        "Restored states continue to own their storage; checkpoint tensors are copied",
        "https://github.com/pytorch/pytorch/issues/196083",
        "https://github.com/NVIDIA/Megatron-LM/pull/7288",
        "__setstate__",
        "name_to_dtype_map",
        "master_weights",
    ):
        assert fact in _words(cover), fact
    for name in MANIFEST[branch]["patches"]:  # format-patch's shortlog names every commit
        subject = _unfolded_subject((REPO_ROOT / "upstream" / branch / name).read_text())
        assert _words(subject.split("] ", 1)[1]) in _words(cover)
    assert (build_series.COVER_OFFLOADER in cover) == MANIFEST[branch]["offloader_special_case"]


def test_readme_lists_exactly_the_exported_names() -> None:
    import importlib

    package_name = "megatron.core.optimizer.state_adoption"
    package = importlib.import_module(package_name)
    expected = set(package.__all__)
    for path in sorted((REPO_ROOT / build_series.SUBSYSTEM).glob("*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"{package_name}.{path.stem}")
        expected |= {f"{path.stem}.{n}" for n in module.__all__ if n not in package.__all__}
    readme = (REPO_ROOT / "upstream" / "README.md").read_text()
    table = readme.split("## Exported names", 1)[1].split("\n## ", 1)[0]
    listed = {
        name
        for row in table.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([\w.]+)`", row.split(" | ")[0])
    }
    assert listed == expected


# ---------------------------------------------------------------------------------------------
# The generator's rules on synthetic files
# ---------------------------------------------------------------------------------------------

SYNTHETIC_PLAIN = '''\
from .param_layout import FullParamLayout

logger = getLogger(__name__)


class DistributedOptimizer:
    def state_dict(self):
        inner_state_dict = self.optimizer.state_dict()
        return inner_state_dict

    def load_state_dict(self, state_dict):
        inner_state_dict = self.optimizer.state_dict()
        state_dict_state = inner_state_dict["state"]

        # Optimizer.
        self.optimizer.load_state_dict(
            {"state": state_dict_state, "param_groups": state_dict_param_groups}
        )

    def other(self):
        pass
'''

SYNTHETIC_OFFLOADER = '''\
from .param_layout import FullParamLayout

logger = getLogger(__name__)


class DistributedOptimizer:
    def load_state_dict(self, state_dict):
        inner_state_dict = self.optimizer.state_dict()
        state_dict_state = inner_state_dict["state"]

        # Optimizer.
        optimizer_state_dict = {"state": state_dict_state, "param_groups": state_dict_param_groups}
        if self._optimizer_state_offloader is None:
            self.optimizer.load_state_dict(optimizer_state_dict)
        else:
            self._optimizer_state_offloader.load_state_dict_without_device_cast(
                optimizer_state_dict
            )
'''

FINAL_API_HUNKS = [
    Hunk(
        before=["from .param_layout import FullParamLayout"],
        added=["from .state_adoption import export_inner_optimizer_state_dict, load_x"],
    ),
    Hunk(
        removed=["        inner_state_dict = self.optimizer.state_dict()"],
        added=["        inner_state_dict = export_inner_optimizer_state_dict(self)"],
    ),
    Hunk(
        removed=[
            "        # Optimizer.",
            "        self.optimizer.load_state_dict(",
            '            {"state": state_dict_state, "param_groups": state_dict_param_groups}',
        ],
        added=[
            "        # Optimizer. Adopters may install it.",
            "        load_inner_optimizer_state_dict(",
            '            self, {"state": state_dict_state, "param_groups": state_dict_param_groups}',
        ],
    ),
]


def test_rules_on_plain_call_site_change_only_load_state_dict() -> None:
    result = build_series.change_call_site(SYNTHETIC_PLAIN, FINAL_API_HUNKS)
    state_dict_method = result.split("def load_state_dict")[0]
    assert "inner_state_dict = self.optimizer.state_dict()" in state_dict_method
    assert "inner_state_dict = export_inner_optimizer_state_dict(self)" in result
    assert "load_inner_optimizer_state_dict(\n            self, {" in result
    assert "self.optimizer.load_state_dict" not in result


def test_rules_on_offloader_call_site_keep_the_offloader_path() -> None:
    result = build_series.change_call_site(SYNTHETIC_OFFLOADER, FINAL_API_HUNKS)
    assert (
        "        if self._optimizer_state_offloader is None:\n"
        "            inner_state_dict = export_inner_optimizer_state_dict(self)\n"
        "        else:\n"
        "            inner_state_dict = self.optimizer.state_dict()\n"
    ) in result
    assert (
        "        if self._optimizer_state_offloader is None:\n"
        "            load_inner_optimizer_state_dict(self, optimizer_state_dict)\n"
        "        else:\n"
        "            self._optimizer_state_offloader.load_state_dict_without_device_cast(\n"
    ) in result
    assert "# Optimizer. Adopters may install it." in result


def test_unknown_call_site_shape_is_refused() -> None:
    broken = SYNTHETIC_PLAIN.replace("# Optimizer.\n", "# Inner optimizer.\n")
    with pytest.raises(SeriesError):
        build_series.change_call_site(broken, FINAL_API_HUNKS)


def test_a_patch_changing_another_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "patches").mkdir()
    for patch in sorted((REPO_ROOT / "patches").glob("*.patch")):
        (tmp_path / "patches" / patch.name).write_text(patch.read_text())
    monkeypatch.setattr(build_series, "REPO_ROOT", tmp_path)
    assert build_series.our_config_hunks()  # the real patches pass
    (tmp_path / "patches" / "0099-other.patch").write_text(
        "--- a/megatron/core/optimizer/grad_scaler.py\n"
        "+++ b/megatron/core/optimizer/grad_scaler.py\n"
        "@@ -1,1 +1,2 @@\n"
        " import torch\n"
        "+import os\n"
    )
    with pytest.raises(SeriesError, match="does not carry"):
        build_series.our_call_site_hunks()


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
    hunks = build_series.our_config_hunks()
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
        build_series.change_optimizer_config(text, build_series.our_config_hunks())


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
# With a Megatron-LM git directory: the rebuild is byte-identical
# ---------------------------------------------------------------------------------------------


def _mirror() -> Path:
    return Path(os.environ.get("MEGATRON_LM_GIT_DIR", "/nonexistent"))


@pytest.mark.skipif(
    not (_mirror() / "HEAD").exists(),
    reason="no Megatron-LM git directory (set MEGATRON_LM_GIT_DIR, e.g. to the fetched mirror "
    f"{DEFAULT_MIRROR}); the byte-for-byte rebuild needs the snapshot, the source-equality "
    "checks above ran without it",
)
@pytest.mark.parametrize("branch", BRANCHES)
def test_series_rebuilds_byte_for_byte(branch: str, tmp_path: Path) -> None:
    commit = MANIFEST[branch]["snapshot_commit"]
    probe = subprocess.run(
        ["git", "--git-dir", str(_mirror()), "cat-file", "-e", f"{commit}^{{commit}}"],
        capture_output=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"{_mirror()} does not hold the recorded {branch} commit {commit}")
    snapshot = build_series.Snapshot.from_git_dir(_mirror(), branch, commit)
    for recorded, files in (
        ("pre_image_blobs", snapshot.files),
        ("checked_blobs", snapshot.checked),
    ):
        blobs = {path: build_series._blob_id(content) for path, content in files.items()}
        assert blobs == MANIFEST[branch][recorded], f"{branch}: {recorded} differ"
    name, email = MANIFEST[branch]["author"][:-1].split(" <")
    rebuilt = build_series.build(snapshot, tmp_path / branch, identity=(name, email))
    assert [p.name for p in rebuilt] == [COVER_LETTER, *MANIFEST[branch]["patches"]]
    for patch in rebuilt:
        committed = REPO_ROOT / "upstream" / branch / patch.name
        assert patch.read_text() == committed.read_text(), f"{branch}/{patch.name}: rebuild"


def _black_26():  # type: ignore[no-untyped-def]
    try:
        import black
    except ImportError:
        return None
    return black if black.__version__.startswith("26.") else None


@pytest.mark.skipif(
    _black_26() is None,
    reason="black 26 (Megatron-LM's required_version) is not installed; Megatron-LM's CI "
    "formats the series' Python files with it (pip install 'black==26.*' to check here)",
)
@pytest.mark.parametrize("branch", BRANCHES)
def test_added_python_files_follow_megatron_lm_black(branch: str) -> None:
    black = _black_26()
    # Megatron-LM's pyproject.toml: line_length 100, skip_string_normalization,
    # skip_magic_trailing_comma.
    mode = black.Mode(line_length=100, string_normalization=False, magic_trailing_comma=False)
    added = {path: d.new_content() for path, d in _diffs(branch).items() if d.new_file}
    unformatted = [
        path
        for path, content in sorted(added.items())
        if path.endswith(".py") and black.format_str(content, mode=mode) != content
    ]
    assert unformatted == [], f"{branch}: black (Megatron-LM's settings) would reformat these"
