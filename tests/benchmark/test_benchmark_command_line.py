"""The benchmark refuses a bad command line before any work: exit status 2 and one line (the
argument at fault, why, and "see --help"; no usage text), before CUDA is looked for, a side is
resolved or probed, anything is installed, downloaded or cloned, and before the workspace is made.
Each number is checked on its own before the checks that combine arguments. One case per refusal,
on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.resume_benchmark import cli
from benchmarks.resume_benchmark.configs import CONFIGURATIONS

REPO_ROOT = Path(__file__).resolve().parents[2]
USER_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--bf16"]


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any step past the command-line checks fails the test."""

    def work_began(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("work began before the command line was refused")

    for name in ("check_cuda", "prepare_sides", "resolve_build", "resolve_upstream", "_probe",
                 "clone_release", "prepare_setup", "Workspace"):  # fmt: skip
        monkeypatch.setattr(cli, name, work_began)


def _checkout(tmp_path: Path) -> Path:
    tree = tmp_path / "Megatron-LM"
    tree.mkdir()
    (tree / "pretrain_gpt.py").write_text("")
    return tree


def _git(tmp_path: Path) -> Path:
    """A Megatron-LM git repository (work tree ``repo``, one commit on ``main``)."""
    repo = tmp_path / "repo"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "one"], check=True)
    return repo


def _file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text("")
    return path


