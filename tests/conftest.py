"""pytest configuration: test helpers importable by name, and shared fixtures."""

import sys
from pathlib import Path
from typing import Any, Iterator, List

import pytest

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR))
sys.path.insert(0, str(TESTS_DIR.parent))  # benchmarks/ (the benchmark tests; the GPU tests use its memory_timeline)

from builders import standin_registry  # noqa: E402

from megatron.core.optimizer.state_adoption import (  # noqa: E402
    StateAdopterRegistry,
    StateAdoptionOutcome,
    register_outcome_hook,
)


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


@pytest.fixture
def outcomes() -> Iterator[List[StateAdoptionOutcome]]:
    """Every outcome the process-wide registry reports while the test runs."""
    recorded: List[StateAdoptionOutcome] = []
    handle = register_outcome_hook(recorded.append)
    yield recorded
    handle.remove()


@pytest.fixture(scope="module")
def cpu_mesh() -> Iterator[Any]:
    """A one-rank CPU device mesh on a gloo group, for real DTensors (Megatron-FSDP's state)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()
