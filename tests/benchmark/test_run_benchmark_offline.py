"""``scripts/run-benchmark.sh``: the main job's entry, on a machine without a GPU and offline.

Without a visible NVIDIA GPU it must say so and exit 2. On a GPU machine without internet it
must not touch a package index: ``WHEELHOUSE=DIR`` installs only from DIR and skips pip's
self-upgrade, ``BUILD=WHEEL`` installs that wheel instead of building the checkout (which needs
the index for setuptools and the upstream wheel), ``BUILD=DIR`` installs nothing and hands the
benchmark ``--build DIR``. The GPU is faked by an ``nvidia-smi`` on ``PATH`` that lists one
device, the index by an unreachable ``PIP_INDEX_URL``; the benchmark runs ``--help`` (it needs
no GPU), which proves the venv and the command line it was given.
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


def _venv_seeing_this_environment_but_megatron(path: Path) -> Path:
    """A venv with pip that also sees this test environment's packages except megatron-core
    (torch, numpy, packaging...: what the machine's container provides on a GPU node), through
    a directory of links to them named in a ``.pth`` file."""
    venv.EnvBuilder(with_pip=True).create(path)
    site = next(path.glob("lib/python*/site-packages"))
    machine = path.parent / "machine-packages"
    machine.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("megatron", "mcore", "__editable__")) and entry.suffix != ".pth":
            (machine / entry.name).symlink_to(entry)
    (site / "machine-packages.pth").write_text(f"{machine}\n")
    return path


def _run(env_changes: Dict[str, str], path_prefix: Optional[Path], *args: str) -> "subprocess.CompletedProcess[str]":
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(env_changes)
    env["PIP_INDEX_URL"] = UNREACHABLE_INDEX  # any index access fails
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHON"] = sys.executable
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
    from build_tools.compose_wheel import compose_wheel
    from build_tools.upstream import ensure_upstream_wheel

    upstream = ensure_upstream_wheel(REPO_ROOT / "build" / "upstream", None, environ={})
    wheelhouse = tmp_path / "wheelhouse"
    patches = sorted((REPO_ROOT / "patches").glob("*.patch"))
    wheel = compose_wheel(Path(upstream), REPO_ROOT, patches, wheelhouse)
    target = _venv_seeing_this_environment_but_megatron(tmp_path / "venv")
    environment = {"VENV": str(target), "WHEELHOUSE": str(wheelhouse), "BUILD": str(wheel)}
    result = _run(environment, _fake_gpu(tmp_path), "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: python -m benchmarks.resume_benchmark" in result.stdout
    # installed into the venv, from the wheelhouse alone (the index is unreachable)
    installed = list(target.glob("lib/python*/site-packages/megatron_core-*.dist-info"))
    assert [p.name for p in installed] == [wheel.name.split("-cp")[0] + ".dist-info"], installed


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
