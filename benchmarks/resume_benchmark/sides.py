"""Where each side's ``megatron-core`` comes from, and the environment its workers run in.

A *side* is one ``megatron-core`` to measure: ``build`` (this project's build of some release V,
version ``V+stateadoption``) or ``upstream`` (exactly megatron-core V, e.g. from PyPI). A side
is a directory put first on ``PYTHONPATH`` (a ``pip install --target`` site), a wheel installed
into such a directory, or -- for the build only -- the current environment. Any V works
(0.16.1, 0.18.2, 0.19.2, ...); both sides must be the same V.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from benchmarks.resume_benchmark.results import progress

#: Local-version marker of this project's build (``V+stateadoption``).
BUILD_LOCAL_VERSION = "stateadoption"

_INSTALLED_MARKER = ".resume-benchmark-installed"


class SideError(RuntimeError):
    """A side cannot be prepared (bad path, failed download or install)."""


@dataclass(frozen=True)
class Side:
    """One ``megatron-core`` to run workers with."""

    label: str
    pythonpath: Path | None
    source: str

    def to_json(self) -> dict[str, str | None]:
        """JSON form for the report."""
        return {
            "label": self.label,
            "pythonpath": None if self.pythonpath is None else str(self.pythonpath),
            "source": self.source,
        }


def default_cache_dir() -> Path:
    """Where downloaded and installed wheels are kept between runs."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megatron-resume-benchmark"


def _pip(args: list[str]) -> None:
    command = [sys.executable, "-m", "pip", *args]
    progress(f"running: {' '.join(command)}")
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        tail = (completed.stdout + completed.stderr).strip().splitlines()[-15:]
        raise SideError(
            f"pip failed ({completed.returncode}): {' '.join(command)}\n" + "\n".join(tail)
        )


def install_wheel(wheel: Path, cache_dir: Path) -> Path:
    """Install ``wheel`` (no dependencies) into a cached ``--target`` directory; return it."""
    if not wheel.is_file():
        raise SideError(f"wheel not found: {wheel}")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()[:16]
    target = cache_dir / f"site-{wheel.stem}-{digest}"
    if (target / _INSTALLED_MARKER).is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    _pip(["install", "--quiet", "--no-deps", "--upgrade", "--target", str(target), str(wheel)])
    (target / _INSTALLED_MARKER).write_text(f"{wheel}\n")
    return target


def download_upstream_wheel(cache_dir: Path, version: str) -> Path:
    """``pip download`` the ``megatron-core==version`` wheel (index: pip's own configuration)."""
    dest = cache_dir / "downloads"
    pattern = f"megatron_core-{version}-*.whl"
    existing = sorted(dest.glob(pattern))
    if not existing:
        dest.mkdir(parents=True, exist_ok=True)
        _pip(
            [
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--dest",
                str(dest),
                f"megatron-core=={version}",
            ]
        )
        existing = sorted(dest.glob(pattern))
    if not existing:
        raise SideError(f"pip download produced no wheel matching {pattern} in {dest}")
    return existing[-1]


def _side_from_path(label: str, path: Path, cache_dir: Path) -> Side:
    path = path.expanduser().resolve()
    if path.is_dir():
        return Side(label, path, f"directory {path}")
    if path.suffix == ".whl":
        target = install_wheel(path, cache_dir)
        return Side(label, target, f"wheel {path.name} installed into {target}")
    raise SideError(f"{label}: {path} is neither a directory nor a .whl file")


def resolve_upstream(arg: Path | None, cache_dir: Path, version: str) -> Side:
    """The upstream side: ``arg`` (directory or wheel), else a downloaded ``version`` wheel."""
    if arg is not None:
        return _side_from_path("upstream", arg, cache_dir)
    wheel = download_upstream_wheel(cache_dir, version)
    target = install_wheel(wheel, cache_dir)
    return Side("upstream", target, f"downloaded {wheel.name}, installed into {target}")


