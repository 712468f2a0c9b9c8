"""``scripts/run-benchmark.sh``: the main job's entry, on a machine without a GPU and offline,
and the environment it makes.

``--help`` works anywhere. Every argument (the benchmark's and the script's ``VENV``,
``WHEELHOUSE``, ``BUILD``) is checked before the GPU check and before any venv or install: a
usage error is one line naming the argument, with "see --help", and exit 2. Without a visible
NVIDIA GPU valid arguments get one message saying why it cannot run, and exit 2. On a GPU machine
without internet it must not touch a package index: ``WHEELHOUSE=DIR`` installs only from DIR and
skips pip's self-upgrade, ``BUILD=WHEEL`` installs that wheel instead of building the checkout
(which needs the index for setuptools and the upstream wheel), ``BUILD=DIR`` installs nothing and
hands the benchmark ``--build DIR``. The GPU is faked by an ``nvidia-smi`` on ``PATH`` that lists
one device, the index by an unreachable ``PIP_INDEX_URL``; the benchmark then runs in the venv
and stops at its own CUDA check (torch sees no CUDA device here), which proves the venv and the
command line it was given.

The benchmark's venv must see the packages of the Python that runs the script: run from a
virtual environment whose torch lives in it, ``python -m venv --system-site-packages`` would see
the base interpreter's site-packages instead, so the venv is layered over it. The tests build
that layout for real: an outer venv (made here, without pip) holding a stand-in ``torch`` and
``transformer_engine`` (or, for the offline install, this environment's packages through a
``.pth`` file, as a user's venv holds its torch), ``PYTHON`` its interpreter.
"""

import os
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "run-benchmark.sh"
UNREACHABLE_INDEX = "http://127.0.0.1:9/simple"


