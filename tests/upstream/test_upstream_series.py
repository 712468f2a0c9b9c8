"""The Megatron-LM pull requests that upstream/build_series.py builds, and upstream/series.json.

Nothing of them is committed: one command builds them into build/upstream-series/ (see
upstream/README.md). Two levels, because CI has no copy of Megatron-LM (only PyPI is reachable
there):

* always, in seconds: series.json and README's table agree with the current sources where that
  needs no snapshot (patch names are the descriptions' commit subjects, the files listed as
  added are the subsystem modules, the in-place merge module, unit tests and docs page here),
  the descriptions carry their numbers, every Python file the pull requests add passes black 26
  with Megatron-LM's settings, (b)'s subsystem (the final one without what upstream/prs/
  split.toml names) imports and exports exactly its names, (b) then (d) replayed give our files
  byte for byte, the generator refuses a split.toml name that is gone and a missing test, and
  its rules are exercised on small synthetic files of every shape;
* with ``MEGATRON_LM_GIT_DIR`` (a Megatron-LM git directory, e.g. a fetched mirror of
  github:NVIDIA/Megatron-LM): the pull requests are built at the recorded snapshots into a
  temporary folder and checked against series.json, applied in turn (and (a), (c) alone) on a
  full work tree, rebuilt byte-identically, and their diffs checked file by file. Skipped, with
  the reason, without it.
"""

import argparse
import ast
import difflib
import importlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
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
    MLP_GLU_TEST,
    NON_DISTRIBUTED_FILE,
    PULL_REQUESTS,
    SUBSYSTEM,
    UTILS_FILE,
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
A, B, C, D = PULL_REQUESTS
B_EXPORTS = [
    "AdoptionContext",
    "AdoptionOutcome",
    "StateAdopter",
    "StateAdopterRegistry",
    "default_registry",
    "load_inner_optimizer_state_dict",
]
"""What (b)'s package exports."""


def _fields() -> List[build_series.ConfigField]:
    return build_series.config_fields(build_series.our_hunks(CONFIG_FILE))


def _changes(hunks: List[Hunk], strip: bool = False) -> List[Tuple[Tuple[str, ...], ...]]:
    def lines(block: List[str]) -> Tuple[str, ...]:
        return tuple(line.strip() if strip else line for line in block)

    return [(lines(h.removed), lines(h.added)) for h in hunks]


def _black_clean(content: str) -> bool:
    import black

    assert black.__version__.startswith("26."), "Megatron-LM requires black 26"
    return bool(black.format_str(content, mode=black.Mode(**BLACK_MODE)) == content)


def _git(cwd: Path, *args: str, stdin: str = "") -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull)
    identity = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
    return subprocess.run(
        ["git", *identity, *args], cwd=cwd, env=env, input=stdin, text=True, check=True,
        capture_output=True,
    ).stdout  # fmt: skip


def _names(source: str) -> Dict[str, List[str]]:
    """Per scope ("" and each class), the names its statements define, imports left out."""
    tree = ast.parse(source)
    scopes = {"": tree.body, **{n.name: n.body for n in tree.body if isinstance(n, ast.ClassDef)}}
    return {
        scope: sorted(
            name
            for node in body
            if not isinstance(node, (ast.Import, ast.ImportFrom, ast.If))
            for name in build_series._defined(node)
        )
        for scope, body in scopes.items()
    }


# ---------------------------------------------------------------------------------------------
# series.json, README and the sources, without a snapshot
# ---------------------------------------------------------------------------------------------


def test_manifest_records_main_and_dev() -> None:
    assert BRANCHES == ["dev", "main"]
    for branch, entry in MANIFEST.items():
        assert len(str(entry["snapshot_commit"])) == 40
        assert entry["git_apply_check"] == (
            "ok: a, b, c, d apply in turn and a and c alone to a full work tree of "
            f"{entry['snapshot_commit']}"
        )
        assert sorted(entry["pre_image_blobs"]) == sorted(build_series.SNAPSHOT_FILES)
        assert sorted(entry["checked_blobs"]) == sorted(build_series.CHECKED_UPSTREAM_FILES)
        assert list(entry["pull_requests"]) == list(PULL_REQUESTS)
    assert MANIFEST["main"]["offloader_special_case"] is False
    assert MANIFEST["dev"]["offloader_special_case"] is True


@pytest.mark.parametrize("branch", BRANCHES)
def test_manifest_lists_the_files_added_from_these_sources(branch: str) -> None:
    """A subsystem module, test or docs page added or removed here needs a rebuild."""
    expected = build_series.added_files(bool(MANIFEST[branch]["offloader_special_case"]))
    modules = [f"{SUBSYSTEM}/{p.name}" for p in (REPO_ROOT / SUBSYSTEM).glob("*.py")]
    assert set(modules) <= set(expected)
    assert MANIFEST[branch]["added_files"] == expected, f"{branch}: rebuild the pull requests"


