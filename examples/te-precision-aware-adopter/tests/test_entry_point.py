"""The installed package opts in to the precision-aware adopter through its entry point."""

from importlib.metadata import PackageNotFoundError, distribution

import pytest

from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    TEFusedAdamPrecisionAwareStateAdopter,
)

GROUP = "megatron_core.optimizer_state_adopters"


def _installed() -> bool:
    try:
        distribution("mcore-te-precision-aware-adopter")
    except PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed(), reason="pip install examples/te-precision-aware-adopter")
def test_loading_the_plugins_registers_the_built_in_precision_aware_adopter() -> None:
    registry = StateAdopterRegistry(strict=True, plugin_group=GROUP)
    assert registry.registrations() == ()  # installed, but nothing is loaded until asked
    registry.load_plugins()
    (adopter, _), = registry.registrations()
    assert type(adopter) is TEFusedAdamPrecisionAwareStateAdopter
    assert adopter.name == "te_fused_adam_precision_aware"
