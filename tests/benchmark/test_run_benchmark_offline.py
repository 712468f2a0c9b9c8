"""``scripts/run-benchmark.sh``: the main job's entry, on a machine without a GPU and offline,
and the environment it makes.

Without a visible NVIDIA GPU it must say so and exit 2. On a GPU machine without internet it
must not touch a package index: ``WHEELHOUSE=DIR`` installs only from DIR and skips pip's
self-upgrade, ``BUILD=WHEEL`` installs that wheel instead of building the checkout (which needs
the index for setuptools and the upstream wheel), ``BUILD=DIR`` installs nothing and hands the
benchmark ``--build DIR``. The GPU is faked by an ``nvidia-smi`` on ``PATH`` that lists one
device, the index by an unreachable ``PIP_INDEX_URL``; the benchmark runs ``--help`` (it needs
no GPU), which proves the venv and the command line it was given.

The benchmark's venv must see the packages of the Python that runs the script (issue #29): run
from a virtual environment whose torch lives in it, ``python -m venv --system-site-packages``
would see the base interpreter's site-packages instead, so the venv is layered over it. The
tests build that layout for real: an outer venv (made here, without pip) holding a stand-in
``torch`` and ``transformer_engine`` (or, for the offline install, this environment's packages
through a ``.pth`` file, as a user's venv holds its torch), ``PYTHON`` its interpreter.
"""

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path
from typing import Dict, Optional

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


def _outer_venv_with_stand_ins(path: Path, torch_version: str = "2.11.0") -> Path:
    """An outer venv whose site-packages hold a stand-in ``torch`` and ``transformer_engine``
    (a package and its dist-info each, as pip installs them)."""
    site = _site(_outer_venv(path))
    for name, version in (("torch", torch_version), ("transformer_engine", "2.20.2")):
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"__version__ = {version!r}\n")
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


def test_without_a_gpu_it_says_why_and_exits_2(tmp_path: Path) -> None:
    result = _run({"VENV": str(tmp_path / "never-made")}, None, "--help")
    assert result.returncode == 2
    assert "no NVIDIA GPU is visible" in result.stderr
    assert not (tmp_path / "never-made").exists()


def test_offline_with_the_build_as_a_directory_installs_nothing(tmp_path: Path) -> None:
    build_site = tmp_path / "build-site"
    build_site.mkdir()
    environment = {"VENV": str(tmp_path / "venv"), "WHEELHOUSE": str(tmp_path), "BUILD": str(build_site)}
    result = _run(environment, _fake_gpu(tmp_path), "--help")
    assert result.returncode == 0, result.stderr
    assert f"using the build in {build_site} (nothing installed)" in result.stderr
    assert "offline: installing only from" in result.stderr
    assert "usage: python -m benchmarks.resume_benchmark" in result.stdout


def test_offline_with_the_build_as_a_wheel_uses_only_the_wheelhouse(tmp_path: Path) -> None:
    """The README's offline command, run from a user's venv that has torch (issue #29: the
    benchmark's venv saw the base interpreter's packages, and pip found no torch>=2.6)."""
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
    result = _run(environment, _fake_gpu(tmp_path), "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: python -m benchmarks.resume_benchmark" in result.stdout
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
    result = _run(environment, gpu, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: python -m benchmarks.resume_benchmark" in result.stdout
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
    result = _run({**environment, "PYTHON": str(other / "bin" / "python")}, gpu, "--help")
    assert result.returncode == 0, result.stderr
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
    result = _run(environment, _fake_gpu(tmp_path), "--help")
    assert result.returncode == 0, result.stderr
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
    result = _run(environment, _fake_gpu(tmp_path), "--help")
    assert result.returncode == 0, result.stderr
    assert f"benchmark environment: using VENV={given} as it is (not made by this script)" in result.stderr
    assert f"it sees torch 2.11.0 ({_site(given)})" in result.stderr
    assert (given / "pyvenv.cfg").read_text() == config
    assert not (_site(given) / "_resume_benchmark_layer.pth").exists()


def test_a_build_that_is_neither_a_wheel_nor_a_directory_is_refused(tmp_path: Path) -> None:
    environment = {"VENV": str(tmp_path / "venv"), "WHEELHOUSE": str(tmp_path), "BUILD": str(tmp_path / "missing.tar")}
    result = _run(environment, _fake_gpu(tmp_path), "--help")
    assert result.returncode == 2
    assert "is neither a wheel (*.whl) nor a directory" in result.stderr


@pytest.mark.parametrize("missing", ["WHEELHOUSE"])
def test_a_wheelhouse_that_is_no_directory_is_refused(tmp_path: Path, missing: str) -> None:
    environment = {"VENV": str(tmp_path / "venv"), missing: str(tmp_path / "nowhere")}
    result = _run(environment, _fake_gpu(tmp_path), "--help")
    assert result.returncode == 2
    assert f"WHEELHOUSE={tmp_path / 'nowhere'} is not a directory" in result.stderr