@pytest.mark.parametrize("branch", BRANCHES)
def test_patch_names_are_the_commit_subjects(branch: str) -> None:
    offloader = bool(MANIFEST[branch]["offloader_special_case"])
    for name in PULL_REQUESTS:
        _, messages = build_series.pr_texts(name, offloader)
        names = MANIFEST[branch]["pull_requests"][name]["patches"]
        assert len(names) == len(messages), f"{branch} {name}: rebuild the pull requests"
        for index, (patch, message) in enumerate(zip(names, messages), 1):
            subject = message.split("\n", 1)[0]
            # git format-patch: NNNN-<subject, runs of other characters as one '-'>, cut to 52
            sanitized = re.sub(r"[^A-Za-z0-9._]+", "-", subject).strip("-.")[:52].rstrip("-.")
            assert patch == f"{index:04d}-{sanitized}.patch", f"{branch}: rebuild"
            assert message.split("\n")[1] == ""


def test_readme_table_is_the_one_series_json_gives() -> None:
    readme = (REPO_ROOT / "upstream" / "README.md").read_text()
    assert build_series.with_table(readme, MANIFEST) == readme, "run build_series.py build"
    table = readme.split(build_series.TABLE_BEGIN)[1].split(build_series.TABLE_END)[0]
    assert f"| **{B}** | **all files** |" in table


DESCRIPTION_FACTS = {
    A: ["#1842", "dp_reshardable", "assert [1] == [3]"],
    B: [
        "17.0 -> 8.0",
        "17.2 -> 8.0",
        "16.9 -> 8.0",
        "bitwise identical",
        "https://github.com/NVIDIA/TransformerEngine/pull/3507",
        "Restored states continue to own their storage; checkpoint tensors are copied",
        "https://github.com/pytorch/pytorch/issues/196083",
        "--no-optimizer-state-adoption",
        "owns_state_dict=True",
    ],
    C: [
        "0.82 bytes per parameter",
        IN_PLACE_MERGE.replace("/", ".").removesuffix(".py"),
        f"test_oom_is_handled in {MLP_GLU_TEST}",
        "test_halves_loaded_in_place_merge_without_a_copy",
        "torch.cuda.max_memory_allocated()",
    ],
    D: [
        "29.06 -> 6.00",
        "16.17 -> 8.00",
        "at or below the uninterrupted run's peak",
        "--precision-aware-optimizer-state-adoption",
        "docs/api-guide/core/optimizer_state_adoption.md",
        "https://github.com/NVIDIA/Megatron-LM/pull/7288",
    ],
}


@pytest.mark.parametrize("offloader", [False, True], ids=["main", "dev"])
@pytest.mark.parametrize("name", PULL_REQUESTS)
def test_descriptions_carry_their_facts(name: str, offloader: bool) -> None:
    description, messages = build_series.pr_texts(name, offloader)
    for text in (description, *messages):
        assert max(len(line) for line in text.splitlines()) <= 72
        assert "[offloader]" not in text and "[docs:" not in text
    words = " ".join(description.split())
    for fact in DESCRIPTION_FACTS[name]:
        assert fact in words, fact
    source = (build_series.PRS_DIR / f"{name}.md").read_text()
    assert ("offloader" in words) is (offloader and "[offloader]" in source) or not offloader


def test_added_python_files_follow_megatron_lm_black() -> None:
    files = {
        **build_series.subsystem_files(),
        **{f"(b) {p}": t for p, t in build_series.subsystem_files(final=False).items()},
        **build_series.test_files(True),
        **build_series.in_place_merge_files(),
    }
    unformatted = [path for path, content in sorted(files.items()) if not _black_clean(content)]
    assert unformatted == [], "black 26 with Megatron-LM's settings would reformat these"


def test_readme_lists_exactly_the_exported_names() -> None:
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
# (b)'s subsystem: the final one without what split.toml names
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def b_package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """(b)'s modules, imported as a package of their own (``b_state_adoption``)."""
    root = tmp_path_factory.mktemp("b-subsystem")
    (root / "b_state_adoption").mkdir()
    for path, text in build_series.subsystem_files(final=False).items():
        (root / "b_state_adoption" / Path(path).name).write_text(text)
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("b_state_adoption")
    finally:
        sys.path.remove(str(root))