# (id, argv from tmp_path, the reason's text); the others use a valid --megatron-lm checkout.
Case = tuple[str, Callable[[Path], list[str]], str]
REFUSALS: list[Case] = [
    ("megatron-lm missing", lambda t: ["--megatron-lm", str(t / "nowhere")],
     "--megatron-lm {t}/nowhere: no such directory"),
    ("megatron-lm a file", lambda t: ["--megatron-lm", str(_file(t, "tree"))],
     "--megatron-lm {t}/tree: is a file, not a directory"),
    ("megatron-lm no checkout", lambda t: ["--megatron-lm", str(t)],
     "--megatron-lm {t}: not a Megatron-LM checkout (no pretrain_gpt.py)"),
    ("megatron-lm-git missing", lambda t: ["--megatron-lm-git", str(t / "nowhere")],
     "--megatron-lm-git {t}/nowhere: no such directory"),
    ("megatron-lm-git a file", lambda t: ["--megatron-lm-git", str(_file(t, "repo.git"))],
     "--megatron-lm-git {t}/repo.git: is a file, not a directory"),
    ("megatron-lm-git no repository", lambda t: ["--megatron-lm-git", str(t)],
     "--megatron-lm-git {t}: not a git repository (neither a git directory, such as a bare "
     "clone or a work tree's .git, nor a work tree)"),
    ("ref missing", lambda t: ["--megatron-lm-git", str(_git(t) / ".git"), "--ref", "core_r9"],
     "--ref core_r9: no such branch, tag or commit in {t}/repo/.git"),
    ("ref missing in a work tree", lambda t: ["--megatron-lm-git", str(_git(t)), "--ref", "core_r9"],
     "--ref core_r9: no such branch, tag or commit in {t}/repo"),
    ("ref empty", lambda t: ["--megatron-lm-git", str(_git(t)), "--ref", ""],
     "--ref '': must not be empty"),
    ("ref with a checkout", lambda t: ["--megatron-lm", str(_checkout(t)), "--ref", "main"],
     "--ref main: --megatron-lm is a checkout, used as it is"),
    ("size with own arguments", lambda t: ["--size", "small", "--", *USER_ARGS],
     "--size small: sizes the built-in configurations; the pretrain_gpt.py arguments after -- "
     "set the model themselves"),
    ("size unknown", lambda t: ["--size", "bogus"],
     "argument --size: invalid choice: 'bogus' (choose from "),  # quoted or not: Python's own
    ("name without own arguments", lambda t: ["--name", "llama", "--configs", "moe"],
     "--name llama: names the run of your pretrain_gpt.py arguments after --; the built-in "
     "configurations have their own names"),
    ("name empty", lambda t: ["--name", "", "--", *USER_ARGS], "--name '': must not be empty"),
    ("name a path", lambda t: ["--name", "../x", "--", *USER_ARGS],
     "--name ../x: must not contain '/' (it names the run's directory in the work directory)"),
    ("configs with own arguments", lambda t: ["--configs", "moe", "--", *USER_ARGS],
     "--configs: give --configs or pretrain_gpt.py arguments after --, not both"),
    ("own arguments the client sets", lambda t: ["--", *USER_ARGS, "--save", "/x"],
     "--save: set by the client"),
    ("nproc 0", lambda t: ["--nproc-per-node", "0"],
     "--nproc-per-node 0: must be a positive integer"),
    ("nproc negative", lambda t: ["--nproc-per-node", "-2"],
     "--nproc-per-node -2: must be a positive integer"),
    ("nproc no number", lambda t: ["--nproc-per-node", "two"],
     "argument --nproc-per-node: invalid int value: 'two'"),
    ("train-iters negative", lambda t: ["--train-iters", "-5"],
     "--train-iters -5: must be a positive integer"),
    ("train-iters 0", lambda t: ["--train-iters", "0", "--resume-at", "3"],
     "--train-iters 0: must be a positive integer"),
    ("resume-at negative", lambda t: ["--train-iters", "4", "--resume-at", "-1"],
     "--resume-at -1: must be a positive integer"),
    ("worker timeout negative", lambda t: ["--worker-timeout", "-1"],
     "--worker-timeout -1: must be a positive number of seconds"),
    ("worker timeout 0", lambda t: ["--worker-timeout", "0"],
     "--worker-timeout 0: must be a positive number of seconds"),
    ("worker timeout nan", lambda t: ["--worker-timeout", "nan"],
     "--worker-timeout nan: must be a positive number of seconds"),
    ("resume point", lambda t: ["--train-iters", "4", "--resume-at", "4"],
     "--resume-at 4: must be less than --train-iters 4"),
    ("duplicate configuration", lambda t: ["--configs", "moe,dp-reshardable,moe"],
     "argument --configs: configuration(s) given more than once: moe"),
    ("all and a name", lambda t: ["--configs", "all,moe"],
     "argument --configs: 'all' runs every configuration (moe included); give all alone or a "
     "list of names"),
    ("unknown configuration", lambda t: ["--configs", "moe,nope"],
     "argument --configs: unknown configuration(s) nope; choose from all, dp-reshardable"),
    ("unknown option", lambda t: ["--sizes", "tiny"], "unrecognized arguments: --sizes"),
    ("stray argument", lambda t: ["--size", "tiny", "extra"],
     "extra: unexpected argument (pretrain_gpt.py arguments go after --)"),
    ("upstream missing", lambda t: ["--upstream", str(t / "mc.whl")],
     "--upstream {t}/mc.whl: no such directory or wheel"),
    ("upstream under a file", lambda t: ["--upstream", str(_file(t, "wheels") / "mc.whl")],
     "--upstream {t}/wheels/mc.whl: its parent {t}/wheels is a file, not a directory"),
    ("upstream no wheel", lambda t: ["--upstream", str(_file(t, "mc.tar.gz"))],
     "--upstream {t}/mc.tar.gz: neither a directory (a site) nor a wheel (*.whl)"),
    ("build missing", lambda t: ["--build", str(t / "site")],
     "--build {t}/site: no such directory or wheel"),
    ("json-out parent missing", lambda t: ["--json-out", str(t / "out" / "r.json")],
     "--json-out {t}/out/r.json: its parent directory {t}/out does not exist"),
    ("json-out parent a file", lambda t: ["--json-out", str(_file(t, "out") / "r.json")],
     "--json-out {t}/out/r.json: its parent {t}/out is a file, not a directory"),
    ("json-out under a file", lambda t: ["--json-out", str(_file(t, "out") / "deeper" / "r.json")],
     "--json-out {t}/out/deeper/r.json: {t}/out is a file, not a directory"),
    ("json-out a directory", lambda t: ["--json-out", str(t)],
     "--json-out {t}: is a directory, not a file"),
    ("markdown-out parent missing", lambda t: ["--markdown-out", str(t / "out" / "r.md")],
     "--markdown-out {t}/out/r.md: its parent directory {t}/out does not exist"),
    ("markdown-out the json-out file", lambda t: ["--json-out", str(t / "r"), "--markdown-out",
                                                  str(t / "r")],
     "--markdown-out {t}/r: the same file as --json-out"),
    ("figures-dir parent missing", lambda t: ["--figures-dir", str(t / "out" / "figures")],
     "--figures-dir {t}/out/figures: its parent directory {t}/out does not exist"),
    ("figures-dir a file", lambda t: ["--figures-dir", str(_file(t, "figures"))],
     "--figures-dir {t}/figures: is a file, not a directory"),
    ("work-dir a file", lambda t: ["--work-dir", str(_file(t, "work"))],
     "--work-dir {t}/work: is a file, not a directory"),
    ("work-dir under a file", lambda t: ["--work-dir", str(_file(t, "work") / "a" / "b")],
     "--work-dir {t}/work/a/b: {t}/work is a file, not a directory"),
    ("cache-dir a file", lambda t: ["--cache-dir", str(_file(t, "cache"))],
     "--cache-dir {t}/cache: is a file, not a directory"),
    ("cache-dir under a file", lambda t: ["--cache-dir", str(_file(t, "cache") / "mrb")],
     "--cache-dir {t}/cache/mrb: its parent {t}/cache is a file, not a directory"),
]  # fmt: skip