def resolve_build(arg: Path | None, cache_dir: Path) -> Side:
    """The build side: ``arg`` (directory or wheel), else the current environment."""
    if arg is not None:
        return _side_from_path("build", arg, cache_dir)
    return Side("build", None, "current environment")


#: Set for every launch, both sides alike, before CUDA (cuBLAS) and TE are initialised: the
#: resumes' losses can then be compared exactly.
DETERMINISM_ENV: Final[Mapping[str, str]] = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}

#: Variables ``torch.distributed.run`` sets; removed from every launch's environment, so a
#: launch is a world of its own even when the driver runs under a launcher.
LAUNCHER_ENV_VARS: Final = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
)  # fmt: skip


def worker_environment(side: Side, repo_root: Path) -> dict[str, str]:
    """Environment for a worker of ``side``: its directory first on ``PYTHONPATH``.

    The inherited ``PYTHONPATH`` follows (minus the repository root, whose ``megatron/`` source
    tree must never shadow an installed ``megatron-core``). Everything else is inherited --
    ``CUDA_VISIBLE_DEVICES`` too -- except a launcher's rank variables
    (:data:`LAUNCHER_ENV_VARS`); :data:`DETERMINISM_ENV` is set.
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV_VARS}
    inherited = [
        entry
        for entry in env.get("PYTHONPATH", "").split(os.pathsep)
        if entry and Path(entry).resolve() != repo_root.resolve()
    ]
    entries = ([str(side.pythonpath)] if side.pythonpath is not None else []) + inherited
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        env.pop("PYTHONPATH", None)
    env.update(DETERMINISM_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    env["NO_VCS_VERSION"] = "1"  # megatron.core.package_info would otherwise run git
    return env


def build_release(version: str | None) -> str | None:
    """The release V of this project's build ``V+stateadoption[.x]``; None for anything else."""
    if not version or "+" not in version:
        return None
    public, local = version.split("+", 1)
    return public if public and local.split(".")[0] == BUILD_LOCAL_VERSION else None


def public_release(version: str | None) -> str | None:
    """``version`` without its local part (``0.19.2+x`` -> ``0.19.2``)."""
    return version.split("+", 1)[0] if version else None


def build_problem(build: Mapping[str, Any], dev_mode: bool = False) -> str | None:
    """Why the probed build side is not a ``V+stateadoption`` build with the subsystem, or None.

    ``dev_mode`` (testing the benchmark itself) accepts any ``megatron-core`` that imports.
    """
    if build.get("error"):
        return f"the build side cannot import megatron.core ({build['error']})"
    if dev_mode or (build_release(build["version"]) and build["has_state_adoption"]):
        return None
    return (
        f"the build side is megatron-core {build['version']} at {build['file']}, not a "
        f"V+{BUILD_LOCAL_VERSION} build (state_adoption present: {build['has_state_adoption']}); "
        "pass --build DIR|WHEEL or install the build"
    )


def upstream_release(build: Mapping[str, Any]) -> str:
    """The release upstream must be: the build's V (in development mode its public version)."""
    return build_release(build["version"]) or public_release(build["version"]) or "unknown"


def sides_problem(
    upstream: Mapping[str, Any], build: Mapping[str, Any], dev_mode: bool = False
) -> str | None:
    """Why the probed sides cannot be compared, or None.

    The build must pass :func:`build_problem`, upstream must be exactly its release V without
    the state-adoption subsystem, and the two must be different installations.
    """
    problem = build_problem(build, dev_mode)
    if problem is not None:
        return problem
    if upstream.get("error"):
        return f"the upstream side cannot import megatron.core ({upstream['error']})"
    release = upstream_release(build)
    if upstream["version"] != release or upstream["has_state_adoption"]:
        return (
            f"the upstream side must be plain megatron-core {release}, the release the build "
            f"{build['version']} is made from; it is {upstream['version']} at {upstream['file']} "
            f"(state_adoption present: {upstream['has_state_adoption']})"
        )
    if upstream["file"] == build["file"]:
        return f"both sides import the same megatron.core ({upstream['file']})"
    return None