def test_b_package_imports_and_exports_exactly_its_names(b_package: object) -> None:
    assert sorted(getattr(b_package, "__all__")) == sorted(B_EXPORTS)
    assert all(hasattr(b_package, name) for name in B_EXPORTS)
    registry = getattr(b_package, "default_registry")()
    assert [adopter.name for adopter in registry._adopters.values()] == ["te_fused_adam_fp32"]
    adopter = importlib.import_module("b_state_adoption.adopter").StateAdopter
    assert not [m for m in vars(adopter) if m.startswith(("export", "initialize", "read"))]


def test_b_keeps_every_name_split_toml_does_not_list() -> None:
    split = build_series.split_manifest()["modules"]
    final = build_series.subsystem_files()
    for path, text in build_series.subsystem_files(final=False).items():
        name = Path(path).name
        removed = split.get(name, {}).get("remove", [])
        expected = _names(final[path])
        for listed in removed:
            scope, _, member = listed.rpartition(".")
            expected[scope].remove(member)
        if name == "__init__.py":
            continue  # only imports and the registrations: checked by the package test
        assert {s: n for s, n in expected.items() if s in _names(text)} == _names(text), name


def test_d_only_adds_lines_outside_docstrings_and_imports() -> None:
    final = build_series.subsystem_files()
    for path, text in build_series.subsystem_files(final=False).items():
        tree = ast.parse(text)
        free = set()  # (b)'s lines that (d) may change: imports, docstrings, __all__
        for node in (n for n in ast.walk(tree) if isinstance(n, ast.stmt)):
            is_all = build_series._defined(node) == ["__all__"]
            if (
                isinstance(node, (ast.Import, ast.ImportFrom))
                or build_series._is_string(node)
                or is_all
            ):
                free |= set(range(node.lineno - 1, node.end_lineno or node.lineno))
        ours, theirs = text.split("\n"), final[path].split("\n")
        for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, ours, theirs).get_opcodes():
            if tag in ("replace", "delete"):
                assert set(range(i1, i2)) <= free, (path, ours[i1:i2])


def test_b_then_d_replayed_give_our_files_byte_for_byte(tmp_path: Path) -> None:
    b_files, d_files = build_series.subsystem_files(final=False), build_series.subsystem_files()
    work, replay = tmp_path / "work", tmp_path / "replay"
    for repo in (work, replay):
        repo.mkdir()
        _git(repo, "init", "-q")
        build_series._write(repo, b_files)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", "(b)")
    build_series._write(work, d_files)
    _git(work, "add", "-A")
    _git(work, "commit", "-q", "-m", "(d)")
    patch = _git(work, "format-patch", "--stdout", "HEAD~1..HEAD")
    _git(replay, "am", "-q", stdin=patch)
    for path, content in d_files.items():
        assert (replay / path).read_bytes() == content.encode(), path


def test_a_split_toml_name_that_is_gone_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    split = build_series.split_manifest()
    split["modules"]["checks.py"]["remove"].append("no_such_function")
    monkeypatch.setattr(build_series, "split_manifest", lambda: split)
    with pytest.raises(SeriesError, match="names no_such_function in checks.py"):
        build_series.subsystem_files(final=False)


def test_removing_what_kept_code_uses_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    split = build_series.split_manifest()
    split["modules"]["checks.py"]["remove"].append("same_memory")
    monkeypatch.setattr(build_series, "split_manifest", lambda: split)
    with pytest.raises(SeriesError, match=r"would read \[.*'same_memory'"):
        build_series.subsystem_files(final=False)


def test_prune_source_keeps_black_layout() -> None:
    source = textwrap.dedent('''\
        """Module."""

        import os
        from typing import Dict, List

        #: A constant.
        LIMIT = 1
        """Its docstring."""


        def kept() -> List[int]:
            return [LIMIT]


        @decorated
        def gone() -> Dict[str, str]:
            return dict(os.environ)


        class Kept:
            """Doc."""

            def one(self) -> None:
                pass

            def two(self) -> None:
                pass
        ''')
    pruned = build_series.prune_source(source, ["gone", "Kept.one"], {"": "New."}, "m.py")
    assert pruned == textwrap.dedent('''\
        """New."""

        import os
        from typing import Dict, List

        #: A constant.
        LIMIT = 1
        """Its docstring."""


        def kept() -> List[int]:
            return [LIMIT]


        class Kept:
            """Doc."""

            def two(self) -> None:
                pass
        ''')
    assert _black_clean(pruned)
    package = build_series.prune_package({"m.py": source}, {"m.py": {"remove": ["gone"]}})
    assert "import os\n" not in package["m.py"] and "from typing import List\n" in package["m.py"]
    with pytest.raises(SeriesError, match="would read"):
        build_series.prune_package({"m.py": source}, {"m.py": {"remove": ["LIMIT"]}})


