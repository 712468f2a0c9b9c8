"""The adopter guide's plugin package, taken from the guide's own code blocks, installs offline
and passes its own tests, so the guide cannot fall behind the code.

Each file of the package is a fenced block in docs/adopter-guide.md right after a line that
names its path (`` `my-sgd-adopter/...`: ``). The package is installed with pip, without an
index, dependencies or build isolation, into a directory of its own (not into this venv: other
tests' registries would see its entry point), and its tests run in a fresh interpreter that
imports it from there.
"""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "adopter-guide.md"
PACKAGE = "my-sgd-adopter"
FILES = ["my_sgd_adopter/__init__.py", "pyproject.toml", "tests/test_sgd_adopter.py"]
FILE_BLOCK = re.compile(r"^`(?P<path>[^`\n]+)`:?[^\n]*\n\n```[\w-]*\n(?P<body>.*?)^```$", re.M | re.S)


def package_files() -> Dict[str, str]:
    """path inside the package -> content, for every block the guide names a package path for."""
    prefix = PACKAGE + "/"
    blocks = [(m["path"], m["body"]) for m in FILE_BLOCK.finditer(GUIDE.read_text())]
    return {path[len(prefix) :]: body for path, body in blocks if path.startswith(prefix)}


def test_the_guide_holds_the_whole_package() -> None:
    assert sorted(package_files()) == FILES


def test_the_guides_package_installs_offline_and_its_tests_pass(tmp_path: Path) -> None:
    source = tmp_path / PACKAGE
    for path, body in package_files().items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(body)
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-build-isolation", "--no-cache-dir", "--target", str(site), str(source)]  # fmt: skip
    installed = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    (entry_points,) = site.glob("my_sgd_adopter-*.dist-info/entry_points.txt")
    assert "sgd_momentum = my_sgd_adopter:SGDMomentumStateAdopter" in entry_points.read_text()

    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *inherited])}
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
             "ignore::UserWarning", "--rootdir", str(source), str(source / "tests")]  # fmt: skip
    # from tmp_path, where the package's own source is not importable: only the installed copy is
    ran = subprocess.run(tests, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert re.search(r"^3 passed", ran.stdout.splitlines()[-1]), ran.stdout
