"""The committed Megatron-LM patch series (upstream/<branch>/) is what upstream/build_series.py makes.

Two levels, because CI has no copy of Megatron-LM (only PyPI is reachable there):

* always: every file the series adds is byte-equal to its source in this repository (the
  subsystem with the copyright line, the unit tests, the docs page); the call-site diff was made
  against the snapshot recorded in upstream/series.json (its pre-image blob ids) and makes the
  changes of patches/*.patch (on main exactly those hunks; on dev those calls, guarded so that
  the chunked offloader's path keeps upstream's calls); the generator's call-site rules are
  exercised on small synthetic files of both shapes.
* when a Megatron-LM git directory is available (``MEGATRON_LM_GIT_DIR``, or the fetched mirror
  at /work/.mirror/NVIDIA+Megatron-LM/repo): the series is rebuilt at the recorded commits into a
  temporary folder and compared byte for byte. Skipped, with the reason, elsewhere.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "upstream"))

import build_series  # noqa: E402  (upstream/ is not a package)
from build_series import CALL_SITE, DOCS_INDEX, FileDiff, Hunk  # noqa: E402

MANIFEST = json.loads((REPO_ROOT / "upstream" / "series.json").read_text())
BRANCHES = sorted(MANIFEST)
DEFAULT_MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")


def _series(branch: str) -> List[List[FileDiff]]:
    names = MANIFEST[branch]["patches"]
    return [
        build_series.read_series_patch((REPO_ROOT / "upstream" / branch / name).read_text())
        for name in names
    ]


def _diffs(branch: str) -> Dict[str, FileDiff]:
    return {d.path: d for patch in _series(branch) for d in patch}


def test_manifest_covers_main_and_dev() -> None:
    assert BRANCHES == ["dev", "main"]
    for branch in BRANCHES:
        entry = MANIFEST[branch]
        assert len(entry["snapshot_commit"]) == 40
        assert entry["git_apply_check"].startswith("ok:")
        on_disk = sorted(p.name for p in (REPO_ROOT / "upstream" / branch).glob("*.patch"))
        assert on_disk == entry["patches"]


@pytest.mark.parametrize("branch", BRANCHES)
def test_added_files_are_our_sources(branch: str) -> None:
    offloader = MANIFEST[branch]["offloader_special_case"]
    expected = {
        **build_series.subsystem_files(),
        **build_series.test_files(offloader),
        **build_series.docs_files(),
    }
    added = {path: d.new_content() for path, d in _diffs(branch).items() if d.new_file}
    assert sorted(added) == sorted(expected)
    for path, content in expected.items():
        assert added[path] == content, f"{branch}: {path} differs from its source; rebuild"


@pytest.mark.parametrize("branch", BRANCHES)
def test_changed_files_were_made_against_the_recorded_snapshot(branch: str) -> None:
    changed = {path: d for path, d in _diffs(branch).items() if not d.new_file}
    assert sorted(changed) == sorted([CALL_SITE, DOCS_INDEX])
    for path, diff in changed.items():
        assert MANIFEST[branch]["pre_image_blobs"][path].startswith(diff.pre_blob)


def _changes(hunks: List[Hunk]) -> List[tuple]:
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
    with pytest.raises(build_series.SeriesError):
        build_series.change_call_site(broken, FINAL_API_HUNKS)


def _mirror() -> Path:
    return Path(os.environ.get("MEGATRON_LM_GIT_DIR", DEFAULT_MIRROR))


@pytest.mark.skipif(
    not (_mirror() / "HEAD").exists(),
    reason="no Megatron-LM git directory (set MEGATRON_LM_GIT_DIR); the byte-for-byte rebuild "
    "needs the snapshot, the source-equality checks above ran without it",
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
    snapshot = build_series.Snapshot(
        branch,
        commit,
        {
            path: subprocess.run(
                ["git", "--git-dir", str(_mirror()), "show", f"{commit}:{path}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            for path in build_series.TOUCHED_UPSTREAM_FILES
        },
    )
    name, email = MANIFEST[branch]["author"][:-1].split(" <")
    rebuilt = build_series.build(snapshot, tmp_path / branch, identity=(name, email))
    assert [p.name for p in rebuilt] == MANIFEST[branch]["patches"]
    for patch in rebuilt:
        committed = REPO_ROOT / "upstream" / branch / patch.name
        assert patch.read_text() == committed.read_text(), f"{branch}/{patch.name}: rebuild"