def test_a_missing_test_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "upstream"
    shutil.copytree(REPO_ROOT / "upstream" / "tests", copy / "tests")
    monkeypatch.setattr(build_series, "UPSTREAM_DIR", copy)
    monkeypatch.setattr(build_series, "REPO_ROOT", tmp_path)
    roles = copy / build_series.ROLES_TEST
    roles.unlink()
    with pytest.raises(SeriesError, match="test_state_adoption_roles.py does not exist"):
        build_series.test_files(False, build_series.PR_TESTS[D])
    (copy / "tests/unit_tests/optimizer/test_other.py").write_text("")
    with pytest.raises(SeriesError, match="no pull request carries"):
        build_series.test_files(False)


def test_the_changed_megatron_lm_test_is_c_s_own_diff() -> None:
    """(c) changes test_mlp_glu.py's test_oom_is_handled (its halves become two allocations)
    and adds the in-place test; nothing else in that file."""
    assert build_series.PR_TEST_CHANGES == {C: [MLP_GLU_TEST]}
    assert build_series.CHANGED_TESTS == (MLP_GLU_TEST,)
    assert not set(build_series.CHANGED_TESTS) & set(build_series.TOUCHED_UPSTREAM_FILES)
    hunks = build_series.changed_test_hunks(MLP_GLU_TEST)
    removed = [line.strip() for hunk in hunks for line in hunk.removed]
    added = "\n".join(line for hunk in hunks for line in hunk.added)
    assert "loaded_state_dict = [sh_ten.data for sh_ten in sharded_state_dict]" in removed
    assert "torch.ones(local_w_plus_v_shape, device='cuda', dtype=dtype)," in removed
    assert "torch.empty(local_w_plus_v_shape, device='meta', dtype=dtype)," in added
    assert "    def test_halves_loaded_in_place_merge_without_a_copy(self, caplog):" in added
    assert "assert torch.cuda.max_memory_allocated() == allocated" in added
    assert "assert merged.data_ptr() == weight.data_ptr()" in added
    assert "def test_oom_is_handled" not in added  # the test is changed, not replaced
    (method,) = ast.parse(textwrap.dedent(build_series._block(hunks[-1].added))).body
    assert isinstance(method, ast.FunctionDef)  # the last hunk adds the in-place test
    assert method.name == "test_halves_loaded_in_place_merge_without_a_copy"


def test_a_missing_or_stray_test_change_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "upstream"
    shutil.copytree(REPO_ROOT / "upstream" / "tests", copy / "tests")
    monkeypatch.setattr(build_series, "UPSTREAM_DIR", copy)
    monkeypatch.setattr(build_series, "REPO_ROOT", tmp_path)
    diff = copy / f"{MLP_GLU_TEST}.diff"
    text = diff.read_text()
    diff.write_text(text.replace(f"b/{MLP_GLU_TEST}", "b/tests/unit_tests/other.py"))
    with pytest.raises(SeriesError, match="must change .*test_mlp_glu.py only"):
        build_series.changed_test_hunks(MLP_GLU_TEST)
    diff.unlink()
    with pytest.raises(SeriesError, match="test_mlp_glu.py.diff does not exist"):
        build_series.changed_test_hunks(MLP_GLU_TEST)
    (copy / "tests/unit_tests/dist_checkpointing/test_other.py.diff").write_text(text)
    with pytest.raises(SeriesError, match="no pull request carries .*test_other.py.diff"):
        build_series.test_files(False)


def test_b_call_sites_are_the_two_loads_with_a_one_name_import() -> None:
    b_init = build_series.subsystem_files(final=False)[f"{SUBSYSTEM}/__init__.py"]
    hunks = build_series.staged_call_site_hunks(
        build_series.our_hunks(CALL_SITE), set(build_series.package_names(b_init))
    )
    first_lines = [h.added[0].strip() for h in hunks]
    assert first_lines[:2] == [
        "from megatron.core.optimizer.state_adoption import load_inner_optimizer_state_dict",
        "load_inner_optimizer_state_dict(self, state_dict)",
    ]
    assert len(hunks) == 3 and first_lines[2].startswith("# Optimizer. A registered state adopter")
    assert "owns_state_dict=True," in [line.strip() for line in hunks[2].added]


# ---------------------------------------------------------------------------------------------
# The generator's rules on synthetic files
# ---------------------------------------------------------------------------------------------

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
    assert _changes(fix) == _changes(build_series.parse_hunks(text, CALL_SITE))
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
    assert config_class().precision_aware_optimizer_state_adoption is False


