"""The installed megatron-core's optimizer classes, built on the CPU for the routing tests.

Megatron-Core's optimizers need CUDA buffers (the distributed optimizer) or CUDA parameters
(``Float16OptimizerWithFloat16Params`` refuses CPU ones), so each class here subclasses the
installed one and only sets what its ``load_state_dict`` reads. ``load_state_dict`` itself is the
installed, unmodified method: what these tests see is what MCore's own code does.
"""

import types
from typing import Any, Dict, List

import torch

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
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


class CpuPrecisionAwareDistributedOptimizer(DistributedOptimizer):
    """The installed DistributedOptimizer with what its precision-aware read and store of one
    parameter's state read (``_get_main_param_and_optimizer_states`` and
    ``_set_main_param_and_optimizer_states``): the inner optimizer, the index of each model
    parameter in it (the inner parameters stand for the model parameters here), and a config
    with the precision-aware flag (MCore's OptimizerConfig refuses it without TE on the CPU); for
    ``state_dict`` and ``load_state_dict``, no grad scaler (BF16)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: Any, ddp_config: Any) -> None:
        self.optimizer = optimizer
        self.config = config
        self.ddp_config = ddp_config
        self.grad_scaler = None
        self.is_stub_optimizer = False
        self.model_param_group_index_map = {
            param: (group_index, order)
            for group_index, group in enumerate(optimizer.param_groups)
            for order, param in enumerate(group["params"])
        }


def precision_aware_config(**changes: Any) -> Any:
    """The flags the precision-aware read, ``load_state_dict`` (BF16, not FP16) and the adoption
    switch read (MCore's OptimizerConfig refuses the precision-aware flag without TE on the CPU)."""
    fields: Dict[str, Any] = dict(
        fp16=False,
        use_precision_aware_optimizer=True,
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=True,
        optimizer_cpu_offload=False,
        optimizer_state_adoption=True,
    )
    fields.update(changes)
    return types.SimpleNamespace(**fields)


def precision_aware_owner(
    optimizer: torch.optim.Optimizer, initialize: bool = True, **config_changes: Any
) -> CpuPrecisionAwareDistributedOptimizer:
    """A precision-aware owner of ``optimizer`` whose state is created as the scaffold pass of a
    resume leaves it (``initialize_state`` of every parameter), unless not to ``initialize``."""
    for group in optimizer.param_groups if initialize else ():
        for param in group["params"]:
            keeps_remainders = bool(getattr(optimizer, "store_param_remainders", False)) and param.dtype == torch.bfloat16
            optimizer.initialize_state(param, keeps_remainders)  # type: ignore[attr-defined]
    return CpuPrecisionAwareDistributedOptimizer(
        optimizer, precision_aware_config(**config_changes), DistributedDataParallelConfig()
    )
