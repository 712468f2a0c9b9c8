"""The installed megatron-core's optimizer classes, built on the CPU for the routing tests.

Megatron-Core's optimizers need CUDA buffers (the distributed optimizer) or CUDA parameters
(``Float16OptimizerWithFloat16Params`` refuses CPU ones), so each class here subclasses the
installed one and only sets what its ``load_state_dict`` reads. ``load_state_dict`` itself is the
installed, unmodified method: what these tests see is what MCore's own code does.
"""

from typing import Any, Dict, List

import torch

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params
from megatron.core.optimizer.optimizer_config import OptimizerConfig

#: The keys MCore's ``_get_param_groups`` puts in every param group (0.16.1 to 0.19.2).
#: ``load_state_dict`` pairs saved and current groups by some of them; before 0.19 it
#: raises ``ValueError: Key wd_mult (or pre_wd_mult) not found`` for a group without them.
MCORE_PARAM_GROUP_KEYS: Dict[str, Any] = {
    "is_expert_parallel": False, "default_config": True, "wd_mult": 1.0, "lr_mult": 1.0,
    "is_decoupled_lr": False, "max_lr": 1e-3, "min_lr": 0.0,
}  # fmt: skip


class CpuDistributedOptimizer(DistributedOptimizer):
    """The installed DistributedOptimizer with only the attributes load_state_dict reads."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, ddp_config: Any) -> None:
        self.optimizer = optimizer
        self.config = config
        self.ddp_config = ddp_config
        self.grad_scaler = None
        self.is_stub_optimizer = False


class CpuFloat16Optimizer(Float16OptimizerWithFloat16Params):
    """The installed Float16OptimizerWithFloat16Params with what load_state_dict reads: the
    inner optimizer, the config, no grad scaler (BF16) and its FP32 main params."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> None:
        self.optimizer = optimizer
        self.config = config
        self.grad_scaler = None
        self.fp32_from_float16_groups: List[List[torch.Tensor]] = [
            list(group["params"]) for group in optimizer.param_groups
        ]


class CpuFP32Optimizer(FP32Optimizer):
    """The installed FP32Optimizer with what load_state_dict reads."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> None:
        self.optimizer = optimizer
        self.config = config