def test_config_rule_for_b_inserts_the_section_without_the_later_field() -> None:
    later = build_series.split_manifest()["optimizer_config"]
    hunks = [
        Hunk(h.before, [], build_series._pruned_block(h.added, later), h.after)
        for h in build_series.our_hunks(CONFIG_FILE)
    ]
    result = build_series.change_optimizer_config(
        SYNTHETIC_CONFIG.replace("{dev_fields}", ""), hunks
    )
    namespace: Dict[str, object] = {}
    exec(compile(result, "<config>", "exec"), namespace)
    config = namespace["OptimizerConfig"]()  # type: ignore[operator]
    assert config.optimizer_state_adoption is True
    assert not hasattr(config, "precision_aware_optimizer_state_adoption")
    assert [f.name for f in build_series.config_fields(hunks)] == ["optimizer_state_adoption"]
    assert "load_state_dict" in result and "precision-aware read targets" not in result


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
    fields = _fields()
    result = build_series.add_switch_arguments(text, fields)
    rendered = "".join(
        build_series._block(build_series.render_argument(f, "group", black_style)) for f in fields
    )
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
    defaults = parser.parse_args([])
    assert defaults.optimizer_state_adoption is True
    assert defaults.precision_aware_optimizer_state_adoption is False
    flagged = parser.parse_args(
        ["--no-optimizer-state-adoption", "--precision-aware-optimizer-state-adoption"]
    )
    assert flagged.optimizer_state_adoption is False
    assert flagged.precision_aware_optimizer_state_adoption is True
    assert "dest='optimizer_state_adoption'" in rendered
    assert "dest='precision_aware_optimizer_state_adoption'" not in rendered


@pytest.mark.parametrize(
    "mutate",
    [
        lambda text: text.replace("'--optimizer',", "'--optimizer-name',"),
        lambda text: text.replace(
            "    return parser\n", "    group.add_argument('--optimizer')\n    return parser\n"
        ),
        lambda text: text.replace("'--optimizer-cpu-offload'", "'--no-optimizer-state-adoption'"),
        lambda text: text.replace(
            "'--optimizer-cpu-offload'", "'--precision-aware-optimizer-state-adoption'"
        ),
        lambda text: text.replace(
            "action='store_true', help='Offload",
            "action='store_true', dest='optimizer_state_adoption', help='Offload",
        ),
        lambda text: text.replace("def _add_training_args", "def _add_other_args"),
    ],
    ids=[
        "anchor missing",
        "anchor twice",
        "flag exists",
        "other flag exists",
        "dest exists",
        "function missing",
    ],
)
def test_argument_rule_refuses(mutate) -> None:  # type: ignore[no-untyped-def]
    text = mutate(SYNTHETIC_ARGUMENTS_DEV)
    assert text != SYNTHETIC_ARGUMENTS_DEV
    with pytest.raises(SeriesError):
        build_series.add_switch_arguments(text, _fields())


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
    switch = _fields()[0]
    for field_ in _fields():
        build_series.check_config_copied_from_args(SYNTHETIC_TRAINING, field_)
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
# With a Megatron-LM git directory: the pull requests built at the recorded snapshots
# ---------------------------------------------------------------------------------------------

needs_mirror = pytest.mark.skipif(
    not (MIRROR / "HEAD").exists(),
    reason="no Megatron-LM git directory (set MEGATRON_LM_GIT_DIR to one, e.g. a fetched mirror "
    "of github:NVIDIA/Megatron-LM); the checks above ran without it",
)


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
        return build_series._block(self.hunks[0].added)


def read_series_patch(text: str) -> List[FileDiff]:
    """Split a ``git format-patch`` file into per-file diffs."""
    diffs: List[FileDiff] = []
    sections = re.split(r"^diff --git a/\S+ b/(\S+)\n", text, flags=re.MULTILINE)
    for path, body in zip(sections[1::2], sections[2::2]):
        index = re.search(r"^index ([0-9a-f]+)\.\.", body, re.MULTILINE)
        if index is None:
            raise AssertionError(f"no index line for {path}")
        body = body.split("\n-- \n")[0]  # a signature, if any
        diffs.append(
            FileDiff(
                path=path,
                pre_blob=index.group(1),
                new_file="\nnew file mode" in "\n" + body.split("@@")[0],
                hunks=build_series.parse_hunks(f"+++ b/{path}\n" + body[body.index("@@") :], path),
            )
        )
    return diffs


