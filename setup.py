"""Build ``megatron-core`` X+stateadoption from a pinned upstream ``megatron-core`` X wheel.

The release X is ``$MCORE_UPSTREAM_VERSION`` (one of ``build_tools.releases.PINNED_WHEELS``;
default: the newest, ``DEFAULT_UPSTREAM_VERSION``) or the release named by the file name of
``$MCORE_UPSTREAM_WHEEL``. Its wheel is taken from ``$MCORE_UPSTREAM_WHEEL`` or from the cache
``build/upstream/``, else downloaded by this interpreter's pip into that cache; it is
sha256-checked every time. ``setup()``'s dependency metadata is derived from its METADATA so
that what pip resolves before the build matches the built wheel. ``bdist_wheel`` then writes
the composed wheel (see ``build_tools/compose_wheel.py``).

A build it refuses (an unsupported release, a missing or misnamed wheel, a hash mismatch, a patch
that does not apply, ...) ends with one framed message saying why and exit status 1, no traceback
(``build_tools.errors.refusals_framed``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup  # type: ignore[import-untyped]
from setuptools.command.bdist_wheel import bdist_wheel  # type: ignore[import-untyped]
from setuptools.command.editable_wheel import editable_wheel  # type: ignore[import-untyped]

REPO_ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO_ROOT))

from build_tools.compose_wheel import compose_wheel  # noqa: E402
from build_tools.errors import ComposeError, refusals_framed  # noqa: E402
from build_tools.patching import find_patches  # noqa: E402
from build_tools.releases import DIST_NAME, local_version, select_upstream_version  # noqa: E402
from build_tools.requirements import requirements_from_metadata  # noqa: E402
from build_tools.upstream import ensure_upstream_wheel, read_wheel_metadata  # noqa: E402

UPSTREAM_CACHE_DIR = REPO_ROOT / "build" / "upstream"
PATCHES_DIR = REPO_ROOT / "patches"
with refusals_framed():
    UPSTREAM_VERSION = select_upstream_version()


class ComposedWheel(bdist_wheel):  # type: ignore[misc]
    """``bdist_wheel`` that writes the composed wheel into ``dist_dir``."""

    def run(self) -> None:
        """Compose the wheel from the upstream wheel, the patches and ``megatron/``."""
        with refusals_framed():
            upstream = ensure_upstream_wheel(UPSTREAM_CACHE_DIR, UPSTREAM_VERSION)
            patches = find_patches(PATCHES_DIR, UPSTREAM_VERSION)
            wheel = compose_wheel(upstream, REPO_ROOT, patches, Path(self.dist_dir))
        print(f"composed {wheel}", file=sys.stderr)


class NoEditableWheel(editable_wheel):  # type: ignore[misc]
    """``editable_wheel`` that refuses: the package is a composed wheel, not a source tree."""

    def run(self) -> None:
        """Fail with a clear message."""
        with refusals_framed():
            raise ComposeError("editable installs are not supported; use 'pip install .'")


with refusals_framed():
    _REQUIREMENTS = requirements_from_metadata(
        read_wheel_metadata(ensure_upstream_wheel(UPSTREAM_CACHE_DIR, UPSTREAM_VERSION))
    )

setup(
    name=DIST_NAME,
    version=local_version(UPSTREAM_VERSION),
    python_requires=_REQUIREMENTS.python_requires,
    install_requires=_REQUIREMENTS.install_requires,
    extras_require=_REQUIREMENTS.extras_require,
    packages=[],
    py_modules=[],
    cmdclass={"bdist_wheel": ComposedWheel, "editable_wheel": NoEditableWheel},
)
