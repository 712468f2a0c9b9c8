"""The installed package opts in to the precision-aware adopter through its entry point."""

import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, entry_points

import pytest
import torch

from megatron.core.optimizer.state_adoption import (
    AdoptionContext,
    StateAdopterRegistry,
    TEFusedAdamPrecisionAwareStateAdopter,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig

GROUP = "megatron_core.optimizer_state_adopters"
NAME = "te_fused_adam_precision_aware"
BUILT_IN = ["te_fused_adam_fp32", "te_fused_adam_bf16"]
OPT_IN_REASON = "OptimizerConfig.precision_aware_optimizer_state_adoption is not set"


def _installed() -> bool:
    try:
        distribution("mcore-te-precision-aware-adopter")
    except PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _installed(), reason="pip install examples/te-precision-aware-adopter")


def test_the_entry_point_registers_a_precision_aware_adopter_that_needs_no_config_field() -> None:
    registry = StateAdopterRegistry(strict=True, plugin_group=GROUP)
    adopters = [adopter for adopter in registry.adopters() if adopter.name == NAME]
    assert len(adopters) == 1 and type(adopters[0]) is TEFusedAdamPrecisionAwareStateAdopter
    # unlike the built-in te_fused_adam_bf16, it acts without OptimizerConfig's opt-in field
    param = torch.nn.Parameter(torch.ones(2))
    context = AdoptionContext(torch.optim.SGD([param], lr=0.1), config=OptimizerConfig())
    assert adopters[0].decline_reason(context) != OPT_IN_REASON


def test_the_process_wide_registry_tries_the_plugin_after_the_built_in_adopters() -> None:
    """In a fresh process: the built-in adopters, then the installed plugins by entry-point
    name, among them this package's."""
    code = (
        "import json\n"
        "from megatron.core.optimizer.state_adoption import default_registry\n"
        "print(json.dumps([adopter.name for adopter in default_registry().adopters()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    names = json.loads(done.stdout.strip().splitlines()[-1])
    plugins = [entry.load()().name for entry in sorted(entry_points(group=GROUP), key=lambda e: e.name)]
    assert NAME in plugins and names == [*BUILT_IN, *plugins]