class Built:
    """The pull requests of one branch, built at its recorded snapshot.

    Attributes:
        prs: per pull request, its diffs by path (per commit, in order).
        trees: the snapshot's touched files after (a), after (b), ..., by pull request.
    """

    def __init__(self, branch: str, out: Path) -> None:
        entry = MANIFEST[branch]
        self.entry = entry
        self.snapshot = build_series.Snapshot.from_git_dir(
            MIRROR, branch, str(entry["snapshot_commit"])
        )
        name, email = str(entry["author"])[:-1].split(" <")
        self.identity = (name, email)
        self.patches = build_series.build(self.snapshot, out, identity=self.identity)
        self.by_pr = build_series.by_pull_request(self.patches)
        self.prs: Dict[str, List[Dict[str, FileDiff]]] = {
            pr: [{d.path: d for d in read_series_patch(p.read_text())} for p in patches]
            for pr, patches in self.by_pr.items()
        }

    def changed(self, pr: str) -> Dict[str, FileDiff]:
        """The diffs of ``pr``, by path (a path two commits change: the later one's)."""
        return {path: diff for commit in self.prs[pr] for path, diff in commit.items()}

    def applied(self, tree: Path, upto: str) -> Path:
        """A full work tree of the snapshot with the pull requests up to ``upto`` applied."""
        build_series.work_tree(MIRROR, self.snapshot.commit, tree)
        for pr in PULL_REQUESTS[: PULL_REQUESTS.index(upto) + 1]:
            for patch in self.by_pr[pr]:
                subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True)
        return tree


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Built]]:
    out = tmp_path_factory.mktemp("upstream-series")
    yield {branch: Built(branch, out / branch) for branch in BRANCHES}


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_built_pull_requests_are_recorded_and_apply(built: Dict[str, Built], branch: str) -> None:
    series, entry = built[branch], MANIFEST[branch]
    for recorded, files in (
        ("pre_image_blobs", series.snapshot.files),
        ("checked_blobs", series.snapshot.checked),
    ):
        assert {p: build_series.blob_id(c) for p, c in files.items()} == entry[recorded]
    for pr, patches in series.by_pr.items():
        assert [p.name for p in patches] == entry["pull_requests"][pr]["patches"]
        assert build_series.line_counts(patches) == entry["pull_requests"][pr]["lines"]
        cover = (series.patches[0].parent.parent / pr / COVER_LETTER).read_text()
        words = " ".join(cover.split())
        for patch in patches:  # format-patch's shortlog names every commit
            subject = re.search(
                rf"^Subject: \[PATCH \d/{len(patches)}\] (.*(?:\n .*)*)",
                patch.read_text(),
                re.MULTILINE,
            )
            assert subject is not None and " ".join(subject.group(1).split()) in words
    check = build_series.apply_check(MIRROR, series.snapshot.commit, series.patches)
    assert check == entry["git_apply_check"]
    added = sorted(p for pr in PULL_REQUESTS for p, d in series.changed(pr).items() if d.new_file)
    assert added == entry["added_files"]


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_a_second_build_is_byte_identical(
    built: Dict[str, Built], branch: str, tmp_path: Path
) -> None:
    series = built[branch]
    again = build_series.build(series.snapshot, tmp_path, identity=series.identity)
    assert [p.relative_to(tmp_path) for p in again] == [
        p.relative_to(series.patches[0].parent.parent) for p in series.patches
    ]
    for first, second in zip(series.patches, again):
        assert first.read_bytes() == second.read_bytes(), first.name


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_after_all_four_every_added_file_is_its_source(
    built: Dict[str, Built], branch: str, tmp_path: Path
) -> None:
    tree = built[branch].applied(tmp_path, D)
    offloader = built[branch].snapshot.offloader
    expected = {
        **build_series.subsystem_files(),
        **build_series.test_files(offloader),
        **build_series.docs_files(),
        **build_series.in_place_merge_files(),
    }
    for path, content in expected.items():
        assert (tree / path).read_text() == content, path
    in_b = build_series.subsystem_files(final=False)
    for path in build_series.subsystem_files():  # (b) adds them, (d) changes them or adds the rest
        assert built[branch].changed(B if path in in_b else D)[path].new_file, path
    assert set(in_b) < set(build_series.subsystem_files())  # split.toml omits allocation.py


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_a_is_the_bug_fix_alone(built: Dict[str, Built], branch: str) -> None:
    series = built[branch]
    ((commit),) = series.prs[A]
    assert sorted(commit) == sorted([CALL_SITE, build_series.ADAM_STEP_TEST])
    fix = build_series.our_hunks(CALL_SITE, bug_fix=True)
    assert _changes(commit[CALL_SITE].hunks) == _changes(fix)
    assert build_series.blob_id(series.snapshot.files[CALL_SITE]).startswith(
        commit[CALL_SITE].pre_blob
    )
    fix_lines = {line for hunk in fix for line in hunk.added}
    for pr in (B, C, D):
        for diff in series.changed(pr).values():
            assert not fix_lines & {line for h in diff.hunks for line in h.added}, pr


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_c_adds_the_merge_and_changes_cat_with_oom_fallback(
    built: Dict[str, Built], branch: str
) -> None:
    series = built[branch]
    diffs = series.changed(C)
    assert sorted(diffs) == sorted([IN_PLACE_MERGE, IN_PLACE_MERGE_TEST, UTILS_FILE, MLP_GLU_TEST])
    assert (
        diffs[IN_PLACE_MERGE].new_content() == build_series.in_place_merge_files()[IN_PLACE_MERGE]
    )
    utils = diffs[UTILS_FILE]
    assert build_series.blob_id(series.snapshot.files[UTILS_FILE]).startswith(utils.pre_blob)
    assert _changes(utils.hunks) == _changes(build_series.our_hunks(UTILS_FILE))
    glu = diffs[MLP_GLU_TEST]
    assert not glu.new_file
    assert build_series.blob_id(series.snapshot.files[MLP_GLU_TEST]).startswith(glu.pre_blob)
    assert _changes(glu.hunks) == _changes(build_series.changed_test_hunks(MLP_GLU_TEST))
    for pr in (A, B, D):
        assert not set(series.changed(pr)) & set(diffs), pr
        assert "megatron/core/transformer/mlp.py" not in series.changed(pr)


