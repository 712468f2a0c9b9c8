"""pytest configuration: test helpers importable by name, and shared fixtures."""

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR))
sys.path.insert(0, str(TESTS_DIR.parent))  # benchmarks/ (its model builder serves the GPU tests)

from builders import standin_registry  # noqa: E402

from megatron.core.optimizer.state_adoption import StateAdopterRegistry  # noqa: E402


@pytest.fixture
def registry() -> StateAdopterRegistry:
    """A registry without entry-point discovery holding only the stand-in adopter."""
    return standin_registry()


@pytest.fixture
def empty_registry() -> StateAdopterRegistry:
    """A registry without adopters and without entry-point discovery."""
    return StateAdopterRegistry(entry_point_group=None)


@pytest.fixture(autouse=True)
def _fresh_configuration_warnings() -> None:
    """Configuration problems are warned once per process; every test starts unwarned."""
    from megatron.core.optimizer.state_adoption import loader

    loader._warned.clear()
