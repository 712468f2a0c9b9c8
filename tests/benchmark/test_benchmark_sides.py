"""Which ``megatron-core`` each side of the resume benchmark runs, for any release V.

The build side must be ``V+stateadoption`` (with the subsystem), the upstream side exactly ``V``
(without it), the same V -- 0.16.1, 0.18.2 and 0.19.2 alike; ``--upstream`` may be a directory
or a wheel, and without it ``megatron-core==V`` is downloaded. (A whole run with the sides of
another release: tests/test_benchmark_cli.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.resume_benchmark import sides
from benchmarks.resume_benchmark.sides import (
    build_release,
    public_release,
    resolve_build,
    resolve_upstream,
    sides_problem,
)

RELEASES = ("0.16.1", "0.18.2", "0.19.2")


def _info(version: str, adoption: bool, file: str) -> dict[str, Any]:
    return {"version": version, "file": file, "has_state_adoption": adoption, "error": None}


def _pair(build: str, upstream: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return _info(upstream, False, "/up/megatron/core/__init__.py"), _info(build, True, "/b/megatron/core/__init__.py")


@pytest.mark.parametrize("release", RELEASES)
def test_build_and_upstream_of_the_same_release_are_accepted(release: str) -> None:
    assert build_release(f"{release}+stateadoption") == release
    assert build_release(f"{release}+stateadoption.2") == release
    assert sides_problem(*_pair(f"{release}+stateadoption", release)) is None


@pytest.mark.parametrize("version", ["0.19.2", "0.19.2+other", "+stateadoption", "", None])
def test_anything_else_is_not_a_build(version: str | None) -> None:
    assert build_release(version) is None


def test_a_different_release_upstream_is_refused_naming_both() -> None:
    problem = sides_problem(*_pair("0.18.2+stateadoption", "0.19.2"))
    assert problem is not None and "plain megatron-core 0.18.2" in problem and "0.19.2 at /up/" in problem


@pytest.mark.parametrize(
    ("upstream", "build", "message"),
    [
        (_info("0.16.1", True, "/up"), _info("0.16.1+stateadoption", True, "/b"), "plain megatron-core 0.16.1"),
        (_info("0.16.1", False, "/up"), _info("0.16.1+stateadoption", False, "/b"), "not a V+stateadoption build"),
        (_info("0.16.1", False, "/up"), _info("0.16.1", False, "/b"), "not a V+stateadoption build"),
        (_info("0.16.1", False, "/same"), _info("0.16.1+stateadoption", True, "/same"), "the same megatron.core"),
        ({"error": "ImportError: x"}, _info("0.16.1+stateadoption", True, "/b"), "upstream side cannot import"),
    ],
)
def test_wrong_sides_are_refused(upstream: dict[str, Any], build: dict[str, Any], message: str) -> None:
    problem = sides_problem(upstream, build)
    assert problem is not None and message in problem


def test_development_mode_compares_any_build_with_its_public_release() -> None:
    assert sides_problem(*_pair("0.18.2", "0.18.2"), dev_mode=True) is None
    assert sides_problem(*_pair("0.18.2+dev", "0.18.2"), dev_mode=True) is None
    assert public_release("0.18.2+dev") == "0.18.2" and public_release(None) is None


class _Pip:
    """Stands in for ``python -m pip`` (no network here): records each call and leaves what
    ``download`` and ``install --target`` would leave."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, args: list[str]) -> None:
        self.calls.append(args)
        if args[0] == "download":
            dest = Path(args[args.index("--dest") + 1])
            version = args[-1].split("==")[1]
            (dest / f"megatron_core-{version}-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"w")
        elif args[0] == "install":
            (Path(args[args.index("--target") + 1]) / "megatron").mkdir()


@pytest.mark.parametrize("release", RELEASES)
def test_without_upstream_the_builds_release_is_downloaded(
    release: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pip = _Pip()
    monkeypatch.setattr(sides, "_pip", pip)
    side = resolve_upstream(None, tmp_path, release)
    assert pip.calls[0][:2] == ["download", "--no-deps"] and pip.calls[0][-1] == f"megatron-core=={release}"
    assert pip.calls[1][0] == "install" and side.pythonpath is not None
    assert (side.pythonpath / "megatron").is_dir() and f"megatron_core-{release}-" in side.source
    assert resolve_upstream(None, tmp_path, release) == side and len(pip.calls) == 2  # cached


def test_upstream_and_build_may_be_directories_or_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sides, "_pip", _Pip())
    site = tmp_path / "site"
    site.mkdir()
    assert resolve_upstream(site, tmp_path, "0.16.1").pythonpath == site
    wheel = tmp_path / "megatron_core-0.16.1+stateadoption-cp312-cp312-linux_x86_64.whl"
    wheel.write_bytes(b"w")
    build = resolve_build(wheel, tmp_path / "cache")
    assert build.pythonpath is not None and "installed into" in build.source
    assert resolve_build(None, tmp_path).pythonpath is None
    with pytest.raises(sides.SideError, match="neither a directory nor a .whl"):
        resolve_upstream(tmp_path / "nothing.txt", tmp_path, "0.16.1")