@pytest.mark.parametrize("make_argv, reason", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_a_bad_command_line_is_refused_before_any_work(
    make_argv: Callable[[Path], list[str]],
    reason: str,
    tmp_path: Path,
    no_work: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = make_argv(tmp_path)
    if "--megatron-lm" not in argv and "--megatron-lm-git" not in argv:
        argv = ["--megatron-lm", str(_checkout(tmp_path)), *argv]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    (error,) = capsys.readouterr().err.splitlines()  # one line, no usage text
    assert error.startswith("python -m benchmarks.resume_benchmark: error: "), error
    assert reason.format(t=tmp_path) in error and error.endswith("; see --help"), error


def test_a_good_command_line_has_no_problem(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    site = tmp_path / "site"
    site.mkdir()
    wheel = _file(tmp_path, "megatron_core-0.19.2-py3-none-any.whl")
    git_dir = _git(tmp_path) / ".git"
    for argv in (
        ["--megatron-lm-git", str(git_dir), "--ref", "main", "--configs", "all", "--size", "tiny",
         "--upstream", str(wheel), "--build", str(site), "--json-out", str(tmp_path / "out/r.json"),
         "--markdown-out", str(tmp_path / "out/r.md"), "--figures-dir", str(tmp_path / "out/fig"),
         "--work-dir", str(tmp_path / "new/work"), "--cache-dir", str(tmp_path / "new/cache"),
         "--nproc-per-node", "2", "--worker-timeout", "60", "--train-iters", "2",
         "--resume-at", "1"],
        ["--megatron-lm", str(_checkout(tmp_path)), "--figures-dir", str(tmp_path / "out"),
         "--work-dir", str(tmp_path), "--cache-dir", str(tmp_path), "--", *USER_ARGS],
        ["--ref", "core_r0.19.0"],  # the release clone's branch
    ):  # fmt: skip
        args = cli.build_parser().parse_args(argv)
        assert cli.command_line_problem(args) is None, argv
        cli.requested_runs(args)
    named = cli.build_parser().parse_args(["--name", "llama-fp32", "--", *USER_ARGS])
    assert [record["name"] for record, _ in cli.requested_runs(named)] == ["llama-fp32"]
    every = cli.build_parser().parse_args(["--configs", "all"])
    assert len(cli.requested_runs(every)) == len(CONFIGURATIONS) and every.size is None  # 1b unless --size


def test_megatron_lm_git_takes_a_work_tree_a_git_directory_or_a_bare_clone(tmp_path: Path) -> None:
    """A work tree is used through its .git; a git directory and a bare clone as they are."""
    tree = _git(tmp_path)
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(tree), str(bare)], check=True)
    for given, git_dir in ((tree, tree / ".git"), (tree / ".git", tree / ".git"), (bare, bare)):
        args = cli.build_parser().parse_args(["--megatron-lm-git", str(given), "--ref", "main"])
        assert cli.command_line_problem(args) is None, given
        assert cli.checked_arguments(args).megatron_lm_git == git_dir, given


def test_a_directory_that_is_not_writable_is_refused(
    tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user may write into a mode 555 directory (root)")
        checkout = str(_checkout(tmp_path))
        for argv, reason in (
            (["--work-dir", str(locked)], f"--work-dir {locked}: the directory is not writable"),
            (["--cache-dir", str(locked / "a" / "cache")],
             f"--cache-dir {locked}/a/cache: cannot be made: {locked} is not writable"),
            (["--json-out", str(locked / "r.json")],
             f"--json-out {locked}/r.json: its parent directory {locked} is not writable"),
            (["--figures-dir", str(locked)], f"--figures-dir {locked}: the directory is not writable"),
        ):  # fmt: skip
            with pytest.raises(SystemExit) as exited:  # the last --cache-dir counts
                cli.main(["--megatron-lm", checkout, "--cache-dir", str(tmp_path), *argv])
            assert exited.value.code == 2
            (error,) = capsys.readouterr().err.splitlines()
            assert reason in error, error
    finally:
        locked.chmod(0o755)


def test_the_entry_point_exits_2_for_a_missing_upstream(tmp_path: Path) -> None:
    """``python -m benchmarks.resume_benchmark``: a missing --upstream path was exit 1, after
    the build side had been probed."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.resume_benchmark", "--megatron-lm",
         str(_checkout(tmp_path)), "--upstream", str(tmp_path / "missing.whl")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "python -m benchmarks.resume_benchmark: error: "
        f"--upstream {tmp_path / 'missing.whl'}: no such directory or wheel; see --help"
    ]
    assert "resume-benchmark" not in done.stdout  # no progress line: no workspace, no probe


ENTRY_POINT_REFUSALS: list[Case] = [
    ("train-iters", lambda t: ["--train-iters", "-5"], "--train-iters -5: must be a positive integer"),
    ("size", lambda t: ["--size", "bogus"], "argument --size: invalid choice: 'bogus' (choose from "),
    ("json-out", lambda t: ["--json-out", str(_file(t, "passwd") / "x.json")],
     "--json-out {t}/passwd/x.json: its parent {t}/passwd is a file, not a directory"),
]  # fmt: skip


@pytest.mark.parametrize(
    "make_argv, line", [c[1:] for c in ENTRY_POINT_REFUSALS], ids=[c[0] for c in ENTRY_POINT_REFUSALS]
)
def test_a_usage_error_of_the_entry_point_is_one_line(
    make_argv: Callable[[Path], list[str]], line: str, tmp_path: Path
) -> None:
    """No usage text: the one line names the argument at fault and points to --help."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.resume_benchmark", *make_argv(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (error,) = done.stderr.splitlines()
    assert error.startswith(f"python -m benchmarks.resume_benchmark: error: {line.format(t=tmp_path)}")
    assert error.endswith("; see --help") and done.stdout == "", error


def test_check_command_line_only_checks(tmp_path: Path, no_work: None) -> None:
    """``--check-command-line``: exit 0 for a command line that would run, before any work (no
    CUDA looked for: what scripts/run-benchmark.sh runs before its GPU check and its venv)."""
    assert cli.main(["--megatron-lm", str(_checkout(tmp_path)), "--check-command-line"]) == 0


@pytest.mark.parametrize("given", ["work tree", "git directory"])
def test_the_run_reads_megatron_lm_from_the_git_directory_of_a_work_tree(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``--megatron-lm-git`` names reaches the client as its git directory (the sides and
    CUDA are stood in for; the client's setup is where this test stops)."""
    tree = _git(tmp_path)
    handed: list[Any] = []

    class Stop(Exception):
        pass

    def prepare_setup(sides: Any, version: str, source: Any, *args: Any) -> Any:
        handed.append(source)
        raise Stop

    build = {"megatron_core": {"version": "0.19.2+stateadoption"}}
    monkeypatch.setattr(cli, "check_cuda", lambda needed=1: None)
    monkeypatch.setattr(cli, "prepare_sides", lambda args, workspace: ({}, {"build": build}))
    monkeypatch.setattr(cli, "prepare_setup", prepare_setup)
    argv = ["--megatron-lm-git", str(tree if given == "work tree" else tree / ".git"),
            "--ref", "main", "--work-dir", str(tmp_path / "work"), "--size", "tiny"]  # fmt: skip
    with pytest.raises(Stop):
        cli.main(argv)
    assert handed == [(None, tree / ".git", "main")]
