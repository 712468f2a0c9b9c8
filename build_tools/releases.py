"""The upstream ``megatron-core`` releases this build composes, their pinned wheels, and the
setting that selects one.

``MCORE_UPSTREAM_VERSION=0.18.2 pip install .`` builds ``0.18.2+stateadoption``; without it
the newest supported release is used. ``MCORE_UPSTREAM_WHEEL=/path/to/wheel`` (offline
builds) selects the release named in the wheel's file name. Every wheel is checked against
the sha256 pinned here for its file name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from .errors import ComposeError, UpstreamFetchError

DIST_NAME: Final = "megatron-core"
LOCAL_VERSION_LABEL: Final = "stateadoption"

#: Environment variable selecting the upstream release (e.g. ``0.18.2``).
UPSTREAM_VERSION_ENV: Final = "MCORE_UPSTREAM_VERSION"
#: Environment variable naming a local copy of the upstream wheel (offline builds).
UPSTREAM_WHEEL_ENV: Final = "MCORE_UPSTREAM_WHEEL"

#: The release built when neither environment variable is set: the newest supported one.
DEFAULT_UPSTREAM_VERSION: Final = "0.19.2"

_X86_64: Final = "manylinux_2_24_x86_64.manylinux_2_28_x86_64"
_AARCH64: Final = "manylinux_2_24_aarch64.manylinux_2_28_aarch64"


def _wheel(version: str, python_tag: str, platform: str) -> str:
    """Return the file name upstream uses for one wheel of ``version``."""
    return f"megatron_core-{version}-{python_tag}-{python_tag}-{platform}.whl"


#: sha256 of every wheel PyPI serves for each supported release for Python >= 3.12: the
#: cp312 and cp313 wheels for manylinux x86_64 and aarch64 (PyPI also serves cp311 wheels of
#: every release and cp310 wheels of 0.16.1; this build supports Python >= 3.12 only, so
#: those are not pinned and are refused). Source: PyPI's simple index
#: (https://pypi.org/simple/megatron-core/, PEP 691 JSON, read 2026-11-29); each value was
#: also recomputed from the file ``pip download --no-deps --only-binary=:all:
#: megatron-core==V --python-version 3.1x --platform manylinux_2_28_{x86_64,aarch64}``
#: fetched, and both agreed. (PyPI's JSON API, /pypi/megatron-core/V/json, was not reachable.)
PINNED_WHEELS: Final[Mapping[str, Mapping[str, str]]] = {
    "0.16.1": {
        _wheel("0.16.1", "cp312", _X86_64):
            "3fb26cb407aa3c4b609c08664022c08146f1648b3d6f2ef2bbe9d3b1294ace61",
        _wheel("0.16.1", "cp313", _X86_64):
            "de0ec63a1c413124a4214b341754335db865aaf75db59823efedc70b50d9a11c",
        _wheel("0.16.1", "cp312", _AARCH64):
            "c96f37f8a630fed5fb7c132d8088da176bf8e6f9345c23532493af0f9ba214ba",
        _wheel("0.16.1", "cp313", _AARCH64):
            "8f5ce1a8660f947925b8d7d070566d89163ea9ec2fd00ffd19a31ead8243ce30",
    },
    "0.17.1": {
        _wheel("0.17.1", "cp312", _X86_64):
            "6dd0826489ee70a791e38612b25e914c4a18b0b074f2282353f235ee96273cf2",
        _wheel("0.17.1", "cp313", _X86_64):
            "15e79fa5bd5cd804de3b5285b7a1d909eb7e4c640edae2b5180060ccf68ff059",
        _wheel("0.17.1", "cp312", _AARCH64):
            "3e998adc75cfe679d0585b5944ffe40160b3960e2c2e9b8178f72483791856cf",
        _wheel("0.17.1", "cp313", _AARCH64):
            "becf5cea7015470130fc6d8a57e5921bf18807e04267944edeaa5a69a7e3f598",
    },
    "0.18.2": {
        _wheel("0.18.2", "cp312", _X86_64):
            "c2717b84079bf0bad1151525533a251870d1a86201f8c0702e0b5a6d6b5594f1",
        _wheel("0.18.2", "cp313", _X86_64):
            "31e0e671e7c147d23d9213e809ac3194a35c42d2638dd4f416e13c5ec5c6d27a",
        _wheel("0.18.2", "cp312", _AARCH64):
            "98ab0808ceb95b8fab79d4215c50eecb4d9d3278a6d4c2518ee950e998a3739a",
        _wheel("0.18.2", "cp313", _AARCH64):
            "7821cf073bd2c3491f97b9f9ce04583ca7773ba52e8ac1f607aa010789f3db7d",
    },
    "0.19.0": {
        _wheel("0.19.0", "cp312", _X86_64):
            "ed4f503a4a6944599857c4f702f3a33039656fe119309119fc5bb8cba8a38240",
        _wheel("0.19.0", "cp313", _X86_64):
            "48dc139bc71ee6f91d15d000dc072f9a2f4dd9cdd843cbf6175488477cf60c71",
        _wheel("0.19.0", "cp312", _AARCH64):
            "25618d4ba1fbed1fd7b00a210905065c1d0479894c1a5f8626c3627844e072fa",
        _wheel("0.19.0", "cp313", _AARCH64):
            "8a1781ed4d1df3a70d6c1cbc5c557fc6e054c034e5de3ae912beb149a9fcb6e3",
    },
    "0.19.2": {
        _wheel("0.19.2", "cp312", _X86_64):
            "8e3e486f13f559450415b9b9dc0ff3331a0bb83dd154553f7f350a75ff9c42b5",
        _wheel("0.19.2", "cp313", _X86_64):
            "10c70ab5273457f3c8232e35bc18633aa20abc6f6ac2d190914acd6323537826",
        _wheel("0.19.2", "cp312", _AARCH64):
            "e1717c0cdb7669d2112c3f3d80a2e748d2721b4798044d750cab5a3b2dffe38f",
        _wheel("0.19.2", "cp313", _AARCH64):
            "346872950e729433c9477c59b5456b859fb7e457a1c0bb39c0c771c302a1d1ea",
    },
}

#: Every pinned wheel file name of every supported release, with its sha256.
ALL_PINNED_WHEELS: Final[Mapping[str, str]] = {
    name: digest for wheels in PINNED_WHEELS.values() for name, digest in wheels.items()
}


class UnsupportedReleaseError(ComposeError):
    """The selected upstream release is not one this build supports."""


def supported_versions() -> tuple[str, ...]:
    """Return the supported upstream releases, oldest first."""
    return tuple(sorted(PINNED_WHEELS, key=Version))


def local_version(upstream_version: str) -> str:
    """Return the version of the composed build, e.g. ``0.18.2+stateadoption``."""
    return f"{upstream_version}+{LOCAL_VERSION_LABEL}"


def _supported_list() -> str:
    """Return the supported releases as text for error messages."""
    return f"{', '.join(supported_versions())} (default {DEFAULT_UPSTREAM_VERSION})"


def check_supported(version: str, source: str) -> str:
    """Return ``version`` normalised if it is a supported release; raise otherwise.

    ``source`` says where the version came from (for the error message).
    """
    try:
        normalised = str(Version(version.strip()))
    except InvalidVersion:
        normalised = version.strip()
    if normalised not in PINNED_WHEELS:
        raise UnsupportedReleaseError(
            f"{source} selects megatron-core {version!r}, which this build does not support; "
            f"supported releases: {_supported_list()}"
        )
    return normalised


def wheel_file_problem(value: str) -> str | None:
    """Why ``$MCORE_UPSTREAM_WHEEL=value`` names no wheel file that can be read, or None.

    Checked before the file name, so that a missing file is reported as missing.
    """
    path = Path(value).expanduser()
    if path.is_dir():
        return f"{UPSTREAM_WHEEL_ENV}={value}: is a directory, not a wheel file"
    if not path.is_file():
        return f"{UPSTREAM_WHEEL_ENV}={value}: no such file"
    if not os.access(path, os.R_OK):
        return f"{UPSTREAM_WHEEL_ENV}={value}: the file is not readable"
    return None


def release_of_wheel(wheel: Path | str) -> str:
    """Return the supported megatron-core release a wheel file name belongs to; raise otherwise."""
    name = Path(wheel).name
    try:
        dist, version, _, _ = parse_wheel_filename(name)
    except InvalidWheelFilename as error:
        raise UnsupportedReleaseError(
            f"{name} is not a wheel file name ({error}); cannot tell which megatron-core "
            "release it is"
        ) from error
    if dist != canonicalize_name(DIST_NAME):
        raise UnsupportedReleaseError(f"{name} is a wheel of {dist!r}, not of {DIST_NAME}")
    return check_supported(str(version), f"the wheel {name}")


def select_upstream_version(environ: Mapping[str, str] | None = None) -> str:
    """Return the upstream release to build from the environment.

    ``$MCORE_UPSTREAM_WHEEL`` selects the release in its file name (the file must exist);
    ``$MCORE_UPSTREAM_VERSION`` selects one by number (if both are set they must agree);
    otherwise the default.
    """
    env = os.environ if environ is None else environ
    requested = env.get(UPSTREAM_VERSION_ENV, "").strip()
    version = None if not requested else check_supported(
        requested, f"{UPSTREAM_VERSION_ENV}={requested}"
    )
    wheel = env.get(UPSTREAM_WHEEL_ENV, "").strip()
    if wheel:
        problem = wheel_file_problem(wheel)
        if problem is not None:
            raise UpstreamFetchError(problem)
        from_wheel = release_of_wheel(wheel)
        if version is not None and version != from_wheel:
            raise UnsupportedReleaseError(
                f"{UPSTREAM_VERSION_ENV}={requested} disagrees with {UPSTREAM_WHEEL_ENV}, "
                f"which is a megatron-core {from_wheel} wheel ({Path(wheel).name}); "
                "unset one of them"
            )
        return from_wheel
    return DEFAULT_UPSTREAM_VERSION if version is None else version