def _methods(source: str, cls: str) -> Dict[str, str]:
    """The methods of class ``cls`` in ``source``, as ``ast.dump`` strings, by name."""
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {m.name: ast.dump(m) for m in node.body if isinstance(m, ast.FunctionDef)}


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("stack", ["after a and b", "alone"])
def test_c_changes_the_swiglu_oom_test_and_applies(
    built: Dict[str, Built], branch: str, stack: str, tmp_path: Path
) -> None:
    """``git apply --check`` passes for every patch in turn ((a), (b), then (c); and (c) alone),
    and (c) leaves test_mlp_glu.py with the changed OOM test and the in-place one, compiling,
    the rest of the file as it was."""
    series = built[branch]
    build_series.work_tree(MIRROR, series.snapshot.commit, tmp_path)
    for pr in [A, B, C] if stack == "after a and b" else [C]:
        for patch in series.by_pr[pr]:
            subprocess.run(["git", "apply", "--check", str(patch)], cwd=tmp_path, check=True)
            subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, check=True)
    before = series.snapshot.files[MLP_GLU_TEST]
    after = (tmp_path / MLP_GLU_TEST).read_text()
    hunks = build_series.changed_test_hunks(MLP_GLU_TEST)
    assert after == build_series.change_file(before, hunks, MLP_GLU_TEST, False)
    compile(after, MLP_GLU_TEST, "exec")
    assert _black_clean(after)
    old, new = (_methods(text, "TestParallelMLPWithGLU") for text in (before, after))
    assert list(new) == [*old, "test_halves_loaded_in_place_merge_without_a_copy"]
    changed = [name for name in old if old[name] != new[name]]
    assert changed == ["test_oom_is_handled"]
    outside = [ast.dump(n) for n in ast.parse(after).body if not isinstance(n, ast.ClassDef)]
    assert outside == [
        ast.dump(n) for n in ast.parse(before).body if not isinstance(n, ast.ClassDef)
    ]
    oom = ast.get_source_segment(after, next(
        n for n in ast.walk(ast.parse(after))
        if isinstance(n, ast.FunctionDef) and n.name == "test_oom_is_handled"
    ))  # fmt: skip
    assert oom is not None
    assert "device='meta'" in oom and "torch.ones(sh_ten.data.shape, device='cuda'" in oom
    assert "sh_ten.data for sh_ten in sharded_state_dict]" not in oom
    assert "CUDA OutOfMemoryError encountered during tensors merging" in oom


