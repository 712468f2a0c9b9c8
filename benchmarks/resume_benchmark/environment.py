"""The venv ``scripts/run-benchmark.sh`` runs the benchmark in, seeing the packages (torch,
Transformer Engine) of the interpreter that makes it. Standard library only: the script runs it
with that interpreter (``$PYTHON``) before anything is installed::

    python -m benchmarks.resume_benchmark.environment VENV [--given]

How the venv sees the current interpreter's packages:

* The interpreter is itself a virtual environment (venv, virtualenv, uv): ``python -m venv
  --system-site-packages`` would see the *base* interpreter's site-packages, not this one's, so
  its torch would be invisible. The new venv is made without system site-packages and *layered*
  over the current environment: ``_resume_benchmark_layer.pth`` in its site-packages adds the
  current environment's site directories with ``site.addsitedir`` (their ``.pth`` files
  processed, e.g. editable installs), after its own site-packages.
* Otherwise (a system or container Python, a conda environment, pyenv):
  ``--system-site-packages``, which is that interpreter's site-packages.

A venv this module made (marked by ``.resume-benchmark-venv``), and the default
``.venv-benchmark`` of earlier versions of the script, is brought up to date with the current
interpreter on every run (the layer rewritten, ``include-system-site-packages`` set, remade if
its Python version differs); packages installed into it stay. ``--given`` (``VENV=DIR``): an
existing environment not made here is used as is. It prints one line saying what it did and
which torch and Transformer Engine the venv sees.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import site
import subprocess
import sys
import venv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

#: The ``.pth`` file that layers the venv over the environment it was made from.
LAYER_PTH: Final = "_resume_benchmark_layer.pth"

#: Marks a venv this module made (so it may be updated on the next run).
MARKER: Final = ".resume-benchmark-venv"

#: Prefix of the line this module prints.
PREFIX: Final = "benchmark environment:"


def is_virtual_environment() -> bool:
    """Whether this interpreter runs in a virtual environment (venv, virtualenv, uv)."""
    return sys.prefix != sys.base_prefix or hasattr(sys, "real_prefix")


def site_directories() -> list[str]:
    """This interpreter's site directories (its site-packages, the user site if enabled), in
    ``sys.path`` order: what a layered venv adds."""
    candidates = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE and site.USER_SITE:
        candidates.append(site.USER_SITE)
    real = {os.path.realpath(c): c for c in candidates if os.path.isdir(c)}
    ordered = [p for p in sys.path if p and os.path.realpath(p) in real]
    seen: dict[str, str] = {}
    for path in ordered + list(real.values()):
        seen.setdefault(os.path.realpath(path), path)
    return list(seen.values())


def package_text(name: str, distribution: str, label: str) -> str:
    """``torch 2.11.0 (DIR)``, or ``no torch``: found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"no {label}"
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    locations = list(spec.submodule_search_locations or []) or [spec.origin or "?"]
    return f"{label} {version} ({Path(locations[0]).parent})"


def environment_name() -> str:
    """What this interpreter is, in words."""
    if is_virtual_environment():
        return f"the virtual environment {sys.prefix}"
    if (Path(sys.prefix) / "conda-meta").is_dir():
        return f"the conda environment {sys.prefix}"
    return f"the Python at {sys.prefix}"


def layer_text(directories: Sequence[str]) -> str:
    """The ``.pth`` file adding ``directories`` (each with its own ``.pth`` files)."""
    calls = "; ".join(f"site.addsitedir({d!r})" for d in directories)
    return (
        "# scripts/run-benchmark.sh: this venv also sees the packages of the environment it was\n"
        f"# made from ({sys.prefix}), after its own.\n"
        f"import site; {calls}\n"
    )


def _config(path: Path) -> dict[str, str]:
    config = {}
    for line in (path / "pyvenv.cfg").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = value.strip()
    return config


def _set_system_site_packages(path: Path, enabled: bool) -> None:
    cfg = path / "pyvenv.cfg"
    value = "true" if enabled else "false"
    lines = [
        (
            f"include-system-site-packages = {value}"
            if line.partition("=")[0].strip() == "include-system-site-packages"
            else line
        )
        for line in cfg.read_text().splitlines()
    ]
    cfg.write_text("\n".join(lines) + "\n")


def _site_packages(path: Path) -> Path:
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    return path / "lib" / version / "site-packages"


def _same_python(path: Path) -> bool:
    """Whether the venv at ``path`` runs this interpreter's base Python (same home, same X.Y)."""
    config = _config(path)
    recorded = (config.get("version_info") or config.get("version") or "").split(".")[:2]
    home = os.path.dirname(os.path.abspath(getattr(sys, "_base_executable", sys.executable)))
    same_home = os.path.realpath(config.get("home", "")) == os.path.realpath(home)
    return same_home and recorded == [str(n) for n in sys.version_info[:2]]


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` did: ``action`` in words, and whether it layered."""

    action: str
    layered: bool


def prepare(path: Path, given: bool) -> Prepared:
    """Make (or update) the venv at ``path`` for this interpreter; see the module docstring."""
    exists = (path / "pyvenv.cfg").is_file() and (path / "bin" / "python").exists()
    if exists and given and not (path / MARKER).is_file():
        return Prepared(f"using VENV={path} as it is (not made by this script)", False)
    layered = is_virtual_environment()
    if exists and _same_python(path):
        action = f"updated {path} for"
    else:
        venv.EnvBuilder(
            system_site_packages=not layered,
            clear=exists,
            symlinks=os.name != "nt",
            with_pip=True,
        ).create(path)
        action = f"{'remade' if exists else 'made'} {path} from"
    _set_system_site_packages(path, not layered)
    layer = _site_packages(path) / LAYER_PTH
    if layered:
        layer.write_text(layer_text(site_directories()))
        how = "layered over it (a .pth file adds its site-packages; python -m venv "
        how += "--system-site-packages would see only its base interpreter's)"
    else:
        layer.unlink(missing_ok=True)
        how = "with its site-packages (--system-site-packages)"
    (path / MARKER).write_text(f"{sys.executable}\n")
    return Prepared(f"{action} {environment_name()}, {how}", layered)


def sees() -> str:
    """Which torch and Transformer Engine this interpreter sees (where it runs: in the venv)."""
    torch = package_text("torch", "torch", "torch")
    te = package_text("transformer_engine", "transformer_engine", "Transformer Engine")
    if torch == "no torch":
        torch += " (pip will install it from the index: is this the Python that has torch?)"
    return f"{torch}, {te}"


def venv_sees(path: Path) -> str:
    """:func:`sees`, run by the venv's own interpreter."""
    code = "from benchmarks.resume_benchmark.environment import sees; print(sees())"
    done = subprocess.run(
        [str(path / "bin" / "python"), "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return f"nothing: its python failed ({done.stderr.strip().splitlines()[-1:]})"
    return lines[-1]


def main(argv: Sequence[str] | None = None) -> int:
    """Prepare the venv and print one line saying what was done and what it sees."""
    parser = argparse.ArgumentParser(prog="environment", description=__doc__)
    parser.add_argument("venv", type=Path)
    parser.add_argument("--given", action="store_true", help="VENV was given by the user")
    args = parser.parse_args(argv)
    prepared = prepare(args.venv, args.given)
    print(
        f"{PREFIX} {prepared.action}; it sees {venv_sees(args.venv)}", file=sys.stderr, flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
