"""The benchmark refuses a bad command line before any work (issue #29): exit status 2 and one
line saying why, before CUDA is looked for, a side is resolved or probed, anything is installed,
downloaded or cloned, and before the workspace is made. One case per refusal, on the CPU.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.resume_benchmark import cli

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
    ("megatron-lm no checkout", lambda t: ["--megatron-lm", str(t)],
     "--megatron-lm {t}: not a Megatron-LM checkout (no pretrain_gpt.py)"),
    ("megatron-lm-git missing", lambda t: ["--megatron-lm-git", str(t / "nowhere")],
     "--megatron-lm-git {t}/nowhere: no such directory"),
    ("megatron-lm-git work tree", lambda t: ["--megatron-lm-git", str(_git(t))],
     "--megatron-lm-git {t}/repo: not a git directory (a work tree: give its .git directory)"),
    ("ref missing", lambda t: ["--megatron-lm-git", str(_git(t) / ".git"), "--ref", "core_r9"],
     "--ref core_r9: no such branch, tag or commit in {t}/repo/.git"),
    ("ref with a checkout", lambda t: ["--megatron-lm", str(_checkout(t)), "--ref", "main"],
     "--ref main: --megatron-lm is a checkout, used as it is"),
    ("size with own arguments", lambda t: ["--size", "small", "--", *USER_ARGS],
     "--size small: sizes the built-in configurations; the pretrain_gpt.py arguments after -- "
     "set the model themselves"),
    ("name without own arguments", lambda t: ["--name", "llama", "--configs", "moe"],
     "--name llama: names the run of your pretrain_gpt.py arguments after --; the built-in "
     "configurations have their own names"),
    ("configs with own arguments", lambda t: ["--configs", "moe", "--", *USER_ARGS],
     "give --configs or pretrain_gpt.py arguments after --, not both"),
    ("nproc 0", lambda t: ["--nproc-per-node", "0"], "--nproc-per-node 0: must be at least 1"),
    ("nproc negative", lambda t: ["--nproc-per-node", "-2"],
     "--nproc-per-node -2: must be at least 1"),
    ("worker timeout negative", lambda t: ["--worker-timeout", "-1"],
     "--worker-timeout -1: must be a positive number of seconds"),
    ("worker timeout 0", lambda t: ["--worker-timeout", "0"],
     "--worker-timeout 0: must be a positive number of seconds"),
    ("worker timeout nan", lambda t: ["--worker-timeout", "nan"],
     "--worker-timeout nan: must be a positive number of seconds"),
    ("resume point", lambda t: ["--train-iters", "4", "--resume-at", "4"],
     "--resume-at 4 must lie in 1..3 (--train-iters 4)"),
    ("duplicate configuration", lambda t: ["--configs", "moe,dp-reshardable,moe"],
     "argument --configs: configuration(s) given more than once: moe"),
    ("all and a name", lambda t: ["--configs", "all,moe"],
     "argument --configs: 'all' runs every configuration (moe included); give all alone or a "
     "list of names"),
    ("unknown configuration", lambda t: ["--configs", "moe,nope"],
     "argument --configs: unknown configuration(s) nope; choose from all, dp-reshardable"),
    ("upstream missing", lambda t: ["--upstream", str(t / "mc.whl")],
     "--upstream {t}/mc.whl: no such directory or wheel"),
    ("upstream no wheel", lambda t: ["--upstream", str(_file(t, "mc.tar.gz"))],
     "--upstream {t}/mc.tar.gz: neither a directory (a site) nor a wheel (*.whl)"),
    ("build missing", lambda t: ["--build", str(t / "site")],
     "--build {t}/site: no such directory or wheel"),
    ("json-out parent missing", lambda t: ["--json-out", str(t / "out" / "r.json")],
     "--json-out {t}/out/r.json: its parent directory {t}/out does not exist"),
    ("json-out a directory", lambda t: ["--json-out", str(t)],
     "--json-out {t}: exists and is not a file"),
    ("markdown-out parent missing", lambda t: ["--markdown-out", str(t / "out" / "r.md")],
     "--markdown-out {t}/out/r.md: its parent directory {t}/out does not exist"),
    ("figures-dir parent missing", lambda t: ["--figures-dir", str(t / "out" / "figures")],
     "--figures-dir {t}/out/figures: its parent directory {t}/out does not exist"),
    ("figures-dir a file", lambda t: ["--figures-dir", str(_file(t, "figures"))],
     "--figures-dir {t}/figures: exists and is not a directory"),
    ("work-dir a file", lambda t: ["--work-dir", str(_file(t, "work"))],
     "--work-dir {t}/work: exists and is not a directory"),
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
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m benchmarks.resume_benchmark: error: "), error
    assert reason.format(t=tmp_path) in error


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
         "--work-dir", str(tmp_path / "new/work"), "--nproc-per-node", "2",
         "--worker-timeout", "60"],
        ["--megatron-lm", str(_checkout(tmp_path)), "--figures-dir", str(tmp_path / "out"),
         "--", *USER_ARGS],
        ["--ref", "core_r0.19.0"],  # the release clone's branch
    ):  # fmt: skip
        args = cli.build_parser().parse_args(argv)
        assert cli.command_line_problem(args) is None, argv
        cli.requested_runs(args)
    named = cli.build_parser().parse_args(["--name", "llama-fp32", "--", *USER_ARGS])
    assert [record["name"] for record, _ in cli.requested_runs(named)] == ["llama-fp32"]
    every = cli.build_parser().parse_args(["--configs", "all"])
    assert len(cli.requested_runs(every)) == 9 and every.size is None  # 1b unless --size


def test_the_entry_point_exits_2_for_a_missing_upstream(tmp_path: Path) -> None:
    """``python -m benchmarks.resume_benchmark``: a missing --upstream path was exit 1, after
    the build side had been probed."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.resume_benchmark", "--megatron-lm",
         str(_checkout(tmp_path)), "--upstream", str(tmp_path / "missing.whl")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "python -m benchmarks.resume_benchmark: error: "
        f"--upstream {tmp_path / 'missing.whl'}: no such directory or wheel"
    )
    assert "resume-benchmark" not in done.stdout  # no progress line: no workspace, no probe
