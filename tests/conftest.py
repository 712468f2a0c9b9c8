"""pytest configuration: test helpers importable by name, a strict process-wide registry, and
shared fixtures.

Tests run strict: every fallback of the process-wide registry (an adopter that raises or whose
result does not match, a broken plugin, a raising outcome hook) raises instead of warning, so a
broken adopter fails its test. Tests of the fallbacks themselves use registries of their own.
"""

import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR))
sys.path.insert(0, str(TESTS_DIR.parent))  # benchmarks/ (its tests; the GPU tests use its timeline)

from megatron.core.optimizer.state_adoption import (  # noqa: E402
    AdoptionOutcome,
    default_registry,
)


@pytest.fixture(autouse=True, scope="session")
def _strict_process_wide_registry() -> Iterator[None]:
    registry = default_registry()
    previous, registry.strict = registry.strict, True
    yield
    registry.strict = previous


@pytest.fixture
def outcomes() -> Iterator[List[AdoptionOutcome]]:
    """Every outcome the process-wide registry reports while the test runs."""
    recorded: List[AdoptionOutcome] = []
    handle = default_registry().register_outcome_hook(recorded.append)
    yield recorded
    handle.remove()


@pytest.fixture
def standin_in_default_registry() -> Iterator[None]:
    """The built-in FP32 adopter for the stand-in, first in the process-wide registry (which the
    installed megatron-core's optimizers consult)."""
    from builders import StandInFP32Adopter
    from fused_adam_standin import FusedAdamStandIn

    handle = default_registry().register(StandInFP32Adopter(FusedAdamStandIn, "cpu", "2.20.2"), prepend=True)
    yield
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


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """``install_plugin(distribution, {entry point: value}, source, group)`` installs a real
    plugin distribution 1.0 (a module and a dist-info with ``entry_points.txt``) in a new folder
    at the front of ``sys.path``, where ``importlib.metadata`` finds it; forgotten after (the
    folder leaves ``sys.path``, the module ``sys.modules``)."""
    count, modules = [0], []

    def install(distribution: str, entry_points: Dict[str, str], source: str = "", group: str = "test.adopters") -> Path:
        count[0] += 1
        root = tmp_path / f"site{count[0]}"
        root.mkdir()
        (root / f"{distribution}.py").write_text(source)
        dist_info = root / f"{distribution}-1.0.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (dist_info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.delitem(sys.modules, distribution, raising=False)
        modules.append(distribution)
        return root

    yield install
    for module in modules:
        sys.modules.pop(module, None)