def test_a_test_change_whose_anchor_is_gone_is_refused() -> None:
    """A hunk of the changed test is carried by its removed lines and context; a file without
    them (here: the ``loaded_state_dict`` line changed) is refused, not patched."""
    hunks = build_series.changed_test_hunks(MLP_GLU_TEST)
    diff = (build_series.UPSTREAM_DIR / f"{MLP_GLU_TEST}.diff").read_text()
    sections = re.split(r"^@@ .*\n", diff, flags=re.MULTILINE)[1:]
    pre_image = [  # the lines of the file each section of the diff shows: context and removed
        line[1:] for section in sections for line in section.splitlines() if line[:1] in " -"
    ]
    for hunk in hunks:
        build_series.locate(pre_image, hunk, MLP_GLU_TEST)
    gone = [line.replace("in sharded_state_dict]", "in built]") for line in pre_image]
    with pytest.raises(SeriesError, match="test_mlp_glu.py: replace hunk .* found 0 times"):
        for hunk in hunks:
            build_series.locate(gone, hunk, MLP_GLU_TEST)


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_the_test_change_refuses_a_snapshot_whose_test_changed(
    built: Dict[str, Built], branch: str
) -> None:
    before = built[branch].snapshot.files[MLP_GLU_TEST]
    hunks = build_series.changed_test_hunks(MLP_GLU_TEST)
    for old, new in [
        ("in sharded_state_dict]", "in built]"),  # the loaded halves are built otherwise
        ("device='cuda', dtype=dtype),", "device='cpu', dtype=dtype),"),  # the weight too
    ]:
        assert before.count(old) == 1
        with pytest.raises(SeriesError, match="found 0 times"):
            build_series.change_file(before.replace(old, new), hunks, MLP_GLU_TEST, False)


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_b_and_d_make_our_call_site_changes(
    built: Dict[str, Built], branch: str, tmp_path: Path
) -> None:
    series = built[branch]
    b, d = series.changed(B), series.changed(D)
    assert CALL_SITE in b and NON_DISTRIBUTED_FILE not in b
    b_added = [line.strip() for h in b[CALL_SITE].hunks for line in h.added]
    assert [line for line in b_added if line.startswith("load_inner_optimizer_state_dict(")] == [
        "load_inner_optimizer_state_dict(self, state_dict)",
        (
            "load_inner_optimizer_state_dict(self, optimizer_state_dict, owns_state_dict=True)"
            if series.snapshot.offloader
            else "load_inner_optimizer_state_dict("
        ),
    ]
    for name in ("export_", "initialize_", "reading_", "unscaled_", "store_read"):
        assert not [line for line in b_added if name in line], name
    ours = build_series.our_hunks(NON_DISTRIBUTED_FILE)
    assert _changes(d[NON_DISTRIBUTED_FILE].hunks, True) == _changes(ours, True)
    fixed = build_series.change_file(
        series.snapshot.files[CALL_SITE], build_series.our_hunks(CALL_SITE, bug_fix=True),
        CALL_SITE, False,
    )  # fmt: skip
    final = build_series.change_file(
        fixed, build_series.our_hunks(CALL_SITE), CALL_SITE, series.snapshot.offloader
    )
    assert (series.applied(tmp_path, D) / CALL_SITE).read_text() == final
    if series.snapshot.offloader:
        build_series.check_offloader_path_kept(final)
        removed = [
            line for pr in (B, D) for h in series.changed(pr)[CALL_SITE].hunks for line in h.removed
        ]
        assert not any("_optimizer_state_offloader" in line for line in removed)
        return
    # main: (a)'s file to the final one is exactly our patch's hunks
    diff = difflib.unified_diff(fixed.splitlines(), final.splitlines(), lineterm="", n=3)
    hunks = build_series.parse_hunks(f"+++ b/{CALL_SITE}\n" + "\n".join(list(diff)[2:]), CALL_SITE)
    assert _changes(hunks) == _changes(build_series.our_hunks(CALL_SITE))


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
def test_config_fields_and_arguments_are_the_generated_ones(
    built: Dict[str, Built], branch: str
) -> None:
    series = built[branch]
    first, later = _fields()
    black_style = branch == "dev"
    for pr, field_ in ((B, first), (D, later)):
        (hunk,) = series.changed(pr)[ARGUMENTS_FILE].hunks
        assert hunk.removed == []
        assert hunk.added == build_series.render_argument(field_, "group", black_style)
        statement = build_series._block(hunk.added)
        call = ast.parse(textwrap.dedent(statement)).body[0]
        assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
        assert [ast.literal_eval(a) for a in call.value.args] == [
            build_series.argument_flag(field_)
        ]
        build_series.check_switch_argument(statement, field_)
    added = {pr: "".join(series.changed(pr)[CONFIG_FILE].hunks[0].added) for pr in (B, D)}
    assert f"{first.name}: bool = True" in added[B] and later.name not in added[B]
    assert f"{later.name}: bool = False" in added[D]
    ours = build_series.our_hunks(CONFIG_FILE)
    (hunk,) = series.changed(B)[CONFIG_FILE].hunks
    assert hunk.after == ours[0].after and hunk.before[-1:] == ours[0].before[-1:]


@needs_mirror
@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("upto", [B, D])
def test_changed_python_files_stay_black_clean(
    built: Dict[str, Built], branch: str, upto: str, tmp_path: Path
) -> None:
    """A changed file the snapshot has black-clean (all but main's arguments.py and dev's
    transformer/utils.py) stays so."""
    series = built[branch]
    tree = series.applied(tmp_path, upto)
    checked = []
    for path, before in series.snapshot.files.items():
        if path.endswith(".py") and _black_clean(before):
            assert _black_clean((tree / path).read_text()), path
            checked.append(path)
    assert len(checked) == 5