def _fake_gpu(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (fake, for the test)'\n")
    smi.chmod(0o755)
    return bin_dir


def _outer_venv(path: Path) -> Path:
    """A user's virtual environment (no pip: fast), made from this interpreter's base Python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    return path


def _site(venv_dir: Path) -> Path:
    return next(venv_dir.glob("lib/python*/site-packages"))


#: What the stand-in ``torch`` has beyond its version: no CUDA device, as on this machine.
CPU_ONLY_TORCH = """
class cuda:
    @staticmethod
    def is_available():
        return False


class version:
    cuda = None
"""


def _outer_venv_with_stand_ins(path: Path, torch_version: str = "2.11.0") -> Path:
    """An outer venv whose site-packages hold a stand-in ``torch`` (CPU-only) and
    ``transformer_engine`` (a package and its dist-info each, as pip installs them)."""
    site = _site(_outer_venv(path))
    for name, version in (("torch", torch_version), ("transformer_engine", "2.20.2")):
        (site / name).mkdir()
        extra = CPU_ONLY_TORCH if name == "torch" else ""
        (site / name / "__init__.py").write_text(f"__version__ = {version!r}\n{extra}")
        dist_info = site / f"{name}-{version}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return path


def _outer_venv_seeing_this_environment_but_megatron(path: Path) -> Path:
    """An outer venv that holds this test environment's packages except megatron-core (torch,
    numpy, packaging...: what a user's venv on a GPU node has), through a directory of links to
    them named in a ``.pth`` file of its site-packages."""
    site = _site(_outer_venv(path))
    machine = path.parent / "outer-packages"
    machine.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("megatron", "mcore", "__editable__", "_resume_benchmark")) and entry.suffix != ".pth":
            (machine / entry.name).symlink_to(entry)
    (site / "outer-packages.pth").write_text(f"{machine}\n")
    return path


def _inner_python_sees(inner: Path, module: str) -> str:
    done = subprocess.run(
        [str(inner / "bin" / "python"), "-c", f"import {module}; print({module}.__file__)"],
        capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _run(env_changes: Dict[str, str], path_prefix: Optional[Path], *args: str) -> "subprocess.CompletedProcess[str]":
    """The script with ``env_changes`` (``PYTHON`` defaults to this interpreter), nothing from
    this process's ``PYTHONPATH``, ``VIRTUAL_ENV`` or ``PIP_*`` settings."""
    dropped = ("PYTHONPATH", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in dropped}
    env["PYTHON"] = sys.executable
    env.update(env_changes)
    env["PIP_INDEX_URL"] = UNREACHABLE_INDEX  # any index access fails
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PATH"] = f"{path_prefix}:{env['PATH']}" if path_prefix else "/usr/bin:/bin"
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def _valid_args(tmp_path: Path) -> list:
    """Benchmark arguments that pass every check (a stand-in checkout, a fresh cache dir)."""
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("")
    return ["--megatron-lm", str(checkout), "--cache-dir", str(tmp_path / "cache"), "--size", "tiny"]


def _ran_in_the_venv(result: "subprocess.CompletedProcess[str]") -> None:
    """The benchmark ran in the venv with its arguments and stopped at its own CUDA check."""
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("resume_benchmark: ") and last.endswith("so it cannot run here."), last


def test_without_a_gpu_it_says_why_and_exits_2(tmp_path: Path) -> None:
    result = _run({"VENV": str(tmp_path / "never-made")}, None, *_valid_args(tmp_path))
    assert result.returncode == 2
    assert "no NVIDIA GPU is visible" in result.stderr
    assert not (tmp_path / "never-made").exists()


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu", "gpu"])
def test_help_works_anywhere_and_makes_nothing(tmp_path: Path, flag: str, gpu: bool) -> None:
    result = _run({"VENV": str(tmp_path / "never-made")}, _fake_gpu(tmp_path) if gpu else None,
                  "--size", "bogus", flag)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: bash scripts/run-benchmark.sh"), result.stdout
    assert "usage: python -m benchmarks.resume_benchmark" in result.stdout
    assert "WHEELHOUSE=DIR" in result.stdout and "--check-command-line" in result.stdout
    assert result.stderr == ""
    assert not (tmp_path / "never-made").exists()


def _a_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text("")
    return path


# (id, environment changes, benchmark arguments, the one line), each from tmp_path (t)
USAGE_ERRORS = [
    ("size", lambda t: {}, lambda t: ["--size", "bogus"],  # the choices quoted or not: Python's own
     "python -m benchmarks.resume_benchmark: error: argument --size: invalid choice: 'bogus' "
     "(choose from ...; see --help"),
    ("train-iters", lambda t: {}, lambda t: ["--train-iters", "-5"],
     "python -m benchmarks.resume_benchmark: error: --train-iters -5: must be a positive "
     "integer; see --help"),
    ("work-dir under a file", lambda t: {}, lambda t: ["--work-dir", str(_a_file(t, "f") / "work")],
     "python -m benchmarks.resume_benchmark: error: --work-dir {t}/f/work: its parent {t}/f is "
     "a file, not a directory; see --help"),
    ("cache-dir a file", lambda t: {}, lambda t: ["--cache-dir", str(_a_file(t, "cache"))],
     "python -m benchmarks.resume_benchmark: error: --cache-dir {t}/cache: is a file, not a "
     "directory; see --help"),
    ("VENV under a file", lambda t: {"VENV": str(_a_file(t, "f") / "venv")}, lambda t: [],
     "run-benchmark.sh: error: VENV={t}/f/venv: its parent {t}/f is a file, not a directory; "
     "see --help"),
    ("VENV a file", lambda t: {"VENV": str(_a_file(t, "venv"))}, lambda t: [],
     "run-benchmark.sh: error: VENV={t}/venv: is a file, not a directory; see --help"),
    ("WHEELHOUSE missing", lambda t: {"WHEELHOUSE": str(t / "nowhere")}, lambda t: [],
     "run-benchmark.sh: error: WHEELHOUSE={t}/nowhere: no such directory; see --help"),
    ("WHEELHOUSE a file", lambda t: {"WHEELHOUSE": str(_a_file(t, "wheels"))}, lambda t: [],
     "run-benchmark.sh: error: WHEELHOUSE={t}/wheels: is a file, not a directory; see --help"),
    ("BUILD missing", lambda t: {"BUILD": str(t / "missing.whl")}, lambda t: [],
     "run-benchmark.sh: error: BUILD={t}/missing.whl: no such file or directory; see --help"),
    ("BUILD no wheel", lambda t: {"BUILD": str(_a_file(t, "build.tar"))}, lambda t: [],
     "run-benchmark.sh: error: BUILD={t}/build.tar: is neither a wheel (*.whl) nor a "
     "directory; see --help"),
    ("PYTHON no Python 3.12", lambda t: {"PYTHON": str(t / "no-python")}, lambda t: [],
     "run-benchmark.sh: error: PYTHON={t}/no-python: not a Python >= 3.12 interpreter; see --help"),
]  # fmt: skip


@pytest.mark.parametrize("gpu", [False, True], ids=["no-gpu", "gpu"])
@pytest.mark.parametrize(
    "environment, arguments, line", [c[1:] for c in USAGE_ERRORS], ids=[c[0] for c in USAGE_ERRORS]
)
def test_a_usage_error_is_one_line_before_the_gpu_check_and_any_venv(
    tmp_path: Path, environment: Any, arguments: Any, line: str, gpu: bool
) -> None:
    """Checked before the GPU check (the same line with and without a GPU) and before the venv
    is made or anything installed (fast: no pip)."""
    changes = {"VENV": str(tmp_path / "never-made"), **environment(tmp_path)}
    argv = [*_valid_args(tmp_path), *arguments(tmp_path)]
    began = time.monotonic()
    result = _run(changes, _fake_gpu(tmp_path) if gpu else None, *argv)
    assert result.returncode == 2, result.stderr
    (error,) = result.stderr.splitlines()
    head, elided, tail = line.format(t=tmp_path).partition("...")
    assert (error.startswith(head) and error.endswith(tail)) if elided else error == head, error
    assert result.stdout == ""
    assert not (tmp_path / "never-made").exists()
    assert time.monotonic() - began < 60


def test_offline_with_the_build_as_a_directory_installs_nothing(tmp_path: Path) -> None:
    build_site = tmp_path / "build-site"
    build_site.mkdir()
    environment = {"VENV": str(tmp_path / "venv"), "WHEELHOUSE": str(tmp_path), "BUILD": str(build_site)}
    result = _run(environment, _fake_gpu(tmp_path), *_valid_args(tmp_path))
    _ran_in_the_venv(result)
    assert f"using the build in {build_site} (nothing installed)" in result.stderr
    assert "offline: installing only from" in result.stderr


def test_offline_with_the_build_as_a_wheel_uses_only_the_wheelhouse(tmp_path: Path) -> None:
    """The README's offline command, run from a user's venv that has torch: the benchmark's venv
    sees that venv's packages (not its base interpreter's, where pip would find no torch>=2.6)."""
    from build_tools.compose_wheel import compose_wheel
    from build_tools.patching import find_patches
    from build_tools.releases import select_upstream_version
    from build_tools.upstream import ensure_upstream_wheel

    upstream = ensure_upstream_wheel(REPO_ROOT / "build" / "upstream", None, environ={})
    wheelhouse = tmp_path / "wheelhouse"
    patches = find_patches(REPO_ROOT / "patches", select_upstream_version({}))
    wheel = compose_wheel(Path(upstream), REPO_ROOT, patches, wheelhouse)
    outer = _outer_venv_seeing_this_environment_but_megatron(tmp_path / "user-venv")
    inner = tmp_path / "benchmark-venv"
    environment = {"PYTHON": str(outer / "bin" / "python"), "VENV": str(inner),
                   "WHEELHOUSE": str(wheelhouse), "BUILD": str(wheel)}  # fmt: skip
    result = _run(environment, _fake_gpu(tmp_path), *_valid_args(tmp_path))
    _ran_in_the_venv(result)
    assert f"made {inner} from the virtual environment {outer}, layered over it" in result.stderr
    # installed into the venv, from the wheelhouse alone (the index is unreachable); torch,
    # the build's requirement, is the outer venv's
    installed = list(inner.glob("lib/python*/site-packages/megatron_core-*.dist-info"))
    assert [p.name for p in installed] == [wheel.name.split("-cp")[0] + ".dist-info"], installed
    assert _inner_python_sees(inner, "torch").startswith(str(tmp_path / "outer-packages"))


def test_a_venv_inside_a_venv_sees_the_outer_venvs_packages(tmp_path: Path) -> None:
    """Run from a user's venv: the benchmark's venv is layered over it (not over its base
    interpreter), says so in one line, and a second run from another venv updates the layer."""
    outer = _outer_venv_with_stand_ins(tmp_path / "user-venv")
    inner = tmp_path / "benchmark-venv"
    site = tmp_path / "build-site"
    site.mkdir()
    environment = {"PYTHON": str(outer / "bin" / "python"), "VENV": str(inner),
                   "WHEELHOUSE": str(tmp_path), "BUILD": str(site)}  # fmt: skip
    gpu = _fake_gpu(tmp_path)
    argv = _valid_args(tmp_path)
    result = _run(environment, gpu, *argv)
    _ran_in_the_venv(result)
    assert result.stderr.strip().splitlines()[-1] == (
        "resume_benchmark: no CUDA device is available (torch 2.11.0, CUDA runtime none (CPU-only"
        " build)). This benchmark measures a GPU memory peak (torch.cuda.max_memory_allocated) while"
        " Transformer Engine's FusedAdam state is restored on a CUDA GPU, so it cannot run here."
    )  # the venv's python ran the benchmark, with the outer venv's torch
    lines = [line for line in result.stderr.splitlines() if "benchmark environment:" in line]
    assert len(lines) == 1, result.stderr
    outer_site = _site(outer)
    assert lines[0] == (
        f"benchmark environment: made {inner} from the virtual environment {outer}, layered over"
        " it (a .pth file adds its site-packages; python -m venv --system-site-packages would see"
        f" only its base interpreter's); it sees torch 2.11.0 ({outer_site}), Transformer Engine"
        f" 2.20.2 ({outer_site})"
    )
    assert _inner_python_sees(inner, "torch") == str(outer_site / "torch" / "__init__.py")
    assert "include-system-site-packages = false" in (inner / "pyvenv.cfg").read_text()

    other = _outer_venv_with_stand_ins(tmp_path / "other-venv", torch_version="2.12.0")
    result = _run({**environment, "PYTHON": str(other / "bin" / "python")}, gpu, *argv)
    _ran_in_the_venv(result)
    assert f"benchmark environment: updated {inner} for the virtual environment {other}" in result.stderr
    assert f"it sees torch 2.12.0 ({_site(other)})" in result.stderr
    assert _inner_python_sees(inner, "torch") == str(_site(other) / "torch" / "__init__.py")


def test_a_python_that_is_no_venv_gives_its_site_packages(tmp_path: Path) -> None:
    """A system, container, pyenv or conda Python: --system-site-packages is its own."""
    base = Path(getattr(sys, "_base_executable", sys.executable))
    site = tmp_path / "build-site"
    site.mkdir()
    inner = tmp_path / "benchmark-venv"
    environment = {"PYTHON": str(base), "VENV": str(inner), "WHEELHOUSE": str(tmp_path), "BUILD": str(site)}
    result = _run(environment, _fake_gpu(tmp_path), *_valid_args(tmp_path))
    _ran_in_the_venv(result)
    assert f"benchmark environment: made {inner} from the Python at " in result.stderr
    assert "with its site-packages (--system-site-packages)" in result.stderr
    assert "include-system-site-packages = true" in (inner / "pyvenv.cfg").read_text()
    assert not list(inner.glob("lib/python*/site-packages/_resume_benchmark_layer.pth"))


def test_a_given_environment_is_used_as_it_is(tmp_path: Path) -> None:
    """``VENV=`` an environment the script did not make: nothing layered, nothing changed."""
    given = _outer_venv_with_stand_ins(tmp_path / "given-venv")
    config = (given / "pyvenv.cfg").read_text()
    site = tmp_path / "build-site"
    site.mkdir()
    environment = {"VENV": str(given), "WHEELHOUSE": str(tmp_path), "BUILD": str(site)}
    result = _run(environment, _fake_gpu(tmp_path), *_valid_args(tmp_path))
    _ran_in_the_venv(result)
    assert f"benchmark environment: using VENV={given} as it is (not made by this script)" in result.stderr
    assert f"it sees torch 2.11.0 ({_site(given)})" in result.stderr
    assert (given / "pyvenv.cfg").read_text() == config
    assert not (_site(given) / "_resume_benchmark_layer.pth").exists()
